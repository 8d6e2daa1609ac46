"""`opd train` under faults: its teacher SIGKILLed and restarted mid-run (by hand, or by the
run's own watchdog in cluster.mode fork), its teacher replaced by another model, the trainer SIGKILLed while it writes a checkpoint, the disk full at a checkpoint.

The yardstick is an uninterrupted run of the same config: runs are deterministic, so a run
whose every step has the reference's loss trained on exactly the reference's batches, none
twice and none skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest.mock import ANY

import pytest
import yaml

from fault_helpers import free_port, train_config_dict
from opd.checkpoint import latest_checkpoint, load_checkpoint
from opd.config import from_dict
from opd.data import write_jsonl
from opd.metrics import read_metrics
from opd.teachers.launch import start_server_process
from opd.tiny import lm_head_teacher
from opd.distill.config import TrainConfig
from opd.distill.trainer import Trainer, TrainError

pytestmark = pytest.mark.timeout(300)

STEPS = 4
HERE = Path(__file__).parent


def serve(model_dir, address):
    return start_server_process(["--model", model_dir, "--max-k", 16, "--bind", address, "--name", "t",
                                 "--log-level", "WARNING"])


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("fault_train")
    write_jsonl(root / "train.jsonl", [{"prompt": f"q{i}: what is {i}+{i}?"} for i in range(16)])
    write_jsonl(root / "eval.jsonl", [{"prompt": f"held out {i}"} for i in range(2)])
    teacher = lm_head_teacher(tiny_model_dir, root / "teacher")
    server = serve(teacher, f"tcp://127.0.0.1:{free_port()}")
    try:
        w = {"root": root, "student": tiny_model_dir, "teacher": teacher, "server": server}
        ref = Trainer(cfg(w, "reference", server.address))
        ref.run()
        w["ref_loss"] = losses(root / "reference")
        w["ref_batches"] = load_state(root / "reference")["batches"]
        yield w
    finally:
        server.stop()


def cfg(w, name, address, **client) -> TrainConfig:
    return from_dict(train_config_dict(w["student"], address, w["root"], w["root"] / name, steps=STEPS, **client),
                     TrainConfig)


def losses(out: Path) -> dict[int, float]:
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {r["step"]: r["loss"] for r in rows}


def load_state(out: Path) -> dict:
    return json.loads((latest_checkpoint(out / "checkpoints") / "state.json").read_text())


def adam_steps(optimizer) -> set[int]:
    return {int(s["step"]) for s in optimizer.state.values()}


def test_teacher_sigkilled_mid_run_and_restarted(world):
    """Kill the teacher right after a batch went out to it; restart it 1 s later on the same port."""
    address = f"tcp://127.0.0.1:{free_port()}"
    box = {"server": serve(world["teacher"], address)}
    events = {}

    class KillOnce(Trainer):
        def _submit(self, batch):
            out = super()._submit(batch)
            if batch.index == 2 and "killed" not in events:
                box["server"].kill()
                events["killed"] = time.monotonic()
                events["answered_before_kill"] = all(f.done() for f in batch.futures.values())

                def restart():
                    time.sleep(1.0)
                    box["server"] = serve(world["teacher"], address)
                    events["ready"] = time.monotonic()

                threading.Thread(target=restart, daemon=True).start()
            return out

    tr = KillOnce(cfg(world, "teacher_killed", address))
    try:
        t0 = time.monotonic()
        result = tr.run()
        took = time.monotonic() - t0
    finally:
        deadline = time.monotonic() + 60
        while "ready" not in events and time.monotonic() < deadline:
            time.sleep(0.1)
        box["server"].stop()
    out = world["root"] / "teacher_killed"
    got = losses(out)
    print(f"\nteacher SIGKILLed at batch 2 (answer already in: {events['answered_before_kill']}), back "
          f"{events['ready'] - events['killed']:.1f} s later; run took {took:.1f} s")
    assert result["step"] == STEPS and sorted(got) == list(range(1, STEPS + 1))
    assert tr.version == STEPS and adam_steps(tr.optimizer) == {STEPS}     # optimizer steps == logged steps
    for step, loss in world["ref_loss"].items():                           # the same batches, once each
        assert got[step] == pytest.approx(loss, rel=1e-4, abs=1e-6), step
    assert load_state(out)["batches"] == world["ref_batches"]


def test_fork_mode_restarts_its_teacher_when_it_dies(world):
    """cluster.mode fork: the teacher the run started is SIGKILLed right after batch 2 went out
    to it; the run's watchdog restarts it at the same address (a subprocess: pytest runs
    threads, so nothing here forks) and the run trains the reference's batches."""
    events = {}

    class KillOnce(Trainer):
        def _submit(self, batch):
            out = super()._submit(batch)
            if batch.index == 2 and "pid" not in events:
                server = self.launched.servers["t"]
                events["pid"], events["address"] = server.proc.pid, server.address
                server.proc.kill()   # no wait: the watchdog finds it dead and reaps it
            return out

    out = world["root"] / "fork_killed"
    d = train_config_dict(world["student"], "tcp://127.0.0.1:*", world["root"], out, steps=STEPS,
                          timeout_s=15.0, retries=2)   # without a restart: TIMEOUT within ~45 s
    d["cluster"] = {"mode": "fork", "teachers": [{"name": "t", "model": str(world["teacher"]),
                                                  "serve_args": ["--max-k", "16", "--log-level", "WARNING"]}]}
    tr = KillOnce(from_dict(d, TrainConfig))
    result = tr.run()
    got = losses(out)
    assert result["step"] == STEPS and sorted(got) == list(range(1, STEPS + 1))
    for step, loss in world["ref_loss"].items():                           # the same batches, once each
        assert got[step] == pytest.approx(loss, rel=1e-4, abs=1e-6), step
    assert load_state(out)["batches"] == world["ref_batches"]
    assert tr.launched.restarts == {"t": 1} and tr.launched.servers == {}  # restarted once; stopped at the end
    said = f"teacher 't' (pid {events['pid']}) exited with -9; restarted at {events['address']} as pid "
    assert said in tr.launched.events[0] and said in (out / "card.json").read_text()
    assert any(said in w for w in load_state(out)["warnings"])   # a resumed run's card keeps it


