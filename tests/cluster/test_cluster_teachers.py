"""Teacher replicas on Ray behind one ReplicaPool: balancing, failover, supervised restart."""

from __future__ import annotations

import time

import pytest
import torch
from oracles import process_gone

from opd.cluster.config import ClusterConfig, TeacherReplicas
from opd.cluster.session import RayCluster
from opd.teachers.pool import FingerprintMismatch, ReplicaPool
from opd.teachers.launch import start_server_process

SEQS = [[5, 17, 99, 3, 42, 7, 8], [120, 4, 9, 11, 250]]
STARTS = [3, 2]
K = 4


@pytest.fixture(scope="module")
def cluster(ray_module, tiny_model_dir):
    spec = TeacherReplicas(name="tiny", model=str(tiny_model_dir), replicas=2, num_cpus=0.5,
                           serve_args=["--max-k", "8"], startup_timeout_s=120, max_restarts=3)
    c = RayCluster.start(ClusterConfig(mode="ray", teachers=[spec], request_timeout_s=20, recheck_s=0.2))
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def group(cluster):
    return cluster.teacher_group("tiny")


def _same(a, b) -> None:
    assert torch.equal(a.ids, b.ids) and a.row_offsets == b.row_offsets
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.token_logprob, b.token_logprob, rtol=1e-5, atol=1e-5)


def _requests(pool) -> dict[str, int]:
    return {s["address"]: s["requests"] for s in pool.replica_stats()}


def test_two_replicas_share_the_load_fail_over_and_come_back(cluster, group):
    infos = group.infos()
    assert len({i["address"] for i in infos}) == 2 and all(i["address"].startswith("tcp://127.0.0.1:") for i in infos)
    assert len({(i["model_fingerprint"], i["tokenizer_fingerprint"]) for i in infos}) == 1

    with cluster.teacher_pool("tiny", heartbeat_s=0.3) as pool:
        assert pool.info().teacher == "tiny" and pool.info().model_fingerprint == infos[0]["model_fingerprint"]
        ref = pool.score_topk(SEQS, STARTS, K)
        assert ref.ids.shape == (sum(len(s) - st for s, st in zip(SEQS, STARTS)), K)
        for f in [pool.submit_topk(SEQS, STARTS, K) for _ in range(8)]:
            _same(f.result(timeout=30), ref)
        assert all(n > 0 for n in _requests(pool).values()) and len(_requests(pool)) == 2

        # SIGKILL one server with requests in flight: they finish on the other replica.
        futures = [pool.submit_topk(SEQS, STARTS, K) for _ in range(6)]
        old_pid = group.kill_server(0)
        for f in futures:
            _same(f.result(timeout=30), ref)
        for _ in range(4):  # and the run keeps going while replica 0 is down
            _same(pool.score_topk(SEQS, STARTS, K), ref)

        # The supervisor restarts it and the pool uses it again.
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            info = group.infos()[0]
            if info["restarts"] == 1 and info["address"] in pool.live_addresses() and len(pool.live_addresses()) == 2:
                break
            _same(pool.score_topk(SEQS, STARTS, K), ref)
            time.sleep(0.2)
        else:
            pytest.fail(f"replica 0 did not come back: {group.infos()} {pool.replica_stats()}")
        assert info["pid"] != old_pid
        before = _requests(pool)
        for f in [pool.submit_topk(SEQS, STARTS, K) for _ in range(8)]:
            _same(f.result(timeout=30), ref)
        after = _requests(pool)
        assert all(after[a] > before.get(a, 0) for a in after), (before, after)


def test_a_replica_with_another_model_is_refused(group, tiny_teacher_dir):
    with start_server_process(["--model", tiny_teacher_dir, "--name", "tiny", "--max-k", "8"]) as other:
        with pytest.raises(FingerprintMismatch, match="same model"):
            ReplicaPool([group.addresses()[0], other.address], timeout_s=20, heartbeat_s=0.3)


def test_a_crashed_replica_actor_takes_its_server_along_and_ray_restarts_it(group):
    # A server that outlived its actor would hold a GPU in a real run. Two things stop it: Ray
    # kills a dead worker's children (Ray 2.60 does, even with its kill_child_processes_*
    # settings off), and die_with_parent, Linux's SIGTERM when the launcher thread ends, which
    # tests/teachers/test_launch.py checks on its own. Here: no server is left, and the
    # actor Ray restarts serves again with a server of its own.
    import ray

    old = group.infos()[1]
    ray.kill(group.actors[1], no_restart=False)   # like a crash: no stop(), no atexit
    deadline = time.monotonic() + 60
    while not process_gone(old["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_gone(old["pid"])
    new = group.wait_until_up(180)[1]             # Ray restarts the actor (max_restarts), with a new server
    assert new["pid"] != old["pid"] and new["model_fingerprint"] == old["model_fingerprint"]
