"""Sessions through tritonclient against the demo model: Triton's sequence
parameters (sequence_id, sequence_start, sequence_end) plus our
sequence_position, as a client that generates token by token uses them.

The oracle throughout: a session fed in pieces must return, for every token
it was sent, the hidden states that one stateless request over the session's
whole sequence returns for that token (the KV cache is an optimisation, never
a change of result). Each Session below keeps what it sent and got, so any
test can check it against that oracle at any point, naming the step that
differs. Tolerances are the other tests' for the wire's dtype: FP32 compute
in both paths, so differences are summation order only; BF16 rounds inputs
and outputs to 8 significant bits.

The demo model is small (hidden 512, 4 layers) and every request here is at
most a few dozen tokens, so the file runs in seconds on CI's two cores.
"""

import itertools
import queue
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from layerserve_client import RPC_TIMEOUT_S, infer, io_names, make_input, output_as_f32
from layerserve_process import sample
from llama_numpy import assert_close, round_to_bf16

DEMO_HIDDEN = 512
# The demo model keeps 8 KiB of K/V per token (4 layers x 4 KV heads x 64 x
# 2 x fp32): 64 MiB is 8192 tokens, 512 blocks of 16, plenty for this file
# and far below the default of a quarter of the machine's memory.
KV_CACHE_FLAGS = ("--kv-cache-memory=64MiB",)
KV_BLOCK_TOKENS = 16
TOLERANCE = {
    "FP32": dict(max_rel=1e-4, rms_rel=1e-5),
    "BF16": dict(max_rel=3e-2, rms_rel=1e-2),
}

_ids = itertools.count(1000)


def fresh_id(kind="int"):
    """A sequence id no other test of this file uses: an int, or a string."""
    n = next(_ids)
    return n if kind == "int" else f"session-{n}"


def activations(shape, rng):
    return rng.normal(size=shape).astype(np.float32)


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(*KV_CACHE_FLAGS)


@pytest.fixture(scope="module")
def client(server):
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        yield c


@pytest.fixture(scope="module")
def names(client, server):
    return io_names(client, server.model)


def stateless(client, model, names, x, datatype):
    """The oracle: one request over the whole sequence, no sequence parameters."""
    out, out_datatype, _ = infer(client, model, *names, x, datatype)
    assert out_datatype == datatype
    return out


def expect_error(code, call, *args, **kwargs):
    """Runs call(*args, **kwargs), which must fail with gRPC status `code`;
    returns the server's message."""
    with pytest.raises(InferenceServerException) as error:
        call(*args, **kwargs)
    assert str(error.value.status()) == f"StatusCode.{code}", (
        f"expected {code}, got {error.value.status()}: {error.value.message()}")
    return error.value.message()


def names_number(message, n):
    return re.search(rf"(?<![\d.]){n}(?![\d.])", message) is not None


class Session:
    """One session driven through unary ModelInfer, remembering the inputs it
    sent and the outputs it got for the tokens the session holds now (a
    rollback forgets the tail), so check() can compare with the oracle."""

    def __init__(self, client, model, names, sequence_id, batch, datatype="FP32"):
        self.client, self.model, self.names = client, model, names
        self.id, self.batch, self.datatype = sequence_id, batch, datatype
        self.x = np.zeros((batch, 0, DEMO_HIDDEN), np.float32)
        self.y = np.zeros((batch, 0, DEMO_HIDDEN), np.float32)
        self.steps = []  # (first token, tokens, label) of every step still held

    @property
    def length(self):
        return self.x.shape[1]

    def send(self, x, start=False, end=False, position=None):
        """One request of the session; returns its output (float32). On
        success the session holds what the server holds."""
        if self.datatype == "BF16":
            x = round_to_bf16(x)  # what the wire carries, so the oracle sees it too
        parameters = None if position is None else {"sequence_position": position}
        out, datatype, _ = infer(self.client, self.model, *self.names, x, self.datatype,
                                 sequence_id=self.id, sequence_start=start, sequence_end=end,
                                 parameters=parameters)
        assert datatype == self.datatype and out.shape == x.shape, (datatype, out.shape, x.shape)
        first = 0 if start else (self.length if position is None else position)
        self.record(first, x, out, f"step {len(self.steps)} (tokens {first}..{first + x.shape[1]})")
        return out

    def record(self, first, x, out, label):
        """Notes that tokens first..first+T-1 were sent as x and came back as out."""
        assert first <= self.length
        self.x = np.concatenate([self.x[:, :first], x], axis=1)
        self.y = np.concatenate([self.y[:, :first], out], axis=1)
        self.steps = [s for s in self.steps if s[0] + s[1] <= first]
        self.steps.append((first, x.shape[1], label))

    def check(self, what="", last_only=False):
        """Every held step's outputs against one stateless request over the
        held sequence."""
        want = stateless(self.client, self.model, self.names, self.x, self.datatype)
        for first, tokens, label in self.steps[-1:] if last_only else self.steps:
            sl = slice(first, first + tokens)
            assert_close(self.y[:, sl], want[:, sl], **TOLERANCE[self.datatype],
                         what=f"session {self.id!r} {what} {label} vs stateless over "
                              f"{self.length} tokens ({self.datatype}, B={self.batch})")


