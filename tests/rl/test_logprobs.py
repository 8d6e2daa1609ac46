"""rl/logprobs.py: GRPO's token log-probs and entropies of packed rows without [B, T, V], checked
against log_softmax.gather / the entropy on tests/oracles.py's response_logits; and rl/batch.py's
rows."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM

from opd.kernels import TopKTeacher, fused_linear_distill_loss
from opd.rl.logprobs import chunked_entropy, rows_logprobs_and_entropy, token_logprobs_and_entropy
from opd.rl.batch import collate
from opd.spine import terms
from oracles import response_logits
from opd.rollout import Rollout


def _rollouts(shapes, seed=0, vocab=256):
    """Rollouts of (prompt length, response length); response lengths differ, one may be 0."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    return [Rollout(ids(p), ids(r), [0.0] * r, "length", i) for i, (p, r) in enumerate(shapes)]


SHAPES = [(5, 7), (9, 3), (2, 1), (4, 9), (3, 0)]


def _want(model, batch):
    """The plain path: [N, V] logits of each sequence's own forward, log_softmax.gather and the
    entropy on them."""
    logits_N_V = response_logits(model, batch)
    targets_N = batch.packed.targets_N.to(logits_N_V.device)
    lp_N = torch.log_softmax(logits_N_V.float(), -1).gather(-1, targets_N[:, None]).squeeze(-1)
    return lp_N, terms.entropy(logits_N_V.detach())


def _grads(model, lp_N, weights_N):
    model.zero_grad()
    (lp_N * weights_N.to(lp_N.device)).sum().backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


def _assert_same_as_today(model, batch, atol=1e-5, **kw):
    n = len(batch.packed.targets_N)
    weights_N = torch.randn(n, generator=torch.Generator().manual_seed(1))
    want_lp, want_ent = _want(model, batch)
    want_grads = _grads(model, want_lp, weights_N)
    lp, ent = token_logprobs_and_entropy(model, batch.packed, **kw)
    assert lp.shape == ent.shape == (n,) and lp.dtype == ent.dtype == torch.float32
    assert lp.requires_grad and not ent.requires_grad
    torch.testing.assert_close(lp.detach(), want_lp.detach(), atol=atol, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=atol, rtol=0)
    grads = _grads(model, lp, weights_N)
    assert grads.keys() == want_grads.keys() and grads
    for name, g in grads.items():
        # relative to the tensor's largest entry: the longrope fixture's weights are scaled up
        # 10x, its gradients reach 4,600, and fp32 summation order differs by ~6e-6 of that
        scale = float(want_grads[name].abs().max())
        assert float((g - want_grads[name]).abs().max()) <= atol + 1e-4 * scale, name


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)


# ---- the kernel identity and the entropy, on rows -------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("impl", ["torch", "reference", "auto"])
def test_log_prob_of_the_sampled_token_is_minus_forward_kl_to_a_one_hot_teacher(dtype, impl):
    # -KL(one-hot(y) || softmax(h W^T)) = log_softmax(h W^T)[y], gradients to h and W included,
    # against fp64 autograd of the plain computation. The chunked path computes in fp32 whatever
    # it is given (fp64 in: fp32 out), so fp64 inputs meet the fp32 tolerance; the naive
    # reference computes in its input's dtype.
    g = torch.Generator().manual_seed(0)
    N, V, H = 37, 5000, 48
    hidden = torch.randn(N, H, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=dtype) * 0.5).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    upstream = torch.randn(N, generator=g, dtype=torch.float64)
    one_hot = TopKTeacher(targets[:, None], torch.zeros(N, 1), torch.full((N,), float("-inf")))
    lp = -fused_linear_distill_loss(hidden, weight, one_hot, beta=0.0, reduction="none", impl=impl)
    got = (lp.double(), *torch.autograd.grad((lp.double() * upstream).sum(), (hidden, weight)))
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    plain = torch.log_softmax(h64 @ w64.T, -1).gather(1, targets[:, None])[:, 0]
    want = (plain, *torch.autograd.grad((plain * upstream).sum(), (h64, w64)))
    atol = 1e-12 if (impl == "reference" and dtype == torch.float64) else 2e-5
    for name, a, b in zip(("logprob", "d hidden", "d weight"), got, want):
        torch.testing.assert_close(a.double(), b, atol=atol, rtol=0, msg=name)
    # and the helper that wraps it
    lp2, ent = rows_logprobs_and_entropy(hidden, weight, targets, impl=impl)
    torch.testing.assert_close(lp2.double(), plain.detach(), atol=atol, rtol=0)
    lp64 = torch.log_softmax(h64.detach() @ w64.detach().T, -1)
    torch.testing.assert_close(ent.double(), -(lp64.exp() * lp64).sum(-1), atol=2e-5, rtol=0)


