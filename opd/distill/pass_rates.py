"""Teacher weights from the verifier, during the run (`merge.routing.refresh_every`).

The seeds weigh the teachers of a domain by how far the verifier trusts them. With
`routing.weighting: pass_rate` and `refresh_every: N`, before the first step and every N steps
after, each teacher covering a domain that two or more teachers cover answers the next
`refresh_prompts` held-out prompts of that domain (SAMPLE, docs/protocol.md: its own responses, at
the run's rollout temperature, top-p and length; a context teacher reads its context), the
domain's verifier scores them, and the router's pass rate of (domain, teacher) becomes its share
of correct answers over every measurement so far. Every prompt's route then follows the new
weights (among the teachers it was routed to when it loaded: it was held to their positions).

The teachers are frozen, so a refresh does not follow a teacher that changes: it adds
measurements. Each draws the next prompts of the held-out set, so the weights rest on more
prompts as the run goes, for `refresh_prompts` x teachers x `rollout.max_new_tokens` tokens of
teacher decoding per domain per refresh, and a run need not measure its teachers beforehand.
"""

from __future__ import annotations

from opd.data import Sample
from opd.distill.context import teacher_prompts
from opd.errors import TrainError
from opd.rewards import correct


class PassRates:
    """Pooled counts per (domain, teacher), the held-out cursor, and the weights over time."""

    def __init__(self, routing, router, held_out: dict[str, list[Sample]]):
        self.every, self.per_refresh = routing.refresh_every, routing.refresh_prompts
        self.router = router
        # Domains two or more teachers cover and that have held-out prompts: where weights can move.
        self.domains = {d: router.covering(d) for d, v in held_out.items() if v and len(router.covering(d)) > 1}
        if self.every and not self.domains:
            raise TrainError(f"merge.routing.refresh_every ({self.every}) measures teachers' pass rates on held-out "
                             f"prompts of a domain two or more teachers cover; no domain has both (held out: "
                             f"{sorted(d for d, v in held_out.items() if v)}; covered: "
                             f"{ {d: router.covering(d) for d in held_out} }). Give such a domain an eval_path, "
                             f"or remove refresh_every")
        self.held_out = held_out
        self.counts: dict[str, dict[str, list[int]]] = {d: {t: [0, 0] for t in ts} for d, ts in self.domains.items()}
        self.cursor = dict.fromkeys(self.domains, 0)
        self.history: list[dict] = []   # {"step", "pass_rates", "weights", "answered"} per refresh

    def due(self, step: int) -> bool:
        """Before step 1 (step 0), then every `every` steps."""
        return bool(self.every) and step % self.every == 0

    def refresh(self, step: int, tr) -> dict:
        """Measure (rank 0; the ranks of a sharded student get its counts), pool, reweigh every
        route; the metrics row. `tr`: the Trainer (its teachers, tokenizer, verifier, config)."""
        if tr.world.main:
            self._measure(step, tr)
        if tr.world.sharded:
            self.load_state(tr.world.broadcast(self.state()))
        row = self.apply(step)
        self.reroute(tr.prompts)
        return row

    def card(self) -> list[str]:
        """One line per refresh: each domain's teachers with weight, pass rate and answers pooled."""
        return [f"step {h['step']}: " + "; ".join(
            f"{d}: " + ", ".join(f"{t} {w:.2f} (pass {h['pass_rates'][d].get(t, float('nan')):.2f} of "
                                 f"{h['answered'][d][t]})" for t, w in ws.items())
            for d, ws in h["weights"].items()) for h in self.history]

    def _measure(self, step: int, tr) -> None:
        """Every teacher of every domain on the domain's next held-out prompts (the teachers
        answer in their own processes at once), scored by the verifier and pooled."""
        cfg, r = tr.cfg, tr.cfg.rollout
        asked = {}   # (domain, teacher) -> (samples, future)
        for d, teachers in self.domains.items():
            pool = self.held_out[d]
            samples = [pool[(self.cursor[d] + i) % len(pool)] for i in range(min(self.per_refresh, len(pool)))]
            self.cursor[d] = (self.cursor[d] + len(samples)) % len(pool)
            prompts = [tr.encode(s) for s in samples]
            for t in teachers:
                seen = teacher_prompts(tr.teachers.specs[t], tr.tok, samples, prompts, tr.tools)
                asked[d, t] = samples, tr.teachers.sample(
                    t, seen, n=1, max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                    seed=cfg.run.seed + 7919 * (step + 1), stop_ids=tr.stop_ids)
        for (d, t), (samples, future) in asked.items():
            try:
                out = future.result()
            except Exception as e:   # noqa: BLE001 - said with the teacher's name
                raise TrainError(f"teacher {t!r} could not answer the pass-rate prompts of {d!r}: {e}") from None
            texts = [tr.tok.decode(ids[:-1] if f == "stop" else ids, skip_special_tokens=True)
                     for ids, f in zip(out.responses, out.finish)]
            scores = tr.verify(samples, texts)
            c = self.counts[d][t]
            c[0] += sum(1 for v in scores if v is not None and correct(v))
            c[1] += sum(1 for v in scores if v is not None)

    def apply(self, step: int | None) -> dict:
        """The pooled rates into the router and every route; with `step`, recorded for the card."""
        rates = {d: {t: c[0] / c[1] for t, c in per.items() if c[1]} for d, per in self.counts.items()}
        self.router.update_pass_rates(rates)
        weights = {d: self.router.domain_weights(d) for d in self.domains}
        if step is not None:
            self.history.append({"step": step, "pass_rates": rates, "weights": weights,
                                 "answered": {d: {t: c[1] for t, c in per.items()} for d, per in self.counts.items()}})
        return {f"routing/{kind}/{d}/{t}": v for kind, table in (("pass_rate", rates), ("weight", weights))
                for d, per in table.items() for t, v in per.items()}

    def reroute(self, prompts) -> None:
        """Every prompt's route under the router's current pass rates (a new dict: a sampling
        thread reading the old one finds it whole)."""
        prompts.routes = {k: self.router.reweighed(v) for k, v in prompts.routes.items()}
        prompts.eval_routes = [self.router.reweighed(v) for v in prompts.eval_routes]

    def state(self) -> dict:
        return {"counts": self.counts, "cursor": self.cursor, "history": self.history}

    def load_state(self, state: dict | None) -> None:
        if not state:
            return
        self.counts = {d: {t: list(c) for t, c in per.items()} for d, per in state["counts"].items()}
        self.cursor, self.history = dict(state["cursor"]), list(state["history"])
