"""Launching the sandbox's limited child process (agent/_sandbox_child.py), shared by code
rewards' unit tests (sandbox.run_tests) and tool calls (sandbox.call_function).

One run: a fresh temporary working directory, the child in its own session with the job on
stdin, a wall-clock deadline after which the whole process group is killed, and what came
back read with a cap (a spamming child gets none of the parent's memory). What the child
enforces on itself is described in sandbox.py's docstring.
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
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0          # wall clock, whole run (start-up included)
    memory_mb: int = 512            # RLIMIT_AS
    max_file_mb: int = 16           # RLIMIT_FSIZE (stdout and stderr are files too)
    max_processes: int = 64         # RLIMIT_NPROC (per user)
    allow_subprocess: bool = False  # let the code fork/exec (still under the limits above)


@dataclass
class ChildRun:
    """What one child run left behind. `raw` holds the result pipe's lines ("TOKEN {json}")."""
    raw: str
    token: str
    timed_out: bool
    returncode: int | None
    seconds: float
    overflow: bool = False          # the child sent more than max_result_bytes: it was killed
    stdout: str = ""                # the first read_stdout bytes it printed
    stdout_omitted: int = 0         # bytes it printed past those
    stderr_tail: str = ""


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
    needed = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    return all(_world_readable(p) for p in needed)


def _site_packages() -> list[str]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def run_child(job: dict, limits: SandboxLimits, *, read_stdout: int = 0,
              max_result_bytes: int = 4 << 20) -> ChildRun:
    """Run `job` (the child's payload: its "mode" and inputs) in a limited child; never raises
    for what the child does. `read_stdout` > 0 reads back that many bytes of what it printed."""
    t0 = time.monotonic()
    token = secrets.token_hex(16)
    drop = _drop_to_nobody()
    job_json = json.dumps(job)      # before anything starts: arguments that are not JSON raise here
    workdir = Path(tempfile.mkdtemp(prefix="opd-sandbox-"))
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
        try:
            proc.stdin.write(('{"config": ' + json.dumps(config) + ', "job": ' + job_json + "}").encode())
            proc.stdin.close()
        except BrokenPipeError:  # the child died at start-up
            pass
        chunks: list[bytes] = []
        room = max_result_bytes
        os.set_blocking(read_fd, False)
        deadline = t0 + limits.timeout_s
        timed_out = overflow = False
        while True:
            chunks.append(_read_available(read_fd, room))
            room -= len(chunks[-1])
            if room <= 0:
                overflow = True
                break
            if proc.poll() is not None:
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.01)
        _kill_group(proc)
        if not overflow:
            chunks.append(_read_available(read_fd, room))
        run = ChildRun(b"".join(chunks).decode(errors="replace"), token, timed_out, proc.returncode,
                       time.monotonic() - t0, overflow, stderr_tail=_tail(workdir / "stderr.txt"))
        if read_stdout > 0:
            run.stdout, run.stdout_omitted = _head(workdir / "stdout.txt", read_stdout)
        return run
    finally:
        for fd in (read_fd, write_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        shutil.rmtree(workdir, ignore_errors=True)


def _read_available(fd: int, limit: int) -> bytes:
    out = []
    while limit > 0:
        try:
            b = os.read(fd, min(65536, limit))
        except BlockingIOError:
            break
        if not b:
            break
        out.append(b)
        limit -= len(b)
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
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - n))
            data = f.read(n)
    except OSError:
        return ""
    return data.decode(errors="replace").strip()


def _head(path: Path, n: int) -> tuple[str, int]:
    """The first `n` bytes of a file as text, and how many bytes it holds past them."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(n)
    except OSError:
        return "", 0
    return data.decode(errors="replace"), max(0, size - len(data))