def test_teacher_replaced_by_another_model_stops_the_run(world, tiny_teacher_dir):
    """Mid-run the teacher at the address becomes another model (same tokenizer): stop, naming both."""
    address = f"tcp://127.0.0.1:{free_port()}"
    box = {"server": serve(world["teacher"], address)}
    first_fp = box["server"].model_fingerprint

    class Swap(Trainer):
        def _sample_batch(self):
            if self.batches == 2 and "swapped" not in box:
                box["server"].kill()
                box["swapped"] = serve(tiny_teacher_dir, address)
                client = self.teachers.clients["t"][0]
                deadline = time.monotonic() + 30
                while client._fatal is None and time.monotonic() < deadline:   # it reconnects on its own
                    time.sleep(0.02)
            return super()._sample_batch()

    tr = Swap(cfg(world, "teacher_swapped", address))
    try:
        with pytest.raises(TrainError) as e:
            tr.run()
    finally:
        box["server"].kill()
        if "swapped" in box:
            box["swapped"].stop()
    second_fp = box["swapped"].model_fingerprint
    assert first_fp != second_fp
    msg = str(e.value)
    assert first_fp in msg and second_fp in msg
    steps = sorted(losses(world["root"] / "teacher_swapped"))
    assert steps and max(steps) < STEPS        # stopped: nothing was trained on the other teacher
    print(f"\nteacher swapped after {max(steps)} steps; the trainer stopped with: {msg[:200]}")
    assert "different model" in msg, msg


def run_opd(args, *, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)


