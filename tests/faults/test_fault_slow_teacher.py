"""A slow teacher: the real server in front of a backend that sleeps (fault_helpers.SlowBackend).

Requests that outlive `timeout_s` are re-sent and finish once the teacher is fast again, or
fail with TIMEOUT after `retries`; BUSY answers are retried with exponential back-off; the
server's accepted work never exceeds its token budget and the client holds only what the
caller submitted.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from fault_helpers import SlowBackend
from opd.teachers.client import TeacherClient, TeacherError
from opd.teachers.protocol import Cancel, Error, Score, decode, encode
from opd.teachers.server import ServerLimits, serving_in_thread

pytestmark = pytest.mark.timeout(120)

SEQ = [(5 * i + 1) % 250 + 1 for i in range(40)]


@pytest.fixture(scope="module")
def hf(tiny_teacher_dir):
    from opd.teachers.hf_backend import HFBackend

    return HFBackend(tiny_teacher_dir, name="teacher", max_k=16)


def running(backend, **limits):
    return serving_in_thread(backend, limits=ServerLimits(**limits))


def test_timed_out_request_is_resent_and_answers_correctly(hf):
    slow = SlowBackend(hf, delay_s=1.0, slow_calls=1)          # only the first call is slow
    with running(slow) as server:
        with TeacherClient(server.address, timeout_s=0.6, retries=6, heartbeat_s=0.1) as client:
            t0 = time.monotonic()
            got = client.score_topk([SEQ], [10], k=8)
            took = time.monotonic() - t0
            again = client.score_topk([SEQ], [10], k=8)        # fast now: the reference
    print(f"\nslow first call (1.0 s) vs timeout_s=0.6: answered after {took:.2f} s, "
          f"{len(slow.calls)} backend calls, {client.reconnects} reconnects")
    assert len(slow.calls) >= 2 and client.reconnects >= 1     # it was re-sent on a new connection
    assert torch.equal(got.ids, again.ids)
    torch.testing.assert_close(got.logprobs, again.logprobs, atol=1e-6, rtol=0)


def test_always_slow_teacher_times_out_in_bounded_time(hf):
    slow = SlowBackend(hf, delay_s=0.8)
    timeout_s, retries = 0.3, 2
    with running(slow) as server:
        with TeacherClient(server.address, timeout_s=timeout_s, retries=retries, heartbeat_s=0.1) as client:
            client.info()
            t0 = time.monotonic()
            with pytest.raises(TeacherError) as e:
                client.score_topk([SEQ], [10], k=8)
            took = time.monotonic() - t0
            assert not client._calls                               # nothing left behind in the client
        deadline = time.monotonic() + 10
        while server._jobs and time.monotonic() < deadline:       # the server drops the abandoned attempts
            time.sleep(0.05)
        assert not server._jobs and server._inflight_tokens == 0
    print(f"\nalways-slow teacher (0.8 s/call), timeout_s={timeout_s}, retries={retries}: TIMEOUT after {took:.2f} s")
    assert e.value.code == "TIMEOUT" and "timeout_s=0.3" in e.value.message
    assert timeout_s * (retries + 1) - 0.05 <= took < timeout_s * (retries + 1) + 1.5


def test_busy_is_retried_with_backoff_and_nothing_queues_without_bound(hf):
    budget, n, backoff_s = 96, 8, 0.05
    slow = SlowBackend(hf, delay_s=0.15)
    peak = {"server_tokens": 0, "server_jobs": 0, "client_calls": 0}
    stop = threading.Event()
    with running(slow, max_inflight_tokens=budget) as server:
        with TeacherClient(server.address, timeout_s=20, retries=40, backoff_s=backoff_s, max_backoff_s=5.0) as client:
            want = client.score_topk([SEQ], [10], k=8)

            def watch():
                while not stop.is_set():
                    peak["server_tokens"] = max(peak["server_tokens"], server._inflight_tokens)
                    # jobs holding budget: one whose answer is being posted has released its tokens
                    # already (opd.teachers.worker._done), and a loaded box can admit the next meanwhile
                    held = sum(not j.released for j in list(server._jobs.values()))
                    peak["server_jobs"] = max(peak["server_jobs"], held)
                    peak["client_calls"] = max(peak["client_calls"], len(client._calls))
                    time.sleep(0.002)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            busy0 = server.stats["busy"]
            t0 = time.monotonic()
            futures = [client.submit_topk([SEQ], [10], k=8) for _ in range(n)]
            results = [f.result(timeout=60) for f in futures]
            took = time.monotonic() - t0
            stop.set()
            watcher.join()
            busy = server.stats["busy"] - busy0
            assert not client._calls
    print(f"\n{n} requests of {len(SEQ)} tokens, budget {budget} tokens, 0.15 s/call: {busy} BUSY answers, "
          f"all answered in {took:.2f} s; peaks: server {peak['server_tokens']} tokens / {peak['server_jobs']} jobs, "
          f"client {peak['client_calls']} calls")
    for r in results:
        assert torch.equal(r.ids, want.ids)
    assert busy > 0                                                   # the budget was hit ...
    assert peak["server_tokens"] <= budget and peak["server_jobs"] <= budget // len(SEQ)   # ... and held
    assert peak["client_calls"] <= n                                  # the client holds what was submitted
    # Exponential back-off: a request can be refused about log2(elapsed / backoff_s) + 1 times,
    # not elapsed / (poll interval) times as with immediate retries.
    assert busy <= n * (math.log2(took / backoff_s) + 2), busy


def test_cancel_during_a_slow_topk_call_releases_its_tokens_once(hf):
    import numpy as np
    import zmq

    slow = SlowBackend(hf, delay_s=0.6)
    ids = np.array(SEQ, dtype="<i4")
    with running(slow, max_inflight_tokens=10 * len(SEQ)) as server:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.address)
        sock.send_multipart(encode(Score(request_id=7, mode="topk", response_starts=[10], k=4),
                                   (ids, np.array([0, len(SEQ)], dtype="<i4"))))
        deadline = time.monotonic() + 10
        while not slow.calls and time.monotonic() < deadline:     # the backend call has begun
            time.sleep(0.01)
        sock.send_multipart(encode(Cancel(request_id=7)))
        answers = []
        while sock.poll(1500):
            msg, _ = decode(sock.recv_multipart())
            answers.append(type(msg).__name__ + (f"({msg.code})" if isinstance(msg, Error) else ""))
        sock.close()
        inflight, jobs = server._inflight_tokens, len(server._jobs)
    print(f"\nCANCEL during a 0.6 s top-k call: answers {answers}, in-flight tokens afterwards {inflight}")
    assert jobs == 0 and inflight == 0                       # released once, not twice
    assert answers == ["Error(ErrorCode.CANCELLED)"]          # one answer, not CANCELLED and then TOPK
