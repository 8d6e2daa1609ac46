"""The cross-tokenizer loss (opd.distill.cross, opd.kernels.cross) at and around its minimum.

Two cases of a teacher that equals the student under two tokenizations:
- the same segmentation, other ids (a byte tokenizer and the same bytes numbered otherwise): the
  teacher's logits are the student's permuted; all three parts are 0 with a zero gradient, and
  any other student raises the exact and ULD parts;
- the same text distribution, other segmentations (bytes against BPE merges): the sampled-token
  part summed over a response is log S(text) - log T(text), 0 on every text, and its expectation
  under another student is that student's text-level reverse KL (> 0); with `cross.match: prefix`
  the exact and ULD parts are 0 there too, with `exact` the ULD part is not (the merges' mass
  has no student token to go to).
"""

import math

import pytest
import torch

from opd.kernels.cross import shared_divergence, sorted_l1
from opd.kernels.reference import divergence
from opd.distill.cross import cross_loss
from opd.routing.config import CrossSpec, TeacherSpec
from opd.teachers.align import CrossTokenizers
from opd.teachers.results import TopKResult
from opd.tiny import build_tokenizer
from opd.tiny.cross import build_bpe_tokenizer

MERGES = [("t", "h"), ("th", "e"), ("Ġ", "c"), ("a", "t"), ("Ġc", "at"), ("Ġ", "s")]


def spec(exact=1.0, uld=1.0, span=1.0, beta=0.0):
    return TeacherSpec(name="t", address="tcp://127.0.0.1:1", k=8, beta=beta, tokenizer="cross",
                       cross=CrossSpec(tokenizer_path="unused", exact=exact, uld=uld, span=span))


PART_WEIGHTS = {"exact": (1, 0, 0), "uld": (0, 1, 0), "span": (0, 0, 1)}


def topk_result(logits_R_V: torch.Tensor, targets: list[int], k: int) -> TopKResult:
    """A teacher's answer from its logits, as a server sends it (one sequence)."""
    lp = torch.log_softmax(logits_R_V.double(), -1)
    top = lp.topk(k, -1)
    tail = torch.log1p(-top.values.exp().sum(-1).clamp(max=1 - 1e-12))
    tok = lp.gather(1, torch.tensor(targets)[:, None]).squeeze(1)
    n = len(targets)
    return TopKResult(ids=top.indices.int(), logprobs=top.values.float(), tail_logmass=tail.float(),
                      token_logprob=tok.float(), lse=torch.zeros(n), row_offsets=[0, n])


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("cross_loss")
    return (build_tokenizer(root / "bytes"), build_bpe_tokenizer(root / "renumbered"),
            build_bpe_tokenizer(root / "bpe", merges=MERGES))


def test_same_segmentation_other_ids_minimum(toks):
    student, teacher, _ = toks
    cross = CrossTokenizers(student, teacher)
    # The same bytes, numbered otherwise: the teacher's logits are the student's, permuted.
    perm = torch.tensor([teacher.convert_tokens_to_ids(student.convert_ids_to_tokens(i)) for i in range(len(student))])
    assert sorted(perm.tolist()) == list(range(len(teacher))) and (perm != torch.arange(len(student))).any()
    g = torch.Generator().manual_seed(0)
    response = student("a cat, a hat; 42!", add_special_tokens=False)["input_ids"] + [student.eos_token_id]
    n = len(response)
    student_N_V = torch.randn(n, len(student), generator=g, dtype=torch.float64) * 3
    teacher_N_V = torch.empty_like(student_N_V)
    teacher_N_V[:, perm] = student_N_V
    aligned = cross.align(response)
    assert aligned.spans == [(i, i + 1, i, i + 1) for i in range(n)]
    ans = cross.answer(topk_result(teacher_N_V, aligned.teacher_ids, 8), [aligned], [n], 0.0)
    assert (ans.mapped >= 0).float().mean() < 1   # some top-k entries are high bytes: the ULD part has work
    idx, targets = torch.arange(n), torch.tensor(response)

    def parts(logits):
        out = {}
        for name, w in PART_WEIGHTS.items():
            out[name] = cross_loss(spec(*w), logits, ans, idx, targets)[1]
        return out

    at_min = student_N_V.float().clone().requires_grad_()
    loss, _ = cross_loss(spec(uld=0.0), at_min, ans, idx, targets)   # the smooth parts: a stationary point
    loss.sum().backward()
    for name, rows in parts(at_min.detach()).items():
        assert rows.abs().max() < 1e-5, name
    assert at_min.grad.abs().max() < 1e-5   # (ULD is an L1 distance: a kink at its minimum, no zero gradient)
    for seed in range(3):   # any other student: the distribution parts rise
        other = (student_N_V + torch.randn(n, len(student), generator=g, dtype=torch.float64) * 0.5).float()
        p = parts(other)
        assert p["exact"].mean() > 1e-3 and p["uld"].mean() > 1e-4, (seed, p["exact"].mean(), p["uld"].mean())


def text_model(dist: dict[str, float], tokenize, eos: int) -> dict[tuple, dict[int, float]]:
    """{token prefix: {next token: probability}} of a distribution over texts, each text read as
    tokenize(text) + [eos] (one tokenization per text: the canonical one)."""
    out: dict[tuple, dict[int, float]] = {}
    for text, p in dist.items():
        ids = list(tokenize(text)) + [eos]
        for i, t in enumerate(ids):
            nxt = out.setdefault(tuple(ids[:i]), {})
            nxt[t] = nxt.get(t, 0.0) + p
    return {k: {t: p / sum(v.values()) for t, p in v.items()} for k, v in out.items()}


