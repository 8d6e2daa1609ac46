"""Checkpoints and metrics under SIGKILL and a full disk, on the real opd.checkpoint / opd.metrics.

- A writer process saving checkpoints in a loop is SIGKILLed at random moments, many times;
  after every kill `latest_checkpoint` loads and its weights belong to its own state.json.
- A file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: writes fail with EFBIG just as they fail
  with ENOSPC on a full disk) while writing metrics or a checkpoint.
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from opd.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.timeout(240)

KILLS = 30

# A zygote: loads the model once, then forks writers and kills each at a random moment.
ZYGOTE = textwrap.dedent("""
    import json, os, random, signal, sys, time
    import torch
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM
    from opd.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    model_dir, root, kills = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    marker = model.lm_head.weight
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng = random.Random(0)
    results = []
    for i in range(kills):
        last = latest_checkpoint(root)
        first = (json.load(open(os.path.join(last, "state.json")))["step"] + 1) if last else 1
        pid = os.fork()
        if pid == 0:                                   # the writer: checkpoint after checkpoint
            step = first
            while True:
                with torch.no_grad():
                    marker.fill_(float(step))          # the weights say which step they are
                save_checkpoint(root, step, model=model, optimizer=opt, state={"data_pos": 10 * step}, keep=2)
                step += 1
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        ckpt = latest_checkpoint(root)
        row = {"kill": i, "latest": ckpt.name if ckpt else None}
        if ckpt is not None:
            state = load_checkpoint(ckpt, model=model, optimizer=opt)
            row.update(step=state["step"], data_pos=state["data_pos"], weight=float(marker.flatten()[0]),
                       uniform=bool((marker == marker.flatten()[0]).all()))
        row["tmp_dirs"] = sum(".tmp-" in n for n in os.listdir(root))
        results.append(row)
    print(json.dumps(results))
""")


def test_sigkill_at_random_moments_never_loses_the_last_checkpoint(tiny_model_dir, tmp_path):
    root = tmp_path / "ckpts"
    out = subprocess.run([sys.executable, "-c", ZYGOTE, str(tiny_model_dir), str(root), str(KILLS)],
                         capture_output=True, text=True, timeout=200, env={"OMP_NUM_THREADS": "1",
                                                                           **__import__("os").environ})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(rows) == KILLS
    seen = [r for r in rows if r["latest"] is not None]
    assert len(seen) >= KILLS - 3        # only kills before the very first checkpoint may find none
    for r in seen:
        assert r["latest"] == f"step_{r['step']:06d}"
        assert r["weight"] == float(r["step"]) and r["uniform"]            # weights of that very step
        assert r["data_pos"] == 10 * r["step"]
    steps = [r["step"] for r in seen]
    assert steps == sorted(steps) and steps[-1] >= KILLS // 5               # progress, never backwards
    assert max(r["tmp_dirs"] for r in rows) <= 1   # a new writer removes the torn dir of the one killed before
    print(f"\n{KILLS} SIGKILLs: latest always loaded; reached step {steps[-1]}; "
          f"torn .tmp dirs left behind: {rows[-1]['tmp_dirs']}")


WRITER = textwrap.dedent("""
    import errno, json, os, resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    what, path = sys.argv[1], sys.argv[2]
    result = {}
    if what == "metrics":
        from opd.metrics import MetricsLogger
        m = MetricsLogger(path, tensorboard=False)
        for step in range(1, 4):
            m.log(step, {"loss": 1.0 / step})
        size = os.path.getsize(m.path)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 40, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            m.log(4, {"loss": 0.25, "note": "x" * 200})
        except OSError as e:
            result = {"error": str(e), "errno": e.errno}
    else:
        import torch
        torch.set_num_threads(1)
        from transformers import AutoModelForCausalLM
        from opd.checkpoint import save_checkpoint
        model = AutoModelForCausalLM.from_pretrained(sys.argv[3], dtype=torch.float32)
        save_checkpoint(path, 1, model=model, state={"data_pos": 10})
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            save_checkpoint(path, 2, model=model, state={"data_pos": 20})
        except Exception as e:
            result = {"error": str(e), "type": type(e).__name__}
    print(json.dumps(result))
