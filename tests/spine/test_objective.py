"""opd.spine.objective: one objective for rewards and teachers, and its off-policy correction.

The equivalence tests run the two trainers' own update code on one batch: `opd rl`'s
GRPOTrainer.update with teacher terms, and `opd train`'s train_batch with a reward advantage.
"""

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from opd.spine.terms import TermsConfig
from opd.distill.batch import Batch
from opd.distill.config import LossConfig
from opd.distill.loss import train_batch
from opd.distill.stats import StepStats
from opd.teachers.session import Answer
from opd.kernels import TopKTeacher
from opd.rl.batch import collate
from opd.rl.config import AlgorithmConfig, OptimConfig
from opd.rl.logprobs import token_logprobs_and_entropy
from opd.rl.teachers import TeacherTerm, sampled_baseline, token_advantages
from opd.rl.trainer import GRPOTrainer
from opd.rollout import Rollout
from opd.routing.config import TeacherSpec
from opd.routing.router import Route
from opd.spine import objective
from opd.spine.config import OffPolicyConfig
from opd.spine.dist import World

V = 12


def test_discounted_sums_later_terms_within_each_sequence():
    x = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0])
    out = objective.discounted(x, [0, 3, 5], 0.5)
    # sequence 1: 1 + .5*2 + .25*4, 2 + .5*4, 4; sequence 2: 8 + .5*16, 16
    assert out.tolist() == [3.0, 4.0, 4.0, 16.0, 16.0]
    assert objective.discounted(x, [0, 5], 0.0) is x
    assert objective.discounted(x, [0, 3, 3, 5], 0.5).tolist() == out.tolist()   # a sequence without rows


def test_importance_weights_token_and_prefix_by_hand():
    now = torch.log(torch.tensor([0.5, 0.4, 0.9, 0.3, 0.6]))
    old = torch.log(torch.tensor([0.25, 0.8, 0.3, 0.3, 0.3]))    # ratios 2, .5, 3 | 1, 2
    w = objective.importance(now, old, [0, 3, 5], [True, False], "tis", cap=2.5, band=(0.5, 2.0))
    assert torch.allclose(w.ratio_N, torch.tensor([2.0, 0.5, 3.0, 1.0, 1.0]))   # sequence 2 is fresh: 1
    assert torch.allclose(w.token_N, torch.tensor([2.0, 0.5, 2.5, 1.0, 1.0]))
    assert torch.allclose(w.prefix_N, torch.tensor([1.0, 2.0, 1.0, 1.0, 1.0]))   # 1, 2, 2 * .5
    assert w.cut_N.tolist() == [False, False, True, False, False]
    m = objective.importance(now, old, [0, 3, 5], [True, True], "mask", cap=2.5, band=(0.6, 2.1))
    assert torch.allclose(m.token_N, torch.tensor([2.0, 0.0, 0.0, 1.0, 2.0]))
    none = objective.importance(now, old, [0, 3, 5], [True, True], "none", cap=2.5, band=(0.6, 2.0))
    assert torch.equal(none.token_N, torch.ones(5)) and torch.equal(none.prefix_N, torch.ones(5))


def test_staleness_zero_weighs_exactly_one():
    now, old = torch.randn(7), torch.randn(7)
    for correction in ("tis", "mask", "none"):
        w = objective.importance(now, old, [0, 4, 7], [False, False], correction, cap=1.0, band=(1.0, 1.0))
        assert torch.equal(w.token_N, torch.ones(7)) and torch.equal(w.prefix_N, torch.ones(7))
        assert not w.cut_N.any()


def test_truncated_importance_sampling_recovers_the_expectation_under_the_new_policy():
    """E_now[f] from samples of an older policy: the TIS estimate lands within 3 standard errors,
    the uncorrected mean far outside them."""
    g = torch.Generator().manual_seed(0)
    old_p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    now_p = torch.tensor([0.25, 0.25, 0.25, 0.25])            # ratios .625 .. 2.5: none above cap 3
    f = torch.tensor([0.0, 1.0, 2.0, 3.0])
    truth = float((now_p * f).sum())                          # 1.5
    x = torch.multinomial(old_p, 40_000, replacement=True, generator=g)
    w = objective.importance(now_p.log()[x], old_p.log()[x], [0, len(x)], [True], "tis", cap=3.0, band=(0.5, 2.0))
    est = w.token_N * f[x]
    se = float(est.std() / len(x) ** 0.5)
    assert abs(float(est.mean()) - truth) < 3 * se
    plain = f[x]
    assert abs(float(plain.mean()) - truth) > 10 * float(plain.std() / len(x) ** 0.5)   # E_old[f] = 1.0


def test_batch_advantage_is_the_reward_less_the_others_mean():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    adv = objective.batch_advantages(r)
    assert adv.tolist() == pytest.approx([1 - 2 / 4, 0 - 3 / 4, 0 - 3 / 4, 1 - 2 / 4, 1 - 2 / 4])
    assert objective.batch_advantages(torch.ones(4)).tolist() == [0.0] * 4
    # one rank's share of a step of 5: the others' mean is over every rank's responses
    assert objective.batch_advantages(r[:2], total=(3.0, 5)).tolist() == pytest.approx([1 - 2 / 4, 0 - 3 / 4])
    assert objective.leave_one_out(torch.tensor([4.0, 6.0]), torch.tensor([2.0, 3.0])).tolist() == [2.0, 2.0]


