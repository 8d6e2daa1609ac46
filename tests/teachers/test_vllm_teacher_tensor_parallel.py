"""A real vLLM teacher split over 2 tensor-parallel ranks answers what one rank answers (slow:
it starts an engine of its own; on the CPU build each rank is bound to half of this machine's CPUs)."""

from __future__ import annotations

import pytest
import torch

from opd.teachers.backend import ScoreRequest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_two_ranks_score_as_a_transformers_forward(vllm_model_dir, two_vllm_ranks):
    from transformers import AutoModelForCausalLM

    from opd.teachers.vllm_backend import VLLMBackend

    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 200, (n,), generator=g) for n in (40, 17)]   # ids below vocab_limit (protocol)
    req = ScoreRequest(1, "topk", torch.cat(seqs), (0, 40, 57), (5, 1), 8, 1.0, "float32", 1024)
    limited = ScoreRequest(2, "topk", seqs[0], (0, 40), (5,), 8, 1.0, "float32", 1024, vocab_limit=200)
    model = AutoModelForCausalLM.from_pretrained(str(vllm_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = [model(s[None]).logits[0] for s in seqs]
    backend = VLLMBackend(vllm_model_dir, name="tp2", max_k=16, max_positions=128, tensor_parallel_size=2)
    try:
        assert backend.limits_vocab              # every rank's worker found the logits step
        got, cut = backend.score_topk([req, limited])
    finally:
        backend.close()
    want = torch.cat([torch.log_softmax(lg, -1)[s - 1:len(lg) - 1] for lg, s in zip(logits, (5, 1))])
    torch.testing.assert_close(got.logprobs, want.topk(8, -1).values, atol=1e-4, rtol=0)
    want_cut = torch.log_softmax(logits[0][4:39, :200], -1)
    torch.testing.assert_close(cut.logprobs, want_cut.topk(8, -1).values, atol=1e-4, rtol=0)
