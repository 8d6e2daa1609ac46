"""Start `opd serve-teacher` and wait until it serves: as a subprocess (tests, demo, scripts)
or forked from this process (`opd train` with cluster.mode: fork).

    with start_server_process(["--model", model_dir, "--max-k", "16"]) as server:
        client = TeacherClient(server.address)
        ...
    # leaving the block sends SIGTERM and waits for the server to drain

`start_server_process(args)` and `fork_server(args, log_path=...)` return a `ServerProcess`:
`.proc` (a Popen, or for a forked server a `ForkedProcess` with the same pid/poll/wait/
send_signal/kill), `.address`, `.model_fingerprint`, `.tokenizer_fingerprint`, `.output`
(a subprocess's first line and latest ~1000, collected by a reader thread; a forked server
writes its log file instead), `.stop()`, `.kill()`. It also unpacks as `proc, address = ...`.

The ready line and `PARENT_ENV` / `die_with_parent` (importable from here too) are defined
in teachers/lifecycle.py, which the server's side (serve.py) shares.

This module imports the server (serve.py, with torch and the backends) only in a forked
child, where it runs it: the launcher itself is imported by processes that only start and
watch servers (a Ray supervisor actor per replica), which would otherwise hold torch's
hundreds of MiB for nothing. `opd train` imports serve.py before it forks (opd.distill.launch).
"""

from __future__ import annotations

import argparse
import gc
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from opd.teachers.lifecycle import PARENT_ENV, READY, die_with_parent, parse_ready_line


@dataclass
class ServerProcess:
    proc: subprocess.Popen | ForkedProcess
    address: str
    model_fingerprint: str
    tokenizer_fingerprint: str
    output: list[str] = field(default_factory=list)

    def __iter__(self):
        return iter((self.proc, self.address))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self, timeout_s: float = 90.0) -> int:
        """SIGTERM (drain), then SIGKILL if it has not exited after `timeout_s` (longer than the
        server's own drain_timeout_s, 60 s, so that it can answer SHUTTING_DOWN). Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def kill(self) -> int:
        """SIGKILL: the crash a fault test wants."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for tests and scripts that must name a port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_server_process(args: list[str], *, timeout_s: float = 180.0, env: dict | None = None,
                         threads: int | None = 1, die_with_parent: bool = False) -> ServerProcess:
    """Run `python -m opd.cli serve-teacher *args`; return once it printed its ready line.

    Without `--bind` in args it binds a free loopback port. `threads` caps torch/OMP threads
    of the server (None: leave the defaults). `die_with_parent`: the server gets SIGTERM when
    the thread that started it ends, as a forked one does (what a trainer wants: no orphan
    teachers after a crash). Raises RuntimeError with the server's output if it exits or
    stays silent for `timeout_s`.
    """
    args = [str(a) for a in args]
    if not _has_option(args, "--bind"):
        args += ["--bind", "tcp://127.0.0.1:*"]
    full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    if die_with_parent:
        full_env[PARENT_ENV] = str(os.getpid())
    if threads:
        full_env.setdefault("OMP_NUM_THREADS", str(threads))
        if not _has_option(args, "--threads"):   # the caller's own --threads wins
            args += ["--threads", str(threads)]
    return spawn_until_ready([sys.executable, "-m", "opd.cli", "serve-teacher", *args], full_env, timeout_s)


def spawn_until_ready(cmd: list[str], env: dict, timeout_s: float) -> ServerProcess:
    """Start any command that ends up serving a teacher; return once it printed the ready line.

    Shared by `start_server_process` and by tests that serve a custom backend through
    `opd.teachers.serve` in their own script. Raises RuntimeError with the process's output
    if it exits or stays silent for `timeout_s`.
    """
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    output: list[str] = []
    found: list[str] = []            # the ready line, kept apart: `output` is trimmed
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            output.append(line.rstrip("\n"))
            if line.startswith(READY) and not found:
                found.append(output[-1])
                ready.set()
            if len(output) > 2000:   # a server that runs for days: keep its first and latest lines
                del output[1:1001]
        ready.set()

    threading.Thread(target=read, name="teacher-output", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.1):
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"teacher server not ready after {timeout_s}s:\n" + "\n".join(output[-40:]))
    if not found:
        proc.wait(timeout=10)
        raise RuntimeError(f"teacher server exited with {proc.returncode}:\n" + "\n".join(output[-40:]))
    return _from_ready_line(proc, found[0], output)


