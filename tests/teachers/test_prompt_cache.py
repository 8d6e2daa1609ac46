"""The hf teacher's prompt cache (protocol 2.6): prompts announced with a "prefill" SCORE are
computed once, and sequences that start with them are scored from their response on, with the
answers a teacher without the cache gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opd.teachers.backend import ScoreRequest
from opd.teachers.batching import pack, pack_masks
from opd.teachers.client import TeacherClient, TeacherError
from opd.teachers.streams import Call as _Call
from opd.teachers.hf_backend import HFBackend
from opd.teachers.prompt_cache import Entry, PromptCache, key_of
from opd.teachers.protocol import Score
from opd.teachers.server import serving_in_thread


def request(seqs, starts, mode="topk", k=6, T=1.0, kept_rows=None, chunk_rows=1024):
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s))
    return ScoreRequest(1, mode, torch.tensor([t for s in seqs for t in s]), tuple(offsets), tuple(starts), k, T,
                        "float32", chunk_rows, kept_rows=kept_rows)


def prefill(prompts, starts=None):
    return request(prompts, starts or [len(p) for p in prompts], mode="prefill")


@pytest.fixture(scope="module")
def backends(tiny_teacher_dir):
    return HFBackend(tiny_teacher_dir, max_k=8), HFBackend(tiny_teacher_dir, max_k=8, prompt_cache_tokens=64,
                                                           batch_tokens=48)


@pytest.fixture(scope="module")
def batch():
    """Three prompts; the first answered twice (two samples), one response a single token."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 260, (n,), generator=g).tolist() for n in (9, 4, 13)]
    responses = [torch.randint(3, 260, (n,), generator=g).tolist() for n in (7, 1, 12, 5)]
    owners = [0, 1, 2, 0]
    return prompts, [prompts[o] + r for o, r in zip(owners, responses)], [len(prompts[o]) for o in owners]


def test_scores_over_cached_prompts_are_the_uncached_ones(backends, batch):
    plain, cached = backends
    prompts, seqs, starts = batch
    assert cached.prompt_cache_tokens == 64 and plain.prompt_cache_tokens == 0

    def announce():   # as the trainer does before each step's rollout
        assert cached.prefill([prefill(prompts[:2]), prefill(prompts[2:])]) == [13, 13]
        assert cached.prompt_cache.tokens == 26 and len(cached.prompt_cache) == 3

    for T in (1.0, 0.7):
        announce()
        hits = cached.prompt_cache.hits
        want, got = plain.score_topk([request(seqs, starts, T=T)])[0], cached.score_topk([request(seqs, starts, T=T)])[0]
        assert torch.equal(want.ids, got.ids)
        for a, b in zip(want[1:], got[1:]):
            torch.testing.assert_close(b, a, atol=2e-5, rtol=0)
        assert cached.prompt_cache.hits - hits == 4   # 4 sequences; prompt 0 serves two of them
        # The SCORE consumed what it read: the server holds no step's sequences past their scoring.
        assert cached.prompt_cache.tokens == 0 and len(cached.prompt_cache) == 0
    # A row mask, and full-vocabulary chunks, over the cache alike.
    kept = tuple(torch.tensor(ix, dtype=torch.long) for ix in ([0, 3, 6], [], [1, 11], [4]))
    want = plain.score_topk([request(seqs, starts, kept_rows=kept)])[0]
    announce()
    got = cached.score_topk([request(seqs, starts, kept_rows=kept)])[0]
    assert got.ids.shape[0] == 6 and torch.equal(want.ids, got.ids)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=2e-5, rtol=0)
    full = []
    announce()
    hits = cached.prompt_cache.hits
    for backend in backends:
        chunks = list(backend.score_full(request(seqs, starts, mode="full", chunk_rows=5)))
        full.append((torch.cat([c.logits for c in chunks]), torch.cat([c.token_logprob for c in chunks])))
    assert cached.prompt_cache.hits - hits == 4
    torch.testing.assert_close(full[1][0], full[0][0], atol=2e-5, rtol=0)
    torch.testing.assert_close(full[1][1], full[0][1], atol=2e-5, rtol=0)