@pytest.mark.parametrize("scale", [1.0, 300.0])
@pytest.mark.parametrize("chunk", [None, 7, 1000, 5000])
def test_chunked_entropy_is_the_entropy_of_the_softmax(scale, chunk):
    # chunk 7 does not divide V (the last chunk is short); 5000 is one chunk; logits of +-1e3
    # (scale 300) are where lse - E[z] would cancel: the shifted form keeps fp32 accuracy.
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(29, 16, generator=g), torch.randn(4999, 16, generator=g) * scale / 4
    lp64 = torch.log_softmax(hidden.double() @ weight.double().T, -1)   # the entropy is fp32
    want = -(lp64.exp() * lp64).sum(-1)
    got = chunked_entropy(hidden, weight, chunk=chunk)
    assert got.dtype == torch.float32 and not got.requires_grad
    torch.testing.assert_close(got.double(), want, atol=2e-5 * max(1.0, scale / 10), rtol=1e-5)


def test_chunked_entropy_of_no_rows_is_empty():
    assert chunked_entropy(torch.zeros(0, 8), torch.randn(100, 8)).shape == (0,)


# ---- on a model: the same numbers as response_logits, and the same gradients -----------------

def test_collate_makes_the_sampled_tokens_rows_in_order_with_their_rollout_logprobs():
    rollouts = _rollouts(SHAPES)
    for r in rollouts:
        r.logprobs = [-0.1 * (i + 1) - r.prompt_index for i in range(len(r.response_ids))]
    traj = Rollout([3, 4], [10, 11, 12, 13, 14], [-1.0, float("nan"), float("nan"), -4.0, -5.0], "stop", 5,
                   mask=[1, 0, 0, 1, 1])   # a tool observation (11, 12) between two turns: no rows, its NaNs unread
    batch = collate(rollouts + [traj], pad_id=0)
    p = batch.packed
    assert batch.lengths == [7, 3, 1, 9, 0, 3] and p.row_offsets[-1] == 23
    want_targets = [t for r in rollouts for t in r.response_ids] + [10, 13, 14]
    assert p.targets_N.tolist() == want_targets
    assert batch.old_logprobs_N.tolist() == pytest.approx([x for r in rollouts for x in r.logprobs] + [-1.0, -4.0, -5.0])
    # each row is predicted by the position before its token, in its own sequence
    assert torch.equal(p.input_ids_B_L[p.row_b_N, p.row_pos_N + 1], p.targets_N)
    # a part keeps where its sequences and rows sit in the whole
    part = batch.sequences(torch.tensor([5, 0]))
    assert part.seq_B.tolist() == [5, 0] and part.lengths == [3, 7]
    assert part.index_N.tolist() == [20, 21, 22, *range(7)]
    assert torch.equal(part.old_logprobs_N, batch.old_logprobs_N[part.index_N])
    assert torch.equal(part.packed.targets_N, p.targets_N[part.index_N])
    assert part.per_row(torch.tensor([1.0, 2.0])).tolist() == [1.0] * 3 + [2.0] * 7
    empty = batch.sequences(slice(6, 8))   # a rank's empty share: no sequences, the batch's width
    assert empty.lengths == [] and empty.packed.input_ids_B_L.shape == (0, p.input_ids_B_L.shape[1])


@pytest.mark.parametrize("chunk", [None, 37])
def test_logprobs_and_entropy_equal_the_plain_ones_on_the_tiny_model(tiny, chunk):
    batch = collate(_rollouts(SHAPES), pad_id=0)
    _assert_same_as_today(tiny, batch, chunk=chunk)
    lp, ent = token_logprobs_and_entropy(tiny, batch.packed, with_entropy=False)
    assert ent is None and lp.requires_grad


def test_under_no_grad_as_the_reference_log_probs_are_taken(tiny):
    batch = collate(_rollouts(SHAPES), pad_id=0)
    with torch.no_grad():
        want, _ = _want(tiny, batch)
        lp, _ = token_logprobs_and_entropy(tiny, batch.packed, with_entropy=False)
    assert not lp.requires_grad
    torch.testing.assert_close(lp, want, atol=1e-5, rtol=0)


def test_a_batch_of_empty_responses_gives_no_rows_and_a_backward_that_runs(tiny):
    batch = collate(_rollouts([(4, 0), (2, 0)]), pad_id=0)
    lp, ent = token_logprobs_and_entropy(tiny, batch.packed)
    assert lp.shape == ent.shape == (0,)
    lp.sum().backward()
    tiny.zero_grad()


def test_the_entropy_a_term_trains_carries_its_gradient(tiny):
    batch = collate(_rollouts(SHAPES, seed=2), pad_id=0)
    lp, ent = token_logprobs_and_entropy(tiny, batch.packed, entropy_grad=True)
    want_lp, want_ent = _want(tiny, batch)
    torch.testing.assert_close(ent.detach(), want_ent, atol=1e-5, rtol=0)
    assert ent.requires_grad
    w = torch.randn(len(ent), generator=torch.Generator().manual_seed(3))
    tiny.zero_grad()
    (ent * w).sum().backward()
    got = {n: p.grad.clone() for n, p in tiny.named_parameters() if p.grad is not None}
    tiny.zero_grad()
    logits = response_logits(tiny, batch)
    (terms.entropy(logits) * w).sum().backward()
    for n, p in tiny.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)
    tiny.zero_grad()


