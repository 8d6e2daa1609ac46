"""Trimming, masks, packing and per-row weights, against hand-computed values."""

import pytest
import torch

from opd.spine.rows import pack, response_mask, row_weights, sequence_weights, trim_length
from opd.tiny import build_tokenizer


EOS = 0


def test_trim_none_keeps_everything():
    assert trim_length([5, 0, 7], eos_ids={EOS}, trim="none") == 3


def test_trim_eos_keeps_through_first_eos():
    assert trim_length([5, 6, 0, 7, 0], eos_ids={EOS}, trim="eos") == 3
    assert trim_length([5, 6, 7], eos_ids={EOS}, trim="eos") == 3
    assert trim_length([0, 6], eos_ids={EOS}, trim="eos") == 1
    assert trim_length([], eos_ids={EOS}, trim="eos") == 0


def test_trim_marker_keeps_through_the_token_that_completes_it(tmp_path):
    tok = build_tokenizer(tmp_path)
    ids = tok("x=4</a> and more</a>", add_special_tokens=False)["input_ids"]   # bytes: one token each
    assert len(ids) == 20
    # "x=4</a>" is 7 bytes: keep 7 tokens, drop the rambling tail.
    assert trim_length(ids, eos_ids={tok.eos_token_id}, trim="marker", marker="</a>", tokenizer=tok) == 7
    # No marker: falls back to EOS trimming.
    no = tok("x=4 done", add_special_tokens=False)["input_ids"] + [tok.eos_token_id, 65]
    assert trim_length(no, eos_ids={tok.eos_token_id}, trim="marker", marker="</a>", tokenizer=tok) == 9
    # EOS before the marker wins.
    early = tok("ab", add_special_tokens=False)["input_ids"] + [tok.eos_token_id] + \
        tok("</a>", add_special_tokens=False)["input_ids"]
    assert trim_length(early, eos_ids={tok.eos_token_id}, trim="marker", marker="</a>", tokenizer=tok) == 3


def test_response_mask_marks_positions_that_predict_response_tokens():
    # prompt 3 + response 2 in a width-6 batch; prompt 1 + response 4.
    m = response_mask([3, 1], [2, 4], 6)
    assert m.tolist() == [[False, False, True, True, False, False],
                          [True, True, True, True, False, False]]


def test_pack_rows_targets_and_padding():
    p = pack([[10, 11, 12], [20]], [[13, 14], [21, 22, 23]], pad_id=99)
    assert p.input_ids_B_L.tolist() == [[10, 11, 12, 13, 14], [20, 21, 22, 23, 99]]
    assert p.attention_B_L.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert p.row_b_N.tolist() == [0, 0, 1, 1, 1]
    assert p.row_pos_N.tolist() == [2, 3, 0, 1, 2]
    assert p.targets_N.tolist() == [13, 14, 21, 22, 23]      # exactly the response tokens, in order
    assert p.row_offsets == [0, 2, 5]


def test_pack_empty_response_has_no_rows():
    p = pack([[1, 2], [3]], [[], [4]], pad_id=0)
    assert p.targets_N.tolist() == [4]
    assert p.row_offsets == [0, 0, 1]


def test_row_weights_per_token_and_per_sequence():
    # two sequences of domain a (2 and 4 rows), one of domain b (1 row), lambda_b = 2.
    offsets = [0, 2, 6, 7]
    w = row_weights(offsets, ["a", "a", "b"], {"b": 2.0}, "token")
    assert torch.allclose(w, torch.tensor([1 / 6] * 6 + [2.0]))
    w = row_weights(offsets, ["a", "a", "b"], {"b": 2.0}, "sequence")
    assert torch.allclose(w, torch.tensor([1 / 4] * 2 + [1 / 8] * 4 + [2.0]))
    # loss rows all 1: each domain's mean is 1, the weighted sum is 1 + 2.
    assert abs(float(w.sum()) - 3.0) < 1e-6


