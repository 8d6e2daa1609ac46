"""A longrope model's log-probs of a sequence must not depend on the batch it is computed in:
every student forward (distillation rows, SFT, data-parallel SFT, GRPO) splits a batch at the
switch length, as the hf teacher does (tests/teachers/test_hf_backend.py)."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from opd.rope import longrope_switch, rope_groups


def test_longrope_switch_reads_each_form_a_config_takes():
    longrope = {"rope_type": "longrope", "original_max_position_embeddings": 32}
    assert longrope_switch(SimpleNamespace(rope_parameters=longrope)) == 32
    assert longrope_switch(SimpleNamespace(rope_parameters={"full_attention": longrope})) == 32
    # the older rope_scaling form, the length on the config itself (Phi-3-mini-128k's checkpoint)
    assert longrope_switch(SimpleNamespace(rope_scaling={"type": "longrope"}, original_max_position_embeddings=4096)) \
        == 4096
    assert longrope_switch(SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4})) is None
    assert longrope_switch(SimpleNamespace()) is None


def test_rope_groups_split_only_a_longrope_batch_and_only_at_its_switch():
    phi = SimpleNamespace(config=SimpleNamespace(rope_parameters={"rope_type": "longrope",
                                                                  "original_max_position_embeddings": 32}))
    assert rope_groups(phi, [40, 12, 33, 32]) == [[1, 3], [0, 2]]
    assert rope_groups(phi, [5, 32]) == [[0, 1]]
    assert rope_groups(phi, [33, 90]) == [[0, 1]]
    assert rope_groups(SimpleNamespace(config=SimpleNamespace()), [40, 12]) == [[0, 1]]


@pytest.fixture(scope="module")
def phi(tiny_longrope_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_longrope_dir), dtype=torch.float32)


def _sequences():
    """Two (prompt, response) pairs within the switch length (32) and two past it, interleaved."""
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(3, 256, (n,), generator=g).tolist()

    return [(ids(20), ids(30)), (ids(6), ids(6)), (ids(25), ids(20)), (ids(4), ids(10))]


def test_student_rows_of_a_longrope_model_are_each_sequences_own(phi):
    from opd.spine.rows import pack, student_rows

    seqs = _sequences()
    packed = pack([p for p, _ in seqs], [r for _, r in seqs], pad_id=0)
    rows = student_rows(phi, packed, fused=False)
    hidden, weight = student_rows(phi, packed, fused=True)
    o = packed.row_offsets
    with torch.no_grad():
        batched = phi(input_ids=packed.input_ids_B_L, attention_mask=packed.attention_B_L).logits[
            packed.row_b_N, packed.row_pos_N]
    for b, (p, r) in enumerate(seqs):
        with torch.no_grad():
            alone = phi(torch.tensor([p + r])).logits[0, len(p) - 1:-1]
        torch.testing.assert_close(rows[o[b]:o[b + 1]], alone, atol=1e-4, rtol=0)
        torch.testing.assert_close((hidden @ weight.T)[o[b]:o[b + 1]], alone, atol=1e-4, rtol=0)
        if len(p + r) <= 32:   # what one padded pass gave: the long factors for the short ones too
            assert (batched[o[b]:o[b + 1]] - alone).abs().max() > 0.1
    rows.sum().backward()      # the gradient reaches the model through both passes
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in phi.parameters() if p.requires_grad)
    phi.zero_grad()


def test_sft_losses_of_a_longrope_model_are_the_sequences_own(phi):
    from opd.sft.trainer import collate, response_loss
    from opd.spine.rows import padded_cross_entropy

    def token_loss_sum(model, batch):   # (summed loss, tokens): the data-parallel split of the mean
        loss = padded_cross_entropy(model, batch["input_ids"], batch["labels"], batch.get("attention_mask"), "sum")
        return loss, (batch["labels"][:, 1:] != -100).sum()

    seqs = _sequences()
    pairs = [(p + r, [-100] * len(p) + r) for p, r in seqs]
    input_B_T, labels_B_T, mask_B_T = collate(pairs, pad_id=0)
    with torch.no_grad():
        alone = [token_loss_sum(phi, dict(zip(("input_ids", "labels", "attention_mask"), collate([pair], 0))))
                 for pair in pairs]
        want = sum(s for s, _ in alone) / sum(n for _, n in alone)
        torch.testing.assert_close(response_loss(phi, input_B_T, labels_B_T, mask_B_T), want, atol=1e-5, rtol=0)
        total, count = token_loss_sum(phi, {"input_ids": input_B_T, "labels": labels_B_T, "attention_mask": mask_B_T})
        torch.testing.assert_close(total / count, want, atol=1e-5, rtol=0)


def test_grpo_response_logits_of_a_longrope_model_are_each_sequences_own(phi):
    from opd.rl.batch import collate
    from oracles import response_logits
    from opd.rollout.base import Rollout

    rollouts = [Rollout(p, r, [0.0] * len(r), "length") for p, r in _sequences()]
    batch = collate(rollouts, pad_id=0)
    with torch.no_grad():
        logits = response_logits(phi, batch)
        for b, r in enumerate(rollouts):
            alone = response_logits(phi, collate([r], pad_id=0))
            o = batch.packed.row_offsets
            torch.testing.assert_close(logits[o[b]:o[b + 1]], alone, atol=1e-4, rtol=0)
