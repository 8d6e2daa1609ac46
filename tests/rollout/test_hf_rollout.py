"""The transformers rollout engine: the reference the vLLM engine is held to."""

from __future__ import annotations

import torch

from opd.rollout.base import SamplingParams
from oracles import forward_logprobs, forward_topk_ids
from opd.rollout.hf import HFRolloutEngine, top_p_filter


def test_hf_rollout_logprobs_match_forward_pass(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    engine = HFRolloutEngine(model, AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    prompts = [[72, 101, 108, 108, 111], list(range(60, 80))]        # different lengths: left padding
    stops = tuple(range(100, 130))
    rollouts = engine.generate(prompts, SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=10,
                                                       n=3, stop_token_ids=stops, seed=2))
    assert [r.prompt_index for r in rollouts] == [0, 0, 0, 1, 1, 1]
    for r in rollouts:
        torch.testing.assert_close(torch.tensor(r.logprobs), forward_logprobs(model, r), atol=1e-3, rtol=0)
        assert r.finish_reason == ("eos" if r.response_ids[-1] in stops else "length")


def test_hf_rollout_returns_the_students_top_k_ids_per_position(tiny_model_dir):
    """SamplingParams.topk: each response position's top-k ids (the support of a student_topk
    teacher) equal a forward pass's, whatever the sampling temperature and top-p."""
    model, tok = _load(tiny_model_dir)
    rollouts = HFRolloutEngine(model, tok).generate([[72, 101, 108], list(range(60, 75))],
                                                   SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=8,
                                                                  n=2, seed=3, topk=5))
    for r in rollouts:
        assert len(r.topk_ids) == len(r.response_ids) and all(len(row) == 5 for row in r.topk_ids)
        assert torch.equal(torch.tensor(r.topk_ids), forward_topk_ids(model, r, 5))
    plain = HFRolloutEngine(model, tok).generate([[72, 101, 108]], SamplingParams(max_new_tokens=4, seed=3))
    assert plain[0].topk_ids is None


def _load(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(model_dir))


def test_hf_rollout_greedy_equals_transformers_generate(tiny_model_dir):
    model, tok = _load(tiny_model_dir)
    prompts = [[72, 101, 108, 108, 111], list(range(60, 80)), [33]]      # different lengths: left padding
    rollouts = HFRolloutEngine(model, tok, batch_size=2).generate(prompts, SamplingParams(temperature=0, max_new_tokens=12))
    for prompt, r in zip(prompts, rollouts):
        ids = torch.tensor([prompt])
        want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)[0, len(prompt):]
        assert r.response_ids == want.tolist()
        torch.testing.assert_close(torch.tensor(r.logprobs), forward_logprobs(model, r), atol=1e-4, rtol=0)
    assert model.training is False
    model.train()
    HFRolloutEngine(model, tok).generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=2))
    assert model.training is True                                         # the training flag comes back


def test_hf_rollout_stops_on_the_generation_configs_eos_ids_too(tiny_model_dir):
    # Instruct models list more than the tokenizer's EOS in generation_config.eos_token_id
    # (Qwen2.5: <|im_end|> and <|endoftext|>); vLLM and model.generate stop on every one of them.
    model, tok = _load(tiny_model_dir)
    prompt = [72, 101, 108, 108, 111]
    free = HFRolloutEngine(model, tok).generate([prompt], SamplingParams(temperature=0, max_new_tokens=8))[0]
    third = free.response_ids[2]
    assert third != tok.eos_token_id and third not in free.response_ids[:2]
    model.generation_config.eos_token_id = [tok.eos_token_id, third]
    r = HFRolloutEngine(model, tok).generate([prompt], SamplingParams(temperature=0, max_new_tokens=8))[0]
    ids = torch.tensor([prompt])
    want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                          pad_token_id=tok.eos_token_id)[0, len(prompt):]
    assert r.response_ids == want.tolist() == free.response_ids[:3] and r.finish_reason == "eos"


