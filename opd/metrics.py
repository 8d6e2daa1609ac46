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
            kept = [json.dumps(r) for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        # Unbuffered: one os-level write per line, so a failed write can be undone exactly.
        self._f = self.path.open("ab", buffering=0)
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
        # A failed write (disk full) must not leave a torn last line that would break every
        # later read and --resume: cut the file back to where the line began, then raise.
        data = (json.dumps(row) + "\n").encode()
        start = self._f.tell()
        try:
            written = self._f.write(data)
            if written != len(data):
                raise OSError(28, "short write (No space left on device?)")
        except OSError as e:
            try:
                self._f.truncate(start)
                self._f.seek(start)
            except OSError:
                pass
            raise OSError(e.errno, f"cannot write metrics to {self.path}: {e.strerror or e}") from e
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k not in ("step", "time"):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict]:
    """Every complete line of a metrics.jsonl (a torn last line from a crash is ignored)."""
    p = Path(path)
    if not p.exists():
        return []
    rows = []
    lines = p.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise ValueError(f"{p}:{i + 1}: not a JSON line") from None
    return rows


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
