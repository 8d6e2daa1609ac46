"""The vLLM teacher backend against a direct transformers forward pass of the same model."""

from __future__ import annotations

import math

import pytest
import torch

from opd.teachers.backend import ScoreRequest

pytestmark = pytest.mark.vllm


def _request(rid: int, seqs: list[list[int]], starts: list[int], *, k: int, mode: str = "topk",
             temperature: float = 1.0) -> ScoreRequest:
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s))
    return ScoreRequest(request_id=rid, mode=mode, ids=torch.tensor([t for s in seqs for t in s]),
                        offsets=tuple(offsets), response_starts=tuple(starts), k=k,
                        temperature=temperature, dtype="float32", chunk_rows=1024)


def _reference_rows(model, req: ScoreRequest) -> torch.Tensor:
    """log_softmax(logits) [R, V] in the row convention: row i of b is position s_b + i."""
    rows = []
    with torch.no_grad():
        for b, s in enumerate(req.response_starts):
            seq = req.sequence(b).long()
            logits = model(seq[None]).logits[0].float()
            rows.append(torch.log_softmax(logits, -1)[s - 1:len(seq) - 1])
    return torch.cat(rows)


@pytest.fixture(scope="module")
def hf_model(vllm_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(vllm_model_dir), dtype=torch.float32).eval()


def _random_requests():
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 17, 65, 2)]
    return [
        _request(7, seqs[:3], [5, 1, 64], k=8),
        _request(8, seqs[1:], [16, 30, 2], k=64),   # one sequence with zero rows (s == len)
        _request(9, seqs[3:], [1], k=1),
    ]


def test_topk_matches_transformers_forward(vllm_teacher_backend, hf_model):
    reqs = _random_requests()
    answers = vllm_teacher_backend.score_topk(reqs)
    for req, ans in zip(reqs, answers):
        ref = _reference_rows(hf_model, req)                       # [R, V]
        R = req.row_offsets()[-1]
        assert ans.ids.shape == (R, req.k) and ans.ids.dtype == torch.int32
        assert ans.logprobs.shape == (R, req.k) and ans.logprobs.dtype == torch.float32
        # values: the k largest reference log-probs, most likely first
        ref_top, ref_ids = ref.topk(req.k, dim=-1)
        torch.testing.assert_close(ans.logprobs, ref_top, atol=1e-4, rtol=0)
        # ids: the reference log-prob at each returned id equals the returned value
        # (robust to ties), and ids agree wherever the reference has no near-tie
        torch.testing.assert_close(ref.gather(1, ans.ids.long()), ans.logprobs, atol=1e-4, rtol=0)
        below = ref.topk(req.k + 1, dim=-1).values                 # k + 1 < V here
        gap_after = below[:, :-1] - below[:, 1:]                   # [R, k]
        gap_before = torch.cat([torch.ones(R, 1), gap_after[:, :-1]], dim=1)
        clear = (gap_after > 1e-4) & (gap_before > 1e-4)          # no near-tie either side
        assert torch.equal(ans.ids.long()[clear], ref_ids[clear])
        # the token in the sequence and the tail mass
        targets = torch.cat([req.sequence(b)[s:] for b, s in enumerate(req.response_starts)]).long()
        torch.testing.assert_close(ans.token_logprob, ref.gather(1, targets[:, None]).squeeze(1), atol=1e-4, rtol=0)
        ref_tail = torch.log1p(-ref_top.exp().sum(-1).clamp(max=1.0))
        torch.testing.assert_close(ans.tail_logmass, ref_tail, atol=1e-4, rtol=0)
        assert torch.isnan(ans.lse).all()                          # not exposed by vLLM: never guessed


def test_topk_matches_hf_backend(vllm_teacher_backend, vllm_model_dir):
    from opd.teachers.hf_backend import HFBackend

    hf = HFBackend(vllm_model_dir, name="tiny", max_k=64)
    assert hf.tokenizer_fingerprint == vllm_teacher_backend.tokenizer_fingerprint
    assert hf.model_fingerprint == vllm_teacher_backend.model_fingerprint
    assert hf.vocab_size == vllm_teacher_backend.vocab_size
    reqs = _random_requests()
    for a, b in zip(vllm_teacher_backend.score_topk(reqs), hf.score_topk(reqs)):
        for name in ("logprobs", "tail_logmass", "token_logprob"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=1e-4, rtol=0)
        assert (a.ids == b.ids).float().mean() > 0.95              # all but near-ties