def test_model_config_announces_sequence_batching(client, server):
    config = client.get_model_config(server.model, client_timeout=RPC_TIMEOUT_S).config
    assert config.HasField("sequence_batching"), config
    assert config.sequence_batching.HasField("oldest"), config.sequence_batching
    assert config.sequence_batching.max_sequence_idle_microseconds == 300 * 10**6
    assert config.parameters["kv_block_tokens"].string_value == str(KV_BLOCK_TOKENS)
    assert config.parameters["kv_blocks"].string_value == str(64 * 2**20 // (16 * 8192))


# (prefill, then step sizes): single tokens across the first block boundary
# (16), several tokens at once across the second (32).
SCHEDULE = (13, [1, 1, 1, 1, 6, 1, 9, 1, 2])


@pytest.mark.parametrize("datatype", ["FP32", "BF16"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("id_kind", ["int", "string"])
def test_pieces_match_one_stateless_request(client, server, names, datatype, batch, id_kind):
    rng = np.random.default_rng(batch * 10 + len(datatype) + len(id_kind))
    prefill, steps = SCHEDULE
    s = Session(client, server.model, names, fresh_id(id_kind), batch, datatype)
    s.send(activations((batch, prefill, DEMO_HIDDEN), rng), start=True)
    for i, tokens in enumerate(steps):
        # An explicit sequence_position equal to the length is a plain append.
        position = s.length if i % 3 == 1 else None
        s.send(activations((batch, tokens, DEMO_HIDDEN), rng), position=position,
               end=i == len(steps) - 1)
    assert s.length == prefill + sum(steps) > 2 * KV_BLOCK_TOKENS
    s.check()


def stream_session(client, model, names, requests, datatype):
    """Sends `requests` [(sequence id, x, start, end, request id)] on one
    ModelStreamInfer stream, all at once, and returns {request id: output}."""
    responses = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)),
                        stream_timeout=RPC_TIMEOUT_S)
    try:
        for sequence_id, x, start, end, rid in requests:
            client.async_stream_infer(model, [make_input(names[0], x, datatype)], request_id=rid,
                                      sequence_id=sequence_id, sequence_start=start,
                                      sequence_end=end,
                                      outputs=[grpcclient.InferRequestedOutput(names[1])])
        got = {}
        for _ in requests:
            result, error = responses.get(timeout=RPC_TIMEOUT_S)
            assert error is None, f"stream error: {error}"
            got[result.get_response().id] = output_as_f32(result, names[1])[0]
        return got
    finally:
        client.stop_stream()