def test_responses_announced_as_they_grow_continue_each_other(backends, batch, tiny_teacher_dir):
    plain, _ = backends
    cached = HFBackend(tiny_teacher_dir, max_k=8, prompt_cache_tokens=256)
    prompts, seqs, starts = batch
    assert cached.prefill([prefill(prompts)]) == [26]
    # A quarter and a half of each response so far (the trainer's announcements mid-rollout).
    for part in (0.25, 0.5):
        grown = [seq[:s + int(part * (len(seq) - s))] for seq, s in zip(seqs, starts)]
        assert cached.prefill([prefill(grown, starts)]) == [sum(map(len, grown))]
    sizes = sorted(e.tokens for e in cached.prompt_cache._entries.values())
    # prompts 9, 4, 13; responses at half: 9 + 3, 13 + 6, 9 + 2 (a quarter's entries dropped; 4 + 0 is the prompt)
    assert sizes == [4, 9, 11, 12, 13, 19] and cached.prompt_cache.tokens == 68
    hits = cached.prompt_cache.hits
    want, got = plain.score_topk([request(seqs, starts)])[0], cached.score_topk([request(seqs, starts)])[0]
    assert torch.equal(want.ids, got.ids) and cached.prompt_cache.hits - hits == 4
    for a, b in zip(want[1:], got[1:]):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=0)
    # Consumed: the entries the sequences read (prompt 1's response was one token, so its
    # sequence read the prompt's), and the prompts' own.
    assert len(cached.prompt_cache) == 0 and cached.prompt_cache.tokens == 0
    # A sequence trimmed shorter than its held part reads its prompt's entry instead.
    cached.prefill([prefill(prompts)])
    cached.prefill([prefill([seqs[2][:19]], [13])])
    assert cached.prompt_cache.lookup(torch.tensor(seqs[2][:15]), 13, 15, count=False).tokens == 13
    short = [seqs[2][:15]]
    want, got = plain.score_topk([request(short, [13])])[0], cached.score_topk([request(short, [13])])[0]
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=2e-5, rtol=0)


def test_a_prompt_and_its_grown_responses_in_one_call_leave_nothing_after_the_score(backends, batch,
                                                                                     tiny_teacher_dir):
    # Under load the hints queue behind a slow SCORE and the server computes a prompt and its
    # response at a quarter and at a half in one call. The shorter ones were kept beside the
    # longest, which alone the SCORE reads and drops: 7 to 16 entries left per run in the trainer's
    # prefill test on a loaded box. Each is now held as the first tokens of the longest.
    plain, _ = backends
    cached = HFBackend(tiny_teacher_dir, max_k=8, prompt_cache_tokens=256)
    prompts, seqs, starts = batch
    quarter, half = ([seq[:s + int(part * (len(seq) - s))] for seq, s in zip(seqs, starts)] for part in (0.25, 0.5))
    held = cached.prefill([prefill(prompts), prefill(quarter, starts), prefill(half, starts)])
    assert held == [26, sum(map(len, quarter)), sum(map(len, half))]   # each held, itself or within a longer one
    # one entry per sequence as announced at a half (prompt 1's response, one token, is its prompt)
    assert sorted(e.tokens for e in cached.prompt_cache._entries.values()) == sorted({len(h) for h in half})
    want, got = plain.score_topk([request(seqs, starts)])[0], cached.score_topk([request(seqs, starts)])[0]
    assert torch.equal(want.ids, got.ids) and cached.prompt_cache.hits == 4
    for a, b in zip(want[1:], got[1:]):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=0)
    assert len(cached.prompt_cache) == 0 and cached.prompt_cache.tokens == 0


def test_prompts_that_share_their_first_tokens_compute_them_once(backends, tiny_teacher_dir):
    # A chat template's system prompt and turn header start every prompt: announced together,
    # the shared tokens go through the body once, and each prompt continues them.
    plain, _ = backends
    cached = HFBackend(tiny_teacher_dir, max_k=8, prompt_cache_tokens=256)
    g = torch.Generator().manual_seed(1)
    head = torch.randint(3, 260, (10,), generator=g).tolist()
    prompts = [head + torch.randint(3, 260, (n,), generator=g).tolist() for n in (3, 7, 1)]
    seqs = [p + torch.randint(3, 260, (5,), generator=g).tolist() for p in prompts]
    starts = [len(p) for p in prompts]
    computed = []   # tokens per sequence through the body (a continuation's mask also covers the cache)

    def counted(input_ids, attention_mask, body=cached.body, **kw):
        computed.extend(attention_mask[:, -input_ids.shape[1]:].sum(1).tolist())
        return body(input_ids=input_ids, attention_mask=attention_mask, **kw)
    cached.body = counted
    assert cached.prefill([prefill(prompts)]) == [sum(starts)]
    assert sorted(computed) == [1, 3, 7, 10]   # the 10 shared tokens once, then each prompt's own
    want, got = plain.score_topk([request(seqs, starts)])[0], cached.score_topk([request(seqs, starts)])[0]
    assert torch.equal(want.ids, got.ids) and cached.prompt_cache.hits == 3
    for a, b in zip(want[1:], got[1:]):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=0)
    # Fewer than MIN_SHARED shared tokens: each prompt whole.
    computed.clear()
    short = [head[:5] + [7, 8, 9], head[:5] + [9, 8, 7, 6]]
    assert cached.prefill([prefill(short)]) == [17] and sorted(computed) == [8, 9]


