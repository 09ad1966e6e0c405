"""Raw HTTP/2, for tests that reach the server or its proxy below gRPC: frames
written by hand (floods, streams that send nothing, resets), and one
connection whose reader thread records what the peer sends back."""

import socket
import struct
import threading

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS, RST_STREAM, SETTINGS, GOAWAY = 0x1, 0x3, 0x4, 0x7


def frame(kind, flags, stream, payload):
    """One HTTP/2 frame: its 9-byte header, then `payload`."""
    return (struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) +
            struct.pack(">I", stream) + payload)


def grpc_headers(method):
    """The HPACK block (literals without indexing, no Huffman) of a plaintext
    call of inference.GRPCInferenceService's `method`."""
    return b"".join(b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v for n, v in [
        (b":method", b"POST"), (b":scheme", b"http"),
        (b":path", b"/inference.GRPCInferenceService/" + method.encode()),
        (b":authority", b"127.0.0.1"), (b"content-type", b"application/grpc"),
        (b"te", b"trailers")])


class Connection:
    """One raw HTTP/2 connection on `sock`: the client preface and SETTINGS,
    then, if `ack`, an acknowledgement of the peer's first SETTINGS (which is
    what makes gRPC apply its own). A thread records what the peer sends: its
    SETTINGS (`settings`, id to value), the streams it resets and their codes
    (`reset`, `reset_codes`), the last stream of its first GOAWAY (`goaway`),
    and whether it closed (`closed`). Only the caller's thread writes, so
    frames are never interleaved."""

    def __init__(self, sock, ack=True):
        self.sock = sock
        self.settings, self.settings_seen = {}, threading.Event()
        self.reset, self.reset_codes, self.goaway = set(), [], None
        self.closed = threading.Event()
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0, b""))
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        assert self.settings_seen.wait(10), "no SETTINGS from the peer"
        if ack:
            self.sock.sendall(frame(SETTINGS, 0x1, 0, b""))

    def _read(self):
        buf = b""
        try:
            while chunk := self.sock.recv(1 << 20):
                buf += chunk
                while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                    length, kind, flags = int.from_bytes(buf[:3], "big"), buf[3], buf[4]
                    stream, payload = int.from_bytes(buf[5:9], "big"), buf[9:9 + length]
                    buf = buf[9 + length:]
                    if kind == SETTINGS and not flags & 0x1:
                        for i in range(0, len(payload), 6):
                            self.settings[int.from_bytes(payload[i:i + 2], "big")] = \
                                int.from_bytes(payload[i + 2:i + 6], "big")
                        self.settings_seen.set()
                    elif kind == RST_STREAM:
                        self.reset.add(stream)
                        self.reset_codes.append(int.from_bytes(payload, "big"))
                    elif kind == GOAWAY and self.goaway is None:
                        self.goaway = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
        except OSError:
            pass
        self.closed.set()

    def streams(self, count, reset=False, method="ModelStreamInfer", first=1):
        """`count` new streams from `first` (HEADERS of `method` calls that
        send nothing more), each reset at once (RST_STREAM CANCEL) if
        `reset`, written in batches as fast as the peer reads; returns how
        many were written before it closed."""
        block = grpc_headers(method)
        batch, written = [], 0
        for i in range(count):
            stream = first + 2 * i
            batch.append(frame(HEADERS, 0x4, stream, block))  # END_HEADERS
            if reset:
                batch.append(frame(RST_STREAM, 0, stream, struct.pack(">I", 0x8)))
            if len(batch) >= 256 or i + 1 == count:
                try:
                    self.sock.sendall(b"".join(batch))
                except OSError:
                    return written
                written, batch = i + 1, []
        return written

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader's recv
        except OSError:
            pass
        self.reader.join(timeout=10)
        self.sock.close()