""")


def run_writer(*args) -> dict:
    out = subprocess.run([sys.executable, "-c", WRITER, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_disk_full_while_writing_metrics(tmp_path):
    from opd.metrics import MetricsLogger, read_metrics

    r = run_writer("metrics", tmp_path)
    assert r["errno"] in (errno.EFBIG, errno.ENOSPC) and str(tmp_path / "metrics.jsonl") in r["error"]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("}\n")   # no torn line left behind
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    MetricsLogger(tmp_path, tensorboard=False, resume_step=3).close()   # and a resume can rewrite it


def test_enospc_in_checkpoint_names_the_last_good_one(tiny_model_dir, tmp_path, monkeypatch):
    """An OSError(ENOSPC) from a write: CheckpointError naming the last good checkpoint; nothing torn."""
    from transformers import AutoModelForCausalLM

    import opd.checkpoint as ckpt

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    good = save_checkpoint(tmp_path, 1, model=model, state={"data_pos": 10})

    def full_disk(path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(tmp_path, 2, model=model, state={"data_pos": 20})
    assert "No space left on device" in str(e.value) and str(good) in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001"]
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == good and load_checkpoint(good, model=model)["data_pos"] == 10


def test_file_size_limit_in_checkpoint_is_a_checkpoint_error(tiny_model_dir, tmp_path):
    r = run_writer("checkpoint", tmp_path, tiny_model_dir)
    assert latest_checkpoint(tmp_path).name == "step_000001"               # holds today already
    assert r.get("type") == "CheckpointError" and "step_000001" in r["error"], r
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]


class _Payload:
    """Stands for any object a pickle could rebuild (and run code while doing so)."""


def test_optimizer_state_is_loaded_as_tensors_only(tiny_model_dir, tmp_path):
    # torch.load(weights_only=True): a checkpoint whose optimizer.pt holds anything but tensors
    # and plain values is refused, not unpickled. The RNG state is saved in such types.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    good = save_checkpoint(tmp_path, 1, model=model, state={"data_pos": 10})
    assert load_checkpoint(good, model=model)["data_pos"] == 10
    blob = torch.load(good / "optimizer.pt", weights_only=True)
    torch.save({**blob, "extra": _Payload()}, good / "optimizer.pt")
    with pytest.raises(CheckpointError, match="holds more than tensors and plain values"):
        load_checkpoint(good, model=model)


def test_a_fresh_run_into_a_used_run_dir_is_refused_or_replaces_it(tiny_model_dir, tmp_path):
    # Before claim_run_dir a fresh run deleted the earlier run's metrics and left its
    # checkpoints, which a later --resume then picked up under the new config.
    from transformers import AutoModelForCausalLM

    from opd.checkpoint import claim_run_dir

    run = tmp_path / "run"
    claim_run_dir(run, resume=False, overwrite=False)           # nothing there yet: fine
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    save_checkpoint(run / "checkpoints", 7, model=model)
    (run / "metrics.jsonl").write_text('{"step": 7}\n')
    (run / "plots").mkdir()
    (run / "notes.txt").write_text("the user's own file")
    with pytest.raises(CheckpointError, match=r"holds a run \(checkpoint step_000007, metrics.jsonl\).*--resume"):
        claim_run_dir(run, resume=False, overwrite=False)
    assert latest_checkpoint(run / "checkpoints").name == "step_000007"   # refused: nothing touched
    assert (run / "metrics.jsonl").read_text() == '{"step": 7}\n'
    claim_run_dir(run, resume=True, overwrite=False)             # a resume keeps it all
    assert latest_checkpoint(run / "checkpoints").name == "step_000007"
    claim_run_dir(run, resume=False, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]
    claim_run_dir(run, resume=False, overwrite=False)            # now a fresh run may start