def test_a_sequence_whose_prompt_was_not_announced_is_scored_whole(backends, batch):
    plain, cached = backends
    prompts, seqs, starts = batch
    other = [5, 6, 7] + seqs[0][9:]            # a prompt never prefilled, next to one that was
    misses = cached.prompt_cache.misses
    cached.prefill([prefill(prompts[:1])])
    want = plain.score_topk([request([other, seqs[0]], [3, 9])])[0]
    got = cached.score_topk([request([other, seqs[0]], [3, 9])])[0]
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=2e-5, rtol=0)
    assert cached.prompt_cache.misses - misses == 1


def test_least_recently_used_entries_go_first_and_the_longest_prefix_is_found():
    def put(cache, ids, start):
        n = len(ids)
        entry = Entry([torch.zeros(1, n, 2)], [torch.zeros(1, n, 2)], torch.zeros(n - start + 1, 4), start)
        return cache.put(key_of(torch.tensor(ids), start), entry, key_of(torch.tensor(ids[:start]), start))

    cache = PromptCache(10)
    assert put(cache, [1, 2, 3, 4], 4) and put(cache, [5, 6, 7, 8], 4)
    seq = torch.tensor([1, 2, 3, 4, 9, 9])
    assert cache.lookup(seq, 4, 6).tokens == 4                  # [5..8] is now the oldest
    assert cache.lookup(seq, 3, 6) is None                      # the same ids, rows from elsewhere: another key
    assert put(cache, [1, 2, 3, 4, 9], 4)                       # a response's first token
    assert key_of(torch.tensor([5, 6, 7, 8]), 4) not in cache and cache.tokens == 9
    assert cache.lookup(seq, 4, 6).tokens == 5 and cache.lookup(seq, 4, 4).tokens == 4   # longest within the limit
    assert not put(cache, list(range(11)), 11) and cache.tokens == 9   # alone over the budget: not kept
    cache.drop(key_of(torch.tensor([1, 2, 3, 4, 9]), 4))
    assert cache.lookup(seq, 4, 6).tokens == 4 and cache.tokens == 4
    assert (cache.hits, cache.misses) == (4, 1)
    # Two samples of one prompt, grown to the same length: dropping one leaves the other found.
    assert put(cache, [1, 2, 3, 4, 7], 4) and put(cache, [1, 2, 3, 4, 8], 4)
    cache.drop(key_of(torch.tensor([1, 2, 3, 4, 7]), 4))
    assert cache.lookup(torch.tensor([1, 2, 3, 4, 8, 9]), 4, 6).tokens == 5


def test_a_longrope_teacher_keeps_no_prompts(tiny_longrope_dir):
    backend = HFBackend(tiny_longrope_dir, max_k=4, prompt_cache_tokens=64)
    assert backend.prompt_cache is None and backend.prompt_cache_tokens == 0
    assert backend.prefill([prefill([[3, 4, 5]])]) == [0]


def test_prefill_over_the_wire(backends, batch):
    plain, cached = backends
    prompts, seqs, starts = batch
    with serving_in_thread(cached) as server, TeacherClient(server.address, timeout_s=30) as client:
        assert client.info().prompt_cache_tokens == 64
        cached.prompt_cache = PromptCache(64)     # empty again
        done = [f.result(timeout=30) for f in client.prefill(prompts)]
        assert [d.cached for d in done] == [26] and done[0].rows == 0
        got = client.score_topk(seqs, starts, k=6)
        want = plain.score_topk([request(seqs, starts)])[0]
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=2e-5, rtol=0)
        assert cached.prompt_cache.hits == 4
        with pytest.raises(ValueError, match="needs a token"):
            client.prefill([[3, 4], []])
        # A prefill carries the teacher's own sequences: one with a row mask is refused.
        score = Score(request_id=0, mode="prefill", response_starts=[9], rows=True)
        bad = client._command("submit", _Call("prefill", score, pack([prompts[0] + [9]]) +
                                               pack_masks([np.ones(1, dtype=np.uint8)])))
        with pytest.raises(TeacherError, match="own sequences only"):
            bad.result(timeout=30)
    with serving_in_thread(plain) as server, TeacherClient(server.address, timeout_s=30) as client:
        assert client.info().prompt_cache_tokens == 0 and client.prefill(prompts) == []   # nothing to announce
