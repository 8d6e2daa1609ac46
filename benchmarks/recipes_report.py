"""`opd bench recipes`: the summary table, its markdown and its plot."""

from __future__ import annotations

import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from opd.benchmarks.recipes_inputs import ARMS, GRPO_GROUP, LABELS, SHORT, reward_group



def reach(points: list[dict], target: float, key: str = "cpu_s") -> float | None:
    """The compute (`key`) at the first evaluation whose accuracy is at least `target`; None if none is."""
    for p in points:
        if p["acc"] >= target - 1e-9:
            return p[key]
    return None


def acc_at(points: list[dict], x: float, start: float, key: str = "cpu_s") -> float:
    """The accuracy a run had at `x` CPU-s (or tokens): its last evaluation at or below it (the
    start before any)."""
    below = [p["acc"] for p in points if p[key] <= x + 1e-9]
    return below[-1] if below else start


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) if xs else (math.nan, math.nan)


def summarize(results: list[dict], start_acc: float, targets: list[float]) -> list[dict]:
    """One row per arm: final accuracy (mean, std over seeds), CPU-s, steps and tokens, and for
    each target the CPU-s (and tokens) to reach it (mean over the seeds that reached it, and
    how many did)."""
    rows = []
    for arm in dict.fromkeys(r["arm"] for r in results):
        ok = [r for r in results if r["arm"] == arm and r.get("rc") == 0 and r.get("points")]
        failed = [r for r in results if r["arm"] == arm and r not in ok]
        row = {"arm": arm, "label": LABELS.get(arm, arm), "seeds": len(ok), "failed": len(failed),
               "error": failed[0].get("error", "") if failed and not ok else ""}
        if ok:
            for name, vals in (("final_acc", [r["points"][-1]["acc"] for r in ok]),
                               ("final_math", [r["points"][-1]["math"] for r in ok]),
                               ("final_code", [r["points"][-1]["code"] for r in ok]),
                               ("best_acc", [max(p["acc"] for p in r["points"]) for r in ok]),
                               ("cpu_s", [r["cpu_s"] for r in ok]), ("tokens", [r["tokens"] for r in ok]),
                               ("steps", [r.get("steps", r["points"][-1]["step"]) for r in ok]),
                               ("wall_s", [r["wall_s"] for r in ok]),
                               ("startup_cpu_s", [r["phases"]["training"].get("to_first_step_cpu_s") or 0.0 for r in ok])):
                row[name], row[name + "_std"] = _mean_std(vals)
            row["reach"] = {}
            for target in targets:
                curves = [[{"acc": start_acc, "cpu_s": 0.0, "tokens": 0.0}] + r["points"] for r in ok]
                cpu = [c for c in (reach(pts, target) for pts in curves) if c is not None]
                tok = [c for c in (reach(pts, target, "tokens") for pts in curves) if c is not None]
                row["reach"][f"{target:.3f}"] = {"cpu_s": _mean_std(cpu)[0] if cpu else None,
                                                 "tokens": _mean_std(tok)[0] if tok else None,
                                                 "reached": len(cpu), "of": len(ok)}
        rows.append(row)
    return rows