@pytest.mark.parametrize("datatype", ["FP32", "BF16"])
def test_generation_on_one_stream_matches_stateless(server, names, datatype):
    """A whole generation on one ModelStreamInfer stream: prefill, then one
    token per step whose input is made from the previous step's output (as a
    model's next-token embedding would be), sequence_end on the last."""
    rng = np.random.default_rng(40)
    batch, prefill, steps = 2, 7, 12
    sequence_id = fresh_id("string" if datatype == "BF16" else "int")
    responses = queue.Queue()
    sent, got = [], []
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)),
                            stream_timeout=RPC_TIMEOUT_S)
        try:
            x = round_to_bf16(activations((batch, prefill, DEMO_HIDDEN), rng))
            for step in range(steps + 1):
                client.async_stream_infer(server.model, [make_input(names[0], x, datatype)],
                                          request_id=f"step-{step}", sequence_id=sequence_id,
                                          sequence_start=step == 0, sequence_end=step == steps,
                                          outputs=[grpcclient.InferRequestedOutput(names[1])])
                result, error = responses.get(timeout=RPC_TIMEOUT_S)
                assert error is None, f"step {step}: stream error: {error}"
                assert result.get_response().id == f"step-{step}"
                out, out_datatype = output_as_f32(result, names[1])
                assert out_datatype == datatype and out.shape == x.shape
                sent.append(x)
                got.append(out)
                last = out[:, -1:].astype(np.float64)
                x = round_to_bf16(last / np.sqrt(np.mean(last * last, axis=-1, keepdims=True)))
        finally:
            client.stop_stream()
        want = stateless(client, server.model, names, np.concatenate(sent, axis=1), datatype)
        expect_error("NOT_FOUND", infer, client, server.model, *names, sent[-1], datatype,
                     sequence_id=sequence_id)
    first = 0
    for step, out in enumerate(got):
        tokens = out.shape[1]
        assert_close(out, want[:, first:first + tokens], **TOLERANCE[datatype],
                     what=f"stream step {step} (tokens {first}..{first + tokens}, {datatype})")
        first += tokens


def test_pipelined_stream_steps_run_in_order(server, names):
    """Every step of two sessions sent on one stream without waiting for a
    reply: each session's requests are queued and run in the order sent."""
    rng = np.random.default_rng(41)
    sizes = {fresh_id("int"): [5, 1, 3, 1, 12, 1], fresh_id("string"): [17, 1, 1, 2, 1, 1]}
    inputs = {sid: [activations((1, t, DEMO_HIDDEN), rng) for t in ts] for sid, ts in sizes.items()}
    requests = []
    for step in range(6):
        for sid, xs in inputs.items():
            requests.append((sid, xs[step], step == 0, step == 5, f"{sid}/{step}"))
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        got = stream_session(client, server.model, names, requests, "FP32")
        for sid, xs in inputs.items():
            want = stateless(client, server.model, names, np.concatenate(xs, axis=1), "FP32")
            first = 0
            for step, x in enumerate(xs):
                sl = slice(first, first + x.shape[1])
                assert_close(got[f"{sid}/{step}"], want[:, sl], **TOLERANCE["FP32"],
                             what=f"pipelined session {sid!r} step {step}")
                first += x.shape[1]


def test_rollback_equals_never_sending_the_tail(client, server, names):
    rng = np.random.default_rng(42)
    s = Session(client, server.model, names, fresh_id(), batch=2)
    s.send(activations((2, 20, DEMO_HIDDEN), rng), start=True)
    s.send(activations((2, 5, DEMO_HIDDEN), rng))           # 25: a tail to take back
    s.send(activations((2, 6, DEMO_HIDDEN), rng), position=20)
    s.check("after a rollback within a block")
    assert s.length == 26
    s.send(activations((2, 12, DEMO_HIDDEN), rng))          # 38: into a third block
    s.send(activations((2, 3, DEMO_HIDDEN), rng), position=14)
    s.send(activations((2, 1, DEMO_HIDDEN), rng))
    s.check("after a rollback that gave back blocks")
    s.send(activations((2, 4, DEMO_HIDDEN), rng), position=16)  # exactly a block boundary
    s.send(activations((2, 2, DEMO_HIDDEN), rng), position=0)   # everything, without a start
    s.send(activations((2, 1, DEMO_HIDDEN), rng))
    s.check("after rollbacks to a block boundary and to 0")

    # A second session that never saw the tails gives the same answers.
    fresh = Session(client, server.model, names, fresh_id("string"), batch=2)
    fresh.send(s.x[:, :2], start=True)
    fresh.send(s.x[:, 2:])
    assert_close(s.y, fresh.y, **TOLERANCE["FP32"], what="rolled-back session vs a fresh one")


