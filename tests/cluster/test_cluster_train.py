"""`opd train` with `cluster: {mode: ray}`: the run starts a local Ray cluster, places two replicas
of its teacher there, trains against both through one ReplicaPool, and shuts everything down."""

from __future__ import annotations

import json

import pytest
import yaml

from opd.cli import main
from opd.data import write_jsonl
from opd.metrics import read_metrics
from opd.distill.trainer import Trainer

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("mode", ["topk", "full"])   # full: streams opened before the loss reads them
def test_opd_train_on_ray_uses_both_teacher_replicas(tmp_path, tiny_model_dir, tiny_teacher_dir, monkeypatch, mode,
                                                     without_ray_session):
    ray = without_ray_session
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"q{i}: what is {i}+{i}?"} for i in range(12)])
    write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"held out {i}"} for i in range(2)])
    config = {
        "student": {"path": str(tiny_model_dir)},
        # In ray mode the address of a teacher in cluster.teachers is not used.
        "merge": {"teachers": [{"name": "t", "address": "tcp://127.0.0.1:1", "mode": mode, "k": 8}],
                  "datasets": [{"domain": "gen", "path": "train.jsonl", "eval_path": "eval.jsonl"}]},
        "rollout": {"prompts_per_step": 4, "max_new_tokens": 6},
        "optim": {"lr": 3e-3, "micro_batch_size": 4},
        "run": {"steps": 3, "out_dir": "run", "progress": False, "tensorboard": False, "eval_prompts": 2},
        "cluster": {"mode": "ray", "address": None, "num_cpus": 2, "request_timeout_s": 30, "recheck_s": 0.5,
                    "teachers": [{"name": "t", "model": str(tiny_teacher_dir), "replicas": 2, "num_cpus": 0.5,
                                  "serve_args": ["--max-k", "16"], "startup_timeout_s": 120}]},
    }
    path = tmp_path / "ray.yaml"
    path.write_text(yaml.safe_dump(config))

    seen = {}
    close = Trainer.close

    def recording_close(self):   # the pool's per-replica counters, read before the cluster goes away
        if hasattr(self, "teachers"):
            pool = self.teachers.clients["t"][0]
            seen["stats"] = pool.replica_stats()
            seen["welcome"] = self.teachers.welcome("t")
        close(self)

    monkeypatch.setattr(Trainer, "close", recording_close)
    assert main(["train", str(path)]) == 0

    stats = seen["stats"]
    assert len(stats) == 2 and len({s["address"] for s in stats}) == 2
    assert all(s["address"].startswith("tcp://127.0.0.1:") for s in stats)
    # 3 training batches + 2 evaluations (start, end), each answered by one replica; both served.
    assert sum(s["requests"] for s in stats) == 5 and all(s["requests"] >= 1 for s in stats), stats
    assert all(s["failures"] == 0 for s in stats), stats
    assert not ray.is_initialized()                      # the run closed the Ray session it opened
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert sorted({r["step"] for r in rows if "loss" in r}) == [1, 2, 3]
    card = json.loads((tmp_path / "run" / "card.json").read_text())
    assert card["teacher t"]["model_fingerprint"] == seen["welcome"].model_fingerprint
