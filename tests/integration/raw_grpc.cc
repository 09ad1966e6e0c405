// The crude HTTP/2 client of raw_grpc.h: frames are written and read by
// hand on one blocking socket, with just the flow control that a body of a
// few megabytes needs.
#include "tests/integration/raw_grpc.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace layerserve::integration {
namespace {

constexpr uint8_t kData = 0x0, kHeaders = 0x1, kRstStream = 0x3, kSettings = 0x4, kPing = 0x6,
                  kGoaway = 0x7, kWindowUpdate = 0x8;
constexpr uint8_t kEndStream = 0x1, kAck = 0x1, kEndHeaders = 0x4, kPadded = 0x8, kPriority = 0x20;
constexpr uint32_t kStream = 1;
constexpr int64_t kMaxFrameBytes = 16384;  // HTTP/2's default SETTINGS_MAX_FRAME_SIZE
constexpr uint16_t kSettingsInitialWindowSize = 0x4;

void PutBe(std::string* out, uint64_t value, int bytes) {
  for (int i = bytes - 1; i >= 0; --i) out->push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
}

uint64_t GetBe(const std::string& in, size_t at, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value = (value << 8) | static_cast<uint8_t>(in[at + i]);
  return value;
}

std::string Frame(uint8_t type, uint8_t flags, uint32_t stream, const std::string& payload) {
  std::string frame;
  PutBe(&frame, payload.size(), 3);
  frame.push_back(static_cast<char>(type));
  frame.push_back(static_cast<char>(flags));
  PutBe(&frame, stream, 4);
  return frame + payload;
}

// HPACK "literal header field without indexing, new name", no Huffman.
void PutHpackString(std::string* out, const std::string& s) {
  // 7-bit prefix integer (RFC 7541 5.1), H bit 0.
  size_t n = s.size();
  if (n < 127) {
    out->push_back(static_cast<char>(n));
  } else {
    out->push_back(127);
    n -= 127;
    while (n >= 128) {
      out->push_back(static_cast<char>((n % 128) | 0x80));
      n /= 128;
    }
    out->push_back(static_cast<char>(n));
  }
  *out += s;
}

void PutHeader(std::string* block, const std::string& name, const std::string& value) {
  block->push_back(0x00);
  PutHpackString(block, name);
  PutHpackString(block, value);
}

// The value of a literal, non-Huffman header `name` in `block`, if any.
bool FindLiteral(const std::string& block, const std::string& name, std::string* value) {
  const std::string needle = static_cast<char>(name.size()) + name;
  const size_t at = block.find(needle);
  if (at == std::string::npos) return false;
  size_t pos = at + needle.size();
  if (pos >= block.size() || (static_cast<uint8_t>(block[pos]) & 0x80) != 0) return false;
  uint64_t length = static_cast<uint8_t>(block[pos++]) & 0x7F;
  if (length == 127) {
    for (int shift = 0; pos < block.size(); shift += 7) {
      const uint8_t b = static_cast<uint8_t>(block[pos++]);
      length += static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) break;
    }
  }
  if (pos + length > block.size()) return false;
  *value = block.substr(pos, length);
  return true;
}

class Connection {
 public:
  ~Connection() {
    if (fd_ >= 0) close(fd_);
  }

  absl::Status Open(int port, absl::Time deadline) {
    deadline_ = deadline;
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) return absl::InternalError(absl::StrCat("socket: ", strerror(errno)));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      return absl::UnavailableError(absl::StrCat("connect to port ", port, ": ", strerror(errno)));
    }
    return absl::OkStatus();
  }

  absl::Status Write(const std::string& bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return absl::UnavailableError(absl::StrCat("send: ", strerror(errno)));
      done += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  // True when a byte can be read within `wait` (0: now).
  bool Readable(absl::Duration wait) {
    pollfd p{fd_, POLLIN, 0};
    return poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(wait))) > 0;
  }

  // Reads exactly n bytes before the deadline; false on EOF, error or timeout.
  bool ReadExactly(size_t n, std::string* out) {
    out->resize(n);
    size_t done = 0;
    while (done < n) {
      const absl::Duration left = deadline_ - absl::Now();
      if (left <= absl::ZeroDuration() || !Readable(left)) {
        timed_out_ = true;
        return false;
      }
      const ssize_t r = recv(fd_, out->data() + done, n - done, 0);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return false;
      done += static_cast<size_t>(r);
    }
    return true;
  }

  bool timed_out() const { return timed_out_; }

 private:
  int fd_ = -1;
  absl::Time deadline_;
  bool timed_out_ = false;
};

}  // namespace

std::string GrpcFrame(const std::string& payload, bool compressed, int64_t announced_length) {
  std::string framed(1, compressed ? '\1' : '\0');
  PutBe(&framed, announced_length >= 0 ? static_cast<uint64_t>(announced_length) : payload.size(),
        4);
  return framed + payload;
}

