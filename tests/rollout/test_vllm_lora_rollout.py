"""The vLLM rollout engine with a peft LoRA student: each push serves the new adapter."""

from __future__ import annotations

import pytest
import torch

from opd.rollout.base import SamplingParams
from oracles import forward_logprobs

pytestmark = pytest.mark.vllm

PROMPTS = [[72, 101, 108, 108, 111], list(range(60, 80))]
RANK = 8


@pytest.fixture(scope="module")
def lora_engine(vllm_model_dir):
    from opd.rollout.vllm import VLLMRolloutEngine

    engine = VLLMRolloutEngine(vllm_model_dir, lora={"rank": RANK}, max_model_len=128, seed=0, max_num_seqs=16)
    yield engine
    engine.close()


def _randomize_adapter(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)   # nonzero B: the adapter matters


def test_lora_push_serves_the_new_adapter(lora_engine, vllm_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(vllm_model_dir), dtype=torch.float32).eval()
    student = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(vllm_model_dir), dtype=torch.float32),
        LoraConfig(r=RANK, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
    ).eval()
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=3)
    for version in (1, 2):
        _randomize_adapter(student, seed=version)
        lora_engine.sync_weights(student)
        rollouts = lora_engine.generate(PROMPTS, params)
        got = torch.cat([torch.tensor(r.logprobs) for r in rollouts])
        want = torch.cat([forward_logprobs(student, r) for r in rollouts])
        torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
        plain = torch.cat([forward_logprobs(base, r) for r in rollouts])
        assert (got - plain).abs().max() > 0.1                      # the adapter is really applied
    # version 2 matched its own adapter above, so it was not served from vLLM's cache of version 1
    assert lora_engine._lora_request.lora_int_id == 2