def test_top_p_filter_matches_transformers_warper():
    from transformers.generation.logits_process import TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 260, generator=g) * 3
    logits[0, :5] = 50.0                                                  # one row: a tie at the top
    for top_p in (0.05, 0.3, 0.8, 0.95, 0.999):
        want = TopPLogitsWarper(top_p)(None, logits.clone())
        got = top_p_filter(logits.clone(), top_p)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), top_p
        assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(got)])
        assert (~torch.isinf(got)).sum(-1).min() >= 1
    assert torch.equal(top_p_filter(logits, 1.0), logits)


def test_hf_rollout_sampling_distribution(tiny_model_dir):
    """Empirical first-token distribution over N samples vs softmax(logits / T).

    Bound: E[TV] = 1/2 sum_i E|p^_i - p_i| <= 1/2 sum_i sqrt(p_i / N), and TV moves by at most
    1/N when one sample changes, so (McDiarmid) P(TV > E[TV] + 0.05) <= exp(-2 N 0.05^2) = 3e-7.
    """
    model, tok = _load(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(15)                                    # logit std ~2.5: a peaked distribution
    prompt, T, N = [72, 101, 108], 0.7, 3000
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    engine = HFRolloutEngine(model, tok, batch_size=1000)               # 3 chunks
    vocab = logits.numel()

    def first_tokens(top_p):
        rs = engine.generate([prompt], SamplingParams(temperature=T, top_p=top_p, max_new_tokens=1, n=N, seed=0))
        return torch.tensor([r.response_ids[0] for r in rs])

    def tv(counts, p):
        return 0.5 * (counts / N - p).abs().sum()

    want = (logits / T).softmax(-1)
    counts = torch.bincount(first_tokens(1.0), minlength=vocab).float()
    bound = 0.5 * (want / N).sqrt().sum() + 0.05
    assert tv(counts, want) < bound
    assert tv(counts, logits.softmax(-1)) > bound                        # the test sees a wrong temperature

    kept = ~torch.isinf(top_p_filter(logits[None] / T, 0.6)[0])
    assert 1 < kept.sum() < vocab
    counts = torch.bincount(first_tokens(0.6), minlength=vocab).float()
    assert counts[~kept].sum() == 0                                      # never a filtered token
    want = torch.where(kept, want, 0.0) / want[kept].sum()
    assert tv(counts, want) < 0.5 * (want / N).sqrt().sum() + 0.05


def test_own_4d_mask_equals_the_models_own_masking(tiny_model_dir, monkeypatch):
    """The ready 4-D mask (SDPA, full attention) gives what transformers' 2-D path gives."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transformers import AutoModelForCausalLM

    import opd.rollout.hf as hf

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    assert hf._builds_own_mask(model.config)  # the tiny Qwen2 takes the fast path
    engine = HFRolloutEngine(model, AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    prompts = [[72, 101, 108], list(range(60, 75)), [5, 6, 7, 8, 9, 10]]   # left padding in one batch
    params = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=12, n=2, seed=3)
    fast = engine.generate(prompts, params)
    monkeypatch.setattr(hf, "_builds_own_mask", lambda config: False)
    slow = engine.generate(prompts, params)
    assert [r.response_ids for r in fast] == [r.response_ids for r in slow]
    for a, b in zip(fast, slow):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_builds_own_mask_only_for_full_attention_sdpa():
    from types import SimpleNamespace as C

    from opd.rollout.hf import _builds_own_mask

    assert _builds_own_mask(C(_attn_implementation="sdpa", sliding_window=4096, use_sliding_window=False))
    assert not _builds_own_mask(C(_attn_implementation="eager"))
    assert not _builds_own_mask(C(_attn_implementation="sdpa", sliding_window=4096))            # Mistral-style
    assert not _builds_own_mask(C(_attn_implementation="sdpa", layer_types=["full_attention", "sliding_attention"]))


def test_training_after_a_rollout_that_replaced_rope_buffers(tmp_path):
    # The rollout runs under inference_mode. A dynamic RoPE replaces its inv_freq buffer once a
    # sequence passes max_position_embeddings, so the buffer the next training step reads was
    # made there; training must still run forward and backward, with gradients equal to those
    # of a model whose buffer was made normally.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from opd.tiny import build_tokenizer

    cfg = Qwen2Config(vocab_size=260, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=128, max_position_embeddings=16,
                      rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    twin = Qwen2ForCausalLM(cfg)
    twin.load_state_dict(model.state_dict())
    tok = build_tokenizer(tmp_path)
    engine = HFRolloutEngine(model, tok)
    out = engine.generate([list(range(10, 22))], SamplingParams(temperature=1.0, max_new_tokens=12, seed=0,
                                                                               stop_token_ids=[]))
    assert model.model.rotary_emb.inv_freq.is_inference()       # replaced during the rollout
    seq = torch.tensor([out[0].prompt_ids + out[0].response_ids])
    assert seq.shape[1] > 16
    with torch.no_grad():
        twin(seq)                                                # the same replacement, made normally
    for m in (model, twin):
        m(seq, labels=seq).loss.backward()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_last_logits_are_the_models_own_with_or_without_its_plain_head(tiny_model_dir, tmp_path):
    # The decode step's head as (W @ h.T).T: the model's logits; a LoRA adapter on the head,
    # or a soft-cap after it, must not be skipped (their forward runs instead).
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    from opd.rollout.hf import last_logits
    from opd.tiny import build_tokenizer

    ids = torch.tensor([[5, 9, 33, 7, 101, 3]])
    model = tf.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    cfg = tf.Gemma2Config(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=2.0,
                          attn_logit_softcapping=None)
    torch.manual_seed(0)
    capped = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        capped.get_output_embeddings().weight.mul_(20)
    lora = get_peft_model(tf.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)),
                          LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False)).eval()
    with torch.no_grad():
        for m in (model, capped, lora):
            want = m(input_ids=ids).logits[:, -1].float()
            for sharded in (False, True):
                got = last_logits(m, sharded)(input_ids=ids)
                assert got.shape == (1, 260) and got.is_contiguous()
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        with lora.disable_adapter():   # the adapter moves the logits: the check above saw it
            base = lora(input_ids=ids).logits[:, -1]
        assert (lora(input_ids=ids).logits[:, -1] - base).abs().max() > 1e-3


def test_few_row_linears_give_the_models_logits_and_restore_its_modules(tiny_model_dir, monkeypatch):
    # Inside, each plain nn.Linear computes fewer than 8 rows as the transposed product and 8 or
    # more as F.linear; on exit (an exception included) every module has its own forward again.
    from transformers import AutoModelForCausalLM

    import opd.rollout.hf as hf

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    calls = []
    real = hf.transposed_linear
    monkeypatch.setattr(hf, "transposed_linear", lambda x, w, b: calls.append(x.shape) or real(x, w, b))
    few, many = torch.tensor([[5], [9], [33]]), torch.tensor([[5, 9, 33, 7], [101, 3, 8, 2]])
    with torch.no_grad():
        want_few, want_many = model(few).logits, model(many).logits
        with hf.few_row_linears(model, sharded=False):
            got_few = model(few).logits
            assert len(calls) == len(linears) and all(s[0] == 3 for s in calls)
            got_many = model(many).logits
            assert len(calls) == len(linears)          # 8 rows: F.linear, no new call
        torch.testing.assert_close(got_few, want_few, atol=1e-5, rtol=0)
        torch.testing.assert_close(got_many, want_many, atol=0, rtol=0)
        assert not any("forward" in m.__dict__ for m in model.modules())
        try:
            with hf.few_row_linears(model, sharded=False):
                raise RuntimeError("inside")
        except RuntimeError:
            pass
        assert not any("forward" in m.__dict__ for m in model.modules())
        with hf.few_row_linears(model, sharded=True):   # FSDP2: its modules keep their forward
            model(few)
        assert len(calls) == len(linears)
