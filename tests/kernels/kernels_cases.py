"""One comparison case: an implementation vs the naive reference in fp64 (values and grads).

Shared by test_kernels_torch.py (in process) and kernels_triton_cases.py (run under
TRITON_INTERPRET=1 in a subprocess). Tolerance follows the dtype, as in Cut Cross-Entropy:
fp32 must be within RTOL_FP32 (relative to the largest reference magnitude); bf16/fp16
may be no worse than PyTorch's own reference computed in that dtype, plus BF16_EPS.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass

import torch

from opd.kernels import TopKTeacher, distill_loss, fused_linear_distill_loss, reference

RTOL_FP32 = 1e-5
BF16_EPS = 1e-2


@dataclass(frozen=True)
class Case:
    impl: str = "torch"
    teacher: str = "full"        # "full" | "topk" | "student_topk" (the student's top k as the support)
    beta: float = 0.0
    temperature: float = 1.0
    scale_by_t2: bool = False
    mask: bool = True
    pad: int = 7                 # vocab_size = V - pad
    dtype: str = "float32"
    extreme: bool = False        # put +-1e4 logits in every row, both sides
    fused: bool = False
    N: int = 12
    V: int = 101                 # not a multiple of any block size
    H: int = 24
    k: int = 6
    reduction: str = "mean"

    def name(self) -> str:
        return "-".join(f"{k}={v}" for k, v in asdict(self).items() if v != getattr(Case, k))


def _inputs(case: Case):
    g = torch.Generator().manual_seed(zlib.crc32(case.name().encode()))
    n, v = case.N, case.V
    vocab = v - case.pad
    hidden = torch.randn(n, case.H, generator=g, dtype=torch.float64)
    weight = torch.randn(v, case.H, generator=g, dtype=torch.float64) * 0.4
    student = hidden @ weight.T if case.fused else torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    teacher = student.detach() * 0.7 + torch.randn(n, v, generator=g, dtype=torch.float64) * 1.5
    if case.extreme and not case.fused:
        cols = torch.randint(0, vocab, (n, 2), generator=g)
        student.scatter_(1, cols[:, :1], 1e4)
        student.scatter_(1, cols[:, 1:], -1e4)
        teacher.scatter_(1, cols[:, 1:], 1e4)   # teacher's favourite is the student's worst
    teacher[:, vocab:] = float("nan")           # padding must never be read as a number
    mask = (torch.rand(n, generator=g) > 0.3) if case.mask else None
    if mask is not None:
        mask[0] = True
    return hidden, weight, student, teacher, mask, vocab


def _topk(teacher: torch.Tensor, vocab: int, k: int, temperature: float) -> TopKTeacher:
    """What the server sends: top-k of log_softmax(teacher / T) and the exact tail."""
    lp = torch.log_softmax(teacher[:, :vocab] / temperature, dim=-1)
    vals, ids = lp.topk(k, dim=-1)
    tail = torch.logsumexp(lp.scatter(1, ids, float("-inf")), dim=-1)   # exact, even if tiny
    return TopKTeacher(ids, vals.float(), tail.float())


def _run(case: Case, impl: str, dtype: torch.dtype, hidden, weight, student, teacher, mask, vocab,
         device: str = "cpu"):
    """Loss and gradients of `impl`, computed on `device`, returned in fp64 on the CPU."""
    def put(t):
        return None if t is None else t.detach().to(device=device, dtype=dtype).clone()

    mask = None if mask is None else mask.to(device)
    opts = dict(beta=case.beta, temperature=case.temperature, scale_by_t2=case.scale_by_t2,
                mask=mask, reduction=case.reduction, vocab_size=vocab, impl=impl)
    if case.teacher in ("topk", "student_topk"):
        top = _topk(teacher, vocab, case.k, case.temperature) if case.teacher == "topk" else \
            reference.student_topk_teacher(student[:, :vocab], teacher[:, :vocab], case.k, case.temperature)
        teacher_arg = TopKTeacher(*(t.to(device) for t in top))
    else:
        teacher_arg = put(teacher)
    if case.fused:
        h, w = put(hidden).requires_grad_(), put(weight).requires_grad_()
        loss = fused_linear_distill_loss(h, w, teacher_arg, **opts)
        loss.sum().backward()
        return loss.detach().cpu().double(), [h.grad.cpu().double(), w.grad.cpu().double()]
    x = put(student).requires_grad_()
    loss = distill_loss(x, teacher_arg, **opts)
    loss.sum().backward()
    return loss.detach().cpu().double(), [x.grad.cpu().double()]


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().clamp(min=1e-12)
    return float(((a - ref).abs().max() / scale).item())


def check(case: Case, device: str = "cpu") -> dict:
    """Errors of case.impl (run on `device`) against the fp64 reference on the CPU, and the
    tolerance they must meet; 'ok' says whether they do."""
    data = _inputs(case)
    dtype = getattr(torch, case.dtype)
    truth_loss, truth_grads = _run(case, "reference", torch.float64, *data)
    loss, grads = _run(case, case.impl, dtype, *data, device=device)
    errors = [_rel_err(loss, truth_loss)] + [_rel_err(g, t) for g, t in zip(grads, truth_grads)]
    if dtype == torch.float32:
        tols = [RTOL_FP32] * len(errors)
    else:   # PyTorch's own error in this dtype, plus eps
        ref_loss, ref_grads = _run(case, "reference", dtype, *data, device=device)
        tols = [_rel_err(ref_loss, truth_loss) + BF16_EPS] + \
               [_rel_err(g, t) + BF16_EPS for g, t in zip(ref_grads, truth_grads)]
    finite = bool(torch.isfinite(loss).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
    ok = finite and all(e <= t for e, t in zip(errors, tols))
    hidden, weight, student, teacher, mask, vocab = data
    if mask is not None and not case.fused:   # masked rows: exactly no gradient
        ok = ok and bool((grads[0][~mask] == 0).all())
    if case.pad:                              # padding columns: exactly no gradient
        ok = ok and bool((grads[-1][vocab:] == 0).all() if case.fused else (grads[0][:, vocab:] == 0).all())
    return {"case": case.name(), "errors": errors, "tolerances": tols, "finite": finite, "ok": ok,
            "loss": float(truth_loss.sum())}


# Few and tiny: the interpreter runs every program instance on numpy.
TRITON_CASES = [
    *[Case(impl="triton", teacher=t, beta=b, temperature=T, scale_by_t2=T != 1.0)
      for t in ("full", "topk") for b, T in ((0.0, 2.0), (0.5, 0.5), (1.0, 1.0))],
    Case(impl="triton", teacher="full", beta=1.0, temperature=0.5, extreme=True),
    Case(impl="triton", teacher="topk", beta=0.0, temperature=0.5, extreme=True),
    Case(impl="triton", teacher="full", beta=0.5, dtype="bfloat16"),
    Case(impl="triton", teacher="topk", beta=1.0, dtype="bfloat16", reduction="none", mask=False),
    Case(impl="triton", teacher="student_topk", beta=1.0, temperature=2.0),
    *[Case(impl="triton", teacher=t, beta=b, temperature=2.0, fused=True, N=20)
      for t in ("full", "topk") for b in (0.0, 0.5, 1.0)],
    Case(impl="triton", teacher="topk", beta=0.5, fused=True, dtype="bfloat16", N=20),
    # the case that failed on the H200 (fp32 gradient 2.1e-5, here 4.1e-5, before lse_s came
    # from the buckets; see autograd.py); 13 s in the interpreter
    Case(impl="triton", teacher="topk", beta=1.0, fused=True, N=130, V=1000, H=200, k=64),
]

# On a GPU (test_kernels_cuda.py): the same cases, then shapes that cross the real launch
# configs' blocks (triton_ops._config: BLOCK_V 4096 unfused; FUSED_CONFIG's 64 x 128 x 64
# fused), none a multiple of its block. The fused backward's gradient chunks (2^26 elements)
# hold all of V at these sizes; the interpreter's cases cross several chunks.
CUDA_CASES = TRITON_CASES + [case for case in (
    *[Case(impl="triton", teacher=t, beta=b, dtype=d, N=33, V=10007, k=64)
      for t in ("full", "topk") for b in (0.0, 0.5, 1.0) for d in ("float32", "bfloat16")],
    *[Case(impl="triton", teacher=t, beta=b, dtype=d, fused=True, N=130, V=1000, H=200, k=64)
      for t in ("full", "topk") for b in (0.0, 0.5, 1.0) for d in ("float32", "bfloat16")],
) if case not in TRITON_CASES]



# ---- edge cases: each returns {"case", "ok", ...}; torch tests call them, Triton runs them
# in kernels_triton_cases.py. Values are checked exactly or against numbers written out here.

def _zero_rows_teacher(kind: str, n: int, v: int):
    if kind == "full":
        return torch.randn(n, v)
    ids = torch.stack([torch.randperm(v)[:3] for _ in range(n)]) if n else torch.zeros(0, 3, dtype=torch.long)
    lp = torch.log(torch.tensor([0.5, 0.2, 0.1])).expand(n, 3)
    return TopKTeacher(ids, lp, torch.full((n,), math.log(0.2)))


def mean_of_no_rows(impl: str) -> dict:
    """The "mean" over zero rows (no rows at all, or every row masked) is 0 with a zero gradient.

    Without a mask it used to be 0 / 0 = NaN (and the chunked fused path divided by zero rows
    per block); with an all-False mask it was already 0.
    """
    torch.manual_seed(0)
    v, h = 16, 4
    out, ok = {}, True
    for kind in ("full", "topk"):
        for beta in (0.0, 0.5, 1.0):
            for n, mask in ((0, None), (3, torch.zeros(3, dtype=torch.bool))):
                teacher = _zero_rows_teacher(kind, n, v)
                x = torch.randn(n, v).requires_grad_()
                loss = distill_loss(x, teacher, beta=beta, mask=mask, impl=impl)
                loss.backward()
                hid, w = torch.randn(n, h).requires_grad_(), torch.randn(v, h).requires_grad_()
                fused = fused_linear_distill_loss(hid, w, teacher, beta=beta, mask=mask, impl=impl)
                fused.backward()
                name = f"{kind}-beta={beta}-n={n}-mask={mask is not None}"
                out[name] = [loss.item(), fused.item()]
                ok = ok and out[name] == [0.0, 0.0] and \
                    all(bool((g == 0).all()) for g in (x.grad, hid.grad, w.grad)) and \
                    x.grad.shape == (n, v) and w.grad.shape == (v, h)
    return {"case": f"mean_of_no_rows-{impl}", "ok": ok, "losses": out}


def masked_rows_with_infinite_divergence(impl: str) -> dict:
    """A masked row whose divergence is +inf gives no loss and exactly 0 gradient, not NaN.

    Rows 1 and 3 are masked and infinite: beta=0 has the student -inf where the teacher has
    mass, beta=1 the teacher -inf (a banned token; for top-k, a -inf log-prob at one of its
    ids) where the student has mass. The reference zeroed such rows after the divergence,
    so 0 * inf = NaN reached their gradient. Expected: the loss and gradients of a run on
    the unmasked rows alone (same sum, so the same values), and 0 on the masked rows.
    """
    g = torch.Generator().manual_seed(3)
    n, v = 4, 40
    mask = torch.tensor([True, False, True, False])
    out, ok = {}, True
    for kind in ("full", "topk"):
        for beta in (0.0, 1.0):
            s, t = torch.randn(n, v, generator=g) * 2, torch.randn(n, v, generator=g) * 2
            top = t.topk(3, dim=-1).indices
            lp = torch.log_softmax(t, -1).gather(1, top)
            tail = torch.log(-torch.expm1(lp.logsumexp(-1)))
            for r in (1, 3):
                if beta == 0.0:
                    s[r, top[r]] = float("-inf")
                elif kind == "full":
                    t[r, :5] = float("-inf")
                else:
                    lp[r, 2] = float("-inf")
            teacher = t if kind == "full" else TopKTeacher(top, lp, tail)
            sub = t[mask] if kind == "full" else TopKTeacher(top[mask], lp[mask], tail[mask])
            x = s.clone().requires_grad_()
            loss = distill_loss(x, teacher, beta=beta, mask=mask, reduction="sum", impl=impl)
            loss.backward()
            x_sub = s[mask].clone().requires_grad_()
            want = distill_loss(x_sub, sub, beta=beta, reduction="sum", impl=impl)
            want.backward()
            unmasked = distill_loss(s, teacher, beta=beta, reduction="none", impl=impl)
            out[f"{kind}-beta={beta}"] = [loss.item(), want.item(), unmasked.tolist()]
            ok = ok and bool(torch.isinf(unmasked[~mask]).all()) and bool(torch.isfinite(want)) and \
                abs(loss.item() - want.item()) <= 1e-5 * abs(want.item()) and \
                bool((x.grad[~mask] == 0).all()) and \
                torch.allclose(x.grad[mask], x_sub.grad, rtol=1e-5, atol=1e-7)
    return {"case": f"masked_rows_with_infinite_divergence-{impl}", "ok": ok, "losses": out}


def topk_covering_the_student(impl: str) -> dict:
    """A top-k teacher whose ids are every column the student can produce is the full teacher.

    Three columns per row are banned (-inf logits on both sides, as under a constrained
    decoder); the teacher's k ids are all the others. Both tails are empty (the teacher's
    -inf, the student's a log-sum-exp over -inf logits only), so values and gradients must
    equal those of the full teacher (reference, fp64). The reference's log-sum-exp over only
    -inf logits used to send NaN into their gradient (exp(-inf - (-inf))).
    """
    g = torch.Generator().manual_seed(5)
    n, v, vocab = 3, 40, 37                    # 3 padding columns
    s = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    t = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    order = torch.stack([torch.randperm(vocab, generator=g) for _ in range(n)])
    banned, ids = order[:, :3], order[:, 3:]
    s.scatter_(1, banned, float("-inf"))
    t.scatter_(1, banned, float("-inf"))
    lp = torch.log_softmax(t[:, :vocab], -1).gather(1, ids)
    teacher = TopKTeacher(ids, lp.float(), torch.full((n,), float("-inf")))
    out, ok = {}, True
    for beta in (0.0, 0.5, 1.0):
        runs = []
        for name, dtype, tch in ((impl, torch.float32, teacher), ("reference", torch.float64, teacher),
                                 ("reference", torch.float64, t.float().double())):
            x = s.to(dtype).clone().requires_grad_()
            rows = distill_loss(x, tch, beta=beta, reduction="none", vocab_size=vocab, impl=name)
            rows.sum().backward()
            runs.append((rows.detach().double(), x.grad.double()))
        (rows, grad), (ref_rows, ref_grad), (want, want_grad) = runs
        out[f"beta={beta}"] = {"rows": rows.tolist(), "want": want.tolist()}
        ok = ok and all(bool(torch.isfinite(a).all()) for a in (rows, grad, ref_rows, ref_grad)) and \
            _rel_err(rows, want) <= RTOL_FP32 and _rel_err(grad, want_grad) <= RTOL_FP32 and \
            _rel_err(ref_rows, want) <= 1e-6 and _rel_err(ref_grad, want_grad) <= 1e-6
    return {"case": f"topk_covering_the_student-{impl}", "ok": ok, "values": out}


def _bucket_loss(log_s: torch.Tensor, log_t: torch.Tensor, beta: float) -> torch.Tensor:
    """The divergence over buckets [R, B], written in probabilities (M = beta T + (1-beta) S)."""
    S, T = log_s.exp(), log_t.exp()
    if beta == 0.0:
        return torch.where(T > 0, T * (log_t - log_s), 0.0).sum(-1)
    if beta == 1.0:
        return torch.where(S > 0, S * (log_s - log_t), 0.0).sum(-1)
    log_m = (beta * T + (1 - beta) * S).log()
    return (torch.where(T > 0, beta * T * (log_t - log_m), 0.0)
            + torch.where(S > 0, (1 - beta) * S * (log_s - log_m), 0.0)).sum(-1)


def neg_inf_teacher_tail(impl: str) -> dict:
    """A top-k teacher's tail of -inf: reverse KL reads it as 2**-24, finite loss and gradient.

    Row 0 is vLLM's peaked teacher: top log-prob 0, the top k sum to 1 in fp32, tail -inf,
    while the student has tail mass. Reverse KL used to be +inf with a NaN gradient (inf - inf);
    now the tail reads as loss.TAIL_LOGMASS_FLOOR = log 2**-24. Row 1 has a finite tail of -40
    nats, below that value: it must stay -40. Row 2 is ordinary. Row 3 has tail -inf and a
    student with no tail either (-inf logits outside the ids): nothing changes there. Forward
    KL and JSD (finite with a zero teacher tail) are unchanged. Per-row values are checked
    against the formula over buckets in fp64; values and gradients against the reference.
    """
    g = torch.Generator().manual_seed(4)
    n, v, floor = 4, 40, math.log(2.0 ** -24)
    s = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    ids = torch.stack([torch.randperm(v, generator=g)[:4] for _ in range(n)])
    lp = torch.tensor([[0.0, -20.0, -21.0, -22.0]] * 2 + [[-0.7, -1.6, -2.3, -2.3]] * 2)
    tail = torch.tensor([float("-inf"), -40.0, math.log(0.1), float("-inf")])
    s[3, torch.ones(v, dtype=torch.bool).scatter(0, ids[3], False)] = float("-inf")   # no student tail
    teacher = TopKTeacher(ids, lp, tail)
    log_s = torch.log_softmax(s, -1)
    rest = log_s.scatter(1, ids, float("-inf"))
    s_tail = torch.where(torch.isneginf(rest).all(-1), float("-inf"), rest.logsumexp(-1))
    log_s_b = torch.cat([log_s.gather(1, ids), s_tail[:, None]], 1)
    out, ok = {}, True
    for beta in (0.0, 0.5, 1.0):
        read_tail = torch.where(torch.isneginf(tail), floor, tail) if beta == 1.0 else tail
        want = _bucket_loss(log_s_b, torch.cat([lp, read_tail[:, None]], 1).double(), beta)
        got = {}
        for name, dtype in ((impl, torch.float32), ("reference", torch.float64)):
            x = s.to(dtype).clone().requires_grad_()
            rows = distill_loss(x, teacher, beta=beta, reduction="none", impl=name)
            rows.sum().backward()
            got[name] = rows.detach().double(), x.grad.double()
        (rows, grad), (ref_rows, ref_grad) = got[impl], got["reference"]
        out[f"beta={beta}"] = {"rows": rows.tolist(), "want": want.tolist()}
        ok = ok and bool(torch.isfinite(rows).all() and torch.isfinite(grad).all()) and \
            _rel_err(rows, want) <= RTOL_FP32 and _rel_err(ref_rows, want) <= 1e-12 and \
            _rel_err(grad, ref_grad) <= RTOL_FP32
    # The floor only ever replaces +inf: row 0 reads S_tail (log S_tail - log 2**-24) > 0.
    ok = ok and out["beta=1.0"]["want"][0] > 0
    return {"case": f"neg_inf_teacher_tail-{impl}", "ok": ok, "values": out}


EDGE_CHECKS = [mean_of_no_rows, masked_rows_with_infinite_divergence, topk_covering_the_student,
               neg_inf_teacher_tail]
