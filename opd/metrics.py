"""Metrics a user sees: one JSON line per step, TensorBoard when installed, PNG plots at the end.

Shared by `opd train`, `opd rl` and `opd validate`, so every run directory looks the same:
    RUN/metrics.jsonl   {"step": int, "time": float, name: value, ...} per line
    RUN/plots/*.png     one plot per metric group, over steps
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            # A resumed run rewrites history from its checkpoint on: drop lines past it so
            # metrics.jsonl never reports a step twice.
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self._f = self.path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tb"))
            except Exception:  # tensorboard not installed: JSONL and plots only
                self._tb = None

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, "time": round(time.time(), 3)}
        for k, v in metrics.items():
            if hasattr(v, "item"):
                v = v.item()
            if isinstance(v, float) and not math.isfinite(v):
                v = None if math.isnan(v) else (1e308 if v > 0 else -1e308)
            row[k] = v
        # An OSError here (disk full) propagates with the path: the caller stops cleanly.
        try:
            self._f.write(json.dumps(row) + "\n")
            self._f.flush()
        except OSError as e:
            raise OSError(e.errno, f"cannot write metrics to {self.path}: {e.strerror}") from e
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k not in ("step", "time"):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def plot_metrics(run_dir: str | Path, groups: dict[str, list[str]]) -> list[Path]:
    """One PNG per group: `groups = {"loss": ["loss", "loss/math"], ...}`; keys matched by prefix too.

    Returns the files written. Metrics absent from the log are skipped.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for title, keys in groups.items():
        names = sorted({k for r in rows for k in r
                        if any(k == key or k.startswith(key + "/") for key in keys)})
        if not names:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name in names:
            pts = [(r["step"], r[name]) for r in rows if isinstance(r.get(name), (int, float))]
            if pts:
                ax.plot(*zip(*pts), label=name, marker="." if len(pts) < 30 else None)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{title.replace('/', '_')}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
