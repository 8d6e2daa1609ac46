"""What a teacher server process and whoever started it agree on, in one module that both
import: serve.py (the server's side) and launch.py (the launcher's side).

- the ready line the server prints (and a forked one writes to its pipe) once it serves:
  `READY` then `key=value` fields, values shell-quoted (`name='Qwen2.5 Math 7B'`);
- dying with the parent: a launcher sets `PARENT_ENV` to its pid, the server calls
  `die_with_parent` with it, and Linux sends the server SIGTERM when that parent goes.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal

READY = "opd-teacher ready"
PARENT_ENV = "OPD_TEACHER_PARENT_PID"   # set: `opd serve-teacher` dies with that process (die_with_parent)


def ready_line(fields: dict) -> str:
    """The startup line: READY, then each field as key=value (the value shell-quoted)."""
    return " ".join([READY, *(f"{k}={shlex.quote(str(v))}" for k, v in fields.items())])


def parse_ready_line(line: str) -> dict[str, str]:
    """The fields of a ready line; ValueError when it does not parse."""
    return dict(kv.split("=", 1) for kv in shlex.split(line[len(READY):]))


def die_with_parent(parent: int) -> None:
    """Ask Linux for SIGTERM when the parent dies, so a killed trainer leaves no teacher behind.
    (Linux's "parent" is the thread that made this process: a trainer starts its teachers from
    threads that live as long as the teachers should.)"""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl: not Linux
        return
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)
