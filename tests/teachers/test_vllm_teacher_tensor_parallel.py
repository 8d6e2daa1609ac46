"""A real vLLM teacher split over 2 tensor-parallel ranks answers what one rank answers (slow:
it starts an engine of its own; on the CPU build each rank is bound to half of this machine's CPUs)."""

from __future__ import annotations

import os

import pytest
import torch

from opd.teachers.backend import ScoreRequest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def bind_two_ranks(monkeypatch) -> None:
    """VLLM_CPU_OMP_THREADS_BIND with one CPU list per rank (vLLM's default binding wants a NUMA
    node per rank); on CUDA, two GPUs."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        if torch.cuda.device_count() < 2:
            pytest.skip("tensor parallelism over 2 ranks needs 2 GPUs")
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("2 ranks need 2 CPUs")
    half = len(cpus) // 2
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, c)) for c in (cpus[:half], cpus[half:])))


def test_two_ranks_score_as_a_transformers_forward(vllm_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    from opd.teachers.vllm_backend import VLLMBackend

    bind_two_ranks(monkeypatch)
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
