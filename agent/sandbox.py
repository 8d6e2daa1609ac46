"""Run untrusted Python in a separate, limited process: a model's answer against unit tests
(`run_tests`, code rewards) and one call of a tool function (`call_function`, agentic rollouts).
The launch itself is sandbox_process.py's; the child's side is _sandbox_child.py.

What is enforced, and how (read this before trusting it with hostile code):
- **Time**: the parent kills the child's whole process group with SIGKILL at `timeout_s`
  (the child runs in its own session); RLIMIT_CPU backs this up. A timeout scores 0.
- **Memory**: RLIMIT_AS caps the child's address space; an allocation past it raises
  MemoryError (the test fails) or kills the child (scores 0).
- **Network**: the child first tries to move into a fresh network namespace
  (`unshare(CLONE_NEWNET)`, or with a user namespace when not root); there only a downed
  loopback exists, so nothing is reachable. Whether that worked is reported in
  `SandboxResult.isolated_network`. In every case an audit hook raises on socket creation,
  connect, bind and name lookups.
- **Files**: the working directory (also HOME and TMPDIR) is a fresh temporary directory,
  removed afterwards. An audit hook refuses open() for writing, and remove/rename/mkdir/
  chmod/..., on any path outside it (except /dev/null); RLIMIT_FSIZE caps any file's size
  (stdout and stderr go to files there too, so output spam is capped the same way).
- **Processes**: RLIMIT_NPROC caps the processes of the child's user (a fork-bomb guard;
  the kernel ignores it for root, so when the parent runs as root the child drops to
  `nobody` if the Python installation is readable by it, and otherwise stays root). The
  audit hook also refuses fork, exec, spawn, system, subprocess and kill unless
  `allow_subprocess` is set, and ctypes calls are refused after start-up.
Audit hooks are not a security boundary against code written to escape them (CPython
says so); the kernel-enforced limits are the process group kill, rlimits and the network
namespace. With `allow_subprocess`, a process that starts its own session (setsid) leaves
the process group and outlives the kill.
The result protocol is a pipe with a per-run random token, given on stdin (the command
line is readable from the solution). The solution runs in the harness's process, so code
written to find the token can still forge results: the hook refuses the easy ways (the
collector's object lists, other threads' frames, /proc/*/mem) but not walking up its own
stack with sys._getframe, which namedtuple, enum, warnings and logging need. A solution can
also return objects whose __eq__ always holds. An RL policy is an optimizer against this
reward: for untrusted models at scale, run it inside a container or VM, and check rewards
that look too good.

Each top-level `assert` in the tests is one test, run separately after the solution and
any non-assert setup lines; the reward is the fraction that passed. A hang, a crash or a
solution that does not even run scores 0.

A tool call (`call_function`) loads the tool's module first (the operator's code, before
the limits and the audit hook), then calls the function limited: its answer is what it
printed and its return value, or the error it raised; a hang, a crash or output spam comes
back as a status and a short text, never an exception. Code the python tool runs can forge
its own answer the same way, which only changes what the model itself reads.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from opd.agent.sandbox_process import SandboxLimits, run_child

Status = Literal["ok", "error", "timeout", "crash", "no_tests"]
CallStatus = Literal["ok", "error", "timeout", "crash"]


@dataclass
class SandboxResult:
    passed: int
    total: int
    status: Status
    seconds: float
    detail: str = ""                # first failure, error or stderr tail
    isolated_network: bool = False

    @property
    def reward(self) -> float:
        if self.status in ("timeout", "crash") or self.total == 0:
            return 0.0
        # The share of tests passed, 0..1 (_parse_results already keeps passed <= total).
        return min(1.0, max(0.0, self.passed / self.total))


@dataclass
class CallResult:
    """One tool call's answer. ok: what it printed, then its return value. Otherwise the
    error line first (it must survive any cut), then what it printed before. `text` is the
    head of that answer; `omitted` counts what was not read back from the child (printed
    output past _CALL_STDOUT_BYTES, a return value past _CALL_VALUE_CHARS)."""
    status: CallStatus
    text: str
    seconds: float
    omitted: int = 0


def _is_count(value) -> bool:
    """A plain non-negative int (json gives bools and floats too, and int(0.5) would be 0)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _messages(raw: str, token: str) -> list[dict]:
    """The JSON objects on the result pipe's lines that carry the run's token."""
    messages = []
    for line in raw.splitlines():
        parts = line.split(" ", 1)
        if len(parts) != 2 or parts[0] != token:
            continue
        try:
            msg = json.loads(parts[1])
        except json.JSONDecodeError:
            continue
        if isinstance(msg, dict):
            messages.append(msg)
    return messages


