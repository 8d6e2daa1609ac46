"""Protocol 2.4 over the wire, hf backend: a teacher-only prompt per sequence (`contexts`) and
the client's own candidate ids per row (`candidates`), against a transformers forward.

One `opd serve-teacher` process for the module, as in test_teacher_server.py, whose helpers
(the bare DEALER, the reference rows) this module reuses.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opd.teachers.client import TeacherClient, TeacherError
from opd.teachers.launch import start_server_process
from opd.teachers.protocol import ErrorCode, Score, encode
from test_teacher_server import (GOOD, assert_refused_and_serving, direct_rows, make_batch, model,  # noqa: F401
                                 score_frames)

V = 260


@pytest.fixture(scope="module")
def server(tiny_teacher_dir):
    s = start_server_process(["--model", tiny_teacher_dir, "--max-k", V, "--max-positions", 64,
                              "--max-tokens-per-request", 128])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    c = TeacherClient(server.address, timeout_s=20)
    yield c
    c.close()


def contexts_for(seqs, seed: int) -> list[list[int]]:
    """One context per sequence: of length 1 (the boundary: row 0 is computed at position 0),
    empty (the sequence keeps its prompt), and longer than the prompt it replaces."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 0, 23, 4][:len(seqs)]
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


def test_context_rows_equal_a_forward_of_context_plus_response(client, model):
    seqs, starts = make_batch(11)
    ctx = contexts_for(seqs, 12)
    k = 6
    r = client.score_topk(seqs, starts, k=k, contexts=ctx)
    # What the teacher must have scored: context + response, the response from len(context).
    t_seqs = [c + s[st:] if c else s for c, s, st in zip(ctx, seqs, starts)]
    t_starts = [len(c) if c else st for c, st in zip(ctx, starts)]
    logits, targets = direct_rows(model, t_seqs, t_starts, 1.0)
    ref = torch.log_softmax(logits, -1)
    assert r.row_offsets == [0, 2, 14, 15, 15]   # the student's rows, whatever the teacher saw
    assert torch.equal(targets, torch.cat([torch.tensor(s[st:]) for s, st in zip(seqs, starts)]))
    torch.testing.assert_close(r.logprobs, ref.topk(k).values, atol=1e-5, rtol=0)
    torch.testing.assert_close(r.token_logprob, ref.gather(1, targets[:, None]).squeeze(1), atol=1e-5, rtol=0)
    assert r.stats.tokens == sum(map(len, t_seqs))
    # The context changed the answers (a test of nothing would pass otherwise).
    plain = client.score_topk(seqs, starts, k=k)
    assert not torch.allclose(plain.token_logprob[:2], r.token_logprob[:2])
    assert torch.equal(plain.token_logprob[2:14], r.token_logprob[2:14])   # the empty context


def test_empty_contexts_answer_bit_for_bit_as_none(client):
    seqs, starts = make_batch(5)
    a = client.score_topk(seqs, starts, k=8)
    b = client.score_topk(seqs, starts, k=8, contexts=[[] for _ in seqs])
    for f in ("ids", "logprobs", "tail_logmass", "token_logprob", "lse"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f


@pytest.mark.parametrize("T", [1.0, 2.0])
def test_given_candidates_answer_their_logprobs_and_the_exact_tail(client, model, T):
    seqs, starts = make_batch(3)
    logits, targets = direct_rows(model, seqs, starts, T)
    ref = torch.log_softmax(logits / T, -1)
    k, g = 5, torch.Generator().manual_seed(4)
    cand = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(len(ref))])
    cand[0, 2] = targets[0]                          # the sampled token among them
    cand[1] = ref[1].topk(k).indices.flip(0)         # the teacher's own top k, in another order
    r = client.score_topk(seqs, starts, k=k, temperature=T, candidates=cand.int())
    assert torch.equal(r.ids.long(), cand)           # echoed, in the client's order
    torch.testing.assert_close(r.logprobs, ref.gather(1, cand), atol=1e-5, rtol=0)
    tail = torch.logsumexp(ref.scatter(1, cand, float("-inf")), -1)
    torch.testing.assert_close(r.tail_logmass, tail, atol=1e-5, rtol=0)
    torch.testing.assert_close(r.token_logprob, ref.gather(1, targets[:, None]).squeeze(1), atol=1e-5, rtol=0)
    # Given candidates equal to the teacher's top k give the teacher-top-k answer's numbers.
    own = client.score_topk(seqs, starts, k=k, temperature=T)
    mine = client.score_topk(seqs, starts, k=k, temperature=T, candidates=own.ids)
    torch.testing.assert_close(mine.logprobs, own.logprobs, atol=0, rtol=0)
    torch.testing.assert_close(mine.tail_logmass, own.tail_logmass, atol=1e-6, rtol=0)


