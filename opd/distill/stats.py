"""What a distillation step measured, and what the run has measured so far.

`StepStats` is filled while a step runs (its batches, then each teacher's rows of each
micro-batch) and turned into the step's metrics line by `row()`. `History` is the run's
record for the card (teacher shares, tail mass, staleness, trimming, evaluations, warnings),
kept in every checkpoint so that a resumed run's card covers the whole run.

Metrics of one step (metrics.jsonl; `diag/<domain>/...` from opd.diagnostics):
    loss, lr, grad_norm, tokens, tokens_per_s, step_s, rollout_s, teacher_wait_s,
    teacher_latency_s, staleness, kl, kl/<domain>, teacher_tail_mass, sft_loss,
    response_len, trimmed_share, routed/<teacher>
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from opd.diagnostics import DomainTally
from opd.routing.normalize import lopsided


def _add_tail(into: dict[str, list[float]], teacher: str, total: float, rows: int) -> None:
    """Add `rows` rows of tail mass summing to `total` to `into[teacher]` = [sum, rows]."""
    acc = into.setdefault(teacher, [0.0, 0])
    acc[0] += total
    acc[1] += rows


@dataclass
class StepStats:
    tally: DomainTally = field(default_factory=DomainTally)
    loss: float = 0.0
    tokens: int = 0                 # response tokens trained on (after trimming)
    response_tokens: int = 0        # response tokens sampled
    responses: int = 0
    rollout_s: float = 0.0          # sampling (and sending) the step's batches
    wait_s: float = 0.0             # blocked on teacher answers
    latencies: list[float] = field(default_factory=list)     # per answer: request to last row, s
    staleness: list[int] = field(default_factory=list)       # per batch: optimizer steps behind
    domain_loss: dict[str, float] = field(default_factory=dict)  # per domain, before its multiplier
    sft_losses: list[float] = field(default_factory=list)
    routed: dict[str, float] = field(default_factory=dict)   # teacher -> weight of the samples sent to it
    tail: dict[str, list[float]] = field(default_factory=dict)   # teacher -> [sum of tail mass, rows]

    def add_batch(self, batch, version: int) -> None:
        """A batch about to be trained on, sampled by weights of `batch.policy_version`."""
        self.staleness.append(version - batch.policy_version)
        for seq, ro in enumerate(batch.rollouts):
            route = batch.route_of(seq)
            self.tally.add_response(route.domain, ro.response_ids, ro.finish_reason)
            for t, w in route.weights.items():
                self.routed[t] = self.routed.get(t, 0.0) + w
        self.tokens += sum(batch.keep)
        self.response_tokens += sum(len(ro.response_ids) for ro in batch.rollouts)
        self.responses += len(batch.rollouts)

    def add_teacher_rows(self, teacher: str, row_domain: list[str], weighted: torch.Tensor, kl: torch.Tensor,
                         overlap: torch.Tensor, tail: torch.Tensor | None, lam: dict[str, float]) -> None:
        """One teacher's rows of a micro-batch: their domains, weighted loss (what the gradient
        saw), divergence, top-k overlap and (top-k answers) the teacher's tail mass; `lam` the
        domains' multipliers, divided out of the per-domain loss the normalizer follows."""
        contrib, kl = weighted.detach().cpu(), kl.detach().cpu()
        if tail is not None:
            _add_tail(self.tail, teacher, float(tail.sum()), len(tail))
        for d in sorted(set(row_domain)):
            m = torch.tensor([x == d for x in row_domain])
            self.tally.add_rows(d, "kl", kl[m])
            self.tally.add_rows(d, "topk_overlap", overlap[m])
            if tail is not None:
                self.tally.add_rows(d, "teacher_tail_mass", tail[m])
            part = float(contrib[m].sum())
            self.domain_loss[d] = self.domain_loss.get(d, 0.0) + part / max(lam[d], 1e-12)
            self.tally.add_loss(d, part)

    def merged(self, world) -> "StepStats":
        """The step's statistics over every rank of `world` (each rank measured its share; the
        same merged statistics on every rank, so every rank updates the same multipliers)."""
        if not world.sharded:
            return self
        parts = world.gather({**{k: v for k, v in vars(self).items() if k != "tally"}, "tally": self.tally.plain()})
        out = StepStats(tally=DomainTally.merged([p["tally"] for p in parts]))
        for p in parts:
            out.loss += p["loss"]
            out.tokens += p["tokens"]
            out.response_tokens += p["response_tokens"]
            out.responses += p["responses"]
            out.latencies += p["latencies"]
            out.sft_losses = p["sft_losses"]   # already the whole step's (opd.distill.loss.sft_mix)
            for key in ("domain_loss", "routed"):
                for k, v in p[key].items():
                    getattr(out, key)[k] = getattr(out, key).get(k, 0.0) + v
            for t, (total, rows) in p["tail"].items():
                _add_tail(out.tail, t, total, rows)
        out.rollout_s = max(p["rollout_s"] for p in parts)   # the ranks wait for the slowest
        out.wait_s = max(p["wait_s"] for p in parts)
        out.staleness = parts[0]["staleness"]   # the same batches' versions on every rank
        return out

    def row(self, *, lr: float, grad_norm: float, elapsed: float, stop_ids: set[int], ngram: int) -> dict:
        """The step's metrics line."""
        row = {"loss": self.loss, "lr": lr, "grad_norm": grad_norm, "tokens": self.tokens,
               "tokens_per_s": self.tokens / max(elapsed, 1e-9), "step_s": elapsed, "rollout_s": self.rollout_s,
               "teacher_wait_s": self.wait_s,
               "teacher_latency_s": sum(self.latencies) / max(len(self.latencies), 1),
               "staleness": sum(self.staleness) / len(self.staleness)}
        for name in ("kl", "teacher_tail_mass"):
            value = self.tally.row_mean(name)
            if value is not None:
                row[name] = value
        if self.sft_losses:
            row["sft_loss"] = sum(self.sft_losses) / len(self.sft_losses)
        diag = self.tally.metrics(stop_ids, ngram)
        row.update(diag)
        for d in sorted({k.split("/")[1] for k in diag}):
            if f"diag/{d}/kl" in diag:
                row[f"kl/{d}"] = diag[f"diag/{d}/kl"]
        row["response_len"] = self.response_tokens / max(self.responses, 1)
        if self.response_tokens:   # dense supervision on the tail after an answer is noise: cut
            row["trimmed_share"] = 1.0 - self.tokens / self.response_tokens
        row.update({f"routed/{t}": n for t, n in self.routed.items()})
        return row

    @staticmethod
    def loss_shares(row: dict) -> dict[str, float]:
        """{domain: its share of the step's loss} from a metrics line."""
        return {k.split("/")[1]: v for k, v in row.items() if k.startswith("diag/") and k.endswith("/loss_share")}