def test_row_weights_skip_empty_sequences():
    w = row_weights([0, 0, 3], ["a", "a"], {}, "sequence")
    assert torch.allclose(w, torch.full((3,), 1 / 3))


def test_opd_rl_aggregates_with_opd_train_weights():
    """One aggregation for both loops: opd rl's reduction of a loss over its rows is the sum of
    those rows weighted by opd train's row weights (one group), for the two norms they share,
    and Dr. GRPO's constant normalizer divides by sequences x max_tokens."""
    from opd.rl.grpo import aggregate

    lengths = [2, 4, 0, 1]
    offsets = [0, 2, 6, 6, 7]
    rows_N = torch.arange(7, dtype=torch.float32) / 7
    for rl_mode, norm in (("token_mean", "token"), ("seq_mean", "sequence")):
        w = row_weights(offsets, ["g"] * 4, {}, norm, {"tokens/g": 7, "seqs/g": 4})
        assert float(aggregate(rows_N, lengths, rl_mode)) == pytest.approx(float((w * rows_N).sum()), rel=1e-6)
    assert float(aggregate(rows_N, lengths, "dr_grpo", max_tokens=8)) == \
        pytest.approx(float(rows_N.sum()) / (4 * 8), rel=1e-6)
    assert sequence_weights(lengths, ["g"] * 4, {"g": 2.0}, "constant", {"tokens/g": 7, "seqs/g": 4}, 8) == \
        [2 / 32, 2 / 32, 0.0, 2 / 32]
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        aggregate(rows_N, lengths, "mean")


def test_student_rows_equal_the_models_own_logits_at_the_response_rows(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from opd.spine.rows import select_rows, student_rows

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    packed = pack([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]], pad_id=0)
    want = model(input_ids=packed.input_ids_B_L, attention_mask=packed.attention_B_L).logits[
        packed.row_b_N, packed.row_pos_N]
    rows = student_rows(model, packed, fused=False)               # body + head on the 5 rows only
    torch.testing.assert_close(rows, want, atol=1e-5, rtol=0)
    hidden, weight = student_rows(model, packed, fused=True)
    torch.testing.assert_close(hidden @ weight.T, want, atol=1e-5, rtol=0)
    assert select_rows(rows, torch.arange(5)) is rows              # all rows in order: no copy
    torch.testing.assert_close(select_rows(rows, torch.tensor([4, 0])), want[[4, 0]])


def _tiny(family: str):
    """A 1-layer model of `family` with a large LM head, so that what comes after it shows."""
    import transformers as tf

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1)
    cfg = {"llama": lambda: tf.LlamaConfig(**common),
           "gemma2": lambda: tf.Gemma2Config(**common, head_dim=16, final_logit_softcapping=2.0,
                                             attn_logit_softcapping=None),
           "cohere": lambda: tf.CohereConfig(**common, logit_scale=0.25),
           "granite": lambda: tf.GraniteConfig(**common, logits_scaling=8.0),
           "phi": lambda: tf.PhiConfig(**{**common, "num_key_value_heads": 2})}[family]()
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20)
        if getattr(model.get_output_embeddings(), "bias", None) is not None:
            model.get_output_embeddings().bias.normal_(0, 3)
    return model


@pytest.mark.parametrize("family,fusable", [("llama", True), ("gemma2", False), ("cohere", False),
                                            ("granite", False), ("phi", False), ("llama-lora-head", False)])