def test_a_lora_adapter_on_the_lm_head_falls_back_to_logits_of_the_response_rows(tiny_model_dir, monkeypatch):
    # The fused loss sees hidden @ lm_head.weight.T only: it would miss the adapter. head_form
    # says so, and the rows' logits go through the head (adapter included) and log_softmax.gather.
    from peft import LoraConfig, get_peft_model

    from opd.lm_head import head_form

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"],
                                            init_lora_weights=False))
    assert not head_form(model).fusable and head_form(model).post is not None

    def refuse(*a, **k):
        raise AssertionError("the fused loss ran on a head it cannot see")

    from opd.spine import rows as spine_rows

    monkeypatch.setattr(spine_rows, "fused_linear_distill_loss", refuse)
    batch = collate(_rollouts(SHAPES, seed=3), pad_id=0)
    _assert_same_as_today(model, batch)
    assert any("lora" in n for n, p in model.named_parameters() if p.requires_grad)


def test_a_head_of_no_known_form_uses_the_rows_of_the_models_own_forward(tiny, monkeypatch):
    from opd.lm_head import HeadForm
    from opd.spine import rows as spine_rows

    monkeypatch.setattr(spine_rows, "head_form", lambda model: HeadForm(post=None, fusable=False))
    monkeypatch.setattr(spine_rows, "last_hidden", None)   # the body alone must not be used
    _assert_same_as_today(tiny, collate(_rollouts(SHAPES, seed=4), pad_id=0))


# ---- longrope: one pass per side of the switch length, as response_logits ---------------------

@pytest.fixture(scope="module")
def phi(tiny_longrope_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_longrope_dir), dtype=torch.float32)


def test_a_longrope_models_rows_are_each_sequences_own(phi):
    # Two sequences within the switch length (32) and two past it, interleaved (tests/opd/test_rope.py).
    # response_logits runs each sequence alone: equal to it is each sequence's own rows.
    rollouts = _rollouts([(20, 30), (6, 6), (25, 20), (4, 10)])
    batch = collate(rollouts, pad_id=0)
    _assert_same_as_today(phi, batch, atol=1e-4)


# ---- memory: nothing of size [N, V] --------------------------------------------------------------

class _Allocations(TorchDispatchMode):
    """Records the shape and bytes of every tensor an aten op returns in new storage (views and
    in-place results share their inputs' storage and are not counted), backward included."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[tuple[int, ...], int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.seen.append((tuple(t.shape), t.untyped_storage().nbytes()))
        return out


def _largest_beyond_parameters(model, batch, fn) -> tuple[int, tuple]:
    """Bytes and shape of the largest allocation of forward + backward that is not
    parameter-shaped (the embedding's and the head's [V, H] gradients are needed anyway)."""
    head_shapes = {tuple(p.shape) for p in model.parameters()}
    with _Allocations() as seen:
        fn(model, batch).sum().backward()
    model.zero_grad()
    return max((nbytes, shape) for shape, nbytes in seen.seen if shape not in head_shapes)


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory):
    """The tiny model with its vocabulary padded to 20,000 and 60,000 rows (H = 64)."""
    from opd.lm_head import head_form
    from opd.tiny import build_tiny_model

    models = {}
    for v in (20_000, 60_000):
        path = build_tiny_model(tmp_path_factory.mktemp(f"v{v}") / "model", seed=0, vocab_size=v)
        models[v] = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        head_form(models[v])   # its check runs a forward of the whole model once: not measured
    return models


def test_memory_beyond_the_parameters_does_not_grow_with_the_vocabulary(wide_models, monkeypatch):
    # B x T = 6 x 12 with N = 60 response rows: [N, V] is 4.8 MB at V = 20,000, 14.4 MB at 60,000.
    # The kernel's tiles are cut to ~16,384 elements and the entropy's to 512 columns, so the
    # chunked path's largest allocation off the parameters' shapes is a few hundred KB at both
    # vocabulary sizes, while today's path allocates [B, T, V] and trips the same check.
    from opd.kernels import chunked

    monkeypatch.setattr(chunked, "LINEAR_TILE_ELEMENTS", 1 << 14)
    batch = collate(_rollouts([(6, 12), (3, 10), (8, 12), (2, 7), (5, 12), (4, 7)]), pad_id=0)
    N = batch.packed.row_offsets[-1]
    largest = {}
    for v, model in wide_models.items():
        nbytes, shape = _largest_beyond_parameters(
            model, batch, lambda m, b: sum(token_logprobs_and_entropy(m, b.packed, chunk=512)).sum())
        assert nbytes < 4 * N * 1024, (v, shape, nbytes)   # < [N, 1024] fp32, far below [N, V]
        largest[v] = nbytes
        today, shape = _largest_beyond_parameters(
            model, batch, lambda m, b: sum(x.sum() for x in _want(m, b)))
        assert today >= 4 * N * v, (v, shape, today)        # the check sees a materialized [N, V]
    assert largest[20_000] == largest[60_000], largest
