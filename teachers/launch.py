"""Start `opd serve-teacher` as a subprocess and wait until it serves (tests, demo, scripts).

    with start_server_process(["--model", model_dir, "--max-k", "16"]) as server:
        client = TeacherClient(server.address)
        ...
    # leaving the block sends SIGTERM and waits for the server to drain

`start_server_process(args)` returns a `ServerProcess`: `.proc` (Popen), `.address`,
`.model_fingerprint`, `.tokenizer_fingerprint`, `.output` (every line the server printed,
stdout and stderr, collected by a reader thread), `.stop()`, `.kill()`. It also unpacks
as `proc, address = start_server_process(args)`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from opd.teachers.serve import READY


@dataclass
class ServerProcess:
    proc: subprocess.Popen
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

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (drain), then SIGKILL if it has not exited after `timeout_s`. Returns the exit code."""
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
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_server_process(args: list[str], *, timeout_s: float = 180.0, env: dict | None = None,
                         threads: int | None = 1) -> ServerProcess:
    """Run `python -m opd.cli serve-teacher *args`; return once it printed its ready line.

    Without `--bind` in args it binds a free loopback port. `threads` caps torch/OMP threads
    of the server (None: leave the defaults). Raises RuntimeError with the server's output
    if it exits or stays silent for `timeout_s`.
    """
    args = [str(a) for a in args]
    if "--bind" not in args:
        args += ["--bind", "tcp://127.0.0.1:*"]
    full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    if threads:
        full_env.setdefault("OMP_NUM_THREADS", str(threads))
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
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            output.append(line.rstrip("\n"))
            if line.startswith(READY):
                ready.set()
        ready.set()

    threading.Thread(target=read, name="teacher-output", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.1):
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"teacher server not ready after {timeout_s}s:\n" + "\n".join(output[-40:]))
    line = next((l for l in output if l.startswith(READY)), None)
    if line is None:
        proc.wait(timeout=10)
        raise RuntimeError(f"teacher server exited with {proc.returncode}:\n" + "\n".join(output[-40:]))
    fields = dict(kv.split("=", 1) for kv in line[len(READY):].split())
    return ServerProcess(proc, fields["address"], fields["model_fingerprint"], fields["tokenizer_fingerprint"], output)
