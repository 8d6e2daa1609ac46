"""What `opd bench step` measures of its processes: CPU seconds, peak RSS, the peak summed PSS."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads (0 once it has exited)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    f = f[f.rindex(")") + 2:].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def wait_child(proc: subprocess.Popen) -> tuple[int, int]:
    """(exit code, peak RSS bytes) of a child process."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss * 1024


class GroupMemory:
    """Peak of the summed PSS of groups of processes, sampled every `interval_s`.

    Summing RSS would count twice the file pages two processes share (libtorch's code is
    mapped by the trainer and the teacher server alike), and the copy-on-write pages a forked
    teacher shares with its trainer; PSS splits each shared page among the processes that map
    it, so the sum is what the group takes. Each pid counts with its descendants (a trainer's
    forked teacher servers). This driver process never imports torch (the models are built in
    a subprocess), so it holds no share.
    """

    def __init__(self, interval_s: float = 0.05):
        import threading

        self.pids: list[int] = []
        self.peak = 0
        self.hwm: dict[int, int] = {}   # every pid seen (roots and descendants) -> its peak RSS (VmHWM)
        # (wall time, CPU seconds of every process of the group so far): the CPU a system spent
        # between two moments, all its processes and threads (opd: trainer + teacher server).
        self.cpu: list[tuple[float, float]] = []
        self._cpu_of: dict[int, float] = {}     # last reading per pid: an exited one keeps its share
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _status(pid: int, key: str, file: str = "smaps_rollup") -> int:
        try:
            for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        except OSError:  # the process has exited
            pass
        return 0

    @staticmethod
    def family(pid: int) -> list[int]:
        """`pid` and its descendants."""
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            try:
                for task in os.listdir(f"/proc/{p}/task"):
                    todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
            except OSError:
                pass
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            pids = [p for root in list(self.pids) for p in self.family(root)]
            self.peak = max(self.peak, sum(self._status(p, "Pss:") for p in pids))
            for p in pids:
                self.hwm[p] = max(self.hwm.get(p, 0), self._status(p, "VmHWM:", "status"))
                self._cpu_of[p] = max(self._cpu_of.get(p, 0.0), _cpu_seconds(p))
            self.cpu.append((time.time(), sum(self._cpu_of.values())))

    def cpu_between(self, t0: float, t1: float) -> float:
        """CPU seconds the group spent between wall times t0 and t1 (linear between samples)."""
        import numpy as np

        t, c = np.array(self.cpu).T
        return float(np.interp(t1, t, c) - np.interp(t0, t, c))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak
