"""HFBackend in-process: the LM head only ever sees row chunks of the scored rows."""

from __future__ import annotations

import torch

from opd.teachers.backend import ScoreRequest
from opd.teachers.hf_backend import HFBackend


def request(seqs, starts, mode="topk", k=5, T=1.0, chunk_rows=1024, dtype="float32"):
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s))
    return ScoreRequest(1, mode, torch.tensor([t for s in seqs for t in s]), tuple(offsets), tuple(starts), k, T,
                        dtype, chunk_rows)


def test_lm_head_sees_only_scored_rows_in_chunks(tiny_teacher_dir):
    backend = HFBackend(tiny_teacher_dir, max_k=8, row_chunk=4, batch_tokens=64)
    rows_seen = []
    backend.lm_head.register_forward_hook(lambda m, inp, out: rows_seen.append(inp[0].shape[0]))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 260, (n,), generator=g).tolist() for n in (30, 12, 5)]
    reqs = [request(seqs[:2], [20, 3]), request(seqs[2:], [1], k=3, T=0.5)]
    answers = backend.score_topk(reqs)                       # one prefill for both requests
    assert [a.ids.shape for a in answers] == [(19, 5), (4, 3)]
    assert max(rows_seen) <= 4 and sum(rows_seen) == 19 + 4  # never [tokens x vocab]
    with torch.no_grad():
        x = torch.tensor(seqs[0])[None]
        ref = torch.log_softmax(backend.model(x).logits[0, 19:29], -1)
    torch.testing.assert_close(answers[0].logprobs[:10], ref.topk(5).values, atol=1e-5, rtol=0)

    rows_seen.clear()
    chunks = list(backend.score_full(request(seqs[:1], [2], mode="full", chunk_rows=3, dtype="float16")))
    assert [c.row_start for c in chunks] == list(range(0, 28, 3)) and chunks[0].logits.dtype == torch.float16
    assert max(rows_seen) <= 3 and sum(rows_seen) == 28
