"""Training cards: what a result needs to be reproduced, next to the result.

`write_card(run_dir, title, facts)` writes RUN/card.json (the facts, machine-readable)
and RUN/card.md (the same facts as sections of bullet points). Trainers pass every
setting that changes the objective: divergence direction, temperature, T^2 scaling,
top-k or full (and the tail mass top-k cut off), GRPO group size, the SFT mix, seeds.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path


def _md_value(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_md_value(x) for x in v) if v else "(none)"
    if isinstance(v, dict):
        return "; ".join(f"{k}: {_md_value(x)}" for k, x in v.items()) if v else "(none)"
    return str(v)


def write_card(run_dir: str | Path, title: str, facts: dict[str, dict]) -> tuple[Path, Path]:
    """facts: {section: {name: value}}; returns (card.md, card.json)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    facts = {**facts, "environment": {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "written": time.strftime("%Y-%m-%d %H:%M:%S"), **facts.get("environment", {})}}
    lines = [f"# {title}", ""]
    for section, items in facts.items():
        lines += [f"## {section}", ""]
        lines += [f"- **{k}**: {_md_value(v)}" for k, v in items.items()]
        lines.append("")
    md, js = run_dir / "card.md", run_dir / "card.json"
    md.write_text("\n".join(lines))
    js.write_text(json.dumps(facts, indent=1, default=str))
    return md, js
