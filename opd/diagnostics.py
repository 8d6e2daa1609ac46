"""Diagnostics that tell a failing distillation run apart, per domain.

    kl                  mean per-token divergence to the teacher (the loss's divergence,
                        before weights and T^2), over response rows
    topk_overlap        per row, |student top-k ∩ teacher top-k| / k, averaged over rows:
                        the share of the teacher's k most likely tokens that are also among
                        the student's k most likely (1 = same support, 0 = disjoint)
    teacher_tail_mass   per row, 1 - the teacher's top-k mass (what top-k cut off), mean
    response_len        mean response length in tokens (before trimming)
    length_limit_share  share of responses that stopped at max_new_tokens
    eos_rate            share of responses that ended with a stop token
    empty_share         share of responses with no token besides a stop token
    repeat_ngram        per response, 1 - distinct n-grams / n-grams (0 when shorter than n),
                        mean: looping, degenerate text shows up here first
    entropy             the student's entropy per sampled token, estimated as the mean of
                        -log pi(x) over the tokens it sampled (raw log-probs, temperature 1:
                        exact in expectation when it samples at temperature 1); nats. A
                        collapse shows as this falling towards 0
    kl@A-B              kl over the rows at response positions A..B (0-based, sampled tokens
                        counted): whether the teacher's signal decays along the response
    teacher_entropy     per row, the teacher's entropy over the tokens it answered with (its
                        top k, or the student's) and one bucket for the rest: a lower bound of
                        its full entropy (merging tokens never raises entropy), nats. A teacher
                        sure of everything (near 0) teaches what its samples would
"""

from __future__ import annotations

from collections import defaultdict

import torch


# Upper ends (exclusive) of the response-position buckets of `kl@A-B`; the last bucket is open.
POSITION_EDGES = (16, 64, 256, 1024)


def position_buckets(pos_N: torch.Tensor) -> dict[str, torch.Tensor]:
    """{label: bool mask [N]} of the non-empty buckets of 0-based response positions [N]:
    labels "0-15", "16-63", "64-255", "256-1023", "1024+"."""
    out, lo = {}, 0
    for hi in (*POSITION_EDGES, None):
        m = pos_N >= lo if hi is None else (pos_N >= lo) & (pos_N < hi)
        if bool(m.any()):
            out[f"{lo}+" if hi is None else f"{lo}-{hi - 1}"] = m
        lo = hi
    return out


def bucket_entropy(logprobs_N_k: torch.Tensor, tail_logmass_N: torch.Tensor) -> torch.Tensor:
    """fp32 [N]: -sum_j p_j log p_j over the k answered tokens and the tail bucket (exp(tail))."""
    lp = torch.cat([logprobs_N_k.float(), tail_logmass_N.float()[:, None]], dim=1)
    return -torch.where(torch.isfinite(lp), lp.exp() * lp, torch.zeros_like(lp)).sum(dim=1)


def repeated_ngram_ratio(ids: list[int], n: int) -> float:
    """1 - (distinct n-grams / n-grams) of one sequence; 0.0 when it has fewer than n tokens."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def topk_overlap(student_logits_N_V: torch.Tensor, teacher_ids_N_k: torch.Tensor) -> torch.Tensor:
    """fp32 [N]: share of the teacher's top-k ids that are among the student's top-k (same k)."""
    k = teacher_ids_N_k.shape[1]
    if student_logits_N_V.shape[0] == 0:
        return torch.zeros(0)
    student_ids = student_logits_N_V.float().topk(min(k, student_logits_N_V.shape[1]), dim=-1).indices
    teacher = teacher_ids_N_k.long().to(student_ids.device)
    hits = (teacher[:, :, None] == student_ids[:, None, :]).any(-1).float().sum(-1)
    return (hits / k).cpu()


def response_stats(responses: list[list[int]], finish_reasons: list[str], stop_ids: set[int],
                   ngram: int) -> dict[str, float]:
    """Length, length-limit share, EOS rate, empty share and repeated n-gram ratio of responses."""
    n = len(responses)
    if n == 0:
        return {}
    content = [[t for t in r if t not in stop_ids] for r in responses]
    return {
        "response_len": sum(len(r) for r in responses) / n,
        "length_limit_share": sum(f == "length" for f in finish_reasons) / n,
        "eos_rate": sum(f == "eos" for f in finish_reasons) / n,
        "empty_share": sum(len(c) == 0 for c in content) / n,
        "repeat_ngram": sum(repeated_ngram_ratio(c, ngram) for c in content) / n,
    }


class DomainTally:
    """Per-domain sums of row and response statistics, turned into `diag/<domain>/<name>` metrics."""

    def __init__(self):
        self.rows: dict[str, dict[str, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        self.responses: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
        self.loss: dict[str, float] = defaultdict(float)
        self.samples: dict[str, int] = defaultdict(int)

    def add_rows(self, domain: str, name: str, values: torch.Tensor) -> None:
        self.rows[domain][name].append(values.detach().float().cpu().reshape(-1))

    def add_rows_by_position(self, domain: str, name: str, values: torch.Tensor, pos_N: torch.Tensor) -> None:
        """`values` [N] of rows at 0-based response positions `pos_N` [N], under `name@A-B` per bucket."""
        values = values.detach().float().cpu().reshape(-1)
        for label, m in position_buckets(pos_N.cpu().reshape(-1)).items():
            self.add_rows(domain, f"{name}@{label}", values[m])

    def add_response(self, domain: str, response: list[int], finish_reason: str) -> None:
        self.responses[domain][0].append(response)
        self.responses[domain][1].append(finish_reason)
        self.samples[domain] += 1

    def add_loss(self, domain: str, value: float) -> None:
        self.loss[domain] += value

    def plain(self) -> dict:
        """Everything tallied, in plain containers (what ranks send each other)."""
        return {"rows": {d: dict(names) for d, names in self.rows.items()},
                "responses": {d: (list(r), list(f)) for d, (r, f) in self.responses.items()},
                "loss": dict(self.loss), "samples": dict(self.samples)}

    @classmethod
    def merged(cls, parts: list[dict]) -> "DomainTally":
        """One tally of several `plain()` ones (every rank's share of a step)."""
        out = cls()
        for part in parts:
            for d, names in part["rows"].items():
                for name, values in names.items():
                    out.rows[d][name].extend(values)
            for d, (responses, reasons) in part["responses"].items():
                out.responses[d][0].extend(responses)
                out.responses[d][1].extend(reasons)
            for d, v in part["loss"].items():
                out.loss[d] += v
            for d, n in part["samples"].items():
                out.samples[d] += n
        return out

    def row_mean(self, name: str, domain: str | None = None) -> float | None:
        parts = [t for d, names in self.rows.items() if domain in (None, d) for t in names.get(name, [])]
        if not parts:
            return None
        cat = torch.cat(parts)
        return float(cat.mean()) if cat.numel() else None

    def metrics(self, stop_ids: set[int], ngram: int, prefix: str = "diag") -> dict[str, float]:
        out: dict[str, float] = {}
        total_loss = sum(abs(v) for v in self.loss.values())
        total_samples = sum(self.samples.values())
        for d in sorted(set(self.rows) | set(self.responses)):
            for name in self.rows.get(d, {}):
                v = self.row_mean(name, d)
                if v is not None:
                    out[f"{prefix}/{d}/{name}"] = v
            if d in self.responses:
                for name, v in response_stats(*self.responses[d], stop_ids, ngram).items():
                    out[f"{prefix}/{d}/{name}"] = v
            if total_samples:
                out[f"{prefix}/{d}/sample_share"] = self.samples.get(d, 0) / total_samples
            if total_loss > 0:
                out[f"{prefix}/{d}/loss_share"] = abs(self.loss.get(d, 0.0)) / total_loss
        return out

