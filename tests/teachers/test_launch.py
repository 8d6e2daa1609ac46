"""Starting teacher servers: forked from a process after its imports (cluster.mode fork).

A forked server must serve like a spawned one, hand its startup line back, report a failed
start with its log, refuse to fork a process with other threads, and never outlive its
parent. The forking runs in a fresh interpreter: this pytest process has threads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from oracles import process_gone

from opd.teachers.launch import ForkUnsafe, fork_server

pytestmark = pytest.mark.timeout(180)


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=150,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_forked_server_serves_reports_failures_and_stops(tiny_model_dir, tmp_path):
    res = _python(f"""
        import json, os
        from opd.teachers.launch import fork_server
        from opd.teachers.client import TeacherClient
        out = {{}}
        try:
            fork_server(["--model", {str(tmp_path / "nowhere")!r}], log_path={str(tmp_path / "bad.log")!r}, timeout_s=60)
        except RuntimeError as e:
            out["bad"] = str(e)
        s = fork_server(["--model", {str(tiny_model_dir)!r}, "--bind", "tcp://127.0.0.1:*", "--max-k", "8",
                         "--threads", "1"], log_path={str(tmp_path / "good.log")!r},
                        env={{"CUDA_VISIBLE_DEVICES": "3"}})
        out["parent_gpus"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        client = TeacherClient(s.address)
        w = client.info()
        client.close()
        out.update(pid=s.proc.pid, parent=os.getpid(), address=s.address, fp=s.tokenizer_fingerprint,
                   welcome_fp=w.tokenizer_fingerprint, max_k=w.max_k, code=s.stop())
        print("RESULT " + json.dumps(out))
    """)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(next(l for l in res.stdout.splitlines() if l.startswith("RESULT "))[7:])
    assert "exited with" in out["bad"] and "bad.log" in out["bad"]
    assert "nowhere" in out["bad"]                     # the log's tail names what failed
    assert out["pid"] != out["parent"] and out["address"].startswith("tcp://127.0.0.1:")
    assert out["fp"] == out["welcome_fp"] and out["max_k"] == 8
    assert out["code"] == 0 and process_gone(out["pid"])
    log = (tmp_path / "good.log").read_text()
    assert "opd-teacher ready address=" + out["address"] in log and "opd-teacher stopped" in log
    # the child alone sees the GPUs it was given (cluster.teachers gpus)
    assert "device=cpu cuda_visible_devices=3" in log and out["parent_gpus"] is None


@pytest.mark.parametrize("launch", ["fork", "process"])
def test_a_trainers_server_dies_with_it(tiny_model_dir, tmp_path, launch):
    # Forked, or a subprocess started with die_with_parent (fork mode's fallback and restarts).
    args = ["--model", str(tiny_model_dir), "--bind", "tcp://127.0.0.1:*"]
    start = (f"fork_server({args + ['--threads', '1']!r}, log_path={str(tmp_path / 't.log')!r})" if launch == "fork"
             else f"start_server_process({args!r}, die_with_parent=True)")
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal
        from opd.teachers.launch import fork_server, start_server_process
        s = {start}
        print(s.proc.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)   # a crash: no stop(), no atexit
    """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    child = int(proc.stdout.readline())
    assert proc.wait(timeout=120) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while not process_gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_gone(child)
    if launch == "fork":
        assert "opd-teacher stopped" in (tmp_path / "t.log").read_text()   # SIGTERM: it drained and exited


def test_fork_is_refused_while_other_threads_run(tmp_path):
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="busy", daemon=True)
    thread.start()
    try:
        with pytest.raises(ForkUnsafe, match="busy"):
            fork_server(["--model", "unused"], log_path=tmp_path / "never.log")
    finally:
        stop.set()
    assert not (tmp_path / "never.log").exists()


