"""Sessions behind replicas, with real components: three CPU layerserve
replicas of a tiny random checkpoint behind Debian's nginx, started with the
configuration shipped in deploy/nginx/nginx.conf (only its addresses, ports,
socket and certificate replaced: tests/support/nginx_proxy.py), driven by
tritonclient clients that send x-session-id as docs/sessions.md tells them to.

  1. 64 sessions opened and stepped from several clients at once: every
     answer equals what a stateless request over the session's whole
     sequence gives (no NOT_FOUND: each step found its session), the
     sessions are spread over all three replicas, and stateless requests
     (no header) are balanced per call over all three;
  2. SIGTERM to one replica: it refuses new sessions at once (UNAVAILABLE,
     the sessions hashing to it), its open sessions step on and may end, the
     rest are dropped after --drain-sessions-timeout-s (a step then gets
     NOT_FOUND "dropped by a drain" from it while it still answers), and it
     exits 0; the other replicas' sessions are untouched (their steps still
     equal the stateless answers), and new sessions land on the survivors.

Ports are the kernel's; every wait is bounded. nginx comes from
scripts/install-deps.sh (the Debian packages nginx and libnginx-mod-stream); the test fails, naming it,
where it is missing. Runs in about 20 s on two cores.
"""

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from layerserve_process import LayerserveProcess
from llama_numpy import assert_close
from nginx_proxy import NginxProxy
from tiny_servers import SMALL_SERVER_FLAGS, TINY_LLAMA, write_tiny_llama

HIDDEN = TINY_LLAMA["hidden_size"]
DRAIN_SESSIONS_S = 4
SERVER_FLAGS = [*SMALL_SERVER_FLAGS, f"--drain-sessions-timeout-s={DRAIN_SESSIONS_S}"]
SESSIONS = 64
CLIENTS = 4
PROMPT_TOKENS = 4
STEPS = 3
TIMEOUT_S = 30
# FP32 in both paths: the session's cached keys against a stateless
# recomputation differ by summation order only.
TOLERANCE = dict(max_rel=1e-4, rms_rel=1e-5)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, server_bin):
    """(nginx's gRPC address, [replica, replica, replica])."""
    work = tmp_path_factory.mktemp("routing")
    model_dir = write_tiny_llama(work, seed=38)
    replicas = []
    nginx = None
    try:
        for i in range(3):
            replicas.append(LayerserveProcess(server_bin, [*SERVER_FLAGS, f"--model-dir={model_dir}"],
                                              work / f"replica-{i}.log"))
        nginx = NginxProxy([r.grpc_url for r in replicas], work / "nginx")
        yield nginx.url, replicas
    finally:
        if nginx is not None:
            nginx.stop()
        for r in replicas:
            r.stop()


def sessions_open(replica):
    return replica.samples().get(("layerserve_sessions_open", frozenset({("model", replica.model)})), 0)


def ok_requests(replica):
    return replica.samples().get(
        ("layerserve_requests_total", frozenset({("model", replica.model), ("code", "OK")})), 0)


class Session:
    """One session's tokens and what it was answered, with the oracle: one
    stateless request over everything sent so far, whose last rows must equal
    each step's answer."""

    def __init__(self, sid, seed):
        self.sid = sid
        self.rng = np.random.default_rng(seed)
        self.sent = np.zeros((1, 0, HIDDEN), dtype=np.float32)

    def tokens(self, count):
        return self.rng.normal(size=(1, count, HIDDEN)).astype(np.float32)

    def step(self, client, model, count, start=False, end=False):
        """Sends `count` new tokens; returns their output (raises tritonclient's
        error as it comes)."""
        x = self.tokens(count)
        out = infer(client, model, x, sequence_id=self.sid, sequence_start=start,
                    sequence_end=end, headers={"x-session-id": str(self.sid)})
        self.sent = np.concatenate([self.sent, x], axis=1)
        return out

    def check(self, client, model, got):
        whole = stateless(client, model, self.sent)
        assert_close(got, whole[:, -got.shape[1]:, :], **TOLERANCE,
                     what=f"session {self.sid} at length {self.sent.shape[1]}")


def infer(client, model, x, headers=None, **sequence):
    inp = grpcclient.InferInput("hidden_states", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer(model, [inp], headers=headers, client_timeout=TIMEOUT_S, **sequence)
    return result.as_numpy("hidden_states")


def stateless(client, model, x, tries=6):
    """A stateless request, retried on UNAVAILABLE as a client behind
    replicas does (a draining replica refuses it; nginx balances the retry to
    the next one)."""
    for attempt in range(tries):
        try:
            return infer(client, model, x)
        except InferenceServerException as e:
            if code_of(e) != "UNAVAILABLE" or attempt + 1 == tries:
                raise


def code_of(error):
    status = error.status() or ""
    return status.replace("StatusCode.", "")


def run_sessions(url, model, sessions, steps):
    """Opens (or steps) `sessions` from CLIENTS clients at once and checks
    every answer against the stateless oracle; returns the errors."""
    errors = []
    lock = threading.Lock()

    def drive(share):
        with grpcclient.InferenceServerClient(url) as client:
            for s in share:
                try:
                    if s.sent.shape[1] == 0:
                        s.check(client, model, s.step(client, model, PROMPT_TOKENS, start=True))
                    for _ in range(steps):
                        s.check(client, model, s.step(client, model, 1))
                except (InferenceServerException, AssertionError) as e:
                    with lock:
                        errors.append(f"session {s.sid}: {e}")

    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(drive, [sessions[i::CLIENTS] for i in range(CLIENTS)]))
    return errors


