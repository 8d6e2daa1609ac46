"""What a distillation step measured, and what the run has measured so far.

`StepStats` is filled while a step runs (its batches, then each teacher's rows of each
micro-batch) and turned into the step's metrics line by `row()`. `History` is the run's
record for the card (teacher shares, tail mass, staleness, trimming, evaluations, warnings),
kept in every checkpoint so that a resumed run's card covers the whole run.

Metrics of one step (metrics.jsonl; `diag/<domain>/...` from opd.diagnostics):
    loss, lr, grad_norm, tokens, tokens_per_s, step_s, rollout_s, teacher_wait_s,
    teacher_latency_s, staleness, kl, kl/<domain>, teacher_tail_mass, entropy, sft_loss,
    response_len, trimmed_share, routed/<teacher>
    with rewards: reward/mean, reward_loss, signal/reward, signal/teacher (mean |advantage| or
    divergence per token of each signal, so that one drowning the other shows)
    rows sampled by older weights: is/ratio_mean, is/ratio_max, is/cut_share (opd.spine.objective)
    with agent: agent/turns, agent/tool_calls, agent/tool_failure_share, agent/observation_tokens,
    agent/turn_limit_rate (opd.agent.loop.trajectory_metrics), masked_tokens (the step's tool
    observation tokens: context, neither trained nor scored); tokens counts the rows trained
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from opd.diagnostics import DomainTally
from opd.distill import agentic
from opd.routing.normalize import lopsided
from opd.spine.objective import drowned


def _add_tail(into: dict[str, list[float]], teacher: str, total: float, rows: int) -> None:
    """Add `rows` rows of tail mass summing to `total` to `into[teacher]` = [sum, rows]."""
    acc = into.setdefault(teacher, [0.0, 0])
    acc[0] += total
    acc[1] += rows


def _merge_importance(a: list[float], b: list[float]) -> list[float]:
    """Two [sum of ratios, max ratio, rows cut, rows] tallies as one."""
    return [a[0] + b[0], max(a[1], b[1]), a[2] + b[2], a[3] + b[3]]


@dataclass
class StepStats:
    tally: DomainTally = field(default_factory=DomainTally)
    loss: float = 0.0
    tokens: int = 0                 # response tokens trained on (after trimming): the rows
    response_tokens: int = 0        # response tokens sampled (by the model: no tool observation)
    masked: int = 0                 # response tokens the model did not sample (tool observations)
    agent: list[float] = field(default_factory=lambda: agentic.zeros())   # opd.agent.totals' sums
    responses: int = 0
    rollout_s: float = 0.0          # sampling (and sending) the step's batches
    wait_s: float = 0.0             # blocked on teacher answers
    latencies: list[float] = field(default_factory=list)     # per answer: request to last row, s
    staleness: list[int] = field(default_factory=list)       # per batch: optimizer steps behind
    domain_loss: dict[str, float] = field(default_factory=dict)  # per domain, before its multiplier
    sft_losses: list[float] = field(default_factory=list)
    routed: dict[str, float] = field(default_factory=dict)   # teacher -> weight of the samples sent to it
    tail: dict[str, list[float]] = field(default_factory=dict)   # teacher -> [sum of tail mass, rows]
    rewards: list[float] = field(default_factory=list)        # per response, with `rewards`
    flat_groups: list[int] = field(default_factory=lambda: [0, 0])   # [groups of equal rewards, groups]
    reward_loss: float = 0.0
    signal: dict[str, list[float]] = field(default_factory=dict)  # "reward"/"teacher" -> [sum |signal|, rows]
    importance: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])  # [sum, max, cut, rows]

    def add_importance(self, w) -> None:
        """A micro-batch's importance ratios (opd.spine.objective.Importance)."""
        if len(w.ratio_N):
            self.importance = _merge_importance(self.importance, [float(w.ratio_N.sum()), float(w.ratio_N.max()),
                                                                  float(w.cut_N.sum()), len(w.ratio_N)])

    def add_signal(self, kind: str, total: float, rows: int) -> None:
        _add_tail(self.signal, kind, total, rows)

    def add_batch(self, batch, version: int) -> None:
        """A batch about to be trained on, sampled by weights of `batch.policy_version`."""
        self.staleness.append(version - batch.policy_version)
        for seq, ro in enumerate(batch.rollouts):
            route = batch.route_of(seq)
            self.tally.add_response(route.domain, ro.response_ids, ro.finish_reason)
            if ro.logprobs and len(ro.logprobs) == len(ro.response_ids):   # opd.diagnostics' entropy
                lp = torch.tensor(ro.logprobs)[torch.tensor(ro.sampled(), dtype=torch.bool)]
                self.tally.add_rows(route.domain, "entropy", -lp)
            for t, w in route.weights.items():
                self.routed[t] = self.routed.get(t, 0.0) + w
        self.tokens += sum(batch.rows(s) for s in range(len(batch.rollouts)))
        sampled = sum(sum(ro.sampled()) for ro in batch.rollouts)
        self.response_tokens += sampled
        self.masked += sum(len(ro.response_ids) for ro in batch.rollouts) - sampled
        self.responses += len(batch.rollouts)
        self.agent = agentic.add(self.agent, agentic.sums(batch.rollouts))

    def add_teacher_rows(self, teacher: str, row_domain: list[str], weighted: torch.Tensor, kl: torch.Tensor,
                         overlap: torch.Tensor | None, tail: torch.Tensor | None, lam: dict[str, float],
                         pos_N: torch.Tensor | None = None, entropy: torch.Tensor | None = None) -> None:
        """One teacher's rows of a micro-batch: their domains, weighted loss (what the gradient
        saw), divergence, top-k overlap and (top-k answers) the teacher's tail mass; `lam` the
        domains' multipliers, divided out of the per-domain loss the normalizer follows; `pos_N`
        each row's position in its response (the divergence per position bucket); `entropy` the
        teacher's bucket entropy per row (opd.diagnostics.bucket_entropy)."""
        contrib, kl = weighted.detach().cpu(), kl.detach().cpu()
        if tail is not None:
            _add_tail(self.tail, teacher, float(tail.sum()), len(tail))
        for d in sorted(set(row_domain)):
            m = torch.tensor([x == d for x in row_domain])
            self.tally.add_rows(d, "kl", kl[m])
            if pos_N is not None:
                self.tally.add_rows_by_position(d, "kl", kl[m], pos_N.cpu()[m])
            if overlap is not None:
                self.tally.add_rows(d, "topk_overlap", overlap[m])
            if tail is not None:
                self.tally.add_rows(d, "teacher_tail_mass", tail[m])
            if entropy is not None:
                self.tally.add_rows(d, "teacher_entropy", entropy.cpu()[m])
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
            out.masked += p["masked"]
            out.agent = agentic.add(out.agent, p["agent"])
            out.responses += p["responses"]
            out.latencies += p["latencies"]
            out.sft_losses = p["sft_losses"]   # already the whole step's (opd.distill.loss.sft_mix)
            for key in ("domain_loss", "routed"):
                for k, v in p[key].items():
                    getattr(out, key)[k] = getattr(out, key).get(k, 0.0) + v
            for t, (total, rows) in p["tail"].items():
                _add_tail(out.tail, t, total, rows)
            for k, (total, rows) in p["signal"].items():
                _add_tail(out.signal, k, total, rows)
            out.rewards += p["rewards"]
            out.flat_groups = [out.flat_groups[0] + p["flat_groups"][0], out.flat_groups[1] + p["flat_groups"][1]]
            out.reward_loss += p["reward_loss"]
            out.importance = _merge_importance(out.importance, p["importance"])
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
        for name in ("kl", "teacher_tail_mass", "entropy"):
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
        if self.agent[0]:   # multi-turn trajectories (opd.distill.agentic)
            row.update(agentic.metrics(self.agent))
            row["masked_tokens"] = self.masked
        if self.rewards:
            row["reward/mean"] = sum(self.rewards) / len(self.rewards)
            row["reward_loss"] = self.reward_loss
            row["groups/all_equal"] = self.flat_groups[0] / max(self.flat_groups[1], 1)
        for kind, (total, rows) in self.signal.items():
            row[f"signal/{kind}"] = total / max(rows, 1)
        if self.importance[3]:
            row["is/ratio_mean"] = self.importance[0] / self.importance[3]
            row["is/ratio_max"] = self.importance[1]
            row["is/cut_share"] = self.importance[2] / self.importance[3]
        return row

    def drowned(self, factor: float) -> str | None:
        """A sentence when one signal's mean per token is `factor` times the other's, else None."""
        if "reward" not in self.signal or "teacher" not in self.signal:
            return None
        (r, nr), (t, nt) = self.signal["reward"], self.signal["teacher"]
        return drowned(r / max(nr, 1), t / max(nt, 1), factor)

    @staticmethod
    def loss_shares(row: dict) -> dict[str, float]:
        """{domain: its share of the step's loss} from a metrics line."""
        return {k.split("/")[1]: v for k, v in row.items() if k.startswith("diag/") and k.endswith("/loss_share")}