absl::StatusOr<RawGrpcReply> RawGrpcCall(int port, const std::string& path,
                                         const RawGrpcCallOptions& options) {
  Connection conn;
  if (absl::Status s = conn.Open(port, absl::Now() + options.timeout); !s.ok()) return s;

  std::string block;
  PutHeader(&block, ":method", "POST");
  PutHeader(&block, ":scheme", "http");
  PutHeader(&block, ":path", path);
  PutHeader(&block, ":authority", absl::StrCat("127.0.0.1:", port));
  PutHeader(&block, "content-type", "application/grpc");
  PutHeader(&block, "te", "trailers");
  for (const auto& [name, value] : options.headers) PutHeader(&block, name, value);
  std::string hello = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  hello += Frame(kSettings, 0, 0, "");
  hello += Frame(kHeaders, kEndHeaders, kStream, block);
  if (absl::Status s = conn.Write(hello); !s.ok()) return s;

  RawGrpcReply reply;
  std::string trailers;
  int64_t connection_window = 65535, stream_window = 65535, initial_window = 65535;
  bool done = false;

  // Reads and handles one frame; false when the connection ended.
  auto handle_frame = [&]() -> bool {
    std::string header, payload;
    if (!conn.ReadExactly(9, &header)) return false;
    const size_t length = GetBe(header, 0, 3);
    const uint8_t type = static_cast<uint8_t>(header[3]), flags = static_cast<uint8_t>(header[4]);
    const uint32_t stream = GetBe(header, 5, 4) & 0x7FFFFFFF;
    if (!conn.ReadExactly(length, &payload)) return false;
    if (type == kSettings && (flags & kAck) == 0) {
      for (size_t at = 0; at + 6 <= payload.size(); at += 6) {
        if (GetBe(payload, at, 2) == kSettingsInitialWindowSize) {
          const int64_t next = static_cast<int64_t>(GetBe(payload, at + 2, 4));
          stream_window += next - initial_window;
          initial_window = next;
        }
      }
      (void)conn.Write(Frame(kSettings, kAck, 0, ""));
    } else if (type == kPing && (flags & kAck) == 0) {
      (void)conn.Write(Frame(kPing, kAck, 0, payload));
    } else if (type == kWindowUpdate && payload.size() == 4) {
      const int64_t increment = static_cast<int64_t>(GetBe(payload, 0, 4) & 0x7FFFFFFF);
      (stream == 0 ? connection_window : stream_window) += increment;
    } else if (type == kData && stream == kStream) {
      size_t begin = 0, end = payload.size();
      if ((flags & kPadded) != 0 && !payload.empty()) {
        begin = 1;
        end -= std::min<size_t>(end - 1, static_cast<uint8_t>(payload[0]));
      }
      reply.data += payload.substr(begin, end - begin);
      if ((flags & kEndStream) != 0) done = true;
    } else if (type == kHeaders && stream == kStream) {
      size_t begin = 0, end = payload.size();
      if ((flags & kPadded) != 0 && !payload.empty()) {
        begin = 1;
        end -= std::min<size_t>(end - 1, static_cast<uint8_t>(payload[0]));
      }
      if ((flags & kPriority) != 0) begin += 5;
      if (begin < end) trailers += payload.substr(begin, end - begin);
      if ((flags & kEndStream) != 0) done = true;
    } else if ((type == kRstStream && stream == kStream) || type == kGoaway) {
      reply.stream_reset = true;
      done = true;
    }
    return true;
  };

  bool open = true;
  const std::string& body = options.body;
  while (open && !done && reply.body_bytes_sent < body.size()) {
    const int64_t room = std::min({connection_window, stream_window, kMaxFrameBytes,
                                   static_cast<int64_t>(body.size() - reply.body_bytes_sent)});
    if (room > 0 && !conn.Readable(absl::ZeroDuration())) {
      const bool last = reply.body_bytes_sent + room == body.size();
      const uint8_t flags = last && options.end_stream ? kEndStream : 0;
      if (!conn.Write(Frame(kData, flags, kStream, body.substr(reply.body_bytes_sent, room)))
               .ok()) {
        break;
      }
      reply.body_bytes_sent += room;
      connection_window -= room;
      stream_window -= room;
    } else {
      open = handle_frame();
    }
  }
  if (open && !done && body.empty() && options.end_stream) {
    open = conn.Write(Frame(kData, kEndStream, kStream, "")).ok();
  }
  while (open && !done) open = handle_frame();

  std::string status;
  if (FindLiteral(trailers, "grpc-status", &status) && !status.empty()) {
    reply.grpc_status = std::atoi(status.c_str());
  }
  FindLiteral(trailers, "grpc-message", &reply.grpc_message);
  if (!done && conn.timed_out()) {
    return absl::DeadlineExceededError(absl::StrCat("no complete reply within the timeout; ",
                                                    reply.body_bytes_sent, " body bytes sent"));
  }
  return reply;
}

}  // namespace layerserve::integration
