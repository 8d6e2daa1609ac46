"""`opd bench long`: its summary rows, markdown table and plots."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from opd.benchmarks.recipes_report import reach

LABELS = {"offline": "offline distillation (SFT on teacher samples)",
          "offline_filtered": "offline, verifier-filtered samples",
          "opd_topk": "OPD top-k", "opd_sampled": "OPD sampled-token", "opd_full": "OPD full vocabulary",
          "opd_reward": "OPD top-k + reward", "grpo": "GRPO alone",
          "offline_then_opd": "offline, then OPD top-k (half each)", "trl": "TRL DistillationTrainer"}
TARGET = 0.8   # of the teacher's accuracy at that length


def _ms(xs: list[float]) -> tuple[float, float]:
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) if xs else (math.nan, math.nan)


def summarize(report: dict) -> list[dict]:
    """One row per (length, start, arm): accuracy at the end of the budget (mean, std over
    seeds) and the CPU-s to reach TARGET x the teacher's accuracy (mean over the seeds that
    reached it, and how many did; a run's start counts as its point at 0 CPU-s)."""
    rows = []
    results = report["results"]
    for key in dict.fromkeys((r["length"], r["start"], r["arm"]) for r in results):
        length, start, arm = key
        runs = [r for r in results if (r["length"], r["start"], r["arm"]) == key]
        ok = [r for r in runs if r.get("rc") == 0 and r.get("points") and all("acc" in p for p in r["points"])]
        refs = report["refs"][str(length)]
        target = TARGET * refs["teacher"]["all"]
        start_acc = refs[start]["all"]
        reached = [reach([{"acc": start_acc, "cpu_s": 0.0}] + r["points"], target) for r in ok] if target > 0 else []
        hits = [x for x in reached if x is not None]
        acc, std = _ms([r["points"][-1]["acc"] for r in ok])
        rows.append({"length": length, "start": start, "arm": arm, "seeds": len(ok), "failed": len(runs) - len(ok),
                     "final_acc": acc, "final_acc_std": std, "target": target, "start_acc": start_acc,
                     "teacher_acc": refs["teacher"]["all"], "to_target_cpu_s": _ms(hits)[0] if hits else None,
                     "reached": len(hits)})
    return rows


def _f(x, spec=".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(report: dict) -> str:
    p = report["plan"]
    lrs = ", ".join(f"{a} {p['lrs'][a]:g}" for a in p["arms"])
    lines = [f"Task `opd.tiny.chain` at {', '.join(f'{n} tokens' for n in p['lengths'])}; teacher "
             f"{p['teacher']['layers']} layers x {p['teacher']['hidden']}, student {p['student']['layers']} x "
             f"{p['student']['hidden']}; budgets {', '.join(f'{k} tokens: {v:g} CPU-s' for k, v in p['budget'].items())}"
             f" per run; {p['batch']} sequences per step; seeds {', '.join(map(str, p['seeds']))}; learning rates "
             f"{lrs}; OPD and TRL beta {p['beta']:g}. "
             f"Accuracy: greedy, {p['eval_prompts']} prompts per length (every start: the task is running a learned program, opd.tiny.chain), the answer exactly right.", ""]
    for start in p["starts"]:
        rows = [r for r in report["rows"] if r["start"] == start]
        head = "| arm | " + " | ".join(f"{n} tok: accuracy at the budget | {n} tok: CPU-s to 80 % of the teacher"
                                       for n in p["lengths"]) + " |"
        lines += [f"**From the {start} start** (" + ", ".join(
            f"{n} tokens: start {_f(next((r['start_acc'] for r in rows if r['length'] == n), None))}, teacher "
            f"{_f(next((r['teacher_acc'] for r in rows if r['length'] == n), None))}" for n in p["lengths"]) + ")", "",
            head, "|---|" + "---|---|" * len(p["lengths"])]
        for arm in p["arms"]:
            cells = []
            for n in p["lengths"]:
                r = next((r for r in rows if r["length"] == n and r["arm"] == arm), None)
                if r is None or not r["seeds"]:
                    cells += ["-", "-"]
                    continue
                cells.append(f"{_f(r['final_acc'])} ± {_f(r['final_acc_std'])}")
                cells.append(f"{_f(r['to_target_cpu_s'], '.0f')} ({r['reached']}/{r['seeds']})"
                             if r["reached"] else f"not reached (0/{r['seeds']})")
            lines.append(f"| {LABELS.get(arm, arm)} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = report["plan"]
    lengths, arms = p["lengths"], p["arms"]
    fig, axes = plt.subplots(len(p["starts"]), len(lengths) + 1, figsize=(4.2 * (len(lengths) + 1), 3.6 * len(p["starts"])),
                             squeeze=False)
    colors = {a: plt.cm.tab10(i % 10) for i, a in enumerate(arms)}
    for row, start in enumerate(p["starts"]):
        for col, n in enumerate(lengths):
            ax = axes[row][col]
            refs = report["refs"][str(n)]
            for r in report["results"]:
                if r["length"] != n or r["start"] != start or not r.get("points"):
                    continue
                pts = [(0.0, refs[start]["all"])] + [(q["cpu_s"], q.get("acc", math.nan)) for q in r["points"]]
                ax.plot(*zip(*pts), color=colors[r["arm"]], alpha=0.7, marker=".",
                        label=LABELS.get(r["arm"], r["arm"]) if r["seed"] == p["seeds"][0] else None)
            ax.axhline(refs["teacher"]["all"], color="k", lw=0.8, ls="--")
            ax.axhline(TARGET * refs["teacher"]["all"], color="k", lw=0.5, ls=":")
            ax.set_title(f"{n} tokens, {start} start")
            ax.set_xlabel("CPU-seconds")
            ax.set_ylabel("accuracy")
        ax = axes[row][-1]
        for arm in arms:
            xs, ys = [], []
            for n in lengths:
                r = next((r for r in report["rows"] if r["length"] == n and r["start"] == start and r["arm"] == arm), None)
                if r and r["to_target_cpu_s"] is not None:
                    xs.append(n)
                    ys.append(r["to_target_cpu_s"])
            if xs:
                ax.plot(xs, ys, marker="o", color=colors[arm], label=LABELS.get(arm, arm))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"CPU-s to 80 % of the teacher ({start} start)")
        ax.set_xlabel("response length (tokens)")
    axes[0][0].legend(fontsize=6)
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
