"""The vLLM rollout engine: raw student log-probs, finish reasons, and on-policy weight pushes."""

from __future__ import annotations

import pytest
import torch

from opd.rollout.base import SamplingParams
from oracles import forward_logprobs, forward_topk_ids

pytestmark = pytest.mark.vllm

PROMPTS = [[72, 101, 108, 108, 111], [49, 43, 50, 61], list(range(60, 90))]
STOPS = tuple(range(100, 130))       # 30 of 260 ids: some samples stop early, some run out


def assert_matches(model, rollouts, atol=1e-3):
    for r in rollouts:
        torch.testing.assert_close(torch.tensor(r.logprobs), forward_logprobs(model, r), atol=atol, rtol=0)


@pytest.fixture(scope="module")
def student(vllm_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(vllm_model_dir), dtype=torch.float32).eval()


def test_rollouts_carry_raw_logprobs_and_finish_reasons(vllm_rollout_engine, student):
    params = SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=12, n=4, stop_token_ids=STOPS, seed=5)
    rollouts = vllm_rollout_engine.generate(PROMPTS, params)
    assert [r.prompt_index for r in rollouts] == [i for i in range(len(PROMPTS)) for _ in range(4)]
    assert all(r.prompt_ids == PROMPTS[r.prompt_index] for r in rollouts)
    # raw log-probs: log_softmax at temperature 1 and before top-p, not of the sampling distribution
    assert_matches(student, rollouts)
    reasons = {r.finish_reason for r in rollouts}
    assert reasons == {"eos", "length"}
    for r in rollouts:
        assert len(r.logprobs) == len(r.response_ids) >= 1
        stops = [t in STOPS for t in r.response_ids]
        if r.finish_reason == "eos":
            assert stops[-1] and not any(stops[:-1])            # the stop token is kept, once, last
        else:
            assert len(r.response_ids) == 12 and not any(stops)
    # the n samples of a prompt differ, and the same seed reproduces them
    assert len({tuple(r.response_ids) for r in rollouts[:4]}) > 1
    again = vllm_rollout_engine.generate(PROMPTS, params)
    assert [r.response_ids for r in again] == [r.response_ids for r in rollouts]


def test_weight_push_makes_next_rollout_on_policy(vllm_rollout_engine, student):
    import copy

    params = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=11)
    new = copy.deepcopy(student)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std().clamp_min(1e-3))
    try:
        vllm_rollout_engine.sync_weights(new)
        rollouts = vllm_rollout_engine.generate(PROMPTS, params)
        assert_matches(new, rollouts)                            # the new weights ...
        old = torch.cat([forward_logprobs(student, r) for r in rollouts])
        got = torch.cat([torch.tensor(r.logprobs) for r in rollouts])
        assert (old - got).abs().max() > 0.1                     # ... and not the old ones
    finally:
        vllm_rollout_engine.sync_weights(student)                # shared engine: restore
    assert_matches(student, vllm_rollout_engine.generate(PROMPTS, params))


def test_greedy_is_the_argmax(vllm_rollout_engine, student):
    rollouts = vllm_rollout_engine.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_new_tokens=6))
    for r in rollouts:
        ids = torch.tensor(r.ids)
        with torch.no_grad():
            logits = student(ids[None]).logits[0]
        p = len(r.prompt_ids)
        assert r.response_ids == logits[p - 1:len(ids) - 1].argmax(-1).tolist()


def test_each_prompt_has_its_own_random_stream(vllm_rollout_engine):
    # vLLM seeds sample j of a request with seed + j: with one seed for the batch, a prompt
    # listed twice got the same samples, and seed s + 1 (the next step) replayed seed s's
    # samples 1..n-1 as its 0..n-2. Per-prompt seeds keep them apart; a seed still repeats a batch.
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=11)
    first = [r.response_ids for r in vllm_rollout_engine.generate([prompt, prompt], params)]
    assert first[:2] != first[2:]
    again = [r.response_ids for r in vllm_rollout_engine.generate([prompt, prompt], params)]
    assert again == first
    following = [r.response_ids for r in vllm_rollout_engine.generate([prompt], SamplingParams(
        temperature=1.0, max_new_tokens=8, n=2, seed=12))]
    assert following[0] != first[1]


def test_rollouts_carry_the_students_top_k_ids(vllm_rollout_engine, student):
    """SamplingParams.topk = k: vLLM's sample log-probs (raw) give each position's top k ids,
    those of a transformers forward, whatever the sampling temperature."""
    params = SamplingParams(temperature=0.8, max_new_tokens=8, n=2, seed=7, topk=4)
    rollouts = vllm_rollout_engine.generate(PROMPTS[:2], params)
    for r in rollouts:
        assert len(r.topk_ids) == len(r.response_ids)
        assert torch.equal(torch.tensor(r.topk_ids), forward_topk_ids(student, r, 4))
    assert_matches(student, rollouts)   # the sampled token's log-prob still comes first