def test_unsupported_requests_name_the_hf_backend(vllm_teacher_backend):
    seqs, starts = [[1, 2, 3, 4]], [1]
    assert vllm_teacher_backend.unsupported(_request(1, seqs, starts, k=4)) is None
    full = vllm_teacher_backend.unsupported(_request(2, seqs, starts, k=0, mode="full"))
    hot = vllm_teacher_backend.unsupported(_request(3, seqs, starts, k=4, temperature=0.5))
    import dataclasses

    narrow = dataclasses.replace(_request(4, seqs, starts, k=4), vocab_limit=100)
    assert vllm_teacher_backend.limits_vocab and vllm_teacher_backend.unsupported(narrow) is None  # protocol 2.3
    for reason in (full, hot):
        assert reason and "--backend hf" in reason
    assert "full" in full and "temperature" in hot
    assert vllm_teacher_backend.modes == ("topk",)
    with pytest.raises(ValueError, match="temperature"):
        vllm_teacher_backend.score_topk([_request(3, seqs, starts, k=4, temperature=0.5)])


def test_vocab_limit_is_the_distribution_over_the_first_columns(vllm_teacher_backend, hf_model):
    """A student with fewer padding rows asks for the first `vocab_limit` columns: vLLM's logits
    are cut to that width in the worker, so the answer is log_softmax(logits[:, :limit]), as
    the hf backend gives it, and a request without a limit gets the whole head back. A batch
    mixing both is scored one width at a time, the engine's current one first."""
    import dataclasses

    limit = 200                     # of 260 rows: the tiny model's last 60 stand for padding
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, limit, (n,), generator=g).tolist() for n in (30, 12)]
    whole = _request(1, seqs, [3, 1], k=16)
    narrow = dataclasses.replace(_request(2, seqs, [3, 1], k=16), vocab_limit=limit)
    ref_whole = _reference_rows(hf_model, whole)                  # [R, 260] log-probs
    ref_narrow = torch.log_softmax(ref_whole[:, :limit], -1)      # = log_softmax(logits[:, :limit])
    assert (ref_whole.topk(16).indices >= limit).any()            # the cut changes the answers
    targets = torch.cat([whole.sequence(b)[s:] for b, s in enumerate(whole.response_starts)]).long()
    backend = vllm_teacher_backend
    one_by_one = backend.score_topk([narrow]) + backend.score_topk([whole])
    assert backend._head_rows == 260
    mixed = backend.score_topk([narrow, whole])                   # 260 is current: scored first
    assert backend._head_rows == limit
    for got_narrow, got_whole in (one_by_one, mixed):
        assert int(got_narrow.ids.max()) < limit
        for got, ref in ((got_narrow, ref_narrow), (got_whole, ref_whole)):
            top = ref.topk(16, dim=-1).values
            torch.testing.assert_close(got.logprobs, top, atol=1e-4, rtol=0)
            torch.testing.assert_close(ref.gather(1, got.ids.long()), got.logprobs, atol=1e-4, rtol=0)
            torch.testing.assert_close(got.token_logprob, ref.gather(1, targets[:, None]).squeeze(1), atol=1e-4, rtol=0)
            torch.testing.assert_close(got.tail_logmass, torch.log1p(-top.exp().sum(-1)), atol=1e-4, rtol=0)
    # the engine is left at 200 columns: the next plain request (any later test) widens it again
    torch.testing.assert_close(backend.score_topk([whole])[0].logprobs, ref_whole.topk(16).values, atol=1e-4, rtol=0)


def test_vllm_ignores_temperature_in_prompt_logprobs(vllm_teacher_backend):
    """Why T != 1 is refused: vLLM returns the same prompt log-probs at any temperature."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(range(10, 30)))
    got = [vllm_teacher_backend.llm.generate(
        [prompt], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=t, detokenize=False),
        use_tqdm=False)[0].prompt_logprobs[5] for t in (1.0, 0.5)]
    assert {k: v.logprob for k, v in got[0].items()} == {k: v.logprob for k, v in got[1].items()}
    assert not math.isnan(next(iter(got[0].values())).logprob)