def logits_of(model, ids: list[int], vocab: int) -> torch.Tensor:
    """[len(ids), vocab] log-probabilities of each next token of `ids` under `model` (1e-9 elsewhere)."""
    rows = torch.full((len(ids), vocab), math.log(1e-9), dtype=torch.float64)
    for i in range(len(ids)):
        for t, p in model[tuple(ids[:i])].items():
            rows[i, t] = math.log(p)
    return rows


@pytest.mark.parametrize("match", ["prefix", "exact"])
def test_same_text_distribution_minimum(toks, match):
    student, _, teacher = toks
    cross = CrossTokenizers(student, teacher, match=match)
    texts = {"the cat": 0.4, "the sat": 0.35, "at": 0.25}
    enc_s = lambda x: student(x, add_special_tokens=False)["input_ids"]   # noqa: E731
    enc_t = lambda x: teacher(x, add_special_tokens=False)["input_ids"]   # noqa: E731
    t_model = text_model(texts, enc_t, teacher.eos_token_id)
    assert len(enc_t("the cat")) == 2 and len(enc_s("the cat")) == 7    # the two sides cut the text otherwise

    def divergence(s_dist: dict[str, float]) -> dict[str, float]:
        """Per part, E over the student's texts of its rows summed over the response (exactly: every text)."""
        s_model = text_model(s_dist, enc_s, student.eos_token_id)
        total = dict.fromkeys(PART_WEIGHTS, 0.0)
        for text, p in s_dist.items():
            response = enc_s(text) + [student.eos_token_id]
            aligned = cross.align(response)
            ans = cross.answer(topk_result(logits_of(t_model, aligned.teacher_ids, len(teacher)), aligned.teacher_ids,
                                           4), [aligned], [len(response)], 0.0)
            for part, w in PART_WEIGHTS.items():
                rows = cross_loss(spec(*w), logits_of(s_model, response, len(student)).float(), ans,
                                  torch.arange(len(response)), torch.tensor(response))[1]
                total[part] += p * float(rows.double().sum())
        return total

    at_min = divergence(texts)
    other = {"the cat": 0.6, "the sat": 0.2, "at": 0.2}
    away = divergence(other)
    # The span part: log S(text) - log T(text), 0 on every text; elsewhere the text-level reverse KL.
    kl = sum(p * math.log(p / texts[x]) for x, p in other.items())
    assert abs(at_min["span"]) < 1e-5
    assert away["span"] == pytest.approx(kl, abs=1e-4) and kl > 0.05
    if match == "prefix":   # the teacher's merges count toward their first byte: all three parts at 0
        assert abs(at_min["exact"]) < 1e-5 and abs(at_min["uld"]) < 1e-5
        assert away["exact"] > 1e-3
    else:   # the merges' mass has no student token: the ULD part is not at its minimum (docs/teachers.md)
        assert at_min["uld"] > 1.0 and away["uld"] < at_min["uld"]


def test_kernel_edges():
    # a row whose top k maps to nothing: the exact part is the bucket alone (0); a student with no
    # unshared ids against a teacher whose unmapped mass is all known: the ULD part is that mass
    logits = torch.randn(2, 6)
    ids = torch.full((2, 3), -1)
    lp = torch.log_softmax(torch.randn(2, 3), -1) - math.log(2)
    tail = torch.log1p(-lp.exp().sum(-1))
    assert shared_divergence(logits, ids, lp, tail).abs().max() < 1e-6
    none_unshared = torch.zeros(6, dtype=torch.bool)
    got = sorted_l1(logits, none_unshared, lp, torch.ones(2, 3, dtype=torch.bool))
    assert torch.allclose(got, lp.exp().sum(-1))
    # reverse KL with an empty teacher bucket stays finite
    full = torch.log_softmax(torch.randn(2, 3), -1)
    assert torch.isfinite(shared_divergence(logits, torch.tensor([[0, 1, 2]] * 2), full,
                                            torch.full((2,), float("-inf")), beta=1.0)).all()


def test_teacher_ids_mapping_to_one_student_id_add_up():
    # teacher ids 0 and 2 both map to student id 1 (match prefix: " cat" and " can" to " "): the
    # partition is {1, 3, bucket} with the teacher's mass on 1 their sum; against the same
    # divergence written out over the student's whole vocabulary
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, generator=g, dtype=torch.float64)
    lp = torch.log_softmax(torch.randn(2, 4, generator=g, dtype=torch.float64), -1) - math.log(1.25)
    tail = torch.log1p(-lp.exp().sum(-1))
    ids = torch.tensor([[1, 3, 1, -1], [1, 3, 1, -1]])
    for beta in (0.0, 0.5, 1.0):
        got = shared_divergence(logits, ids, lp, tail, beta=beta)
        p_t = torch.stack([lp[:, 0].exp() + lp[:, 2].exp(), lp[:, 1].exp(), lp[:, 3].exp() + tail.exp()], 1)
        s = torch.softmax(logits, -1)
        p_s = torch.stack([s[:, 1], s[:, 3], 1 - s[:, 1] - s[:, 3]], 1)
        want = divergence(p_s.log(), p_t.log(), beta)
        assert torch.allclose(got.double(), want, atol=1e-5), (beta, got, want)
