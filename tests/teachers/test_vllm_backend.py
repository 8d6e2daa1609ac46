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
    assert vllm_teacher_backend.modes == ("topk", "sample")
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


# ---- given support (protocol 2.4): the client's candidate ids per row ---------------------

def _with_candidates(req: ScoreRequest, gen: torch.Generator, width: int, *, with_token: bool = True) -> ScoreRequest:
    """`req` asking for k distinct random ids per row below `width`; with_token: the first
    row's candidates include the token that stands in the sequence."""
    import dataclasses

    R = req.row_offsets()[-1]
    cands = torch.stack([torch.randperm(width, generator=gen)[:req.k] for _ in range(R)]) if R else torch.zeros(0, req.k, dtype=torch.long)
    targets = _targets(req)
    if with_token and R and not (cands[0] == targets[0]).any():
        cands[0, 1] = targets[0]
    return dataclasses.replace(req, candidates=cands)


def _targets(req: ScoreRequest) -> torch.Tensor:
    """The tokens of the rows answered (with a row mask, its ones')."""
    return torch.cat([req.sequence(b)[s:][req.kept(b)] for b, s in enumerate(req.response_starts)]).long()


def _check_given(ans, req: ScoreRequest, ref: torch.Tensor) -> float:
    """ref: [R, V] log-probs. Returns the largest deviation seen."""
    cands = req.candidates
    assert torch.equal(ans.ids, cands.int())                           # echoed, in their order
    assert ans.ids.dtype == torch.int32 and ans.logprobs.dtype == torch.float32
    want = ref.gather(1, cands)
    tail = torch.logsumexp(ref.scatter(1, cands, float("-inf")), dim=-1)   # log-mass of all other ids
    token = ref.gather(1, _targets(req)[:, None]).squeeze(1)
    torch.testing.assert_close(ans.logprobs, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(ans.tail_logmass, tail, atol=1e-4, rtol=0)
    torch.testing.assert_close(ans.token_logprob, token, atol=1e-4, rtol=0)
    assert torch.isnan(ans.lse).all()
    if not len(want):
        return 0.0
    finite = torch.isfinite(tail)
    assert torch.equal(finite, torch.isfinite(ans.tail_logmass))
    return max(float((ans.logprobs - want).abs().max()), float((ans.token_logprob - token).abs().max()),
               float((ans.tail_logmass[finite] - tail[finite]).abs().amax()) if finite.any() else 0.0)


def test_given_candidates_match_transformers_forward(vllm_teacher_backend, hf_model):
    """support 'given': the log-probs at the client's ids (echoed in their order) and the exact
    log-mass of every other id, in one batch with a plain top-k request, a row whose
    candidates hold its own token, a sequence without rows, a vocab_limit request and one
    whose k ids are its whole limited vocabulary (tail -inf)."""
    import dataclasses

    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (40, 17, 65, 9)]
    given = _with_candidates(_request(1, seqs[:3], [5, 17, 60], k=8), g, 260)       # 17: no rows
    wide = _with_candidates(_request(2, seqs[1:], [1, 30, 3], k=64), g, 260)
    narrow = _with_candidates(dataclasses.replace(_request(3, seqs[2:], [10, 2], k=16), vocab_limit=200), g, 200)
    whole = _with_candidates(dataclasses.replace(
        _request(4, [[t % 12 for t in seqs[3]]], [4], k=12), vocab_limit=12), g, 12)
    plain = _random_requests()[0]
    backend = vllm_teacher_backend
    assert backend.given_route == "v1" and backend.unsupported(given) is None
    answers = backend.score_topk([given, plain, wide, narrow, whole])
    err = 0.0
    for req, ans in zip([given, wide], [answers[0], answers[2]]):
        err = max(err, _check_given(ans, req, _reference_rows(hf_model, req)))
    assert answers[0].ids.shape == (35 + 0 + 5, 8)
    assert (answers[0].ids[0] == _targets(given)[0]).any()            # its token among the candidates
    for req, ans in ((narrow, answers[3]), (whole, answers[4])):      # log_softmax(logits[:, :limit])
        ref = torch.log_softmax(_reference_rows(hf_model, req)[:, :req.vocab_limit], -1)
        err = max(err, _check_given(ans, req, ref))
    assert torch.isneginf(answers[4].tail_logmass).all()
    torch.testing.assert_close(answers[1].logprobs, _reference_rows(hf_model, plain).topk(8).values, atol=1e-4, rtol=0)
    print(f"given candidates: max abs error {err:.2e}")