def _fmt(x, spec=".0f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(report: dict) -> str:
    p = report["plan"]
    targets = report["targets"]
    reward = (f"; OPD + reward: loss.reward_weight {p.get('reward_weight', 1.0):g}, loss.reward_advantage "
              f"{p.get('reward_advantage', 'grpo')}" if "opd_reward" in p["lrs"] else "")
    group = reward_group(p.get("reward_advantage", "grpo"))
    budget = (f"{p['cpu_budget']:.0f} CPU-s per run (stopped when its processes have used them; at most "
              f"{p['steps']} steps)" if p["cpu_budget"] else f"{p['steps']} optimizer steps per run")
    lines = [f"Held-out accuracy: greedy, {p['eval_prompts']} math + {p['eval_prompts']} code prompts (the demo's "
             f"eval sets), the share the domain verifier scores fully correct. SFT start: "
             f"{report['start']['all']:.3f} (math {report['start']['math']:.2f}, code {report['start']['code']:.2f}); "
             f"teachers on their own domain: math {report['teachers']['math']:.2f}, code {report['teachers']['code']:.2f} "
             f"(mean {report['teacher_acc']:.3f}).", "",
             f"Budget, every arm: {budget}, {p['batch']} sequences per optimizer step (GRPO {p['batch'] // GRPO_GROUP} "
             f"prompts x {GRPO_GROUP}; OPD + reward {p['batch'] // group} x {group}; OPD {p['batch']} x 1; "
             f"offline: {p['offline_samples']} teacher samples, then SFT batches of {p['batch']}); responses "
             f"<= {p['max_new_tokens']} tokens; domain mix {', '.join(f'{d} {r:.2f}' for d, r in p['ratios'].items())}; "
             f"constant learning rates after warm-up ({', '.join(f'{SHORT[a]} {lr:g}' for a, lr in p['lrs'].items())})"
             f"{reward}; "
             f"seeds {', '.join(map(str, p['seeds']))}. CPU-s: user + sys of every process of the run (trainer "
             f"and its children, code sandboxes included; the teacher servers while it ran; the offline arm's "
             f"teacher sampling); evaluation not counted. Mean ± std over seeds.", "",
             "| arm | seeds | accuracy at the end | math | code | best | CPU-s | of which to 1st step | steps | "
             "tokens sampled | wall s | " + " | ".join(f"CPU-s to reach {t:.2f}" for t in targets) + " | " +
             " | ".join(f"tokens to reach {t:.2f}" for t in targets) + " |",
             "|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * (2 * len(targets))]
    for r in report["rows"]:
        if not r["seeds"]:
            why = r["error"].splitlines()[-1][:120].replace("|", "/") if r["error"] else "?"
            lines.append(f"| {r['label']} | 0 (failed: {why}) |" + " - |" * (9 + 2 * len(targets)))
            continue

        def reached(t, key, r=r):
            x = r["reach"][f"{t:.3f}"]
            if not x["reached"]:
                return f"not reached (0/{x['of']})"
            return _fmt(x[key]) + (f" ({x['reached']}/{x['of']})" if x["reached"] < x["of"] else "")

        failed = f" (+{r['failed']} failed)" if r["failed"] else ""
        lines.append(
            f"| {r['label']} | {r['seeds']}{failed} | {r['final_acc']:.3f} ± {r['final_acc_std']:.3f} | "
            f"{r['final_math']:.2f} | {r['final_code']:.2f} | {r['best_acc']:.3f} | "
            f"{r['cpu_s']:.0f} ± {r['cpu_s_std']:.0f} | {r['startup_cpu_s']:.0f} | {r['steps']:.0f} | "
            f"{r['tokens']:.0f} | {r['wall_s']:.0f} | "
            + " | ".join(reached(t, "cpu_s") for t in targets) + " | "
            + " | ".join(reached(t, "tokens") for t in targets) + " |")
    marks = (f"at the {p['evals']} marks {p['cpu_budget'] / p['evals']:.0f}, {2 * p['cpu_budget'] / p['evals']:.0f}, ... "
             f"CPU-s (the last checkpoint at or below each)" if p["cpu_budget"] else f"every {p['steps'] // p['evals']} steps")
    lines += ["", f"'CPU-s to reach X': the CPU-seconds at the first evaluated checkpoint at or above accuracy X, mean "
              f"over the seeds that got there ((n/N): only n of N did); checkpoints are evaluated {marks}, so it is "
              "an upper bound within one interval. 'of which to 1st step': the trainer's start-up (imports, model "
              "load) and its first step.", "",
              f"Teacher servers: started once ({report['server_startup_cpu']:.1f} CPU-s, counted in no run). "
              f"Library: {'working tree at ' if report['code'].get('working_tree') else ''}"
              f"{report['code'].get('rev', '?')[:10]}{' + uncommitted changes' if report['code'].get('uncommitted_changes') else ''}.",
              "", f"Machine: {report['machine']}. Whole benchmark: {report['wall_s']:.0f} s wall.", ""]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12.5, 4.8))
    colors = dict(zip(ARMS, ("tab:red", "tab:green", "tab:purple", "tab:blue", "tab:orange", "tab:brown")))
    start = report["start"]["all"]
    p = report["plan"]
    for ax, key, xlabel in ((axes[0], "cpu_s", "CPU-seconds (every process of the run)"),
                            (axes[1], "tokens", "tokens sampled")):
        for arm in dict.fromkeys(r["arm"] for r in report["results"]):
            runs = [r for r in report["results"] if r["arm"] == arm and r.get("points")]
            if not runs:
                continue
            for r in runs:   # each seed, thin
                ax.plot([0] + [q[key] for q in r["points"]], [start] + [q["acc"] for q in r["points"]],
                        color=colors.get(arm), alpha=0.3, lw=0.8, marker=".", ms=3)
            top = min(r["points"][-1][key] for r in runs)
            varies = all(r["points"][0][key] < r["points"][-1][key] for r in runs)
            if key == "cpu_s" and p["cpu_budget"]:   # the mean over seeds at each CPU mark
                xs = [0.0] + [p["cpu_budget"] * (i + 1) / p["evals"] for i in range(p["evals"])]
                accs = [[acc_at(r["points"], x, start) for r in runs] for x in xs]
            elif varies:   # the mean over seeds on a grid of the x every seed reached
                xs = [0.0] + [top * (i + 1) / p["evals"] for i in range(p["evals"])]
                accs = [[acc_at(r["points"], x, start, key) for r in runs] for x in xs]
            else:   # the mean over seeds at each evaluation
                n = min(len(r["points"]) for r in runs)
                xs = [0.0] + [statistics.fmean(r["points"][i][key] for r in runs) for i in range(n)]
                accs = [[start] * len(runs)] + [[r["points"][i]["acc"] for r in runs] for i in range(n)]
            ys = [statistics.fmean(a) for a in accs]
            es = [statistics.stdev(a) if len(a) > 1 else 0.0 for a in accs]
            ax.errorbar(xs, ys, yerr=es, color=colors.get(arm), marker="o", ms=4, lw=1.8, capsize=2,
                        label=f"{SHORT.get(arm, arm)} (n={len(runs)})")
        for t in report["targets"]:
            ax.axhline(t, color="grey", ls=":", lw=0.8)
        ax.axhline(report["teacher_acc"], color="black", ls="--", lw=0.8, label="teachers (own domain)")
        ax.axhline(start, color="grey", ls="-", lw=0.6, label="SFT start")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out accuracy (greedy, math + code)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    budget = f"{p['cpu_budget']:.0f} CPU-s per run" if p["cpu_budget"] else f"{p['steps']} steps per run"
    fig.suptitle(f"Recipes from one SFT start, {budget}, {p['batch']} sequences per step, seeds "
                 f"{','.join(map(str, p['seeds']))} (mean ± std over seeds; thin: each seed)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> str:
    cpu = platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return f"{os.cpu_count()} CPU cores ({cpu}), no GPU used, Python {platform.python_version()}, load average at the end {load}"