def _has_option(args: list[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


def _from_ready_line(proc, line: str, output: list[str]) -> ServerProcess:
    """The server's handle from its ready line (values shell-quoted: a name may hold spaces).
    A line that does not parse kills the server rather than leaving it running unowned."""
    try:
        fields = parse_ready_line(line)
        return ServerProcess(proc, fields["address"], fields["model_fingerprint"], fields["tokenizer_fingerprint"],
                             output)
    except (ValueError, KeyError) as e:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"cannot read the teacher server's ready line ({e!r}): {line!r}") from None


# ---- forked servers ---------------------------------------------------------------------

class ForkUnsafe(RuntimeError):
    """Forking this process now is unsafe (other Python threads run, or CUDA is initialized):
    start the server as a subprocess instead."""


_live_forks: set[int] = set()  # pids of forked servers not yet reaped; gc stays frozen while any runs


class ForkedProcess:
    """The Popen subset ServerProcess uses, for a child made by os.fork()."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._reaped(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked teacher server {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _reaped(self, status: int) -> None:
        self.returncode = os.waitstatus_to_exitcode(status)
        _live_forks.discard(self.pid)
        if not _live_forks:
            gc.unfreeze()  # nothing shares our pages any more; let the collector see them again


def fork_server(args: list[str], *, log_path: str | Path, timeout_s: float = 180.0,
                env: dict[str, str] | None = None) -> ServerProcess:
    """Fork this process into `opd serve-teacher *args`; return once it serves.

    Why fork rather than start a fresh interpreter: the child begins with every module this
    process has imported (torch and transformers with what loading a model pulls in: the same
    heap in every process, whatever the model's size; docs/train.md) on copy-on-write pages, so the trainer and
    its teacher hold that runtime once. Before forking, gc.freeze() moves every object into a
    generation the collector never scans, so collections in either process do not write to
    (and so copy) the shared pages; it is undone when the last forked server is reaped.

    Fork only a process that has not computed anything yet (`opd train` forks right after its
    imports): an OpenMP thread pool used before the fork hangs the child's first parallel
    region, and CUDA cannot be used in a child forked after it was initialized. This raises
    ForkUnsafe when other Python threads run (a lock one holds would stay held in the child
    forever) or CUDA is initialized. The server's output goes to `log_path`; its startup line
    comes back through a pipe. It gets SIGTERM when this process dies (Linux). `env` is set in
    the child before it loads anything (e.g. CUDA_VISIBLE_DEVICES: CUDA reads it at its first
    use, which in the child comes after). Raises RuntimeError with the log's tail if it exits
    or stays silent for `timeout_s`.
    """
    if threading.active_count() > 1:
        raise ForkUnsafe(f"{threading.active_count()} Python threads run in this process "
                         f"({[t.name for t in threading.enumerate()]})")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise ForkUnsafe("CUDA is initialized in this process")
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()  # else the child inherits and writes our buffered output
    sys.stderr.flush()
    gc.collect()
    gc.freeze()
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        if not _live_forks:
            gc.unfreeze()
        raise
    if pid == 0:  # the teacher server; it never returns into the caller's code
        os.close(read_fd)
        os.environ.update(env or {})
        _serve_forked(args, log_path, write_fd, parent)
    os.close(write_fd)
    _live_forks.add(pid)
    proc = ForkedProcess(pid)
    started = time.monotonic()
    line = _read_line(read_fd, timeout_s)
    if line is None or not line.startswith(READY):
        if time.monotonic() - started < timeout_s:   # the pipe closed: the child is exiting, reap it
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            why = f"not ready after {timeout_s}s"
        else:
            why = f"exited with {proc.returncode}"
        tail = log_path.read_text(errors="replace").splitlines()[-40:] if log_path.exists() else []
        raise RuntimeError(f"forked teacher server {why} (log {log_path}):\n" + "\n".join(tail))
    return _from_ready_line(proc, line, [])


def _serve_forked(args: list[str], log_path: Path, write_fd: int, parent: int) -> None:
    code = 1
    try:
        die_with_parent(parent)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        from opd.teachers import serve   # the server, in the child only (see the module docstring)

        parser = argparse.ArgumentParser(prog="opd serve-teacher (forked by opd train)")
        serve.add_arguments(parser)
        code = serve.run(parser.parse_args(args), on_ready=lambda line: os.write(write_fd, (line + "\n").encode()))
    except SystemExit as e:  # argparse's errors, with their message already in the log
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # not the parent's atexit handlers, not its interpreter teardown


def _read_line(fd: int, timeout_s: float) -> str | None:
    """The first line written to pipe `fd`; None at end of file (the writer exited) or timeout."""
    data, deadline = b"", time.monotonic() + timeout_s
    try:
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if select.select([fd], [], [], min(left, 0.5))[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    return None
                data += chunk
    finally:
        os.close(fd)
    return data.split(b"\n", 1)[0].decode()
