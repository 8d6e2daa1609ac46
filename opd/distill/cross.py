"""The loss of a cross-tokenizer teacher (`tokenizer: cross`) on the student's rows.

    L_row = T^2 * ( w_exact * exact_row + w_uld * uld_row )   on a span's first row
          + w_span * d_span * log S(x_row)                     on every row of the span

exact and uld compare the next-token distributions where both sides read the same text
(opd.kernels.cross: the mapped ids exactly, the rest by sorted probabilities); d_span =
log S(span) - log T(span) (detached) is the sampled-token reverse-KL advantage of the span the
row belongs to, so a span's rows together receive d_span * grad log S(span): the
policy-gradient form of the text-level reverse KL, which is the sampled-token mode's per-token
term when both tokenizers cut the text alike. The divergence rows (metrics, held-out
`eval/kl`) are exact + uld on first rows plus d_span spread evenly over the span's rows, each
part where its weight is not 0 (exact and uld are 0 already where their weight is).
"""

from __future__ import annotations

import torch

from opd.kernels.cross import shared_divergence, sorted_l1, span_logratio
from opd.spine.rows import token_logprobs

PARTS = ("exact", "uld", "span")


def cross_loss(spec, logits: torch.Tensor, answer, idx: torch.Tensor, targets: torch.Tensor,
               impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(loss rows with grad [n], divergence rows [n]) of teacher `spec` (its `cross` weights, beta,
    temperature) on student logits [n, V] at answer rows `idx` [n] (whole responses) with the
    sampled tokens `targets` [n]. Adds each part's weighted |value| and rows to answer.parts."""
    w = spec.cross
    device = logits.device
    idx = idx.to(answer.start_row.device)
    n = len(idx)
    t2 = spec.temperature ** 2 if spec.scale_by_t2 else 1.0
    start = answer.start_row[idx]                                   # [n] teacher row, -1 inside a span
    first = (start >= 0).nonzero().squeeze(1)                       # local rows that start a span
    exact_n = logits.new_zeros(n, dtype=torch.float32)
    uld_n = logits.new_zeros(n, dtype=torch.float32)
    if len(first):
        t_rows = start[first]
        rows = logits[first.to(device)]
        ids = answer.mapped[t_rows].to(device)
        lp, tail = answer.teacher.logprobs[t_rows].to(device), answer.teacher.tail_logmass[t_rows].to(device)
        if w.exact:
            exact_n = exact_n.index_put((first.to(device),), shared_divergence(rows, ids, lp, tail, spec.beta,
                                                                               spec.temperature))
        if w.uld:
            unshared = answer.unshared(logits.shape[1]).to(device)
            uld_n = uld_n.index_put((first.to(device),), sorted_l1(rows, unshared, lp, ids < 0, spec.temperature))
    lp_n = token_logprobs(logits, targets.to(device), temperature=spec.temperature, impl=impl)
    span = answer.span_of[idx]
    scored = span >= 0
    local, inverse = torch.unique(span[scored], return_inverse=True)   # this call's spans, 0..S'-1
    d_s = span_logratio(lp_n.detach()[scored.to(device)], inverse.to(device),
                        answer.span_teacher_lp[local].to(device))   # [S']
    counts = torch.zeros_like(d_s).index_add(0, inverse.to(device), torch.ones_like(inverse, dtype=d_s.dtype,
                                                                                     device=device))
    adv_n = logits.new_zeros(n, dtype=torch.float32)
    spread_n = logits.new_zeros(n, dtype=torch.float32)
    adv_n[scored.to(device)] = d_s[inverse.to(device)]
    spread_n[scored.to(device)] = (d_s / counts)[inverse.to(device)]
    loss = t2 * (w.exact * exact_n + w.uld * uld_n) + w.span * adv_n * lp_n
    for part, rows, weight in (("exact", exact_n, w.exact * t2), ("uld", uld_n, w.uld * t2),
                               ("span", spread_n, w.span)):
        acc = answer.parts.setdefault(part, [0.0, 0])
        acc[0] += float(rows.detach().abs().sum()) * weight
        acc[1] += n
    return loss, (exact_n + uld_n + (spread_n if w.span else 0.0)).detach()


def part_shares(parts: dict[str, list[float]]) -> dict[str, float]:
    """{part: its share of the weighted |value| summed over the parts}, from [sum, rows] per part."""
    total = sum(v[0] for v in parts.values())
    return {p: (parts[p][0] / total if total else 0.0) for p in PARTS if p in parts}
