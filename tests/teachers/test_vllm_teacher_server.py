"""The vLLM backend behind the real ZeroMQ server: WELCOME, answers, and UNSUPPORTED on the wire."""

from __future__ import annotations


import pytest
import torch

pytestmark = pytest.mark.vllm

SEQS = [list(range(40, 70)), [5, 6, 7, 8, 9, 10]]
STARTS = [10, 1]


def _check_over_the_wire(client, expected_fingerprint: str, reference, narrow_reference) -> None:
    from opd.teachers.client import TeacherError

    info = client.info()
    assert info.backend == "vllm" and info.modes == ["topk", "sample"]
    assert info.tokenizer_fingerprint == expected_fingerprint
    # A student head of 100 rows (protocol 2.3): the distribution over the first 100 columns; the
    # plain request after it widens the engine again (the session's engine is shared).
    assert tuple(info.version) >= (2, 3)
    narrow = client.score_topk(SEQS, STARTS, k=8, vocab_limit=100)
    assert int(narrow.ids.max()) < 100
    torch.testing.assert_close(narrow.logprobs, narrow_reference.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(narrow.tail_logmass, narrow_reference.tail_logmass, atol=1e-5, rtol=0)
    with pytest.raises(TeacherError) as past:       # SEQS[0] holds ids up to 69
        client.score_topk(SEQS, STARTS, k=8, vocab_limit=60)
    assert past.value.code == "BAD_TOKEN"
    # SAMPLE (2.7), right after the narrow request: over the whole head again. Greedy responses
    # are the engine's own top-1 at every position; a seed gives the same samples twice.
    greedy = client.sample(SEQS, n=2, max_new_tokens=6, temperature=0.0, stop_ids=[])
    assert len(greedy.responses) == 4 and greedy.responses[0] == greedy.responses[1]
    for b, seq in enumerate(SEQS):
        resp = greedy.responses[2 * b]
        top1 = client.score_topk([seq + resp], [len(seq)], k=1).ids[:, 0].tolist()
        assert resp == top1[:len(resp)] and (greedy.finish[2 * b] == "stop" or len(resp) == 6)
    hot = [client.sample(SEQS, n=3, max_new_tokens=8, temperature=1.0, seed=5, stop_ids=[]) for _ in range(2)]
    assert hot[0].responses == hot[1].responses and max(t for r in hot[0].responses for t in r) >= 100
    got = client.score_topk(SEQS, STARTS, k=8)
    assert got.row_offsets == [0, 20, 25]
    torch.testing.assert_close(got.logprobs, reference.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.token_logprob, reference.token_logprob, atol=1e-5, rtol=0)
    # Protocol 2.4 on the wire: a teacher-only prompt per sequence (the first replaced, the second
    # kept) answers as the plain request for [context + response] does, and given candidates are
    # echoed with their log-probs (test_vllm_backend.py holds both to a transformers forward).
    ctx = [[3, 4, 5], []]
    seen = client.score_topk(SEQS, STARTS, k=8, contexts=ctx)
    plain = client.score_topk([ctx[0] + SEQS[0][STARTS[0]:], SEQS[1]], [3, STARTS[1]], k=8)
    assert seen.row_offsets == [0, 20, 25]
    for f in ("ids", "logprobs", "tail_logmass", "token_logprob"):
        assert torch.equal(getattr(seen, f), getattr(plain, f)), f
    cand = torch.stack([torch.randperm(256, generator=torch.Generator().manual_seed(r))[:5] for r in range(25)]).int()
    given = client.score_topk(SEQS, STARTS, k=5, candidates=cand)
    assert torch.equal(given.ids, cand)
    top = client.score_topk(SEQS, STARTS, k=5, candidates=got.ids[:, :5].contiguous())
    torch.testing.assert_close(top.logprobs, got.logprobs[:, :5], atol=1e-5, rtol=0)
    with pytest.raises(TeacherError) as hot:
        client.score_topk(SEQS, STARTS, k=8, temperature=0.5)
    assert hot.value.code == "UNSUPPORTED" and "hf" in hot.value.message
    with pytest.raises(TeacherError) as full:
        list(client.score_full(SEQS, STARTS))
    assert full.value.code == "UNSUPPORTED" and "--backend hf" in full.value.message   # the generic text had no hint


def _reference(backend, vocab_limit: int = 0):
    """The backend's own answer, in process (test_vllm_backend.py checks it against transformers)."""
    from opd.teachers.backend import ScoreRequest

    ids = torch.tensor([t for s in SEQS for t in s])
    req = ScoreRequest(request_id=1, mode="topk", ids=ids, offsets=(0, len(SEQS[0]), len(ids)),
                       response_starts=tuple(STARTS), k=8, temperature=1.0, dtype="float32", chunk_rows=1024,
                       vocab_limit=vocab_limit)
    return backend.score_topk([req])[0]


def test_vllm_backend_behind_server(vllm_teacher_backend, free_tcp_address):
    """In-process server around the session's engine (a second engine would cost ~40 s)."""
    from opd.teachers.client import TeacherClient
    from opd.teachers.server import serving_in_thread

    with serving_in_thread(vllm_teacher_backend, free_tcp_address) as server, \
            TeacherClient(server.address, timeout_s=60) as client:
        _check_over_the_wire(client, vllm_teacher_backend.tokenizer_fingerprint, _reference(vllm_teacher_backend),
                             _reference(vllm_teacher_backend, vocab_limit=100))


@pytest.mark.slow
def test_serve_teacher_cli_with_vllm_backend(vllm_model_dir, vllm_teacher_backend):
    """`opd serve-teacher --backend vllm` as its own process (starts a second engine)."""
    from opd.teachers.client import TeacherClient
    from opd.teachers.launch import start_server_process

    with start_server_process(["--model", vllm_model_dir, "--backend", "vllm", "--max-k", "16"],
                              threads=None) as server:
        with TeacherClient(server.address, timeout_s=60) as client:
            _check_over_the_wire(client, vllm_teacher_backend.tokenizer_fingerprint, _reference(vllm_teacher_backend),
                                 _reference(vllm_teacher_backend, vocab_limit=100))