@dataclass
class History:
    teacher_samples: dict[str, float]           # teacher -> weight of the samples it scored
    tail_mass: dict[str, list[float]]           # teacher -> [sum of its tail mass, rows]
    staleness: list[int] = field(default_factory=list)
    trimmed: list[int] = field(default_factory=lambda: [0, 0])   # [response tokens trimmed, sampled]
    evals: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    quiet: bool = False                         # a rank other than 0: keeps the warnings, prints none

    @classmethod
    def start(cls, teachers: list[str], quiet: bool = False) -> "History":
        return cls({t: 0.0 for t in teachers}, {t: [0.0, 0] for t in teachers}, quiet=quiet)

    def add_step(self, stats: StepStats) -> None:
        self.staleness += stats.staleness
        self.trimmed[0] += stats.response_tokens - stats.tokens
        self.trimmed[1] += stats.response_tokens
        for t, w in stats.routed.items():
            self.teacher_samples[t] = self.teacher_samples.get(t, 0.0) + w
        for t, (total, rows) in stats.tail.items():
            _add_tail(self.tail_mass, t, total, rows)

    def warn(self, msg: str) -> None:
        if not self.quiet:
            print(f"warning: {msg}", flush=True)
        self.warnings.append(msg)

    def warn_lopsided(self, step: int, values: dict, what: str, factor: float) -> None:
        """A warning per domain whose `what` (loss share, eval accuracy) is lopsided against the
        other domains' (opd.routing.normalize.lopsided)."""
        values = {k: v for k, v in values.items() if v is not None}
        for d in lopsided(values, factor):
            self.warn(f"step {step}: domain {d!r} {what} {values[d]:.3g} is far from the other domains' "
                      f"({', '.join(f'{k}: {v:.3g}' for k, v in values.items())}); "
                      f"the student may be becoming lopsided (merge.domain_weights / merge.normalize)")

    def state(self) -> dict:
        return {"teacher_samples": self.teacher_samples, "tail_mass": self.tail_mass, "staleness": self.staleness,
                "trimmed": self.trimmed, "evals": self.evals, "warnings": self.warnings}

    def load_state(self, state: dict) -> None:
        """A checkpoint's history; this session's warnings so far (a resume's own) follow it."""
        self.teacher_samples = state["teacher_samples"]
        self.tail_mass = {k: list(v) for k, v in state["tail_mass"].items()}
        self.staleness = state["staleness"]
        self.trimmed = list(state.get("trimmed", [0, 0]))
        self.evals = state["evals"]
        self.warnings = state["warnings"] + [w for w in self.warnings if w not in state["warnings"]]
