"""A teacher process SIGKILLed while it answers: mid full-vocabulary stream, mid top-k forward pass.

With the server restarted on the same address (or a second replica behind ReplicaPool) the
request finishes with the answer a direct forward pass gives; without one it fails with a
TeacherError in bounded time. Times are measured from the SIGKILL.
"""

from __future__ import annotations

import time

import pytest
import torch

from fault_helpers import free_port, start_slow_server
from opd.teachers.client import TeacherClient, TeacherError
from opd.teachers.launch import start_server_process

pytestmark = pytest.mark.timeout(240)

SEQ = [(7 * i + 3) % 250 + 1 for i in range(48)]
START = 8          # 40 answer rows
HEARTBEAT_S = 0.2


@pytest.fixture(scope="module")
def direct(tiny_teacher_dir):
    """log_softmax of the teacher's logits for SEQ's answer rows, computed in this process."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_teacher_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([SEQ])).logits[0, START - 1:len(SEQ) - 1].float()
    return logits


def serve(model_dir, address):
    return start_server_process(["--model", model_dir, "--max-k", 16, "--bind", address,
                                 "--heartbeat-s", HEARTBEAT_S, "--log-level", "WARNING"])


def wait_until(pred, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout_s, "condition not reached"
        time.sleep(0.005)
    return time.monotonic() - t0


def test_sigkill_mid_stream_restart_finishes_exactly_else_timeout(tiny_teacher_dir, direct):
    address = f"tcp://127.0.0.1:{free_port()}"
    server = serve(tiny_teacher_dir, address)
    try:
        with TeacherClient(address, timeout_s=30, retries=3, heartbeat_s=HEARTBEAT_S) as client:
            stream = client.score_full([SEQ], [START], chunk_rows=8, window=1)
            chunks = [next(stream)]
            server.kill()
            noticed_s = wait_until(lambda: not client._verified, 3 * HEARTBEAT_S + 1.0)
            t0 = time.monotonic()
            server = serve(tiny_teacher_dir, address)
            restart_s = time.monotonic() - t0
            chunks += list(stream)
            finished_s = time.monotonic() - t0
        # The same fault with nobody restarting the server: a clear TIMEOUT in bounded time.
        timeout_s, retries = 1.0, 1
        with TeacherClient(address, timeout_s=timeout_s, retries=retries, heartbeat_s=HEARTBEAT_S) as client:
            stream = client.score_full([SEQ], [START], chunk_rows=8, window=1)
            next(stream)
            server.kill()
            t1 = time.monotonic()
            with pytest.raises(TeacherError) as e:
                list(stream)
            stream_fail_s = time.monotonic() - t1
            t1 = time.monotonic()
            with pytest.raises(TeacherError) as e2:   # a new request to the dead address: the same bound
                client.score_topk([SEQ], [START], k=8)
            topk_fail_s = time.monotonic() - t1
    finally:
        server.kill()
    print(f"\nmid-stream SIGKILL: noticed after {noticed_s * 1000:.0f} ms, restart took {restart_s:.1f} s, "
          f"stream finished {finished_s - restart_s:.2f} s after the new server was ready; without restart "
          f"the stream failed after {stream_fail_s:.2f} s, a new top-k after {topk_fail_s:.2f} s "
          f"(timeout_s={timeout_s}, retries={retries})")
    for err, took in ((e.value, stream_fail_s), (e2.value, topk_fail_s)):
        assert err.code == "TIMEOUT" and address in err.message and "timeout_s" in err.message
        assert took < timeout_s * (retries + 1) + 2.0
    assert [c.row_start for c in chunks] == [0, 8, 16, 24, 32]          # every row once, in order
    torch.testing.assert_close(torch.cat([c.logits for c in chunks]), direct, atol=1e-5, rtol=1e-5)
    lse = torch.logsumexp(direct, -1)
    torch.testing.assert_close(torch.cat([c.lse for c in chunks]), lse, atol=1e-5, rtol=1e-5)


def test_sigkill_mid_topk_forward_restart_finishes_exactly(tiny_teacher_dir, direct):
    """The first server sleeps 1.5 s in every backend call, so the kill lands inside the forward pass."""
    address = f"tcp://127.0.0.1:{free_port()}"
    slow = start_slow_server(tiny_teacher_dir, address, delay_s=1.5)
    restarted = None
    try:
        with TeacherClient(address, timeout_s=30, retries=3, heartbeat_s=HEARTBEAT_S) as client:
            assert client.info().model_fingerprint == slow.model_fingerprint
            fut = client.submit_topk([SEQ], [START], k=8)
            time.sleep(0.5)
            slow.kill()
            assert not fut.done()
            restarted = serve(tiny_teacher_dir, address)
            got = fut.result(timeout=60)
    finally:
        slow.kill()
        if restarted is not None:
            restarted.stop()
    want = torch.log_softmax(direct, -1).topk(8, dim=-1)
    torch.testing.assert_close(got.logprobs, want.values, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.ids.long(), want.indices)
    assert got.row_offsets == [0, len(SEQ) - START]


def test_replica_pool_fails_over_mid_stream(tiny_teacher_dir, direct):
    from opd.teachers.pool import ReplicaPool

    a = serve(tiny_teacher_dir, f"tcp://127.0.0.1:{free_port()}")
    b = serve(tiny_teacher_dir, f"tcp://127.0.0.1:{free_port()}")
    try:
        with ReplicaPool([a.address, b.address], timeout_s=1.0, heartbeat_s=HEARTBEAT_S, retries=1,
                         recheck_s=0.5) as pool:
            pool.info()
            stream = pool.score_full([SEQ], [START], chunk_rows=8, window=1)
            chunks = [next(stream)]
            first = next(r for r in pool.replica_stats() if r["inflight_tokens"] > 0)["address"]
            victim = a if first == a.address else b
            victim.kill()
            t0 = time.monotonic()
            chunks += list(stream)
            failover_s = time.monotonic() - t0
            assert pool.live_addresses() == [({a.address, b.address} - {victim.address}).pop()]
            again = pool.score_topk([SEQ], [START], k=8)          # later work goes to the survivor
    finally:
        a.kill()
        b.stop()
    print(f"\nreplica SIGKILLed mid-stream: the other replica finished it {failover_s:.2f} s later")
    assert [c.row_start for c in chunks] == [0, 8, 16, 24, 32]
    torch.testing.assert_close(torch.cat([c.logits for c in chunks]), direct, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again.logprobs, torch.log_softmax(direct, -1).topk(8, dim=-1).values,
                               atol=1e-5, rtol=1e-5)
