"""Protocol 2.5 over the wire, hf backend: a row mask per request (`rows`), the rows a multi-turn
trajectory trains on. The teacher reads every token but answers only the masked rows; checked
against the unmasked answer's rows at the mask's ones and against a transformers forward.

One `opd serve-teacher` process for the module, as in test_teacher_context.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opd.teachers.client import TeacherClient, TeacherError
from opd.teachers.protocol import ErrorCode, Score, encode
from test_teacher_context import client, server  # noqa: F401  (its fixtures: this module gets its own server)
from test_teacher_server import GOOD, assert_refused_and_serving, direct_rows, model, score_frames  # noqa: F401

V = 260
FIELDS = ("ids", "logprobs", "tail_logmass", "token_logprob", "lse")


def batch(seed: int = 21):
    """3 sequences: a mask interleaved like a trajectory (assistant, tool output, assistant), one
    all ones, one all zeros (no rows)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (12, 20, 9)]
    starts = [5, 8, 3]
    rows = [[1, 1, 0, 0, 0, 1, 1], [True] * 12, [0] * 6]
    return seqs, starts, rows


def kept(rows) -> torch.Tensor:
    """The flat indices, into all response rows, of the mask's ones."""
    return torch.tensor([bool(x) for r in rows for x in r]).nonzero().squeeze(1)


def reference(model, seqs, starts, rows, contexts=None, T: float = 1.0):
    """log_softmax(logits / T) [R, V] and targets [R] of a forward of (context or prompt) + response,
    at the mask's ones only."""
    ctx = contexts or [[] for _ in seqs]
    t_seqs = [c + s[st:] if c else s for c, s, st in zip(ctx, seqs, starts)]
    t_starts = [len(c) if c else st for c, st in zip(ctx, starts)]
    logits, targets = direct_rows(model, t_seqs, t_starts, T)
    keep = kept(rows)
    return torch.log_softmax(logits / T, -1)[keep], targets[keep]


@pytest.mark.parametrize("with_context", [False, True])
def test_masked_rows_are_the_unmasked_rows_at_the_ones_and_a_forward(client, model, with_context):
    seqs, starts, rows = batch()
    ctx = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [], []] if with_context else None   # a teacher prompt on the first
    k = 6
    r = client.score_topk(seqs, starts, k=k, contexts=ctx, rows=rows)
    full = client.score_topk(seqs, starts, k=k, contexts=ctx)
    keep = kept(rows)
    assert r.row_offsets == [0, 4, 16, 16] and r.ids.shape == (16, k)
    assert r.stats.rows == 16 and r.stats.tokens == full.stats.tokens     # every token read, 16 rows answered
    for f in FIELDS:
        if f == "ids":
            assert torch.equal(r.ids, full.ids[keep])
        else:
            torch.testing.assert_close(getattr(r, f), getattr(full, f)[keep], atol=1e-5, rtol=0)
    ref, targets = reference(model, seqs, starts, rows, ctx)
    torch.testing.assert_close(r.logprobs, ref.topk(k).values, atol=1e-5, rtol=0)
    torch.testing.assert_close(r.token_logprob, ref.gather(1, targets[:, None]).squeeze(1), atol=1e-5, rtol=0)
    # 0/1 ints, bools, numpy and torch masks are the same mask
    alike = [np.array(rows[0], bool), torch.tensor(rows[1]), rows[2]]
    assert torch.equal(client.score_topk(seqs, starts, k=k, contexts=ctx, rows=alike).logprobs, r.logprobs)


def test_given_candidates_are_one_row_per_mask_one(client, model):
    seqs, starts, rows = batch(22)
    ref, targets = reference(model, seqs, starts, rows, T=2.0)
    k, g = 5, torch.Generator().manual_seed(3)
    cand = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(len(ref))])   # [16, k]
    r = client.score_topk(seqs, starts, k=k, temperature=2.0, candidates=cand.int(), rows=rows)
    assert torch.equal(r.ids.long(), cand)
    torch.testing.assert_close(r.logprobs, ref.gather(1, cand), atol=1e-5, rtol=0)
    torch.testing.assert_close(r.tail_logmass, torch.logsumexp(ref.scatter(1, cand, float("-inf")), -1),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(r.token_logprob, ref.gather(1, targets[:, None]).squeeze(1), atol=1e-5, rtol=0)


def test_full_mode_streams_only_the_masked_rows(client, model):
    seqs, starts, rows = batch(23)
    chunks = list(client.score_full(seqs, starts, chunk_rows=5, rows=rows))
    whole = list(client.score_full(seqs, starts, chunk_rows=5))
    assert [c.row_start for c in chunks] == [0, 5, 10, 15]
    logits = torch.cat([c.logits for c in chunks])
    keep = kept(rows)
    assert logits.shape == (16, V)
    torch.testing.assert_close(logits, torch.cat([c.logits for c in whole])[keep], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat([c.lse for c in chunks]), torch.cat([c.lse for c in whole])[keep],
                               atol=1e-5, rtol=0)
    ref, targets = reference(model, seqs, starts, rows)
    torch.testing.assert_close(torch.log_softmax(logits, -1), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat([c.token_logprob for c in chunks]),
                               ref.gather(1, targets[:, None]).squeeze(1), atol=1e-5, rtol=0)


def test_all_zero_masks_answer_no_rows(client):
    seqs, starts, _ = batch(24)
    zeros = [[0] * (len(s) - st) for s, st in zip(seqs, starts)]
    r = client.score_topk(seqs, starts, k=4, rows=zeros)
    assert r.row_offsets == [0, 0, 0, 0] and r.ids.shape == (0, 4) and r.stats.rows == 0
    assert list(client.score_full(seqs, starts, rows=zeros)) == []


def test_split_batch_keeps_each_parts_masks_and_candidates(server, model):
    """Over max_tokens_per_request (128) the batch goes as several requests: each part sends its
    sequences' masks, and the candidates are cut at the masked row counts."""
    g = torch.Generator().manual_seed(25)
    seqs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (40, 50, 30, 45)]
    starts = [10, 5, 29, 20]
    rows = [[i % 3 == 0 for i in range(len(s) - st)] for s, st in zip(seqs, starts)]
    rows[1][:20] = [0] * 20
    assert sum(map(len, seqs)) > 128
    ref, targets = reference(model, seqs, starts, rows)
    cand = torch.stack([torch.randperm(V, generator=g)[:3] for _ in range(len(ref))])
    with TeacherClient(server.address, timeout_s=20) as c:
        r = c.score_topk(seqs, starts, k=3, rows=rows)
        assert r.stats is None and r.row_offsets == [0, *np.cumsum([sum(map(bool, m)) for m in rows]).tolist()]
        torch.testing.assert_close(r.logprobs, ref.topk(3).values, atol=1e-5, rtol=0)
        given = c.score_topk(seqs, starts, k=3, candidates=cand.int(), rows=rows)
        torch.testing.assert_close(given.logprobs, ref.gather(1, cand), atol=1e-5, rtol=0)
        chunks = list(c.score_full(seqs, starts, chunk_rows=4, rows=rows))
        assert [x.row_start for x in chunks][-1] + len(chunks[-1].logits) == len(ref)
        torch.testing.assert_close(torch.log_softmax(torch.cat([x.logits for x in chunks]), -1), ref,
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.cat([x.token_logprob for x in chunks]),
                                   ref.gather(1, targets[:, None]).squeeze(1), atol=1e-5, rtol=0)


def test_a_replica_pool_passes_row_masks_through(server, client):
    """opd.teachers.pool.ReplicaPool (what a run with replicas talks to) sends the masks along."""
    from opd.teachers.pool import ReplicaPool

    seqs, starts, rows = batch(27)
    with ReplicaPool([server.address], timeout_s=20) as pool:
        r = pool.score_topk(seqs, starts, k=4, rows=rows)
        assert r.row_offsets == [0, 4, 16, 16]
        assert torch.equal(r.logprobs, client.score_topk(seqs, starts, k=4, rows=rows).logprobs)
        full = torch.cat([c.logits for c in pool.score_full(seqs, starts, chunk_rows=7, rows=rows)])
        want = torch.cat([c.logits for c in client.score_full(seqs, starts, chunk_rows=7, rows=rows)])
        assert torch.equal(full, want) and full.shape[0] == 16


def test_the_trainers_teacher_set_passes_row_masks_through(client):
    """opd.teachers.session.TeacherSet.request(rows=...): the request logic alone, over this
    module's server; a full-mode answer's offsets count the masked rows."""
    from types import SimpleNamespace

    from opd.teachers.session import TeacherSet

    seqs, starts, rows = batch(28)
    ts = object.__new__(TeacherSet)
    ts.full_dtype = "float32"
    ts.clients, ts._open_tokens, ts.vocab_limit = {"t": (client, client.info())}, {"t": 0}, {}
    ts.specs = {"t": SimpleNamespace(mode="topk", k=4, temperature=1.0)}
    top = ts.request("t", seqs, starts, rows=rows).result()
    want = client.score_topk(seqs, starts, k=4, rows=rows)
    assert top.row_offsets == [0, 4, 16, 16] and torch.equal(top.topk.logprobs, want.logprobs)
    ts.specs = {"t": SimpleNamespace(mode="full", temperature=1.0)}
    full = ts.request("t", seqs, starts, rows=rows).result()
    assert full.row_offsets == [0, 4, 16, 16]
    logits = full.logits[torch.arange(16)]
    TeacherSet.finish({"t": full})
    want = torch.cat([c.logits for c in client.score_full(seqs, starts, rows=rows)])
    assert torch.equal(logits, want)


def test_hf_lm_head_sees_only_the_masked_rows(tiny_teacher_dir):
    """In-process: the hidden states are gathered at the mask's ones before the LM head."""
    from opd.teachers.hf_backend import HFBackend
    from opd.teachers.validate import score_request

    backend = HFBackend(tiny_teacher_dir, max_k=8, row_chunk=3)
    seen = []
    backend.lm_head.register_forward_hook(lambda m, inp, out: seen.append(inp[0].shape[0]))
    seqs, starts, rows = batch(26)
    arrays = [*score_frames(seqs, starts)[1:], np.array([x for r in rows for x in r], np.uint8)]
    req = score_request(Score(request_id=1, mode="topk", response_starts=starts, k=4, rows=True), arrays,
                        backend, max_tokens_per_request=1 << 10)
    assert [t.tolist() for t in req.kept_rows] == [[0, 1, 5, 6], list(range(12)), []]
    assert backend.score_topk([req])[0].ids.shape == (16, 4)
    assert sum(seen) == 16 and max(seen) <= 3            # 16 of the 25 response rows, in chunks of 3


def _frames(mask, cand=None, k=4, seqs_starts=GOOD):
    """A SCORE of GOOD (one sequence, 3 response rows) with the row mask as given, unchecked."""
    arrays = [*score_frames(*seqs_starts)[1:], mask] + ([np.asarray(cand, "<i4")] if cand is not None else [])
    msg = Score(request_id=1, mode="topk", response_starts=list(seqs_starts[1]), k=k, rows=True,
                support="given" if cand is not None else "teacher")
    return encode(msg, arrays)


