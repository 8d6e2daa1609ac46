"""The router: which teacher (or weighted set of teachers) scores a sample, and why.

Rules are tried in the order the config lists them; the first that decides wins, a rule
that cannot decide abstains and the next one is tried:

    domain_field   the sample's own `domain`, mapped to the teachers whose `domains` hold it
    pattern        any regular expression of the rule found in the prompt (re.search)
    keywords       any keyword of the rule in the prompt, case-insensitive, whole word
    classifier     the trained text classifier's most likely domain, if p >= min_confidence
    fallback       always decides

A rule names either a `teacher` (that teacher, alone) or a `domain` (the teachers covering
it, weighted as below). The classifier's labels are domains (or teacher names).

Weighting: "single" picks one teacher per sample; when several teachers cover a domain the
one with the highest known pass rate wins, ties going to the first listed. "pass_rate"
gives every teacher covering the domain a weight proportional to its measured pass rate on
that domain (`pass_rates[domain][teacher]`, from the config or `update_pass_rates`); a teacher
with no measurement gets the mean of the measured ones, and all-zero rates fall back to
equal weights. `Route.teacher` is the teacher of highest weight.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from opd.data import Sample
from opd.routing.classifier import Classifier
from opd.routing.config import RouterConfig, RuleSpec, TeacherSpec


class RoutingError(ValueError):
    """No rule decided a sample, or a rule cannot be used with these teachers."""


@dataclass(frozen=True)
class Route:
    """Where a sample goes, and why: what `opd route explain` prints and `opd train` follows."""
    teacher: str                # the chosen teacher (highest weight)
    weights: dict[str, float]   # teacher -> weight > 0, sums to 1
    rule: str                   # "domain_field", "pattern[1]", "classifier", "fallback", ...
    reason: str                 # "domain 'math' -> teacher math"
    domain: str                 # the domain the sample is counted under (metrics, domain weights)
    finding: str = ""           # routed to a domain's teachers: what the rule found ("domain 'math'"); else ""


def preview(text: str, n: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


class Router:
    def __init__(self, cfg: RouterConfig, teachers: list[TeacherSpec], base_dir: Path | str = "."):
        self.cfg = cfg
        self.teachers = list(teachers)
        self.names = [t.name for t in self.teachers]
        self.pass_rates: dict[str, dict[str, float]] = {d: dict(r) for d, r in cfg.pass_rates.items()}
        self._rule_counts: Counter = Counter()
        self._teacher_counts: Counter = Counter()
        self._domain_counts: Counter = Counter()
        self._rules = [self._compile(i, r, Path(base_dir)) for i, r in enumerate(cfg.rules)]

    # -- setup --------------------------------------------------------------------------
    def _compile(self, index: int, rule: RuleSpec, base_dir: Path):
        """Check a rule against the teachers and precompile what it needs."""
        target_domain = rule.domain
        if rule.teacher is not None and rule.teacher not in self.names:
            raise RoutingError(f"rules[{index}] ({rule.kind}) names teacher {rule.teacher!r}, not among {self.names}")
        if target_domain is not None and not self.covering(target_domain):
            raise RoutingError(f"rules[{index}] ({rule.kind}) names domain {target_domain!r}, "
                               f"which no teacher covers ({self._coverage()})")
        if rule.kind in ("pattern", "keywords", "fallback") and rule.teacher is None and target_domain is None:
            raise RoutingError(f"rules[{index}] ({rule.kind}) needs `teacher` or `domain`")
        if rule.kind == "pattern":
            if not rule.patterns:
                raise RoutingError(f"rules[{index}] (pattern) has no `patterns`")
            try:
                return [re.compile(p) for p in rule.patterns]
            except re.error as e:
                raise RoutingError(f"rules[{index}] (pattern): bad regular expression {e.pattern!r}: {e}") from None
        if rule.kind == "keywords":
            if not rule.keywords:
                raise RoutingError(f"rules[{index}] (keywords) has no `keywords`")
            return [(k, re.compile(r"(?<!\w)" + re.escape(k.lower()) + r"(?!\w)")) for k in rule.keywords]
        if rule.kind == "classifier":
            if not rule.path:
                raise RoutingError(f"rules[{index}] (classifier) needs `path` (written by `opd route fit`)")
            path = base_dir / rule.path
            if not path.is_file():
                raise RoutingError(f"rules[{index}] (classifier): {path} not found; "
                                   f"fit it with `opd route fit --data LABELLED.jsonl --out {path}`")
            clf = Classifier.load(path)
            unknown = [lab for lab in clf.labels if not self.covering(lab) and lab not in self.names]
            if unknown:
                raise RoutingError(f"rules[{index}] (classifier): labels {unknown} of {path} are neither domains "
                                   f"nor teachers ({self._coverage()})")
            return clf
        return None

    def _coverage(self) -> str:
        return "; ".join(f"{t.name}: {t.domains}" for t in self.teachers)

    def covering(self, domain: str) -> list[str]:
        """Teachers whose `domains` contain `domain`, in config order."""
        return [t.name for t in self.teachers if domain in t.domains]

    # -- weighting ----------------------------------------------------------------------
    def update_pass_rates(self, rates: dict[str, dict[str, float]]) -> None:
        """Merge fresh measurements {domain: {teacher: pass rate}} (e.g. from a held-out evaluation)."""
        for domain, per_teacher in rates.items():
            for name, rate in per_teacher.items():
                if not 0.0 <= rate <= 1.0:
                    raise ValueError(f"pass rate of {name} on {domain} must be in [0, 1], got {rate}")
            self.pass_rates.setdefault(domain, {}).update(per_teacher)

    def domain_weights(self, domain: str) -> dict[str, float]:
        """Weights of the teachers covering `domain` (sums to 1)."""
        names = self.covering(domain)
        measured = self.pass_rates.get(domain, {})
        known = [measured[n] for n in names if n in measured]
        fill = sum(known) / len(known) if known else 1.0
        raw = {n: measured.get(n, fill) for n in names}
        total = sum(raw.values())
        if total <= 0:
            return {n: 1.0 / len(names) for n in names}
        return {n: v / total for n, v in raw.items()}

    def _to_domain(self, domain: str, rule: str, reason: str) -> Route:
        # A teacher of weight 0 (a pass rate of 0 beside better ones) is not asked at all.
        weights = {n: float(w) for n, w in self.domain_weights(domain).items() if w > 0}
        # An unmeasured teacher is given the mean of the measured rates: on a tie, the measured one wins.
        measured = self.pass_rates.get(domain, {})
        best = max(weights, key=lambda n: (weights[n], n in measured, -self.names.index(n)))
        if self.cfg.weighting == "single" or len(weights) == 1:
            how = f" (best of {sorted(weights)} by pass rate)" if len(weights) > 1 else ""
            return Route(best, {best: 1.0}, rule, f"{reason} -> teacher {best}{how}", domain, reason)
        shares = ", ".join(f"{n} {w:.2f}" for n, w in weights.items())
        return Route(best, weights, rule, f"{reason} -> teachers weighted by pass rate: {shares}", domain, reason)

    def reweighed(self, route: Route) -> Route:
        """`route` under the current pass rates (after `update_pass_rates`), among the teachers it
        had: a prompt was held to those teachers' positions when it loaded. A route to a named
        teacher, or under weighting single, is returned as it is."""
        if not route.finding or self.cfg.weighting != "pass_rate" or len(route.weights) == 1:
            return route
        fresh = self.domain_weights(route.domain)
        raw = {n: fresh[n] for n in route.weights if fresh.get(n, 0.0) > 0}
        if not raw:   # every one of its teachers measured 0: equal weights, as domain_weights does
            raw = dict.fromkeys(route.weights, 1.0)
        total = sum(raw.values())
        weights = {n: w / total for n, w in raw.items()}
        best = max(weights, key=lambda n: (weights[n], -self.names.index(n)))
        shares = ", ".join(f"{n} {w:.2f}" for n, w in weights.items())
        return Route(best, weights, route.rule, f"{route.finding} -> teachers weighted by pass rate: {shares}",
                     route.domain, route.finding)

    def _to_teacher(self, name: str, rule: str, reason: str, domain: str | None) -> Route:
        if domain is None:
            spec = self.teachers[self.names.index(name)]
            domain = spec.domains[0] if spec.domains else name
        return Route(name, {name: 1.0}, rule, f"{reason} -> teacher {name}", domain)

    def _decide(self, rule_spec: RuleSpec, rule: str, reason: str, sample: Sample) -> Route:
        target_domain = rule_spec.domain
        if target_domain is not None:
            return self._to_domain(target_domain, rule, reason)
        return self._to_teacher(rule_spec.teacher, rule, reason, sample.domain)

    # -- routing ------------------------------------------------------------------------
    def _try(self, index: int, spec: RuleSpec, compiled, sample: Sample) -> Route | None:
        if spec.kind == "domain_field":
            if sample.domain is None or not self.covering(sample.domain):
                return None
            return self._to_domain(sample.domain, "domain_field", f"domain {sample.domain!r}")
        if spec.kind == "pattern":
            for rx in compiled:
                if rx.search(sample.prompt):
                    return self._decide(spec, f"pattern[{index}]", f"pattern '{rx.pattern}' matched", sample)
            return None
        if spec.kind == "keywords":
            lowered = sample.prompt.lower()
            for word, rx in compiled:
                if rx.search(lowered):
                    return self._decide(spec, f"keywords[{index}]", f"keyword {word!r} found", sample)
            return None
        if spec.kind == "classifier":
            probs = compiled.predict_proba(sample.prompt)
            label = max(probs, key=probs.get)
            if probs[label] < spec.min_confidence:
                return None
            reason = f"classifier p={probs[label]:.2f} for {label}"
            if self.covering(label):
                return self._to_domain(label, "classifier", reason)
            return self._to_teacher(label, "classifier", reason, sample.domain)
        if spec.kind == "fallback":
            return self._decide(spec, "fallback", "no earlier rule decided", sample)
        raise RoutingError(f"unknown rule kind {spec.kind!r}")

    def route(self, sample: Sample) -> Route:
        for index, (spec, compiled) in enumerate(zip(self.cfg.rules, self._rules)):
            decided = self._try(index, spec, compiled, sample)
            if decided is not None:
                return self._count(decided)
        if not self.cfg.rules and len(self.names) == 1:  # single-teacher run: everything goes to it
            return self._count(self._to_teacher(self.names[0], "fallback", "only teacher", sample.domain))
        kinds = [r.kind for r in self.cfg.rules]
        raise RoutingError(f"no routing rule decided sample (domain={sample.domain!r}, "
                           f"prompt {preview(sample.prompt)!r}); rules tried: {kinds}. "
                           f"Add a `fallback` rule or a rule that covers it.")

    def _count(self, r: Route) -> Route:
        self._rule_counts[r.rule] += 1
        self._teacher_counts[r.teacher] += 1
        self._domain_counts[r.domain] += 1
        return r

    def stats(self) -> dict[str, dict[str, int]]:
        """How many samples each rule decided, each teacher received, each domain counted."""
        return {"rule": dict(self._rule_counts), "teacher": dict(self._teacher_counts),
                "domain": dict(self._domain_counts)}
