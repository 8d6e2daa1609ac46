"""A teacher served by several replicas at fixed addresses (`merge.teachers[].replicas`): what a
sharded student on torchrun uses, each rank with its own pool, where Ray's replicas are rank 0's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from opd.config import from_dict
from opd.data import write_jsonl
from opd.distill.config import TrainConfig
from opd.distill.trainer import Trainer
from opd.errors import TrainError
from opd.teachers import session
from opd.teachers.hf_backend import HFBackend
from opd.teachers.pool import ReplicaPool
from opd.teachers.server import serving_in_thread


def config(tmp_path, student, address, replicas) -> TrainConfig:
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"q{i}: what is {i}+{i}?"} for i in range(8)])
    return from_dict({
        "student": {"path": str(student)},
        "merge": {"teachers": [{"name": "t", "address": address, "replicas": replicas, "k": 8}],
                  "datasets": [{"domain": "gen", "path": str(tmp_path / "train.jsonl")}]},
        "rollout": {"prompts_per_step": 4, "max_new_tokens": 6},
        "optim": {"lr": 1e-3},
        "run": {"steps": 4, "out_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False,
                "eval_every": 0}}, TrainConfig)


def test_a_run_spreads_its_requests_over_the_replicas(tmp_path, tiny_model_dir, tiny_teacher_dir, monkeypatch):
    pools = []

    class Recorded(ReplicaPool):
        def close(self):
            pools.append(self.replica_stats())
            super().close()

    monkeypatch.setattr(session, "ReplicaPool", Recorded)
    with serving_in_thread(HFBackend(tiny_teacher_dir, name="t", max_k=8)) as a, \
            serving_in_thread(HFBackend(tiny_teacher_dir, name="t", max_k=8)) as b:
        Trainer(config(tmp_path, tiny_model_dir, a.address, [b.address])).run()
    assert len(pools) == 1
    served = {r["address"]: r["requests"] for r in pools[0]}
    assert set(served) == {a.address, b.address}
    # Requests overlap (the next batch's is sent while this one trains): the least loaded takes each.
    assert all(n > 0 for n in served.values()) and sum(served.values()) >= 4, served


def test_a_replica_of_another_model_is_refused(tmp_path, tiny_model_dir, tiny_teacher_dir):
    with serving_in_thread(HFBackend(tiny_teacher_dir, name="t", max_k=8)) as a, \
            serving_in_thread(HFBackend(tiny_model_dir, name="t", max_k=8)) as b:
        with pytest.raises(TrainError, match=r"teacher 't': its replicas .* are unusable .* serves model"):
            Trainer(config(tmp_path, tiny_model_dir, a.address, [b.address])).run()


def test_no_replica_answering_is_refused_with_the_keys_to_fix(tmp_path, tiny_model_dir):
    cfg = config(tmp_path, tiny_model_dir, "tcp://127.0.0.1:9", ["tcp://127.0.0.1:10"])
    cfg = replace(cfg, teacher_client=replace(cfg.teacher_client, timeout_s=1.0))
    with pytest.raises(TrainError, match=r"unusable \(NO_REPLICA.*fix merge.teachers\[0\].address/replicas"):
        Trainer(cfg).run()
