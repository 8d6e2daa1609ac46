"""What the memory benchmarks (kernels.py, grpo.py) share: one case per fresh process, and
the peak memory a case adds above what its process held before it.

    run_case(module, spec, timeout, error_row, env)   `python -m MODULE --worker SPEC` -> its row
    PeakMemory(torch, device)                           .extra(): peak bytes since it was made
    pick_device(device), write_rows(path, rows)          --device auto, --json FILE

A process per case keeps one case's allocator caches and peak out of the next one's figure.
On CUDA the peak is the caching allocator's (`max_memory_allocated`); on the CPU it is the
process's peak resident set (VmHWM), reset to the current RSS first where Linux allows it.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable


def run_case(module: str, spec: dict, timeout: float, error_row: Callable[..., dict],
             env: dict | None = None) -> dict:
    """The row a case's worker prints as its last JSON line; error_row(spec, error=TEXT) when the
    worker times out, fails or prints none."""
    cmd = [sys.executable, "-m", module, "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        return error_row(spec, error=f"timeout after {timeout:.0f} s")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return error_row(spec, error=f"exit {proc.returncode}: {tail[0][:200]}")
    return json.loads(lines[-1])


def pick_device(device: str) -> str:
    """--device: auto is cuda when torch sees a GPU, else cpu (torch imported only then)."""
    if device != "auto":
        return device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def write_rows(path: str | None, rows: list[dict]) -> None:
    """--json FILE: the rows, its folder made first (no file when `path` is None)."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


class PeakMemory:
    """Peak memory of this process from now on, above what it holds now, in bytes."""

    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.base = _rss_bytes("VmRSS") if _reset_peak() else _rss_bytes("VmHWM")

    def extra(self) -> int:
        peak = self.torch.cuda.max_memory_allocated() if self.cuda else _rss_bytes("VmHWM")
        return peak - self.base


def _rss_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")   # resets VmHWM to the current RSS
        return True
    except OSError:
        return False
