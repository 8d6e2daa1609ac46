"""`opd bench all`: kernels, transport and step in one run, then OUT/summary.md.

Absolute times on shared machines drift, so the three are run back to back and each
table compares providers measured in the same run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import time
from pathlib import Path

from opd.benchmarks.transport import ratio_spread


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("runs/bench"), help="folder for the JSON files and summary.md")
    p.add_argument("--quick", action="store_true", help="small shapes and short runs (smoke test)")
    p.add_argument("--trl-python", default=None, help="interpreter with trl installed (opd bench step)")


def _sub_args(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def run(args) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    quick = ["--quick"] if args.quick else []
    plans = {
        "kernels": ["--json", str(out / "kernels.json"), *quick],
        "transport": ["--json", str(out / "transport.json"), *quick,
                      *(["--seconds", "0.3", "--rounds", "1", "--positions", "1024"] if args.quick else [])],
        "step": ["--json", str(out / "step.json"),
                 *(["--steps", "3", "--warmup", "1", "--rounds", "1"] if args.quick else []),
                 *(["--trl-python", args.trl_python] if args.trl_python else [])],
    }
    if not args.quick:  # the same step at a real vocabulary, where [tokens x V] tensors dominate memory
        plans["step-v152064"] = ["--json", str(out / "step_v152064.json"), "--vocab", "152064", "--steps", "6",
                                 "--warmup", "1", "--rounds", "2", *(["--trl-python", args.trl_python] if args.trl_python else [])]
    wall = {}
    for name, argv in plans.items():
        module = importlib.import_module(f"opd.benchmarks.{name.split('-')[0]}")
        print(f"== opd bench {name} {' '.join(argv)}", flush=True)
        t0 = time.perf_counter()
        module.run(_sub_args(module, argv))
        wall[name] = time.perf_counter() - t0
    (out / "summary.md").write_text(summary(out, wall, quick=bool(quick)))
    print(f"wrote {out / 'summary.md'}")
    return 0


def _load(path: Path) -> list[dict]:
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    return data["rows"] if isinstance(data, dict) else data


def _mib(b) -> str:
    return f"{b / 2**20:.0f}" if isinstance(b, (int, float)) and b else "-"


def _cpu(r: dict) -> str:
    """CPU microseconds per position of opd and of the bare socket (rows written before they
    were measured have none)."""
    if r.get("cpu_us_per_position") is None:
        return "-"
    return f"{r['cpu_us_per_position']:.3g} / {r['ceiling_cpu_us_per_position']:.3g}"


def _references(r: dict) -> str:
    """Where opd's gap to the bare socket comes from (`opd bench transport`, top-k rows only)."""
    if r.get("reqresp_ratio_to_ceiling") is None:
        return "-"
    return f"{100 * r['reqresp_ratio_to_ceiling']:.0f}% / {100 * r['work_ratio_to_ceiling']:.0f}%"


def summary(out: Path, wall: dict, quick: bool) -> str:

    lines = [f"# Benchmark summary{' (quick smoke run: not representative)' if quick else ''}", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; "
             f"written {time.strftime('%Y-%m-%d %H:%M')}. Command: `opd bench all --out {out}`"
             f"{' --quick' if quick else ''}.", ""]
    k = _load(out / "kernels.json")
    if k:
        lines += ["## Kernels (loss + backward)", "", "| impl | case | teacher | N | V | H | dtype | peak extra MiB | median ms |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in k:
            lines.append(f"| {r.get('impl')} | {r.get('case')} ({r.get('divergence')}) | {r.get('teacher')} | {r.get('N')} | {r.get('V')} | "
                         f"{r.get('H') or '-'} | {r.get('dtype')} | {_mib(r.get('peak_extra_bytes'))} | "
                         f"{r.get('error') or '-' if r.get('median_ms') is None else round(r['median_ms'], 1)} |")
        lines.append("")
    t = _load(out / "transport.json")
    if t:
        lines += ["## Transport (model taken out)", "",
                  "| transport | answer | positions/request | positions/s | bytes/position | % of bare ZeroMQ (rounds) "
                  "| references, % of bare ZeroMQ: request/response, + message work "
                  "| CPU us/position, opd / bare | x HTTP/JSON | CURVE cost |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in t:
            what = f"top-{r['k']}" if r["mode"] == "topk" else f"full V={r['vocab']} {r['dtype']}"
            lines.append(f"| {r['transport']} | {what} | {r.get('positions_per_request', '-')} | "
                         f"{r['positions_per_s']:.0f} | {r['bytes_per_position']} | "
                         f"{100 * r['ratio_to_ceiling']:.0f}% ({ratio_spread(r)}) | {_references(r)} | "
                         f"{_cpu(r)} | "
                         f"{'%.0fx' % r['ratio_to_http'] if r.get('ratio_to_http') else '-'} | "
                         f"{'%.0f%%' % (100 * r['curve_cost']) if 'curve_cost' in r else '-'} |")
        lines.append("")
    for name, title in (("step.json", "One on-policy distillation step"),
                        ("step_v152064.json", "The same step, vocabulary padded to 152,064")):
        lines += _step_table(_load(out / name), title)
    lines += ["Wall time per benchmark: " + ", ".join(f"{k} {v:.0f} s" for k, v in wall.items()), ""]
    return "\n".join(lines)


def _step_table(s: list[dict], title: str) -> list[str]:
    lines = []
    if s:
        lines += [f"## {title}", "",
                  "| system | tokens/s | s/step | trainer peak RSS MiB | teacher server RSS MiB | total peak PSS MiB "
                  "| x TRL tokens/s | phases (s) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in s:
            phases = ", ".join(f"{a} {b:.3f}" for a, b in (r.get("phases_s") or {}).items()) or "-"
            vs = f"{r['tokens_per_s_vs_trl']:.2f}" if "tokens_per_s_vs_trl" in r else "-"
            system = r["system"] + (f" (teacher: {r['teacher_launch']})" if "teacher_launch" in r else "")
            lines.append(f"| {system} | {r['tokens_per_s']:.0f} | {r['step_s']:.3f} | {_mib(r['peak_rss_trainer'])} | "
                         f"{_mib(r['peak_rss_teacher'])} | {_mib(r.get('peak_pss_total'))} | {vs} | {phases} |")
        lines.append("")
    return lines
