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


def test_a_soft_capped_or_scaled_teacher_serves_its_own_distribution(tmp_path):
    # Gemma 2 caps its logits after the LM head, Granite divides them: the backend's rows must
    # be the model's own log-probabilities, not those of the raw head output.
    import transformers as tf

    from opd.tiny import build_tokenizer

    common = dict(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1)
    for name, cfg in [("gemma2", tf.Gemma2Config(**common, head_dim=16, final_logit_softcapping=2.0,
                                                 attn_logit_softcapping=None)),
                      ("granite", tf.GraniteConfig(**common, logits_scaling=8.0))]:
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(20)   # logits large enough for the cap to bite
        model.save_pretrained(tmp_path / name)
        build_tokenizer(tmp_path / name)
        backend = HFBackend(tmp_path / name, max_k=8)
        seq = [(7 * j) % 250 + 3 for j in range(12)]
        topk = backend.score_topk([request([seq], [4], k=8)])[0]
        [full] = list(backend.score_full(request([seq], [4], mode="full", T=2.0)))
        with torch.no_grad():
            logits = backend.model(torch.tensor(seq)[None]).logits[0, 3:11]
        want = torch.log_softmax(logits, -1)
        torch.testing.assert_close(topk.logprobs, want.topk(8).values, atol=1e-5, rtol=0)
        torch.testing.assert_close(full.logits, logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(full.lse, torch.logsumexp(logits / 2.0, -1), atol=1e-5, rtol=0)


def test_a_padded_teacher_scores_over_the_students_rows_when_asked(tmp_path):
    # One tokenizer, LM heads padded to other sizes (Qwen2.5 0.5-3B: 151,936 rows, 7B+: 152,064).
    # vocab_limit asks for the distribution over the first rows: top-k never names a padding
    # row (the student has none; the kernels refuse such ids) and full rows have the student's width.
    from opd.teachers.client import TeacherClient, TeacherError
    from opd.teachers.protocol import ErrorCode
    from opd.teachers.server import serving_in_thread
    from opd.tiny import build_tiny_model

    padded = build_tiny_model(tmp_path / "padded", vocab_size=300, init_std=0.5, seed=4)
    backend = HFBackend(padded, max_k=16)
    seq = [(11 * j) % 250 + 3 for j in range(20)]
    with torch.no_grad():
        z = backend.model(torch.tensor(seq)[None]).logits[0, 1:19].float()
    assert (z.argmax(-1) >= 260).any()                         # unmasked, padding rows win somewhere
    want = torch.log_softmax(z[:, :260], -1)
    with serving_in_thread(backend) as server, TeacherClient(server.address, timeout_s=30) as client:
        assert client.info().vocab_size == 300 and tuple(client.info().version) >= (2, 2)
        top = client.score_topk([seq], [2], k=16, vocab_limit=260)
        assert int(top.ids.max()) < 260
        torch.testing.assert_close(top.logprobs, want.topk(16).values, atol=1e-5, rtol=0)
        rest = want.scatter(1, top.ids.long(), float("-inf")).logsumexp(-1)
        torch.testing.assert_close(top.tail_logmass, rest, atol=1e-5, rtol=0)
        torch.testing.assert_close(top.token_logprob, want.gather(1, torch.tensor(seq[2:])[:, None]).squeeze(1),
                                   atol=1e-5, rtol=0)
        rows = torch.cat([c.logits for c in client.score_full([seq], [2], chunk_rows=5, vocab_limit=260)])
        assert rows.shape == (18, 260)
        torch.testing.assert_close(torch.log_softmax(rows, -1), want, atol=1e-5, rtol=0)
        unlimited = client.score_topk([seq], [2], k=16)
        assert int(unlimited.ids.max()) >= 260                   # what the trainer got before
        # A limit past the vocabulary, k above the limit, or an id past the limit is refused.
        for ids, kwargs, code in [(seq, dict(k=4, vocab_limit=301), ErrorCode.BAD_REQUEST),
                                  ([1, 2, 3, 4, 5, 6, 7], dict(k=16, vocab_limit=8), ErrorCode.BAD_K)]:
            try:
                client.score_topk([ids], [2], **kwargs)
                raise AssertionError(f"{kwargs} was answered")
            except TeacherError as e:
                assert e.code == code, (kwargs, e)
        try:
            client.score_topk([seq + [280]], [2], k=4, vocab_limit=260)
            raise AssertionError("an id past the limit was answered")
        except TeacherError as e:
            assert e.code == ErrorCode.BAD_TOKEN


def test_a_longrope_teachers_answer_does_not_depend_on_the_batch_it_shares(tiny_longrope_dir):
    # Phi-3-style longrope picks its RoPE factors from the batch's padded width: a short
    # sequence batched with one past original_max_position_embeddings took the long factors.
    backend = HFBackend(tiny_longrope_dir, max_k=5)
    g = torch.Generator().manual_seed(0)
    short, long = torch.randint(3, 256, (12,), generator=g).tolist(), torch.randint(3, 256, (60,), generator=g).tolist()
    alone = backend.score_topk([request([short], [2])])[0]
    shared = backend.score_topk([request([short], [2]), request([long], [2])])[0]
    torch.testing.assert_close(shared.lse, alone.lse, atol=1e-5, rtol=0)
    torch.testing.assert_close(shared.token_logprob, alone.token_logprob, atol=1e-5, rtol=0)
    with torch.no_grad():   # and it is the model's own answer for the sequence alone
        direct = torch.log_softmax(backend.model(torch.tensor(short)[None]).logits[0, 1:11].float(), -1)
    torch.testing.assert_close(alone.logprobs, direct.topk(5).values, atol=1e-4, rtol=0)
