"""Run untrusted Python (a model's answer) against unit tests in a separate, limited process.

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
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Status = Literal["ok", "error", "timeout", "crash", "no_tests"]


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0          # wall clock, whole run (solution + all tests)
    memory_mb: int = 512            # RLIMIT_AS
    max_file_mb: int = 16           # RLIMIT_FSIZE
    max_processes: int = 64         # RLIMIT_NPROC (per user)
    allow_subprocess: bool = False  # let the code fork/exec (still under the limits above)


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


_BOOTSTRAP = Path(__file__).with_name("_sandbox_child.py")


def _world_readable(path: Path) -> bool:
    """Every directory from / down to `path` is searchable by others (so `nobody` can import)."""
    p = path.resolve()
    for d in [p, *p.parents]:
        if not d.exists() or not (d.stat().st_mode & stat.S_IXOTH):
            return False
    return True


def _drop_to_nobody() -> bool:
    if os.geteuid() != 0:
        return False
    import sysconfig

    needed = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    return all(_world_readable(p) for p in needed)


def _site_packages() -> list[str]:
    import sysconfig

    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def _is_count(value) -> bool:
    """A plain non-negative int (json gives bools and floats too, and int(0.5) would be 0)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_results(raw: str, token: str) -> tuple[dict[int, tuple[bool, str]], dict | None]:
    """The harness's result lines: per-test results by index, and its final `done` line.

    A line the solution wrote with the token (it can find it, see the module docstring) must
    not score above the harness: only indices 0 <= index < total count, each once (the first
    line wins), so `passed` never exceeds `total`. Without a `done` line nothing is filtered
    (the run scores 0 anyway).
    """
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
    t0 = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="opd-sandbox-"))
    token = secrets.token_hex(16)
    drop = _drop_to_nobody()
    read_fd, write_fd = os.pipe()
    try:
        if drop:
            os.chown(workdir, 65534, 65534)
        config = {"workdir": str(workdir), "token": token, "result_fd": write_fd, "drop_to_nobody": drop,
                  "memory_mb": limits.memory_mb, "max_file_mb": limits.max_file_mb,
                  "max_processes": limits.max_processes, "cpu_s": int(limits.timeout_s) + 1,
                  "allow_subprocess": limits.allow_subprocess, "site_packages": _site_packages()}
        env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with open(workdir / "stdout.txt", "wb") as out, open(workdir / "stderr.txt", "wb") as err:
            # -S: skip site's .pth hooks (a third of the start-up time); the child adds
            # site-packages to sys.path itself, so installed libraries still import.
            # The config (with the result token) goes in on stdin, not the command line: the
            # solution can read sys.argv and /proc/self/cmdline.
            proc = subprocess.Popen([sys.executable, "-I", "-S", str(_BOOTSTRAP)],
                                    stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=workdir, env=env,
                                    pass_fds=(write_fd,), start_new_session=True)
        os.close(write_fd)
        write_fd = -1
        timed_out = False
        try:
            proc.stdin.write(json.dumps({"config": config, "code": code, "tests": tests}).encode())
            proc.stdin.close()
        except BrokenPipeError:  # the child died at start-up
            pass
        chunks = []
        os.set_blocking(read_fd, False)
        deadline = t0 + limits.timeout_s
        while True:
            chunks.append(_read_available(read_fd))
            if proc.poll() is not None:
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.01)
        _kill_group(proc)
        chunks.append(_read_available(read_fd))
        results, done = _parse_results(b"".join(chunks).decode(errors="replace"), token)
        stderr_tail = _tail(workdir / "stderr.txt")
        seconds = time.monotonic() - t0
        if timed_out:
            return SandboxResult(0, done["total"] if done else len(results), "timeout", seconds,
                                 f"killed after {limits.timeout_s:.1f}s", bool(done and done.get("netns")))
        if done is None:
            return SandboxResult(0, len(results), "crash", seconds,
                                 f"exit code {proc.returncode}; {stderr_tail}")
        passed = sum(ok for ok, _ in results.values())
        first_fail = next((e for ok, e in sorted(results.values(), key=lambda x: x[0]) if not ok), "")
        status: Status = "no_tests" if done["total"] == 0 else ("error" if done.get("error") else "ok")
        return SandboxResult(passed if not done.get("error") else 0, done["total"], status, seconds,
                             done.get("error") or first_fail, bool(done.get("netns")))
    finally:
        for fd in (read_fd, write_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        shutil.rmtree(workdir, ignore_errors=True)


def _read_available(fd: int) -> bytes:
    out = []
    while True:
        try:
            b = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not b:
            break
        out.append(b)
        if sum(map(len, out)) > 4 << 20:  # a spamming child gets no more of our memory
            break
    return b"".join(out)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(path: Path, n: int = 400) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-n:].decode(errors="replace").strip()


def run_many(jobs: list[tuple[str, str]], limits: SandboxLimits = SandboxLimits(),
             workers: int = 2) -> list[SandboxResult]:
    """run_tests for each (code, tests), `workers` at a time, results in input order."""
    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda job: run_tests(job[0], job[1], limits), jobs))