def bad_masks():
    ok = np.array([1, 0, 1], np.uint8)
    yield "mask of another length", _frames(np.array([1, 1], np.uint8)), ErrorCode.MALFORMED
    yield "mask value 2", _frames(np.array([1, 2, 0], np.uint8)), ErrorCode.MALFORMED
    yield "mask of int32", _frames(ok.astype("<i4")), ErrorCode.MALFORMED
    yield "mask of two dimensions", _frames(ok[None]), ErrorCode.MALFORMED
    yield "candidates of the unmasked row count", _frames(ok, cand=[[1, 2, 3, 4]] * 3), ErrorCode.MALFORMED
    yield "rows flag without its mask", encode(Score(request_id=1, mode="topk", response_starts=[1], k=4, rows=True),
                                              score_frames(*GOOD)[1:]), ErrorCode.MALFORMED
    yield "mask too short for a context's sequence", encode(
        Score(request_id=1, mode="topk", response_starts=[1], k=4, context=True, rows=True),
        (*score_frames(*GOOD)[1:], np.array([7] * 5, "<i4"), np.array([0, 5], "<i4"),
         np.ones(5, np.uint8))), ErrorCode.MALFORMED   # the rows are the response's 3, not 5


@pytest.mark.parametrize("name,frames,code", list(bad_masks()), ids=[b[0] for b in bad_masks()])
def test_bad_row_masks_get_their_error_and_the_server_serves_on(server, name, frames, code):
    assert_refused_and_serving(server.address, name, frames, code)


def test_masked_given_candidates_on_the_wire(server):
    """The good neighbour of the bad cases above: R = the mask's ones."""
    from test_teacher_server import Raw

    raw = Raw(server.address)
    try:
        msg, arrays = raw.ask(_frames(np.array([1, 0, 1], np.uint8), cand=[[1, 2, 3, 4], [5, 6, 7, 8]]))
        assert msg.row_offsets == [0, 2] and msg.stats.rows == 2 and arrays[0].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    finally:
        raw.close()


def test_client_checks_masks_and_the_servers_version(server):
    seqs, starts = GOOD
    with TeacherClient(server.address, timeout_s=20) as c:
        with pytest.raises(ValueError, match="row mask 0 has 2 entries; its sequence has 3 response rows"):
            c.score_topk(seqs, starts, k=4, rows=[[1, 1]])
        with pytest.raises(ValueError, match="values other than 0/1"):
            c.score_topk(seqs, starts, k=4, rows=[[1, 2, 0]])
        with pytest.raises(ValueError, match="2 row masks for 1 sequences"):
            c.score_topk(seqs, starts, k=4, rows=[[1, 1, 1], [1]])
        with pytest.raises(ValueError, match=r"\[2, 4\] \(rows: the row masks' ones\)"):
            c.score_topk(seqs, starts, k=4, rows=[[1, 0, 1]], candidates=torch.zeros(3, 4, dtype=torch.int32))
        with pytest.raises(ValueError, match="row mask 0"):
            list(c.score_full(seqs, starts, rows=[[1]]))
        c._welcome.version = (2, 4)       # what a 2.4 server's WELCOME says
        for call in (lambda: c.score_topk(seqs, starts, k=4, rows=[[1, 0, 1]]),
                     lambda: list(c.score_full(seqs, starts, rows=[[1, 0, 1]]))):
            with pytest.raises(TeacherError) as e:
                call()
            assert e.value.code == "UNSUPPORTED" and "2.5" in e.value.message
        assert c.score_topk(seqs, starts, k=4).row_offsets == [0, 3]    # without rows: a 2.4 request


def test_a_score_names_its_tensors_in_wire_order_and_a_miscount_says_which():
    from opd.teachers.protocol import ProtocolError
    from opd.teachers.validate import score_request

    msg = Score(request_id=1, mode="topk", response_starts=[1], k=4, context=True, rows=True, support="given")
    assert msg.tensor_names() == ["ids", "offsets", "context_ids", "context_offsets", "row_mask", "candidates"]
    with pytest.raises(ProtocolError, match=r"carries 6 tensors \(ids, offsets, context_ids, context_offsets, "
                                            r"row_mask, candidates\), got 2") as err:
        score_request(msg, list(score_frames(*GOOD)[1:]), None, max_tokens_per_request=1 << 10)
    assert err.value.code == ErrorCode.MALFORMED