def test_position_past_the_length_is_refused(client, server, names):
    rng = np.random.default_rng(43)
    s = Session(client, server.model, names, fresh_id(), batch=1)
    s.send(activations((1, 9, DEMO_HIDDEN), rng), start=True)
    message = expect_error("FAILED_PRECONDITION", s.send, activations((1, 1, DEMO_HIDDEN), rng),
                           position=12)
    assert names_number(message, 12) and names_number(message, 9), (
        f"the message should name the position (12) and the length (9): {message}")
    assert names_number(message, s.id), message
    # On a start, a position past 0 is refused the same way.
    other = fresh_id()
    message = expect_error("FAILED_PRECONDITION", infer, client, server.model, *names,
                           activations((1, 1, DEMO_HIDDEN), rng), "FP32", sequence_id=other,
                           sequence_start=True, parameters={"sequence_position": 3})
    assert names_number(message, 3), message
    # The refused step changed nothing.
    s.send(activations((1, 2, DEMO_HIDDEN), rng))
    assert s.length == 11
    s.check("after a refused position")


def wait_for_delta(server, before, name, want, **labels):
    """The growth of a metric since `before` (samples), once it reaches `want`
    or 10 s have passed: the edge counts a call as it replies, so the client
    can see the reply a moment before the metrics do."""
    deadline = time.monotonic() + 10
    while True:
        got = sample(server.samples(), name, **labels) - sample(before, name, **labels)
        if got >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_errors_name_the_session_and_leave_others_intact(client, server, names):
    rng = np.random.default_rng(44)
    metrics_before = server.samples()
    witness = Session(client, server.model, names, fresh_id("string"), batch=2)
    witness.send(activations((2, 6, DEMO_HIDDEN), rng), start=True)

    def witness_still_right(after):
        witness.send(activations((2, int(rng.integers(1, 4)), DEMO_HIDDEN), rng))
        witness.check(f"after {after}", last_only=True)

    one_token = activations((1, 1, DEMO_HIDDEN), rng)

    for unknown in (fresh_id("int"), fresh_id("string")):
        message = expect_error("NOT_FOUND", infer, client, server.model, *names, one_token,
                               "FP32", sequence_id=unknown)
        assert str(unknown) in message, f"the message does not name {unknown!r}: {message}"
        witness_still_right(f"unknown id {unknown!r}")

    # 7 and "7" are two sessions.
    number = fresh_id("int")
    s = Session(client, server.model, names, number, batch=1)
    s.send(one_token, start=True)
    message = expect_error("NOT_FOUND", infer, client, server.model, *names, one_token, "FP32",
                           sequence_id=str(number))
    assert str(number) in message, message
    witness_still_right("a string id spelling an open int id")

    # After sequence_end the id is gone.
    s.send(activations((1, 3, DEMO_HIDDEN), rng), end=True)
    message = expect_error("NOT_FOUND", s.send, one_token)
    assert str(number) in message, message
    witness_still_right("a request after sequence_end")

    # B is fixed by the start.
    b2 = Session(client, server.model, names, fresh_id(), batch=2)
    b2.send(activations((2, 4, DEMO_HIDDEN), rng), start=True)
    message = expect_error("INVALID_ARGUMENT", infer, client, server.model, *names,
                           activations((3, 1, DEMO_HIDDEN), rng), "FP32", sequence_id=b2.id)
    assert names_number(message, 2) and names_number(message, 3), message
    assert names_number(message, b2.id), message
    witness_still_right("a request with another B")
    # A malformed tensor on a session is refused before it reaches the session.
    expect_error("INVALID_ARGUMENT", infer, client, server.model, *names,
                 activations((2, 1, DEMO_HIDDEN - 1), rng), "FP32", sequence_id=b2.id)
    witness_still_right("a malformed tensor on a session")
    b2.send(activations((2, 2, DEMO_HIDDEN), rng))
    b2.check("after its refused requests")
    witness.send(activations((2, 1, DEMO_HIDDEN), rng), end=True)
    witness.check("at its end")

    # The four NOT_FOUNDs above are counted as such, and as requests for
    # unknown sessions.
    model = server.model
    assert wait_for_delta(server, metrics_before, "layerserve_requests_total", 4, model=model,
                          code="NOT_FOUND") == 4
    assert wait_for_delta(server, metrics_before, "layerserve_rejections_total", 4, model=model,
                          reason="unknown_session") == 4
    assert wait_for_delta(server, metrics_before, "layerserve_requests_total", 2, model=model,
                          code="INVALID_ARGUMENT") == 2