def test_context_and_candidates_together_and_split_over_requests(server, model):
    """A batch over max_tokens_per_request (here 128: the contexts make it 2 requests) keeps
    each part's contexts and candidate rows with its sequences."""
    with TeacherClient(server.address, timeout_s=20) as c:
        seqs, starts = make_batch(9, lengths=(20, 30, 40, 20), starts=(5, 10, 35, 3))
        ctx = [[7] * 40, [], [9] * 30, [3] * 10]
        rows = sum(len(s) - st for s, st in zip(seqs, starts))
        cand = torch.stack([torch.randperm(V, generator=torch.Generator().manual_seed(i))[:3] for i in range(rows)])
        t_seqs = [cx + s[st:] if cx else s for cx, s, st in zip(ctx, seqs, starts)]
        assert sum(map(len, t_seqs)) > 128 > sum(map(len, seqs))
        r = c.score_topk(seqs, starts, k=3, contexts=ctx, candidates=cand.int())
        logits, _ = direct_rows(model, t_seqs, [len(cx) if cx else st for cx, st in zip(ctx, starts)], 1.0)
        torch.testing.assert_close(r.logprobs, torch.log_softmax(logits, -1).gather(1, cand), atol=1e-5, rtol=0)
        assert r.stats is None   # several requests, joined


def _frames(seqs, starts, ctx=None, cand=None, k=4, **kw):
    """A SCORE with contexts and/or candidates as given, sizes unchecked (the client checks them)."""
    arrays = list(score_frames(seqs, starts)[1:])
    if ctx is not None:
        arrays += [np.array([t for c in ctx for t in c], dtype="<i4"), np.cumsum([0, *map(len, ctx)]).astype("<i4")]
    if cand is not None:
        arrays.append(np.asarray(cand, dtype="<i4"))
    msg = Score(request_id=1, mode="topk", response_starts=list(starts), k=k, context=ctx is not None,
                support="given" if cand is not None else "teacher", **kw)
    return encode(msg, arrays)


def bad_inputs():
    seqs, starts = GOOD                                  # one sequence of 4 tokens, 3 rows
    yield "context offsets of another batch", encode(
        Score(request_id=1, mode="topk", response_starts=[1], k=4, context=True),
        (*score_frames(*GOOD)[1:], np.array([1, 2], "<i4"), np.array([0, 1, 2], "<i4"))), ErrorCode.MALFORMED
    yield "context flag without its tensors", encode(
        Score(request_id=1, mode="topk", response_starts=[1], k=4, context=True),
        score_frames(*GOOD)[1:]), ErrorCode.MALFORMED
    yield "context id past the vocabulary", _frames(seqs, starts, ctx=[[3, V]]), ErrorCode.BAD_TOKEN
    yield "negative context id", _frames(seqs, starts, ctx=[[-2]]), ErrorCode.BAD_TOKEN
    yield "context past max_positions", _frames(seqs, starts, ctx=[[1] * 62]), ErrorCode.TOO_LONG
    yield "context past max tokens", _frames([[1] * 40] * 3, [39] * 3, ctx=[[2] * 60] * 3), ErrorCode.TOO_LONG
    yield "candidates for fewer rows", _frames(seqs, starts, cand=[[1, 2, 3, 4]] * 2), ErrorCode.MALFORMED
    yield "candidates of another k", _frames(seqs, starts, cand=[[1, 2, 3]] * 3), ErrorCode.MALFORMED
    yield "candidate id past the vocabulary", _frames(seqs, starts, cand=[[1, 2, 3, V]] * 3), ErrorCode.BAD_TOKEN
    yield "candidate id past vocab_limit", _frames(seqs, starts, cand=[[1, 2, 3, 50]] * 3,
                                                   vocab_limit=20), ErrorCode.BAD_TOKEN
    yield "duplicate candidates", _frames(seqs, starts, cand=[[1, 2, 2, 4]] * 3), ErrorCode.BAD_REQUEST
    yield "candidates in full mode", encode(
        Score(request_id=1, mode="full", response_starts=[1], support="given"),
        (*score_frames(*GOOD)[1:], np.zeros((3, 0), "<i4"))), ErrorCode.BAD_REQUEST


@pytest.mark.parametrize("name,frames,code", list(bad_inputs()), ids=[b[0] for b in bad_inputs()])
def test_bad_context_or_candidates_get_their_error_and_the_server_serves_on(server, name, frames, code):
    assert_refused_and_serving(server.address, name, frames, code)


def test_client_refuses_to_send_24_fields_to_an_older_server(server):
    with TeacherClient(server.address, timeout_s=20, protocol_version=(2, 3)) as c:
        c.info()
        c._welcome.version = (2, 3)       # what a 2.3 server's WELCOME says
        with pytest.raises(TeacherError) as e:
            c.score_topk(*GOOD, k=4, contexts=[[1, 2]])
        assert e.value.code == "UNSUPPORTED" and "2.4" in e.value.message
        with pytest.raises(ValueError, match=r"\[3, 4\]"):
            c._welcome.version = (2, 4)
            c.score_topk(*GOOD, k=4, candidates=torch.zeros(2, 4, dtype=torch.int32))