def test_given_candidates_across_chunked_prefill(vllm_teacher_backend, hf_model):
    """More tokens than one engine step takes: vLLM splits prompts over steps (chunked prefill),
    and every row still gets its own candidates."""
    g = torch.Generator().manual_seed(12)
    scheduler = vllm_teacher_backend.llm.llm_engine.vllm_config.scheduler_config
    budget = scheduler.max_num_batched_tokens
    assert scheduler.enable_chunked_prefill                            # a prompt may span steps
    n = -(-(budget + 300) // 250)
    seqs = [torch.randint(0, 260, (250,), generator=g).tolist() for _ in range(n)]
    req = _with_candidates(_request(5, seqs, [int(x) for x in torch.randint(1, 250, (n,), generator=g)], k=4), g, 260)
    assert req.num_tokens > budget
    ans = vllm_teacher_backend.score_topk([req])[0]
    print(f"chunked prefill ({req.num_tokens} tokens, {budget} a step): max abs error "
          f"{_check_given(ans, req, _reference_rows(hf_model, req)):.2e}")


def test_given_candidates_refused_without_a_route(vllm_teacher_backend, monkeypatch):
    """An engine whose workers found no prompt-logprob step to extend refuses them, naming hf."""
    req = _with_candidates(_request(1, [[1, 2, 3, 4]], [1], k=4), torch.Generator().manual_seed(0), 260)
    monkeypatch.setattr(vllm_teacher_backend, "given_route", "")
    reason = vllm_teacher_backend.unsupported(req)
    assert reason and "--backend hf" in reason and "candidate" in reason
    with pytest.raises(ValueError, match="candidate"):
        vllm_teacher_backend.score_topk([req])


# ---- teacher context (protocol 2.4): the teacher's own prompt per sequence ----------------

def _score(backend, seqs, starts, contexts=None, *, k: int, given: bool = False, gen=None, masks=None):
    """A ScoreRequest as the server's validator builds it from a SCORE message (masks: protocol
    2.5's row masks, one 0/1 list per sequence)."""
    import numpy as np

    from opd.teachers.protocol import Score
    from opd.teachers.validate import score_request

    def ragged(parts):
        return (np.array([t for p in parts for t in p], dtype=np.int32),
                np.array([0, *np.cumsum([len(p) for p in parts])], dtype=np.int32))

    arrays = [*ragged(seqs)] + ([*ragged(contexts)] if contexts is not None else [])
    rows = sum(len(s) - st for s, st in zip(seqs, starts))
    if masks is not None:
        arrays.append(np.array([x for m in masks for x in m], dtype=np.uint8))
        rows = int(arrays[-1].sum())
    if given:
        arrays.append(torch.stack([torch.randperm(260, generator=gen)[:k] for _ in range(rows)]).int().numpy())
    msg = Score(request_id=1, mode="topk", response_starts=starts, k=k, context=contexts is not None,
                support="given" if given else "teacher", rows=masks is not None)
    return score_request(msg, arrays, backend, max_tokens_per_request=1 << 20)


def test_teacher_context_rows_are_the_response_after_the_context(vllm_teacher_backend, hf_model):
    """With context c_b the teacher scores c_b + the response: row i is the response's token i,
    from the forward pass of that input; an empty c_b leaves the sequence as it is, bit for bit.
    Both supports (the teacher's top k and given candidates)."""
    g = torch.Generator().manual_seed(13)
    seqs = [torch.randint(0, 260, (n,), generator=g).tolist() for n in (30, 20, 12)]
    starts = [6, 4, 12]                               # the last has no response rows
    contexts = [torch.randint(0, 260, (n,), generator=g).tolist() for n in (25, 0, 3)]
    backend = vllm_teacher_backend
    for given in (False, True):
        req = _score(backend, seqs, starts, contexts, k=8, given=given, gen=torch.Generator().manual_seed(1))
        ans = backend.score_topk([req])[0]
        ref = []
        with torch.no_grad():
            for seq, s, ctx in zip(seqs, starts, contexts):
                prompt = ctx if ctx else seq[:s]
                full = torch.tensor(prompt + seq[s:])
                ref.append(torch.log_softmax(hf_model(full[None]).logits[0].float(), -1)[len(prompt) - 1:len(full) - 1])
        ref = torch.cat(ref)
        assert ans.logprobs.shape == (sum(len(q) - s for q, s in zip(seqs, starts)), 8)
        if given:
            _check_given(ans, req, ref)
        else:
            torch.testing.assert_close(ans.logprobs, ref.topk(8).values, atol=1e-4, rtol=0)
        targets = torch.tensor([t for q, s in zip(seqs, starts) for t in q[s:]])
        torch.testing.assert_close(ans.token_logprob, ref.gather(1, targets[:, None]).squeeze(1), atol=1e-4, rtol=0)
        # an empty context for every sequence: the request without context, bit for bit
        empty = _score(backend, seqs, starts, [[]] * 3, k=8, given=given, gen=torch.Generator().manual_seed(1))
        bare = _score(backend, seqs, starts, k=8, given=given, gen=torch.Generator().manual_seed(1))
        assert empty.ids.equal(bare.ids) and empty.response_starts == bare.response_starts
        for a, b in zip(*backend.score_topk([empty, bare])):
            assert torch.equal(a, b) or (torch.isnan(a).all() and torch.isnan(b).all())


# ---- row masks (protocol 2.5): only the rows a multi-turn trajectory trains on ------------

def test_row_masks_select_the_rows_of_the_unmasked_answer(vllm_teacher_backend, hf_model):
    """A mask interleaved like a trajectory, one all ones, one all zeros (with a teacher context on
    the first): the answer is the unmasked answer's rows at the ones and a transformers forward
    there, for the teacher's top k and for given candidates (one per masked row)."""
    g = torch.Generator().manual_seed(14)
    seqs = [torch.randint(0, 260, (n,), generator=g).tolist() for n in (12, 20, 9)]
    starts, contexts = [5, 8, 3], [[7, 1, 9, 4, 2, 8, 3, 3, 6], [], []]
    masks = [[1, 1, 0, 0, 0, 1, 1], [1] * 12, [0] * 6]
    keep = torch.tensor([x for m in masks for x in m]).nonzero().squeeze(1)
    ref = []
    with torch.no_grad():
        for seq, s, ctx in zip(seqs, starts, contexts):
            full = torch.tensor((ctx or seq[:s]) + seq[s:])
            n = len(ctx or seq[:s])
            ref.append(torch.log_softmax(hf_model(full[None]).logits[0].float(), -1)[n - 1:len(full) - 1])
    ref = torch.cat(ref)[keep]                                         # [16, V]
    backend = vllm_teacher_backend
    for given in (False, True):
        req = _score(backend, seqs, starts, contexts, k=8, given=given, gen=torch.Generator().manual_seed(2),
                     masks=masks)
        assert req.row_offsets() == [0, 4, 16, 16]
        ans = backend.score_topk([req])[0]
        if given:
            _check_given(ans, req, ref)                                # candidates [16, 8], targets at the ones
        else:
            torch.testing.assert_close(ans.logprobs, ref.topk(8).values, atol=1e-4, rtol=0)
            targets = _targets(req)                                    # the tokens at the ones
            torch.testing.assert_close(ans.token_logprob, ref.gather(1, targets[:, None]).squeeze(1),
                                       atol=1e-4, rtol=0)
            whole = backend.score_topk([_score(backend, seqs, starts, contexts, k=8)])[0]
            for a, b in zip(ans, whole):
                torch.testing.assert_close(a, b[keep], atol=1e-5, rtol=0, equal_nan=True)