def test_student_rows_follow_what_comes_after_the_lm_head(family, fusable):
    # Soft-cap (Gemma 2), scales (Cohere, Granite), a bias (Phi) or a LoRA adapter on the head:
    # the rows equal the model's own logits; only a plain head may go through the fused loss,
    # which sees hidden @ lm_head.weight.T alone.
    from opd.spine.rows import student_rows
    from opd.lm_head import head_form

    model = _tiny(family.split("-")[0])
    if family == "llama-lora-head":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"],
                                                 init_lora_weights=False))
    packed = pack([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]], pad_id=0)
    with torch.no_grad():
        want = model(input_ids=packed.input_ids_B_L, attention_mask=packed.attention_B_L).logits[
            packed.row_b_N, packed.row_pos_N]
        form = head_form(model)
        assert form.post is not None and form.fusable is fusable
        torch.testing.assert_close(student_rows(model, packed, fused=False), want, atol=1e-4, rtol=1e-5)
        if fusable:
            hidden, weight = student_rows(model, packed, fused=True)
            torch.testing.assert_close(hidden @ weight.T, want, atol=1e-4, rtol=1e-5)
        else:
            with pytest.raises(ValueError, match="not hidden @ lm_head.weight.T"):
                student_rows(model, packed, fused=True)
    assert model.training                                          # the check left it in train mode


def test_take_rows_copies_only_a_real_selection():
    from opd.spine.rows import take_rows

    t = torch.arange(12.0).view(4, 3)
    assert take_rows(t, torch.arange(4)) is t
    assert torch.equal(take_rows(t, torch.tensor([2, 0])), t[[2, 0]])
    assert torch.equal(take_rows(t, torch.tensor([0, 1, 3, 2])), t[[0, 1, 3, 2]])   # same length, not in order


@pytest.mark.parametrize("padding", [None, 3])
def test_a_tied_embeddings_sparse_lookup_gradient_equals_the_dense_one(padding):
    """student_rows(fused=True) looks a tied embedding up with a row-sparse weight gradient
    (no zero [V, H] per backward): every parameter's gradient equals the plain forward's, the
    weight's stays dense (AdamW needs it), and a padding row gets none, as nn.Embedding's."""
    import transformers as tf

    from opd.spine.rows import student_rows

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True, pad_token_id=padding)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    packed = pack([[5, 6, 3, 7], [8, 9]], [[10, 11], [12, 3, 14]], pad_id=0)

    def grads(fused: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        if fused:
            hidden, weight = student_rows(model, packed, fused=True)
            logits = hidden @ weight.T
        else:
            logits = model(input_ids=packed.input_ids_B_L, attention_mask=packed.attention_B_L).logits[
                packed.row_b_N, packed.row_pos_N]
        (torch.logsumexp(logits, -1) - logits[:, 1]).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    from opd.spine import rows as rows_module

    calls = []
    apply = rows_module._RowsEmbedding.apply
    rows_module._RowsEmbedding.apply = lambda *a: calls.append(a) or apply(*a)
    try:
        want, got = grads(False), grads(True)
    finally:
        rows_module._RowsEmbedding.apply = apply
    assert len(calls) == 1 and calls[0][2] == padding    # the sparse lookup was the one taken
    weight = model.get_input_embeddings().weight
    assert weight.grad.layout == torch.strided
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_from_hidden_states_equal_those_from_logits_gradient_included(temperature):
    """The fused form (hidden, head weight) gives log softmax(logits / T)[target] and its
    gradient, as the logits form does: the sampled mode's and the reward's log-probs."""
    from opd.spine.rows import token_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 40, (7,), generator=g)
    fused = token_logprobs((hidden, weight), targets, temperature=temperature, impl="torch")
    (fused * torch.arange(7.0)).sum().backward()
    got = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    want = torch.log_softmax((hidden @ weight.T) / temperature, -1).gather(-1, targets[:, None]).squeeze(-1)
    (want * torch.arange(7.0)).sum().backward()
    assert torch.allclose(fused.double(), want, atol=1e-5)
    assert torch.allclose(got[0], hidden.grad, atol=1e-4) and torch.allclose(got[1], weight.grad, atol=1e-4)
    logits = token_logprobs(hidden @ weight.T, targets, temperature=temperature)
    assert torch.allclose(logits.double(), want, atol=1e-6)