def test_kv_cache_and_session_limits(start_server):
    """A pool of 4 blocks (512 KiB at 8 KiB a token, 16 tokens a block) and
    at most 2 sessions: what does not fit is RESOURCE_EXHAUSTED saying why,
    the sessions that fit are unaffected, and ending one makes room."""
    server = start_server("--kv-cache-memory=512KiB", "--max-sessions=2")
    rng = np.random.default_rng(48)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        names = io_names(client, server.model)
        a = Session(client, server.model, names, fresh_id(), batch=1)
        a.send(activations((1, 40, DEMO_HIDDEN), rng), start=True)  # 3 of the 4 blocks
        b = Session(client, server.model, names, fresh_id("string"), batch=2)
        message = expect_error("RESOURCE_EXHAUSTED", b.send, activations((2, 1, DEMO_HIDDEN), rng),
                               start=True)
        assert "KV cache" in message and b.id in message, message
        assert sample(server.samples(), "layerserve_sessions_open", model=server.model) == 1
        c = Session(client, server.model, names, fresh_id(), batch=1)
        c.send(activations((1, 16, DEMO_HIDDEN), rng), start=True)   # the 4th block
        message = expect_error("RESOURCE_EXHAUSTED", c.send, activations((1, 1, DEMO_HIDDEN), rng))
        assert "KV cache" in message, message
        # A third session is one more than --max-sessions.
        message = expect_error("RESOURCE_EXHAUSTED", infer, client, server.model, *names,
                               activations((1, 1, DEMO_HIDDEN), rng), "FP32",
                               sequence_id=fresh_id(), sequence_start=True)
        assert names_number(message, 2), message
        a.send(activations((1, 8, DEMO_HIDDEN), rng), end=True)     # 48 tokens: still 3 blocks
        a.check("beside refused sessions")
        c.send(activations((1, 1, DEMO_HIDDEN), rng))               # a's blocks are free again
        c.check("after a session that ended gave its blocks back")
        b.send(activations((2, 1, DEMO_HIDDEN), rng), start=True, end=True)
        b.check("once there was room")


def test_start_while_a_step_is_queued_or_in_flight_is_refused(server, names):
    """A reset would race with the session's own work: refused, not queued.
    Both requests go on one stream, where the server enqueues the first
    before it reads the second; the first is large enough (1024 tokens) to
    be still queued or running then, on any machine this runs on."""
    rng = np.random.default_rng(45)
    sid = fresh_id()
    big = activations((4, 256, DEMO_HIDDEN), rng)
    small = activations((1, 2, DEMO_HIDDEN), rng)
    responses = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)),
                            stream_timeout=RPC_TIMEOUT_S)
        try:
            for x, rid in ((big, "big"), (small, "reset")):
                client.async_stream_infer(server.model, [make_input(names[0], x, "FP32")],
                                          request_id=rid, sequence_id=sid, sequence_start=True)
            outcomes = [responses.get(timeout=RPC_TIMEOUT_S) for _ in range(2)]
        finally:
            client.stop_stream()
        errors = [str(error) for result, error in outcomes if error is not None]
        ids = [result.get_response().id for result, error in outcomes if error is None]
        assert ids == ["big"] and len(errors) == 1, f"answered {ids}, errors {errors}"
        assert "FAILED_PRECONDITION" in errors[0] and str(sid) in errors[0], errors[0]
        # The session is the big request's, of B = 4.
        message = expect_error("INVALID_ARGUMENT", infer, client, server.model, *names, small,
                               "FP32", sequence_id=sid)
        assert names_number(message, 4), message


