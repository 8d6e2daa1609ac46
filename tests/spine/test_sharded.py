"""Training sharded over two ranks (FSDP2 over gloo) equals one process on the same global batch.

`opd sft`, `opd rl` and `opd train` run with num_workers 2 (the command starts the ranks with
torchrun's launcher) and with 1, both as subprocesses with one OpenMP thread, on the tiny
model; after 3 optimizer steps the losses and the weights agree within fp32 tolerance, and
each rank holds about half of one process's weights, gradients and optimizer state. `opd rl` and
`opd train` also run their 2 ranks as Ray actors (cluster.mode ray), with torchrun's numbers. A
rank killed mid-run stops the job naming it, and --resume continues from the sharded checkpoint.
Prompts of equal length keep the ranks' padding the one process's.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from opd.data import write_jsonl
from opd.metrics import read_metrics
from opd.spine.shards import is_sharded_checkpoint
from opd.teachers.launch import start_server_process
from opd.tiny import lm_head_teacher

from sharded_runs import ENV, LABEL, both, opd, worker_reports   # tests/spine/sharded_runs.py

pytestmark = pytest.mark.timeout(600)
# The ranks as Ray actors (cluster.mode ray) on a local Ray cluster the command starts itself.
ON_RAY = "{mode: ray, address: null, num_cpus: 2, student: {num_workers: 2}}"


def assert_same_run(runs: dict[int | str, Path], keys: tuple[str, ...], tol: float = 1e-4) -> None:
    """Each sharded run's losses and final weights are one process's (and Ray's ranks torchrun's)."""
    metrics = {n: [r for r in read_metrics(runs[n] / "metrics.jsonl") if "loss" in r] for n in runs}
    weights = {n: load_file(str(runs[n] / "model" / "model.safetensors")) for n in runs}
    for n in [n for n in runs if n != 1]:
        assert [r["step"] for r in metrics[1]] == [r["step"] for r in metrics[n]] == [1, 2, 3]
        for a, b in zip(metrics[1], metrics[n]):
            for k in keys:
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (n, a["step"], k)
        assert weights[1].keys() == weights[n].keys()
        gap = max(float((weights[1][k] - weights[n][k]).abs().max()) for k in weights[1])
        print(f"\n{runs[n].parent.name}: largest weight difference, {LABEL[n]} vs 1 process: {gap:.2e}; "
              f"losses {[round(r['loss'], 7) for r in metrics[n]]} vs {[round(r['loss'], 7) for r in metrics[1]]}")
        assert gap < tol, gap
        assert (runs[n] / "checkpoints" / "step_000003" / "dcp").is_dir()   # sharded, resumable on any rank count
    if "ray" in runs:   # the same ranks doing the same sums in the same order: torchrun's numbers
        gap = max(float((weights[2][k] - weights["ray"][k]).abs().max()) for k in weights[2])
        assert gap <= 1e-6, gap
        for a, b in zip(metrics[2], metrics["ray"]):
            assert {k: b[k] for k in keys} == pytest.approx({k: a[k] for k in keys}, rel=1e-6, abs=1e-9)


def card_run(out: Path) -> dict:
    card = json.loads((out / "card.json").read_text())
    return next(v for k, v in card.items() if isinstance(v, dict) and "memory_per_rank_bytes" in v)


# LoRA runs and the ranks on Ray: 25 to 50 s each, in make test-all (the suite's 8-minute
# target); make test keeps every command's full-weight run on torchrun's ranks.
LORA_IN_TEST_ALL = pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)],
                                           ids=["full", "lora"])


@LORA_IN_TEST_ALL
def test_opd_sft_on_two_ranks_is_one_process_with_half_the_memory_per_rank(tmp_path, lora):
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"{a}+1=", "response": str(a + 1)} for a in range(10, 40)])
    runs = both("sft", tmp_path, "model: {{tiny: {{layers: 2, hidden: 32, heads: 2, kv_heads: 1, intermediate: 64}}, "
                "device: cpu" + (", lora: {{rank: 4}}" if lora else "") + "}}\n"
                "data: {{train: [{{path: train.jsonl}}], batch_size: 4}}\noptim: {{lr: 0.01, warmup_steps: 0}}\n"
                "run: {{out_dir: {out}, steps: 3, log_every: 1, checkpoint_every: 3}}\n"
                "cluster: {{student: {{num_workers: {ranks}}}}}\n")
    assert_same_run(runs, ("loss", "grad_norm"))
    if lora:
        return
    one, two = card_run(runs[1])["memory_per_rank_bytes"], card_run(runs[2])["memory_per_rank_bytes"]
    print(f"\nbytes per rank, 1 process -> 2 ranks: {one} -> {two}")
    for k in ("weights", "gradients", "optimizer_state"):
        assert 0.45 < two[k] / one[k] < 0.56, (k, one[k], two[k])


@pytest.mark.parametrize("lora, ray", [(False, False), pytest.param(False, True, marks=pytest.mark.slow),
                                       pytest.param(True, False, marks=pytest.mark.slow)],
                         ids=["full", "full-ray", "lora"])
def test_opd_rl_on_two_ranks_is_one_process(tmp_path, tiny_model_dir, lora, ray):
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"Number {i}:", "answer": str(i)} for i in range(10, 26)])
    (tmp_path / "digits.py").write_text("def digits(sample, text):\n    return sum(c.isdigit() for c in text) / "
                                        "max(len(text), 1)\n")
    model = f"{{path: {tiny_model_dir}, device: cpu" + (", lora: {rank: 4}}" if lora else "}")
    runs = both("rl", tmp_path, (
        f"model: {model}\n".replace("{", "{{").replace("}", "}}")
        + "data: {{train: train.jsonl}}\n"
          "rollout: {{prompts_per_step: 4, samples_per_prompt: 4, max_new_tokens: 4, temperature: 1.0}}\n"
          "algorithm: {{epochs: 2, kl_beta: 0.01, advantage: batch_std}}\n"
          "rewards: [{{name: python, path: 'digits.py:digits'}}]\noptim: {{lr: 0.01}}\n"
          "run: {{steps: 3, checkpoint_every: 3, out_dir: {out}, progress: false, tensorboard: false}}\n"
          "cluster: {cluster}\n"), ray_cluster=ON_RAY if ray else None)
    assert_same_run(runs, ("loss", "kl", "reward/mean", "entropy", "grad_norm"))
    for n in set(runs) - {1}:
        assert "2 (FSDP2, each rank 2 prompts a step)" in (runs[n] / "card.md").read_text()


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("sharded_teacher")
    with start_server_process(["--model", str(lm_head_teacher(tiny_model_dir, root / "teacher")), "--max-k", "16",
                               "--name", "t"]) as server:
        yield server.address


@pytest.mark.parametrize("lora, ray", [(False, False), pytest.param(False, True, marks=pytest.mark.slow),
                                       pytest.param(True, False, marks=pytest.mark.slow)],
                         ids=["full", "full-ray", "lora"])
def test_opd_train_on_two_ranks_is_one_process(tmp_path, tiny_model_dir, teacher, lora, ray):
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"q{i}: what is {i}+{i}?"} for i in range(10, 26)])
    write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"q{i}: what is {i}+{i}?", "answer": str(2 * i)}
                                          for i in range(30, 35)])   # 5 held-out prompts: a rank's share padded
    write_jsonl(tmp_path / "sft.jsonl", [{"prompt": f"say {i}", "response": f"{i}"} for i in range(4)])
    lora_cfg = ", lora: {{rank: 4, target_modules: [q_proj, v_proj, lm_head]}}" if lora else ""
    runs = both("train", tmp_path, (
        f"student: {{{{path: {tiny_model_dir}, device: cpu{lora_cfg}}}}}\n"
        f"merge:\n  teachers: [{{{{name: t, address: '{teacher}', k: 8}}}}]\n"
        "  datasets: [{{domain: gen, path: train.jsonl, eval_path: eval.jsonl}}]\n"
        "  sft: {{path: sft.jsonl, batch_size: 2, lambda_sft: 0.1}}\n"
        "rollout: {{prompts_per_step: 4, max_new_tokens: 6}}\noptim: {{lr: 0.003, micro_batch_size: 1}}\n"
        "run: {{steps: 3, out_dir: {out}, progress: false, tensorboard: false, checkpoint_every: 3}}\n"
        "cluster: {cluster}\n"), ray_cluster=ON_RAY if ray else None)
    assert_same_run(runs, ("loss", "kl", "sft_loss", "grad_norm", "teacher_tail_mass"))
    evals = {n: [r["eval/kl"] for r in read_metrics(runs[n] / "metrics.jsonl") if "eval/kl" in r] for n in runs}
    for n in set(runs) - {1}:
        assert evals[n] == pytest.approx(evals[1], rel=1e-4)


def rank_process(launcher: subprocess.Popen, rank: int) -> psutil.Process | None:
    for p in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if p.environ().get("RANK") == str(rank) and "opd.cli" in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            continue
    return None


@LORA_IN_TEST_ALL
def test_the_ranks_load_their_shards_without_a_whole_copy(tmp_path, tiny_model_dir, lora):
    # 8 ranks x an 8B model in fp32 read whole would take 256 GB of host memory on one node. A
    # full start is streamed from the files by rank 0 into every rank's shards: no rank reads
    # the model whole. Here from an index of several files, with a tied head and an odd number
    # of rows (261: rank 0 gets 131, rank 1 130, as FSDP2 cuts them). A LoRA start is read whole
    # by rank 0 alone (it initialises the adapter) and broadcast.
    model_dir = tiny_model_dir
    if not lora:
        from transformers import AutoModelForCausalLM

        from opd.tiny import build_tiny_model

        model_dir = build_tiny_model(tmp_path / "odd", vocab_size=261, tie_embeddings=True, seed=3)
        whole = AutoModelForCausalLM.from_pretrained(str(model_dir))
        (model_dir / "model.safetensors").unlink()
        whole.save_pretrained(str(model_dir), max_shard_size="60KB")
        assert len(set(json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"].values())) > 2
    r0, r1 = worker_reports("sharded_load_worker.py", model_dir, "lora" if lora else "full", out=tmp_path / "report")
    assert (r0["reads"], r1["reads"]) == ((1, 0) if lora else (0, 0))
    assert r0["weights_equal"]                                     # the shards hold the directory's weights
    assert r0["buffers_equal"] and r0["buffers"] == r1["buffers"]  # RoPE's inverse frequencies as built
    assert r0["logits"] == r1["logits"]


def test_a_checkpoint_of_one_process_resumes_sharded_and_back_with_the_losses_of_one_process(tmp_path):
    # Started on one device, continued on two: rank 0 reads the checkpoint, the other receives
    # its shards of the weights and of AdamW's moments; the losses go on as one process's. Then
    # the 2-rank run's own checkpoint (DCP, step 10) resumed in one process: the same again.
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"{a}+1=", "response": str(a + 1)} for a in range(10, 40)])
    base = ("model: {tiny: {layers: 2, hidden: 32, heads: 2, kv_heads: 1, intermediate: 64}, device: cpu}\n"
            "data: {train: [{path: train.jsonl}], batch_size: 4}\noptim: {lr: 0.01, warmup_steps: 0}\n"
            "run: {out_dir: OUT, steps: 12, log_every: 1, checkpoint_every: 5}\n")
    (tmp_path / "one.yaml").write_text(base.replace("OUT", "one"))
    assert opd("sft", "one.yaml", cwd=tmp_path).returncode == 0
    shutil.copytree(tmp_path / "one", tmp_path / "two")
    shutil.rmtree(tmp_path / "two" / "checkpoints" / "step_000010")   # resume from step 5
    (tmp_path / "two" / "checkpoints" / "latest").unlink(missing_ok=True)
    (tmp_path / "two.yaml").write_text(base.replace("OUT", "two") + "cluster: {student: {num_workers: 2}}\n")
    resumed = opd("sft", "two.yaml", "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    one, two = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("one", "two"))
    assert [r["step"] for r in two][-7:] == list(range(6, 13))
    assert [r["loss"] for r in two][-7:] == pytest.approx([r["loss"] for r in one][5:], rel=1e-4)
    wa, wb = (load_file(str(tmp_path / name / "model" / "model.safetensors")) for name in ("one", "two"))
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4

    back = tmp_path / "back"
    shutil.copytree(tmp_path / "two", back)
    for ckpt in (back / "checkpoints").iterdir():   # keep step 10, the 2 ranks' own
        if ckpt.name != "step_000010":
            shutil.rmtree(ckpt) if ckpt.is_dir() and not ckpt.is_symlink() else ckpt.unlink()
    assert is_sharded_checkpoint(back / "checkpoints" / "step_000010")
    (back / "metrics.jsonl").unlink()
    shutil.rmtree(back / "model")
    (tmp_path / "back.yaml").write_text(base.replace("OUT", "back"))
    resumed = opd("sft", "back.yaml", "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = read_metrics(back / "metrics.jsonl")
    assert [r["step"] for r in again] == [11, 12]
    assert [r["loss"] for r in again] == pytest.approx([r["loss"] for r in one][10:], rel=1e-4)
    wc = load_file(str(back / "model" / "model.safetensors"))
    assert max(float((wa[k] - wc[k]).abs().max()) for k in wa) < 1e-4


def test_a_killed_rank_stops_the_run_naming_it_and_resume_continues_from_the_sharded_checkpoint(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"{a}+1=", "response": str(a + 1)} for a in range(10, 40)])
    base = ("model: {tiny: {layers: 2, hidden: 32, heads: 2, kv_heads: 1, intermediate: 64}, device: cpu}\n"
            "data: {train: [{path: train.jsonl}], batch_size: 4}\noptim: {lr: 0.01, warmup_steps: 0}\n"
            "run: {out_dir: OUT, steps: 40, log_every: 1, checkpoint_every: 5}\n")
    (tmp_path / "one.yaml").write_text(base.replace("OUT", "one"))
    (tmp_path / "two.yaml").write_text(base.replace("OUT", "two") + "cluster: {student: {num_workers: 2}}\n")
    assert opd("sft", "one.yaml", cwd=tmp_path).returncode == 0
    launcher = subprocess.Popen([sys.executable, "-m", "opd.cli", "sft", "two.yaml"], cwd=tmp_path, env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while len(read_metrics(tmp_path / "two" / "metrics.jsonl")) < 12 and time.monotonic() < deadline:
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        time.sleep(0.05)
    victim = rank_process(launcher, 1)
    assert victim is not None
    victim.send_signal(signal.SIGKILL)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 1, err[-3000:]
    assert "opd sft: error: rank 1 of 2 failed (killed by SIGKILL); the other ranks were stopped" in err, err[-3000:]
    steps = [r["step"] for r in read_metrics(tmp_path / "two" / "metrics.jsonl")]
    assert steps and max(steps) < 40
    resumed = opd("sft", "two.yaml", "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    one, two = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("one", "two"))
    assert [r["step"] for r in two] == list(range(1, 41))          # the steps after the checkpoint redone once
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-4)
    wa, wb = (load_file(str(tmp_path / name / "model" / "model.safetensors")) for name in ("one", "two"))
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4
    assert torch.isfinite(torch.cat([w.flatten() for w in wb.values()])).all()

