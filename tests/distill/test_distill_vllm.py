"""`opd train` with `rollout.engine: vllm`: the first training batch is sampled by vLLM from the
student's initial weights, so its log-probs equal a transformers forward pass of that model."""

from __future__ import annotations

import pytest
import torch

from opd.config import from_dict
from oracles import forward_logprobs
from opd.data import write_jsonl
from opd.metrics import read_metrics
from opd.distill.config import TrainConfig
from opd.distill.trainer import Trainer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


def test_vllm_rollouts_train_two_steps_with_matching_logprobs(tmp_path, vllm_model_dir):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from opd.teachers.launch import start_server_process
    from opd.tiny import perturb_model

    teacher = perturb_model(vllm_model_dir, tmp_path / "teacher", seed=5)
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"q{i}: what is {i}+{i}?"} for i in range(8)])
    server = start_server_process(["--model", str(teacher), "--max-k", "16", "--name", "t"])
    first: list = []

    class Recording(Trainer):
        def _sample_batch(self):
            batch = super()._sample_batch()
            if not first:
                first.append(batch)
            return batch

    try:
        cfg = from_dict({
            "student": {"path": str(vllm_model_dir)},
            "merge": {"teachers": [{"name": "t", "address": server.address, "k": 8}],
                      "datasets": [{"domain": "gen", "path": str(tmp_path / "train.jsonl")}]},
            "rollout": {"engine": "vllm", "prompts_per_step": 4, "max_new_tokens": 8, "vllm_max_model_len": 128},
            "optim": {"lr": 1e-3, "micro_batch_size": 4},
            "run": {"steps": 2, "out_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False},
        }, TrainConfig)
        assert Recording(cfg).run()["step"] == 2
    finally:
        server.stop()
    batch = first[0]
    assert batch.policy_version == 0 and any(ro.response_ids for ro in batch.rollouts)
    model = AutoModelForCausalLM.from_pretrained(str(vllm_model_dir), dtype=torch.float32).eval()
    for ro in batch.rollouts:
        if ro.response_ids:
            torch.testing.assert_close(torch.tensor(ro.logprobs), forward_logprobs(model, ro), atol=1e-3, rtol=0)
    assert sorted(r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r) == [1, 2]


def test_vllm_rollouts_run_two_steps_ahead(tmp_path, vllm_model_dir):
    """run.max_staleness 2 with the vLLM engine: the thread samples with vLLM's own weights,
    loaded from the snapshots the trainer hands over; rows are corrected by TIS."""
    pytest.importorskip("vllm")
    import json

    from opd.teachers.launch import start_server_process
    from opd.tiny import perturb_model

    teacher = perturb_model(vllm_model_dir, tmp_path / "teacher", seed=5)
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"q{i}: what is {i}+{i}?"} for i in range(8)])
    write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"q{i}: what is {i}+{i}?", "answer": str(2 * i)}
                                          for i in range(20, 24)])
    server = start_server_process(["--model", str(teacher), "--max-k", "16", "--name", "t"])
    try:
        cfg = from_dict({
            "student": {"path": str(vllm_model_dir)},
            "merge": {"teachers": [{"name": "t", "address": server.address, "k": 8}],
                      "datasets": [{"domain": "gen", "path": str(tmp_path / "train.jsonl"),
                                    "eval_path": str(tmp_path / "eval.jsonl")}]},
            "rollout": {"engine": "vllm", "prompts_per_step": 4, "max_new_tokens": 8, "vllm_max_model_len": 128},
            "optim": {"lr": 1e-3, "micro_batch_size": 4},
            "run": {"steps": 4, "max_staleness": 2, "eval_every": 2, "eval_prompts": 4, "out_dir": str(tmp_path / "run"),
                    "progress": False, "tensorboard": False},
        }, TrainConfig)
        assert Trainer(cfg).run()["step"] == 4
    finally:
        server.stop()
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 4 and all(0 <= r["staleness"] <= 2 for r in rows) and any(r["staleness"] for r in rows)
    card = json.loads((tmp_path / "run" / "card.json").read_text())
    assert card["trajectories"]["off_policy_correction"]["rows"] > 0
