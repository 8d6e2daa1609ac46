"""A real vLLM rollout engine split over 2 tensor-parallel ranks: raw log-probs and the weight
push reach every rank (slow: it starts an engine of its own; on the CPU build each rank is bound
to half of this machine's CPUs)."""

from __future__ import annotations

import copy

import pytest
import torch

from opd.rollout.base import SamplingParams
from oracles import forward_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_two_ranks_sample_raw_logprobs_and_take_weight_pushes(vllm_model_dir, two_vllm_ranks):
    from transformers import AutoModelForCausalLM

    from opd.rollout.vllm import VLLMRolloutEngine

    student = AutoModelForCausalLM.from_pretrained(str(vllm_model_dir), dtype=torch.float32).eval()
    new = copy.deepcopy(student)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std().clamp_min(1e-3))
    prompts, params = [[72, 101, 108, 108, 111], list(range(60, 90))], SamplingParams(max_new_tokens=8, n=2, seed=3)
    engine = VLLMRolloutEngine(vllm_model_dir, max_model_len=128, seed=0, max_num_seqs=8, tensor_parallel_size=2)
    try:
        for model in (student, new):             # the second: after a push, which each rank loads its shard of
            if model is new:
                engine.sync_weights(new)
            for r in engine.generate(prompts, params):
                torch.testing.assert_close(torch.tensor(r.logprobs), forward_logprobs(model, r), atol=1e-3, rtol=0)
    finally:
        engine.close()