def test_a_subprocess_servers_output_is_kept_bounded():
    # A server that runs for days keeps printing: its first line and the latest ~1000 are kept.
    from opd.teachers.launch import spawn_until_ready
    from opd.teachers.serve import READY

    code = (f"import sys, time; print('first'); print({READY!r} + ' address=tcp://x:1 model_fingerprint=m "
            f"tokenizer_fingerprint=t'); [print(i) for i in range(5000)]; sys.stdout.flush(); time.sleep(30)")
    server = spawn_until_ready([sys.executable, "-c", code], dict(os.environ), timeout_s=30)
    try:
        deadline = time.monotonic() + 20
        while server.output[-1:] != ["4999"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.output[-1] == "4999" and server.output[0] == "first"
        assert len(server.output) <= 2000 and server.address == "tcp://x:1"
    finally:
        server.proc.kill()
        server.proc.wait()



def test_a_subprocess_server_keeps_the_callers_options_and_a_name_with_spaces(tiny_model_dir):
    from opd.teachers.launch import free_port, start_server_process

    port = free_port()
    server = start_server_process(["--model", str(tiny_model_dir), "--name", "math teacher",
                                   f"--bind=tcp://127.0.0.1:{port}", "--threads", "2"])
    try:
        assert server.address == f"tcp://127.0.0.1:{port}"      # --bind=ADDR is the caller's bind
        argv = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().split(b"\0")
        assert argv.count(b"--threads") == 1 and argv.count(b"--bind") == 0
        from opd.teachers.client import TeacherClient

        with TeacherClient(server.address) as client:
            assert client.info().teacher == "math teacher"
        assert any("name='math teacher'" in line for line in server.output)
    finally:
        assert server.stop() == 0


def test_stop_outwaits_the_servers_drain():
    # stop() sends SIGTERM, then SIGKILL after its timeout: shorter than the server's drain
    # and a server still finishing in-flight answers is killed mid-answer.
    import inspect

    from opd.teachers.launch import ServerProcess
    from opd.teachers.server import ServerLimits

    assert inspect.signature(ServerProcess.stop).parameters["timeout_s"].default > ServerLimits().drain_timeout_s


def test_serve_teacher_refuses_a_taken_port_a_missing_model_or_key_before_any_load(tmp_path, capsys):
    # The bind used to fail after the whole model had loaded (minutes for a large one), as a
    # ZMQError traceback. The model path here does not exist: the port is checked first.
    import socket

    from opd.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        assert main(["serve-teacher", "--model", str(tmp_path / "none"), "--bind", address]) == 1
    assert f"error: {address} is already in use" in capsys.readouterr().err
    # A path that is no model is said before any load (it was the Hub's "Repo id" OSError).
    assert main(["serve-teacher", "--model", str(tmp_path / "none"), "--bind", address]) == 1
    assert f"error: teacher model {tmp_path / 'none'}: no such directory" in capsys.readouterr().err
    assert main(["serve-teacher", "--model", str(tmp_path / "none"), "--curve-secret-key", str(tmp_path / "k"),
                 "--curve-allow", str(tmp_path)]) == 2
    assert "k: no such key file" in capsys.readouterr().err


def test_serve_teacher_refuses_non_positive_limits_and_documents_its_log_level(capsys):
    # --max-positions -5 was accepted and then every request failed TOO_LONG ("the model takes
    # at most -5"); a heartbeat or peer timeout of 0 turned heartbeats off or dropped every client.
    from opd.cli import build_parser, main

    for option, value, expect in [("--max-positions", "-5", "must be at least 1, got -5"),
                                  ("--max-positions", "0", "must be at least 1, got 0"),
                                  ("--threads", "-2", "must be at least 1, got -2"),
                                  ("--heartbeat-s", "0", "must be a finite number above 0, got 0"),
                                  ("--peer-timeout-s", "-1", "must be a finite number above 0, got -1"),
                                  ("--peer-timeout-s", "nan", "must be a finite number above 0, got nan")]:
        with pytest.raises(SystemExit) as e:
            main(["serve-teacher", "--model", "unused", option, value])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {option}: {expect}" in err, (option, value, err)
    args = build_parser("serve-teacher").parse_args(["serve-teacher", "--model", "m", "--max-positions", "64",
                                                     "--heartbeat-s", "0.5", "--threads", "2"])
    assert (args.max_positions, args.heartbeat_s, args.threads, args.peer_timeout_s) == (64, 0.5, 2, 10.0)
    with pytest.raises(SystemExit):
        main(["serve-teacher", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--log-level {DEBUG,INFO,WARNING,ERROR} server log verbosity" in text and "(default: INFO)" in text
