"""Data-parallel student workers on Ray: same weights as one process with the whole batch."""

from __future__ import annotations

import pytest
import torch

from opd.checkpoint import latest_checkpoint, load_checkpoint
from opd.cluster import StudentWorkers
from opd.cluster_dp import (DataParallelGroup, WorkerDiedError, load_student, local_step, make_optimizer,
                            split_batch)
from opd.cluster_rollout import RolloutPool
from opd.rollout.base import SamplingParams
from opd.rollout.hf import HFRolloutEngine

LR = 0.5


def _batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (4, 12), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    labels[:2, 3:9] = -100  # the first shard trains far fewer tokens than the second
    return {"input_ids": ids, "labels": labels}


def test_two_workers_match_one_process_and_a_dead_worker_stops_the_job(ray_cluster, tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    batches = [_batch(1), _batch(2)]
    ref = load_student(tiny_model_dir)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt = make_optimizer(ref, "sgd", LR, 0.0)
    ref_losses = [local_step(ref, opt, b) for b in batches]
    want = {n: p.detach() for n, p in ref.named_parameters()}

    rollouts = RolloutPool.start(tiny_model_dir, 2, num_cpus_per_worker=0.5)  # loads while the workers train
    group = DataParallelGroup.start(tiny_model_dir, StudentWorkers(num_workers=2, num_cpus_per_worker=0.5),
                                    optimizer="sgd", lr=LR)
    try:
        results = [group.step(split_batch(b, 2)) for b in batches]
        assert [r.tokens for r in results] == [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
        assert [r.loss for r in results] == pytest.approx(ref_losses, rel=1e-5)
        for rank in (0, 1):
            got = group.weights(rank)
            moved = max(float((want[n] - start[n]).abs().max()) for n in want)
            assert moved > 1e-3  # the steps changed the weights far beyond the tolerance below
            for n in want:
                torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)

        ckpt = group.save_checkpoint(str(tmp_path / "ckpt"), 2, {"note": "after two steps"})
        assert latest_checkpoint(tmp_path / "ckpt").name == "step_000002"

        # Rollout actors sample from the trained weights once synced to the checkpoint.
        from transformers import AutoTokenizer
        assert rollouts.sync_weights(ckpt) == 2
        prompts, greedy = [[72, 105, 32], [50, 43, 50, 61], [100, 101]], SamplingParams(temperature=0.0,
                                                                                         max_new_tokens=5)
        got_r = rollouts.generate(prompts, greedy)
        want_r = HFRolloutEngine(ref, AutoTokenizer.from_pretrained(str(tiny_model_dir))).generate(prompts, greedy)
        assert [r.prompt_index for r in got_r] == [0, 1, 2]
        assert [r.response_ids for r in got_r] == [r.response_ids for r in want_r]
        for g, w in zip(got_r, want_r):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)

        ray_cluster.kill(group.workers[1], no_restart=True)
        with pytest.raises(WorkerDiedError, match="rank 1 of 2 died") as err:
            group.step(split_batch(_batch(3), 2))
        assert err.value.rank == 1 and err.value.last_checkpoint == ckpt
        assert group.workers == []  # the surviving rank was stopped, not left in all_reduce
    finally:
        group.shutdown()
        rollouts.shutdown()

    fresh = load_student(tiny_model_dir)
    state = load_checkpoint(latest_checkpoint(tmp_path / "ckpt"), model=fresh, restore_rng=False)
    assert state["step"] == 2 and state["note"] == "after two steps"
    for n, p in fresh.named_parameters():
        torch.testing.assert_close(p.detach(), want[n], rtol=1e-5, atol=1e-6)


def test_a_failed_rendezvous_frees_the_workers_and_their_placement_group(ray_cluster, tiny_model_dir):
    # Both ranks raise in init_process_group (a RayTaskError, not a death): the group's CPUs
    # must come back, or every later attempt in this job waits for them.
    import time

    spec = StudentWorkers(num_workers=2, num_cpus_per_worker=0.5, backend="no-such-backend")
    with pytest.raises(ray_cluster.exceptions.RayTaskError, match="no-such-backend"):
        DataParallelGroup.start(tiny_model_dir, spec)
    deadline = time.monotonic() + 20
    while True:
        live = [g["state"] for g in ray_cluster.util.placement_group_table().values() if g["state"] != "REMOVED"]
        if not live or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert live == []


def test_an_error_in_one_worker_stops_the_others_and_a_death_behind_it_is_named(monkeypatch):
    # Without Ray running: ray.wait/ray.get stand in for two workers' step results. A worker
    # that raises (out of memory, gloo's 'connection closed by peer') must stop the group, or
    # the other waits in its all_reduce for collective_timeout_s; if the other died, that is
    # the error reported.
    import ray
    from ray.exceptions import ActorDiedError, RayTaskError

    def run(second):
        raised = RayTaskError("step", "Traceback ...", RuntimeError("[gloo] Connection closed by peer"))
        outcomes = {0: raised, 1: second}

        def get(ref, timeout=None):
            if isinstance(outcomes[ref], BaseException):
                raise outcomes[ref]
            return outcomes[ref]

        monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (refs[:num_returns], refs[num_returns:]))
        monkeypatch.setattr(ray, "get", get)
        group = DataParallelGroup(["w0", "w1"], None, 2)
        stopped = []
        group.shutdown = lambda: stopped.append(True)
        with pytest.raises(Exception) as e:
            group._gather([0, 1])
        return e.value, stopped

    err, stopped = run(ActorDiedError())
    assert isinstance(err, WorkerDiedError) and err.rank == 1 and stopped
    err, stopped = run((0.5, 10))
    assert isinstance(err, RayTaskError) and "Connection closed by peer" in repr(err.cause) and stopped