def open_where(url, model, replicas, sids):
    """Opens each session alone and reads which replica's sessions_open grew:
    {sid: replica index} (one client, one session at a time)."""
    placed = {}
    with grpcclient.InferenceServerClient(url) as client:
        for sid in sids:
            before = [sessions_open(r) for r in replicas]
            s = Session(sid, seed=sid)
            s.check(client, model, s.step(client, model, PROMPT_TOKENS, start=True))
            grew = [i for i, r in enumerate(replicas) if sessions_open(r) > before[i]]
            assert len(grew) == 1, f"session {sid}: sessions_open grew on {grew}"
            placed[sid] = (grew[0], s)
    return placed


def test_sessions_stay_on_their_replica_and_a_drain_ends_them_as_documented(fleet):
    url, replicas = fleet
    model = replicas[0].model

    # 1. 64 sessions, each opened alone so its replica is known, then stepped
    # by several clients at once.
    placed = open_where(url, model, replicas, range(1, SESSIONS + 1))
    per_replica = [sum(1 for i, _ in placed.values() if i == k) for k in range(3)]
    assert all(per_replica), f"the hash left a replica without sessions: {per_replica}"
    errors = run_sessions(url, model, [s for _, s in placed.values()], STEPS)
    assert not errors, "\n".join(errors[:5])
    assert [sessions_open(r) for r in replicas] == per_replica

    # Stateless requests carry no header and are balanced per call.
    before = [ok_requests(r) for r in replicas]
    with grpcclient.InferenceServerClient(url) as client:
        for i in range(12):
            infer(client, model, np.full((1, 2, HIDDEN), i, dtype=np.float32))
    served = [ok_requests(r) - b for r, b in zip(replicas, before)]
    assert sum(served) == 12 and all(served), f"stateless calls per replica: {served}"

    # 2. SIGTERM to the replica with the most sessions.
    gone = per_replica.index(max(per_replica))
    leaving = [s for i, s in placed.values() if i == gone]
    staying = [s for i, s in placed.values() if i != gone]
    ending, probe, dropped = leaving[: len(leaving) // 2], leaving[-1], leaving[len(leaving) // 2:-1]
    replicas[gone].proc.send_signal(signal.SIGTERM)

    with grpcclient.InferenceServerClient(url) as client:
        # New sessions: refused by the leaving replica at once, taken by the
        # others.
        deadline = time.monotonic() + 10
        refused = []
        for sid in range(1000, 1064):
            s = Session(sid, seed=sid)
            try:
                s.step(client, model, PROMPT_TOKENS, start=True)
                # Opened: it is not on the leaving replica (that one
                # refuses), so end it again.
                s.step(client, model, 1, end=True)
            except InferenceServerException as e:
                assert code_of(e) == "UNAVAILABLE", e
                assert f"opens no new session; start session {sid} on another replica" in str(e), e
                refused.append(sid)
            if refused or time.monotonic() > deadline:
                break
        assert refused, "no new session hashed to the leaving replica in 64 tries"

        # Its open sessions step on, and some end as their clients want.
        for s in ending:
            s.check(client, model, s.step(client, model, 1))
            s.check(client, model, s.step(client, model, 1, end=True))

        # One keeps stepping until the drain drops it: the leaving replica
        # itself says so (a step crossing the drop may get UNAVAILABLE first).
        outcome = None
        for _ in range(int(DRAIN_SESSIONS_S / 0.02) + 200):
            try:
                probe.step(client, model, 1)
            except InferenceServerException as e:
                if code_of(e) == "UNAVAILABLE" and outcome is None:
                    outcome = e
                    continue
                outcome = e
                break
            time.sleep(0.02)
        assert isinstance(outcome, InferenceServerException), "the drain never dropped the probe"
        assert code_of(outcome) == "NOT_FOUND", outcome
        assert f"session {probe.sid} was dropped by a drain" in str(outcome), outcome

    # Waited for, not stopped: a second SIGTERM would cut the drain short.
    assert replicas[gone].proc.wait(timeout=30) == 0, replicas[gone].log_text()
    replicas[gone].stop()
    log = replicas[gone].log_text()
    assert f"drain: sessions dropped: {len(dropped) + 1} ({len(leaving)} were open" in log, log

    with grpcclient.InferenceServerClient(url) as client:
        # The dropped sessions are gone for good: the next replica on the
        # ring never saw them.
        for s in dropped:
            with pytest.raises(InferenceServerException) as e:
                s.step(client, model, 1)
            assert code_of(e.value) == "NOT_FOUND", e.value
            assert f"session {s.sid}" in str(e.value), e.value

    # The survivors' sessions are untouched.
    survivors = [r for k, r in enumerate(replicas) if k != gone]
    open_before = sum(sessions_open(r) for r in survivors)
    assert open_before == len(staying)
    errors = run_sessions(url, model, staying, 2)
    assert not errors, "\n".join(errors[:5])

    # New sessions land on the survivors, those refused above included.
    fresh = [Session(sid, seed=sid) for sid in [*refused, *range(2000, 2015)]]
    errors = run_sessions(url, model, fresh, 1)
    assert not errors, "\n".join(errors[:5])
    assert sum(sessions_open(r) for r in survivors) == open_before + len(fresh)