def write_config(world, name, **run) -> Path:
    d = train_config_dict(world["student"], world["server"].address, world["root"], world["root"] / name, steps=STEPS)
    d["run"].update(run)
    path = world["root"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def test_trainer_sigkilled_while_writing_a_checkpoint_resumes(world):
    out = world["root"] / "killed_ckpt"
    config = write_config(world, "killed_ckpt", checkpoint_every=2)
    wrapper = str(HERE / "fault_train_wrapper.py")
    killed = run_opd([wrapper, "kill-in-checkpoint", "4", "--", "train", str(config)])
    assert killed.returncode == -9, killed.stderr[-2000:]
    ckpts = out / "checkpoints"
    assert latest_checkpoint(ckpts).name == "step_000002"                  # the torn step 4 is not it
    assert any(".tmp-" in p.name for p in ckpts.iterdir())                 # (it was caught mid-write)
    from opd.spine.model import load_policy
    model, _ = load_policy(from_dict(yaml.safe_load(config.read_text()), TrainConfig).student, seed=0)
    assert load_checkpoint(latest_checkpoint(ckpts), model=model)["step"] == 2
    assert sorted(losses(out)) == [1, 2, 3, 4]                             # step 4 was logged, then death

    t0 = time.monotonic()
    resumed = run_opd(["-m", "opd.cli", "train", str(config), "--resume"])
    print(f"\nresume after a SIGKILL inside checkpoint 4: {time.monotonic() - t0:.1f} s")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step_000002" in resumed.stdout
    got = losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))                        # steps 3-4 replaced, not doubled
    for step, loss in world["ref_loss"].items():
        assert got[step] == pytest.approx(loss, rel=1e-4, abs=1e-6), step
    assert load_state(out)["step"] == STEPS and load_state(out)["batches"] == world["ref_batches"]


def test_disk_full_at_a_checkpoint_is_a_clear_error_and_keeps_the_last_one(world):
    out = world["root"] / "disk_full"
    config = write_config(world, "disk_full", checkpoint_every=2)
    wrapper = str(HERE / "fault_train_wrapper.py")
    full = run_opd([wrapper, "disk-full-after-checkpoint", "200000", "--", "train", str(config)])
    assert full.returncode != 0
    err = full.stderr
    ckpts = out / "checkpoints"
    assert latest_checkpoint(ckpts).name == "step_000002"                  # the last good one is intact
    from opd.spine.model import load_policy
    model, _ = load_policy(from_dict(yaml.safe_load(config.read_text()), TrainConfig).student, seed=0)
    assert load_checkpoint(ckpts / "step_000002", model=model)["step"] == 2
    assert sorted(losses(out)) == [1, 2, 3, 4]
    print("\ndisk full at checkpoint 4, last stderr line: " + err.strip().splitlines()[-1][:300])
    assert "could not write checkpoint" in err and "step_000004" in err and "step_000002" in err, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert not [p.name for p in ckpts.iterdir() if ".tmp-" in p.name]     # the torn one was removed


def write_bad_data(world) -> Path:
    path = world["root"] / "train_bad.jsonl"
    path.write_text("".join(f'{{"prompt": "q{i}: what is {i}+{i}?"}}\n' for i in range(6))
                    + '{"prompt": "torn\n' + '{"prompt": "q7"}\n')        # line 7 is malformed
    return path


def test_malformed_data_line_stops_opd_train_naming_the_line(world, capsys):
    from opd.cli import main
    from opd.data import DataError

    bad = write_bad_data(world)
    d = train_config_dict(world["student"], world["server"].address, world["root"], world["root"] / "bad_stop", steps=1)
    d["merge"]["datasets"][0]["path"] = str(bad)
    config = world["root"] / "bad_stop.yaml"
    config.write_text(yaml.safe_dump(d))
    try:
        code = main(["train", str(config)])
    except DataError as e:
        raise AssertionError(f"DataError escaped opd train: {e}") from None
    err = capsys.readouterr().err
    assert code != 0 and f"{bad}:7" in err and "not valid JSON" in err, err
    assert not (world["root"] / "bad_stop" / "metrics.jsonl").exists()


def test_skipped_data_lines_are_counted_and_reported(world, capsys):
    from opd.cli import main

    bad = write_bad_data(world)
    out = world["root"] / "bad_skip"
    d = train_config_dict(world["student"], world["server"].address, world["root"], out, steps=1)
    d["merge"]["datasets"][0]["path"] = str(bad)
    d["run"]["on_data_error"] = "skip"
    config = world["root"] / "bad_skip.yaml"
    config.write_text(yaml.safe_dump(d))
    assert main(["train", str(config)]) == 0                               # the run goes on
    said = capsys.readouterr()
    assert f"{bad}: skipped 1 malformed lines (first: {bad}:7: not valid JSON" in said.out, said.out[-2000:]
    data = json.loads((out / "card.json").read_text())["data"]
    assert data["skipped_malformed_lines"] == {str(bad): {"loaded": 7, "skipped": 1, "first": ANY}}
    assert data["skipped_malformed_lines"][str(bad)]["first"].startswith(f"{bad}:7: not valid JSON")
    assert f"{bad}:7" in (out / "card.md").read_text()
