"""ReplicaPool over in-process servers (no Ray): what a training step relies on in full mode."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from opd.cluster.pool import ReplicaPool
from opd.teachers.client import TeacherClient, TeacherError
from opd.teachers.server import ServerLimits, serving_in_thread


@pytest.fixture(scope="module")
def teacher(tiny_teacher_dir):
    from opd.teachers.hf_backend import HFBackend

    return HFBackend(tiny_teacher_dir, name="teacher", max_k=16)


def test_a_full_stream_is_sent_at_once_and_one_dropped_unread_is_released(teacher, monkeypatch):
    # The trainer opens a batch's stream before the student's forward pass, so that the
    # teacher computes meanwhile: the pool must send the request then, not at the first read.
    # A stream dropped unread gives its replica's tokens back and frees the server's budget.
    seq = [(3 * j) % 200 + 3 for j in range(60)]
    asked = threading.Event()
    score_full = teacher.score_full
    monkeypatch.setattr(teacher, "score_full", lambda req: (asked.set(), score_full(req))[1])
    limits = ServerLimits(max_tokens_per_request=64, max_inflight_tokens=64)
    with serving_in_thread(teacher, limits=limits) as server, \
            ReplicaPool([server.address], timeout_s=20, heartbeat_s=0.2) as pool:
        want = torch.cat([c.logits for c in pool.score_full([seq], [1], chunk_rows=8, window=1)])
        asked.clear()
        stream = pool.score_full([seq], [1], chunk_rows=8, window=1)
        assert asked.wait(10), "the request did not go out before the first read"
        got = torch.cat([c.logits for c in stream])
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        [stats] = pool.replica_stats()
        assert stats["inflight_tokens"] == 0 and stats["requests"] == 2

        stream = pool.score_full([seq], [1], chunk_rows=8, window=1)
        assert pool.replica_stats()[0]["inflight_tokens"] == 60
        del stream
        assert pool.replica_stats()[0]["inflight_tokens"] == 0
        with TeacherClient(server.address, retries=0, busy_timeout_s=3, backoff_s=0.05) as other:
            t0 = time.monotonic()
            assert other.score_topk([seq[:30]], [1], k=4).ids.shape == (29, 4)   # BUSY until cancelled
            assert time.monotonic() - t0 < 2.5


def test_a_pool_with_no_live_replica_refuses_to_start():
    with pytest.raises(TeacherError, match="NO_REPLICA: none of the replicas"):
        ReplicaPool(["tcp://127.0.0.1:1"], timeout_s=0.3, heartbeat_s=0.1, retries=0)


@pytest.mark.timeout(60)
def test_a_full_stream_that_fails_everywhere_gives_up_after_max_attempts(teacher, monkeypatch):
    # Two replicas that answer every full request with INTERNAL: the stream goes elsewhere at
    # most max_attempts times, then raises (it counted replicas tried, and once both were,
    # re-sent forever).
    calls = []

    def broken(req):
        calls.append(req)
        raise RuntimeError("out of memory")

    monkeypatch.setattr(teacher, "score_full", broken)
    with serving_in_thread(teacher) as a, serving_in_thread(teacher) as b, \
            ReplicaPool([a.address, b.address], timeout_s=20, heartbeat_s=0.2, retries=0, backoff_s=0.01,
                        max_attempts=3) as pool:
        with pytest.raises(TeacherError, match="INTERNAL"):
            list(pool.score_full([[5] * 20], [1], chunk_rows=8))
        assert len(calls) == 4                      # the first send and 3 more
        assert all(s["alive"] and s["inflight_tokens"] == 0 for s in pool.replica_stats())


def test_a_request_uses_the_client_it_acquired_when_a_probe_takes_it_away(teacher, monkeypatch):
    # A probe sets `rep.client = None` under the pool's lock at any moment (and a new client
    # later); a request that read `rep.client` again after choosing its replica met None there.
    seq = [(5 * j) % 200 + 3 for j in range(20)]
    with serving_in_thread(teacher) as server, ReplicaPool([server.address], timeout_s=20) as pool:
        acquire, taken = pool._acquire, []

        def probe_strikes(tokens, tried):
            rep, client = acquire(tokens, tried)
            with pool._lock:
                rep.client = None
            taken.append((rep, client))
            return rep, client

        def probe_done():
            rep, client = taken.pop()
            rep.client = client

        monkeypatch.setattr(pool, "_acquire", probe_strikes)
        assert pool.score_topk([seq], [1], k=4).ids.shape == (19, 4)
        probe_done()
        stream = pool.score_full([seq], [1], chunk_rows=8, window=1)
        probe_done()
        assert sum(c.logits.shape[0] for c in stream) == 19 and not taken