def _parse_results(raw: str, token: str) -> tuple[dict[int, tuple[bool, str]], dict | None]:
    """The harness's result lines: per-test results by index, and its final `done` line.

    A line the solution wrote with the token (it can find it, see the module docstring) must
    not score above the harness: only indices 0 <= index < total count, each once (the first
    line wins), so `passed` never exceeds `total`. Without a `done` line nothing is filtered
    (the run scores 0 anyway).
    """
    messages = _messages(raw, token)
    done = next((m for m in messages if m.get("kind") == "done" and _is_count(m.get("total"))), None)
    tests: dict[int, tuple[bool, str]] = {}
    for msg in messages:
        index = msg.get("index")
        if msg.get("kind") != "test" or not _is_count(index) or index in tests:
            continue
        if done is not None and index >= done["total"]:
            continue
        tests[index] = (msg.get("ok") is True, str(msg.get("error", "")))
    return tests, done


def run_tests(code: str, tests: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code`, then each assert of `tests`, in a limited child process; never raises for bad code."""
    run = run_child({"mode": "tests", "code": code, "tests": tests}, limits)
    results, done = _parse_results(run.raw, run.token)
    if run.timed_out:
        return SandboxResult(0, done["total"] if done else len(results), "timeout", run.seconds,
                             f"killed after {limits.timeout_s:.1f}s", bool(done and done.get("netns")))
    if done is None:
        return SandboxResult(0, len(results), "crash", run.seconds,
                             f"exit code {run.returncode}; {run.stderr_tail}")
    passed = sum(ok for ok, _ in results.values())
    first_fail = next((e for ok, e in sorted(results.values(), key=lambda x: x[0]) if not ok), "")
    status: Status = "no_tests" if done["total"] == 0 else ("error" if done.get("error") else "ok")
    return SandboxResult(passed if not done.get("error") else 0, done["total"], status, run.seconds,
                         done.get("error") or first_fail, bool(done.get("netns")))


def run_many(jobs: list[tuple[str, str]], limits: SandboxLimits = SandboxLimits(),
             workers: int = 2) -> list[SandboxResult]:
    """run_tests for each (code, tests), `workers` at a time, results in input order."""
    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda job: run_tests(job[0], job[1], limits), jobs))


# What of a tool call's answer comes back from the child: a model reads a few thousand
# characters of it at most (AgentConfig.max_output_chars), so a few hundred KB is plenty.
_CALL_STDOUT_BYTES = 256 << 10
_CALL_VALUE_CHARS = 100_000


def _import_paths() -> list[str]:
    """The parent's sys.path as absolute folders: a module the parent imports, the child does."""
    return [str(Path(p or ".").resolve()) for p in sys.path if Path(p or ".").is_dir()]


def call_function(ref: str, arguments: dict, limits: SandboxLimits = SandboxLimits()) -> CallResult:
    """Call the function `ref` ('module:function' or '/abs/FILE.py:function') with the keyword
    `arguments` (JSON values) in a limited child process, under the same limits as run_tests.
    Never raises for what the function does; raises TypeError for arguments that are not JSON."""
    job = {"mode": "call", "ref": ref, "arguments": arguments, "sys_path": _import_paths(),
           "max_chars": _CALL_VALUE_CHARS}
    run = run_child(job, limits, read_stdout=_CALL_STDOUT_BYTES, max_result_bytes=1 << 20)
    done = next((m for m in _messages(run.raw, run.token) if m.get("kind") == "done"), None)
    printed, omitted = run.stdout, run.stdout_omitted

    def failed(status: CallStatus, line: str) -> CallResult:
        return CallResult(status, line + ("\n" + printed if printed else ""), run.seconds, omitted)

    if run.timed_out:
        return failed("timeout", f"timed out after {limits.timeout_s:g} s")
    if run.overflow:
        return failed("crash", "its answer was too long (killed)")
    if done is None:
        how = f"killed by signal {-run.returncode}" if (run.returncode or 0) < 0 else f"exit code {run.returncode}"
        tail = run.stderr_tail.splitlines()[-1] if run.stderr_tail else ""
        return failed("crash", f"the process ended without an answer ({how}){'; ' + tail if tail else ''}")
    if done.get("ok") is not True:
        return failed("error", str(done.get("error", "unknown error")))
    value = str(done.get("text", ""))
    length = done.get("length") if isinstance(done.get("length"), int) else len(value)
    if omitted:   # printed output was cut: the value after it is part of what is missing
        return CallResult("ok", printed, run.seconds, omitted + length)
    sep = "\n" if printed and value and not printed.endswith("\n") else ""
    return CallResult("ok", printed + sep + value, run.seconds, max(0, length - len(value)))