@dataclass
class History:
    teacher_samples: dict[str, float]           # teacher -> weight of the samples it scored
    tail_mass: dict[str, list[float]]           # teacher -> [sum of its tail mass, rows]
    staleness: list[int] = field(default_factory=list)
    importance: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])  # [sum, max, cut, rows]
    trimmed: list[int] = field(default_factory=lambda: [0, 0])   # [response tokens trimmed, sampled]
    agent: list[float] = field(default_factory=lambda: agentic.zeros())   # opd.agent.totals' sums, the run's
    cross: dict[str, list[float]] = field(default_factory=dict)   # "cross/<teacher>/<part>" -> [sum, rows]
    evals: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    quiet: bool = False                         # a rank other than 0: keeps the warnings, prints none

    @classmethod
    def start(cls, teachers: list[str], quiet: bool = False) -> "History":
        return cls({t: 0.0 for t in teachers}, {t: [0.0, 0] for t in teachers}, quiet=quiet)

    def add_step(self, stats: StepStats) -> None:
        self.staleness += stats.staleness
        self.importance = _merge_importance(self.importance, stats.importance)
        self.trimmed[0] += stats.response_tokens - stats.tokens
        self.trimmed[1] += stats.response_tokens
        self.agent = agentic.add(self.agent, stats.agent)
        for t, w in stats.routed.items():
            self.teacher_samples[t] = self.teacher_samples.get(t, 0.0) + w
        for t, (total, rows) in stats.tail.items():
            _add_tail(self.tail_mass, t, total, rows)
        for k, (total, rows) in stats.signal.items():   # a cross-tokenizer teacher's parts (opd.distill.cross)
            if k.startswith("cross/"):
                _add_tail(self.cross, k, total, rows)

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

    def warn_kl_without_accuracy(self, step: int, row: dict) -> None:
        """A warning when held-out KL fell since the previous evaluation while held-out accuracy
        fell by more than its standard error: the student matches the teacher where it does
        not matter (the tail after an answer, easy tokens) or the teacher is wrong there."""
        before = next((e for e in reversed(self.evals) if "eval/kl" in e and "eval/accuracy" in e), None)
        if before is None or "eval/kl" not in row or "eval/accuracy" not in row:
            return
        (k0, a0, n0), (k1, a1, n1) = ((e["eval/kl"], e["eval/accuracy"], e.get("eval/scored", 0))
                                      for e in (before, row))
        se = (a0 * (1 - a0) / max(n0, 1) + a1 * (1 - a1) / max(n1, 1)) ** 0.5
        if k1 < k0 and a0 - a1 > se:
            self.warn(f"step {step}: held-out KL fell ({k0:.3g} -> {k1:.3g}) while held-out accuracy fell "
                      f"({a0:.3g} -> {a1:.3g}, more than its standard error {se:.2g}) since step {before['step']}: "
                      f"the student is matching the teacher where it does not decide the answer (check trimming, "
                      f"the teacher's own accuracy, and diag/<domain>/kl@A-B along the response)")

    def state(self) -> dict:
        return {"teacher_samples": self.teacher_samples, "tail_mass": self.tail_mass, "staleness": self.staleness,
                "importance": self.importance, "trimmed": self.trimmed, "agent": self.agent, "cross": self.cross, "evals": self.evals,
                "warnings": self.warnings}

    def load_state(self, state: dict) -> None:
        """A checkpoint's history; this session's warnings so far (a resume's own) follow it."""
        self.teacher_samples = state["teacher_samples"]
        self.tail_mass = {k: list(v) for k, v in state["tail_mass"].items()}
        self.staleness = state["staleness"]
        self.importance = list(state.get("importance", [0.0, 0.0, 0.0, 0.0]))
        self.trimmed = list(state.get("trimmed", [0, 0]))
        self.agent = list(state.get("agent", agentic.zeros()))
        self.cross = {k: list(v) for k, v in state.get("cross", {}).items()}
        self.evals = state["evals"]
        self.warnings = state["warnings"] + [w for w in self.warnings if w not in state["warnings"]]
