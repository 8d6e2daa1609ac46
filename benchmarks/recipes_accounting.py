"""`opd bench recipes`: the CPU-seconds of a process tree, read from /proc (every process of a run)."""

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

REPO = Path(__file__).resolve().parent.parent


_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, CPU seconds): its own user + sys time plus that of the children it reaped
    (fields 14-17 of /proc/PID/stat). A process still in /proc (a zombie too) counts its own
    time here; once reaped, its time (and its reaped children's) is in its parent's."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
        except OSError:          # gone between listdir and open
            continue
        rest = raw[raw.rfind(b")") + 2:].split()
        utime, stime, cutime, cstime = (int(x) for x in rest[11:15])
        out[int(name)] = (int(rest[1]), (utime + stime + cutime + cstime) / _CLK)
    return out


def tree_cpu(roots, table: dict | None = None) -> float:
    """CPU seconds of the processes `roots` and every descendant still in /proc, with all the
    children any of them reaped: the whole tree's CPU so far (orphans re-parented to init are
    lost; what the trainers start, they wait for)."""
    table = proc_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, stack, seen = 0.0, [r for r in roots if r in table], set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += table[pid][1]
        stack.extend(children.get(pid, ()))
    return total


def at(timeline: list[tuple[float, float]], t: float) -> float:
    """The timeline's value at time t, linearly interpolated (clamped at its ends)."""
    if not timeline:
        return 0.0
    if t <= timeline[0][0]:
        return timeline[0][1]
    for (t0, c0), (t1, c1) in zip(timeline, timeline[1:]):
        if t <= t1:
            return c0 if t1 <= t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)
    return timeline[-1][1]


@dataclass
class Counted:
    rc: int
    line: list[tuple[float, float]]          # (wall time, CPU-s of the process tree)
    extra: list[tuple[float, float]]         # (wall time, CPU-s of the `also` trees since the start)
    wall_s: float
    stopped: bool                            # stopped by the budget (SIGTERM from here)

    @property
    def cpu_s(self) -> float:
        return self.line[-1][1] + (self.extra[-1][1] if self.extra else 0.0)


def run_counted(cmd: list[str], log: Path, env: dict | None, *, also: list[int] = (), offset: float = 0.0,
                budget: float | None = None, interval: float = 0.2, cwd: Path = REPO) -> Counted:
    """Run `cmd`, sampling every `interval` s the CPU time of its process tree and of the trees
    of `also` (the teacher servers: what they spend while it runs is its cost too). When
    offset + both reach `budget`, the process gets SIGTERM (SIGKILL 10 s later). The tree's
    last point is the exact total from wait4: the process and every child it waited for."""
    log.parent.mkdir(parents=True, exist_ok=True)
    also = list(also)
    base = tree_cpu(also) if also else 0.0
    t0 = time.time()
    line, extra, stopped, term_at = [(t0, 0.0)], [(t0, 0.0)] if also else [], False, None
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                table, t = proc_table(), time.time()
                line.append((t, max(tree_cpu([proc.pid], table), line[-1][1])))
                if also:
                    extra.append((t, max(tree_cpu(also, table) - base, extra[-1][1])))
                used = offset + line[-1][1] + (extra[-1][1] if also else 0.0)
                if budget and used >= budget and term_at is None:
                    proc.send_signal(signal.SIGTERM)
                    stopped, term_at = True, t
                elif term_at is not None and t - term_at > 10:
                    proc.kill()
                time.sleep(interval)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    t1 = time.time()
    line.append((t1, max(usage.ru_utime + usage.ru_stime, line[-1][1])))
    if also:
        extra.append((t1, max(tree_cpu(also) - base, extra[-1][1])))
    return Counted(proc.returncode, line, extra, t1 - t0, stopped)