def test_metrics_follow_a_session(client, server, names):
    rng = np.random.default_rng(46)
    model = server.model

    def now():
        samples = server.samples()
        return {
            "open": sample(samples, "layerserve_sessions_open", model=model),
            "blocks": sample(samples, "layerserve_kv_cache_blocks_used", model=model),
            "end": sample(samples, "layerserve_sessions_freed_total", model=model, reason="end"),
            "reset": sample(samples, "layerserve_sessions_freed_total", model=model,
                            reason="reset"),
        }

    before = now()

    def delta():
        n = now()
        return {k: n[k] - before[k] for k in n}

    # The session table reports to the metrics before the reply goes out.
    s = Session(client, server.model, names, fresh_id(), batch=2)
    s.send(activations((2, 20, DEMO_HIDDEN), rng), start=True)
    assert delta() == {"open": 1, "blocks": 4, "end": 0, "reset": 0}
    s.send(activations((2, 13, DEMO_HIDDEN), rng))
    assert delta() == {"open": 1, "blocks": 6, "end": 0, "reset": 0}
    s.send(activations((2, 1, DEMO_HIDDEN), rng), position=10)
    assert delta() == {"open": 1, "blocks": 2, "end": 0, "reset": 0}
    # sequence_start on an open session resets it: a fresh session, B may change.
    s = Session(client, server.model, names, s.id, batch=1)
    s.send(activations((1, 17, DEMO_HIDDEN), rng), start=True)
    assert delta() == {"open": 1, "blocks": 2, "end": 0, "reset": 1}
    s.check("after a reset")
    s.send(activations((1, 1, DEMO_HIDDEN), rng), end=True)
    assert delta() == {"open": 0, "blocks": 0, "end": 1, "reset": 1}


def test_interleaved_sessions_from_threads_stay_independent(server, names):
    """4 threads, each driving 2 sessions (int and string ids, B of 1 or 2)
    with random step sizes, all at once, while a fifth sends requests the
    server refuses: every session matches its own oracle."""
    threads, steps = 4, 5
    barrier = threading.Barrier(threads + 1)
    done = threading.Event()

    def misbehave():
        rng = np.random.default_rng(99)
        refused = 0
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            own = Session(client, server.model, names, fresh_id(), batch=2)
            own.send(activations((2, 3, DEMO_HIDDEN), rng), start=True)
            barrier.wait(timeout=RPC_TIMEOUT_S)
            while not done.is_set() or refused < 4:
                for code, kwargs in (
                        ("NOT_FOUND", dict(sequence_id=fresh_id())),
                        ("INVALID_ARGUMENT", dict(sequence_id=own.id)),  # B = 1, not 2
                        ("FAILED_PRECONDITION", dict(sequence_id=own.id,
                                                     parameters={"sequence_position": 99}))):
                    x = activations((1 if code == "INVALID_ARGUMENT" else 2, 1, DEMO_HIDDEN), rng)
                    expect_error(code, infer, client, server.model, *names, x, "FP32", **kwargs)
                    refused += 1
            own.send(activations((2, 1, DEMO_HIDDEN), rng), end=True)
            own.check("after its refused requests")
        return refused

    def drive(worker):
        rng = np.random.default_rng(100 + worker)
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            sessions = [Session(client, server.model, names, fresh_id(kind), batch=1 + worker % 2)
                        for kind in ("int", "string")]
            barrier.wait(timeout=RPC_TIMEOUT_S)
            for step in range(steps):
                for s in sessions:
                    tokens = int(rng.integers(5, 12)) if step == 0 else int(rng.integers(1, 4))
                    s.send(activations((s.batch, tokens, DEMO_HIDDEN), rng), start=step == 0,
                           end=step == steps - 1)
            for s in sessions:
                s.check(f"(thread {worker})")
            return [s.id for s in sessions]

    with ThreadPoolExecutor(max_workers=threads + 1) as pool:
        refused = pool.submit(misbehave)
        try:
            ids = list(pool.map(drive, range(threads)))
        finally:
            done.set()
        assert refused.result(timeout=RPC_TIMEOUT_S) >= 4
    assert len({sid for worker in ids for sid in worker}) == 2 * threads


def test_idle_session_expires(start_server):
    """With --session-idle-timeout-s=1 an unused session is freed (counted
    under reason="idle_timeout"), and a later request for it hears
    NOT_FOUND "expired"; a session used more often than that stays."""
    server = start_server("--session-idle-timeout-s=1", "--kv-cache-memory=16MiB")
    rng = np.random.default_rng(47)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        names = io_names(client, server.model)
        config = client.get_model_config(server.model, client_timeout=RPC_TIMEOUT_S).config
        assert config.sequence_batching.max_sequence_idle_microseconds == 10**6, config

        def freed_idle():
            return sample(server.samples(), "layerserve_sessions_freed_total", model=server.model,
                          reason="idle_timeout")

        idle = Session(client, server.model, names, fresh_id("string"), batch=1)
        busy = Session(client, server.model, names, fresh_id("int"), batch=1)
        busy.send(activations((1, 4, DEMO_HIDDEN), rng), start=True)
        idle.send(activations((1, 4, DEMO_HIDDEN), rng), start=True)
        started = time.monotonic()  # the server last used idle before this
        assert freed_idle() == 0
        # busy is used every 0.25 s, idle not at all, until idle is freed
        # (1 s, plus at most the server's sweep interval of 1/8 of it).
        while freed_idle() < 1:
            assert time.monotonic() - started < 10, "no session freed for idleness in 10 s"
            busy.send(activations((1, 1, DEMO_HIDDEN), rng))
            time.sleep(0.25)
        assert time.monotonic() - started >= 0.9, "freed before its idle timeout"
        assert freed_idle() == 1
        assert sample(server.samples(), "layerserve_sessions_open", model=server.model) == 1

        message = expect_error("NOT_FOUND", idle.send, activations((1, 1, DEMO_HIDDEN), rng))
        assert "expired" in message and idle.id in message, message
        busy.send(activations((1, 1, DEMO_HIDDEN), rng))
        busy.check("beside an expired session")
        # The id can be started again.
        again = Session(client, server.model, names, idle.id, batch=1)
        again.send(activations((1, 3, DEMO_HIDDEN), rng), start=True, end=True)
        again.check("restarted after expiry")


def test_retry_after_a_client_timeout_with_sequence_position(client, server, names):
    """A client that gave up on a step cannot tell whether the server applied
    it; resending it with sequence_position = the length it knows gives the
    answer as if the first attempt never happened, whichever it was."""
    rng = np.random.default_rng(49)
    s = Session(client, server.model, names, fresh_id(), batch=2)
    s.send(activations((2, 10, DEMO_HIDDEN), rng), start=True)
    step = activations((2, 200, DEMO_HIDDEN), rng)
    for timeout_s in (0.001, 0.05):
        with pytest.raises(InferenceServerException) as error:
            client.infer(server.model, [make_input(names[0], step, "FP32")],
                         sequence_id=s.id, client_timeout=timeout_s)
        assert "DEADLINE_EXCEEDED" in str(error.value.status()), error.value
        s.send(step, position=10)
        s.check(f"after a retry of a step abandoned at {timeout_s} s")
    s.send(activations((2, 1, DEMO_HIDDEN), rng), end=True)
    s.check("after the retries")


def test_a_queued_step_keeps_its_session_alive(start_server):
    """The step arrives 0.2 s after the session's last use (timeout 1 s) and
    waits in the queue behind a long stateless batch: the session was not
    idle, so the step must run, not find its session expired."""
    server = start_server("--session-idle-timeout-s=1", "--kv-cache-memory=16MiB")
    rng = np.random.default_rng(50)
    big = activations((8, 512, DEMO_HIDDEN), rng)  # 4096 tokens: seconds on two cores
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        names = io_names(client, server.model)
        s = Session(client, server.model, names, fresh_id(), batch=1)
        s.send(activations((1, 4, DEMO_HIDDEN), rng), start=True)
        last_used = time.monotonic()
        with ThreadPoolExecutor(max_workers=1) as pool:
            def long_batch():
                with grpcclient.InferenceServerClient(server.grpc_url) as c:
                    return stateless(c, server.model, names, big, "FP32")
            running = pool.submit(long_batch)
            time.sleep(0.2)
            try:
                s.send(activations((1, 1, DEMO_HIDDEN), rng))
                outcome = None
            except InferenceServerException as e:
                outcome = e
            waited = time.monotonic() - last_used
            running.result(timeout=RPC_TIMEOUT_S)
        if waited < 1.5:
            pytest.skip(f"inconclusive: the step came back {waited:.2f} s after the session's "
                        "last use, before its idle timeout could pass")
        assert outcome is None, (
            f"a step sent 0.2 s after the session's last use, answered {waited:.1f} s after it: "
            f"{outcome.status()}: {outcome.message()}")
        s.check("after waiting in the queue")
