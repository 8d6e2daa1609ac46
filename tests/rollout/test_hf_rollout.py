"""The transformers rollout engine: the reference the vLLM engine is held to."""

from __future__ import annotations

import torch

from opd.rollout.base import SamplingParams
from opd.rollout.hf import HFRolloutEngine


def test_hf_rollout_logprobs_match_forward_pass(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    engine = HFRolloutEngine(model, AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    prompts = [[72, 101, 108, 108, 111], list(range(60, 80))]        # different lengths: left padding
    stops = tuple(range(100, 130))
    rollouts = engine.generate(prompts, SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=10,
                                                       n=3, stop_token_ids=stops, seed=2))
    assert [r.prompt_index for r in rollouts] == [0, 0, 0, 1, 1, 1]
    for r in rollouts:
        ids = torch.tensor(r.ids)
        with torch.no_grad():
            lp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
        p = len(r.prompt_ids)
        ref = lp[p - 1:len(ids) - 1].gather(1, ids[p:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(r.logprobs), ref, atol=1e-3, rtol=0)
        assert r.finish_reason == ("eos" if r.response_ids[-1] in stops else "length")
