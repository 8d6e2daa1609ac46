"""The prompts of a distillation run: loaded, routed once, and held to their teachers' lengths.

Every prompt file of `merge.datasets` (and its `eval_path`) is read, each prompt is routed
once at load (a prompt no rule decides is refused here, not when its batch comes hours into a
run), and a prompt that leaves no room for `rollout.max_new_tokens` (with `agent`: for
`agent.max_tokens`, the whole trajectory) within the positions of the student and of the
teachers it is routed to is refused (`run.on_data_error: stop`) or left
out and said in the card (`skip`). The training prompts feed a MixtureSampler in the datasets'
ratios; the held-out ones are picked round-robin over domains; `merge.sft` is cycled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from opd.distill.context import check_contexts
from opd.data import Cycler, LoadReport, Sample, encode_prompt, load_jsonl
from opd.routing.mixture import MixtureSampler
from opd.routing.router import Route, Router, RoutingError
from opd.spine.optim import TrainError


@dataclass
class Prompts:
    datasets: dict[str, list[Sample]]     # domain -> training prompts kept
    sampler: MixtureSampler               # batches of them in the datasets' ratios
    eval_samples: list[Sample]            # held-out prompts of an evaluation
    eval_routes: list[Route]
    routes: dict[int, Route]              # id(sample) -> its route, for every sample kept
    sft: Cycler | None                    # merge.sft's prompt/response pairs
    reports: dict[str, LoadReport]        # file -> lines loaded / skipped
    warnings: list[str] = field(default_factory=list)
    held_out: dict[str, list[Sample]] = field(default_factory=dict)   # domain -> every held-out prompt kept
    router: Router | None = None          # what routed them (its pass rates may be refreshed in the run)


def load_prompts(cfg, tokenizer, base_dir: str | Path, student_positions: int,
                 teacher_positions: dict[str, int], tools: list[dict] | None = None) -> Prompts:
    """`cfg`: the TrainConfig. student_positions / teacher_positions: the positions the student
    and each teacher take (0 or left out: not said). tools: the agent's tool schemas, which the
    prompts (and the teachers' contexts) are rendered with."""
    files: list[tuple[str, str, list[Sample], bool]] = []   # (domain, path, samples, held out)
    reports: dict[str, LoadReport] = {}
    for d in cfg.merge.datasets:
        for path, held_out in ((d.path, False), (d.eval_path, True)):
            if path:
                samples, reports[path] = load_jsonl(path, on_error=cfg.run.on_data_error, default_domain=d.domain)
                files.append((d.domain, path, samples, held_out))
    router = make_router(cfg.merge, {s.domain for *_, samples, _ in files for s in samples if s.domain}, base_dir)
    routes: dict[int, Route] = {}
    datasets: dict[str, list[Sample]] = {}
    eval_sets: dict[str, list[Sample]] = {}
    warnings: list[str] = []
    for domain, path, samples, held_out in files:
        try:
            routed = [router.route(s) for s in samples]
        except RoutingError as e:
            raise TrainError(f"{path}: {e}") from None
        kept = _fit_length(cfg, tokenizer, samples, routed, path, student_positions, teacher_positions, warnings,
                           tools)
        check_contexts({t.name: t for t in cfg.merge.teachers}, tokenizer, [s for s, _ in kept], [r for _, r in kept],
                       path, teacher_positions, cfg.response_budget(), tools)
        routes.update((id(s), r) for s, r in kept)   # kept samples live for the run: their ids stay theirs
        (eval_sets if held_out else datasets).setdefault(domain, []).extend(s for s, _ in kept)
    sampler = MixtureSampler(datasets, {d.domain: d.ratio for d in cfg.merge.datasets}, seed=cfg.run.seed)
    sft = None
    if cfg.merge.sft is not None:
        pairs, reports[cfg.merge.sft.path] = load_jsonl(cfg.merge.sft.path, on_error=cfg.run.on_data_error)
        missing = [i for i, s in enumerate(pairs) if not s.response]
        if missing:
            raise TrainError(f"{cfg.merge.sft.path}: SFT samples need a `response` (sample {missing[0] + 1} has none)")
        sft = Cycler(pairs, seed=cfg.run.seed + 1)
    for path, report in reports.items():  # run.on_data_error: skip; said once, kept in the card
        if report.skipped:
            print(f"{path}: skipped {report.skipped} malformed lines (first: {report.errors[0]})", flush=True)
    picked = _round_robin(list(eval_sets.values()), cfg.run.eval_prompts)
    return Prompts(datasets, sampler, picked, [routes[id(s)] for s in picked], routes, sft, reports, warnings,
                   eval_sets, router)


def make_router(merge, sample_domains: set[str], base_dir: str | Path) -> Router:
    """The merge config's router; a domain in merge.domain_weights or routing.pass_rates that
    is no domain of the run is refused (a misspelt one would silently weigh nothing)."""
    known = ({d.domain for d in merge.datasets} | {r.domain for r in merge.routing.rules if r.domain}
             | sample_domains | {d for t in merge.teachers for d in t.domains} | {t.name for t in merge.teachers})
    for key, mapping in (("merge.domain_weights", merge.domain_weights),
                         ("merge.routing.pass_rates", merge.routing.pass_rates)):
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise TrainError(f"{key}: {unknown} is not a domain of this run (its domains: {sorted(known)})")
    return Router(merge.routing, merge.teachers, base_dir)


def _fit_length(cfg, tokenizer, samples: list[Sample], routes: list[Route], path: str, student: int,
                teachers: dict[str, int], warnings: list[str], tools: list[dict] | None = None
                ) -> list[tuple[Sample, Route]]:
    """The (sample, route) pairs whose prompt (rendered with the agent's `tools`) leaves room for
    the response budget (rollout.max_new_tokens, or agent.max_tokens) within the positions of
    the student and of the teachers the sample is routed to."""
    def limit(route: Route) -> tuple[str, int] | None:
        """(who, positions): the smallest limit this sample meets, None when none is said."""
        named = {f"teacher {t!r}": n for t, n in teachers.items() if t in route.weights}
        if student:
            named["the student"] = student
        return min(named.items(), key=lambda kv: kv[1]) if named else None

    key, new = cfg.response_budget()
    limits = [limit(r) for r in routes]
    lengths = [len(encode_prompt(tokenizer, s.chat, tools=tools)) if lim else 0 for s, lim in zip(samples, limits)]
    long = [i for i, (n, lim) in enumerate(zip(lengths, limits)) if lim and n > lim[1] - new]
    if long:
        who, n = limits[long[0]]
        msg = (f"{path}: {len(long)} of {len(samples)} prompts leave no room for {key} ({new}) "
               f"within the positions their teacher or the student takes (first: "
               f"{samples[long[0]].prompt[:60]!r}, {lengths[long[0]]} tokens; {who} takes {n})")
        if len(long) == len(samples):
            raise TrainError(f"{msg}: no prompt of the file fits; shorten them or lower {key}")
        if cfg.run.on_data_error == "stop":
            raise TrainError(f"{msg}; shorten them, lower {key}, or set run.on_data_error: "
                             f"skip to leave them out")
        print(f"warning: {msg}; left out (run.on_data_error: skip)", flush=True)
        warnings.append(f"{msg}; left out")
    drop = set(long)
    return [(s, r) for i, (s, r) in enumerate(zip(samples, routes)) if i not in drop]


def _round_robin(pools: list[list[Sample]], n: int) -> list[Sample]:
    """Up to n samples, one from each pool in turn (held-out prompts: every domain evaluated)."""
    pools = [list(p) for p in pools]
    picked: list[Sample] = []
    while len(picked) < n and any(pools):
        for p in pools:
            if p and len(picked) < n:
                picked.append(p.pop(0))
    return picked