def test_off_policy_band_must_hold_one():
    with pytest.raises(ValueError, match="low <= 1 <= high"):
        OffPolicyConfig(band=[1.2, 2.0])


# ---- the two trainers' updates on one batch --------------------------------------------------

def _model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def _batch(model, G: int = 2, P: int = 2):
    """P prompts x G responses with the model's own log-probs as the sampler's (on-policy)."""
    g = torch.Generator().manual_seed(1)
    rollouts = []
    for b in range(P * G):
        prompt = torch.randint(1, V, (2 + b % 2,), generator=g).tolist()
        response = torch.randint(1, V, (3 + b % 3,), generator=g).tolist()
        rollouts.append(Rollout(prompt, response, [0.0] * len(response), "length", b // G))
    with torch.no_grad():
        batch = collate(rollouts, 0)
        lp = token_logprobs_and_entropy(model, batch.packed, with_entropy=False)[0]
    o = batch.packed.row_offsets
    for b, r in enumerate(rollouts):
        r.logprobs = lp[o[b]:o[b + 1]].tolist()
    teacher = [torch.randn(len(r.response_ids), generator=g) - 2.0 for r in rollouts]
    return rollouts, teacher


def _rl_update(model, rollouts, teacher, adv_B, lam):
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    stub = SimpleNamespace(
        cfg=SimpleNamespace(algorithm=AlgorithmConfig(micro_batch_size=2, eps_low=10.0, eps_high=10.0),
                            optim=OptimConfig(grad_clip=0.0), rollout=SimpleNamespace(max_new_tokens=8),
                            terms=TermsConfig()),
        model=model, optimizer=opt, params=list(model.parameters()), world=World(),
        scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), token_advantages=token_advantages)
    batch = collate(rollouts, 0)
    terms = []
    if lam is not None:
        lp_N = torch.cat(teacher)   # the rows, sequence by sequence
        on_B = torch.ones(len(rollouts))   # teacher `baseline: batch`, the default (opd train's too)
        terms = [TeacherTerm(lam, 0.0, lp_N, on_B, sampled_baseline(batch, lp_N, on_B))]
    GRPOTrainer.update(stub, batch, adv_B, None, terms)
    return [p.detach().clone() for p in model.parameters()]


class _Teachers:
    """The TeacherSet surface train_batch reads, with answers given up front."""

    def __init__(self, spec, rollouts, teacher):
        self.specs = {spec.name: spec}
        offsets = [0]
        for t in teacher:
            offsets.append(offsets[-1] + len(t))
        lp = torch.cat(teacher)
        topk = TopKTeacher(torch.zeros(len(lp), 1, dtype=torch.long), lp[:, None], torch.full((len(lp),), -1.0))
        self.answer = Answer(topk, None, lp, offsets, 0.0)

    def answers(self, futures):
        return {"t": self.answer}

    @staticmethod
    def finish(answers):
        return 0.0

    @staticmethod
    def topk_ids(spec, answer, idx):
        return answer.topk.ids[idx]


def _distill_update(model, rollouts, teacher, adv_B, lam, G=2):
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    spec = TeacherSpec(name="t", address="tcp://127.0.0.1:1", mode="sampled", weight=lam)
    samples = [SimpleNamespace(prompt="p", domain="d")] * (len(rollouts) // G)
    batch = Batch(index=0, samples=samples, routes=[Route(domain="d", weights={"t": 1.0}, teacher="t", rule="test", reason="test")] * len(samples),
                  rollouts=rollouts, keep=[len(r.response_ids) for r in rollouts], policy_version=0,
                  advantages=adv_B.tolist() if adv_B is not None else None)
    batch.requests()
    cfg = SimpleNamespace(loss=LossConfig(reward_weight=1.0), optim=SimpleNamespace(micro_batch_size=2), terms=TermsConfig())
    opt.zero_grad()
    train_batch(model, batch, _Teachers(spec, rollouts, teacher), cfg=cfg, lam={"d": 1.0}, pad_id=0, scale=1.0,
                stats=StepStats())
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_rl_update_with_teacher_weight_zero_is_opd_rl_update():
    model = _model()
    rollouts, teacher = _batch(model)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    plain = _rl_update(_model(), rollouts, teacher, adv, None)
    zero = _rl_update(_model(), rollouts, teacher, adv, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(plain, zero))
    moved = _rl_update(_model(), rollouts, teacher, adv, 0.5)
    assert not all(torch.equal(a, b) for a, b in zip(plain, moved))


@pytest.mark.parametrize("with_reward,lam", [(False, 1.0), (True, 0.5)])
def test_opd_rl_and_opd_train_take_the_same_step_on_one_batch(with_reward, lam):
    """No rewards: opd rl's combined update is opd train's sampled mode; rewards and a teacher:
    the two CLIs' objectives are one (token_mean = length_norm token, on-policy ratio 1)."""
    model = _model()
    rollouts, teacher = _batch(model)
    start = [p.detach().clone() for p in _model().parameters()]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5]) if with_reward else torch.zeros(4)
    rl = _rl_update(_model(), rollouts, teacher, adv, lam)
    distill = _distill_update(_model(), rollouts, teacher, adv if with_reward else None, lam)
    deltas = [(r - s, d - s) for r, d, s in zip(rl, distill, start)]
    assert any(float(a.abs().max()) > 1e-4 for a, _ in deltas)            # the step moved something
    for a, b in deltas:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
