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
