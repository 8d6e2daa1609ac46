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
