"""Smoke test of `opd bench step` (this project's side; TRL is a benchmark extra)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from opd.benchmarks import step


def test_group_memory_sees_a_child_allocate():
    code = "import time; b = bytearray(160 << 20); time.sleep(0.6)"   # 160 MiB, pages touched
    mem = step.GroupMemory(interval_s=0.02)
    proc = subprocess.Popen([sys.executable, "-c", code])
    mem.pids.append(proc.pid)
    proc.wait()
    peak = mem.stop()
    assert 160 << 20 <= peak < 260 << 20


def test_group_memory_counts_descendants():
    # A child that starts a grandchild allocating 160 MiB: registering the child counts both.
    code = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
            "'import time; b = bytearray(160 << 20); time.sleep(0.6)'])")
    mem = step.GroupMemory(interval_s=0.02)
    proc = subprocess.Popen([sys.executable, "-c", code])
    mem.pids.append(proc.pid)
    proc.wait()
    assert mem.stop() >= 160 << 20
    assert max(v for p, v in mem.hwm.items() if p != proc.pid) >= 160 << 20


def test_group_cpu_is_what_its_processes_spent_in_a_window():
    # A child that spends 0.6 CPU-s between two printed wall times, idle before and after: the
    # group's CPU in that window is the busy time, not the idle time around it. (Busy for 0.6 s
    # of CPU, not of wall time: on a loaded machine 0.6 s of wall time held 0.18 CPU-s.)
    code = ("import time\ntime.sleep(0.3)\nt, c = time.time(), time.process_time()\nprint(t, flush=True)\n"
            "while time.process_time() - c < 0.6:\n    pass\nprint(time.time(), flush=True)\ntime.sleep(0.3)")
    mem = step.GroupMemory(interval_s=0.02)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    mem.pids.append(proc.pid)
    t0, t1 = (float(line) for line in proc.stdout.read().split())
    proc.wait()
    mem.stop()
    busy = mem.cpu_between(t0, t1)
    assert 0.45 < busy <= 0.75 and mem.cpu_between(t1 + 0.05, t1 + 0.25) < 0.06, (busy, mem.cpu[-3:])


def test_opd_step_rows_and_what_a_forked_teacher_saves(tmp_path):
    student, teacher, data = step.build_models(tmp_path)
    added = {}
    for launch in ("fork", "process"):
        out = tmp_path / launch
        out.mkdir()
        row = step.run_opd(out, student, teacher, data, "topk", steps=3, warmup=1, launch=launch)
        metrics = [json.loads(line) for line in (out / "opd-topk" / "metrics.jsonl").read_text().splitlines()]
        measured = [m for m in metrics if "step_s" in m][1:]
        assert row["steps_measured"] == len(measured) == 2 and row["teacher_launch"] == launch
        assert abs(row["tokens_per_s"] - sum(m["tokens"] for m in measured) / sum(m["step_s"] for m in measured)) < 1e-6
        phases = row["phases_s"]
        assert phases["rollout"] > 0 and phases["teacher_wait"] >= 0 and phases["loss_backward_optim"] > 0
        # CPU of trainer and teacher in the measured steps: at most the box's two cores
        assert 0 < row["cpu_s"] and 0.3 < row["cores"] <= 2.1, row["cores"]
        trainer, teacher_rss, total = row["peak_rss_trainer"], row["peak_rss_teacher"], row["peak_pss_total"]
        # Both processes are counted, their shared pages once: above either one's private
        # half, below the sum of their RSS (which counts libtorch's pages twice).
        assert max(trainer, teacher_rss) * 0.5 < total < trainer + teacher_rss
        assert teacher_rss > 100 << 20
        added[launch] = (total - trainer) / teacher_rss
    # What the teacher adds to the trainer's RSS, as a share of its own RSS. Forked, it shares
    # the trainer's runtime (~260 MiB of heap) and adds nothing (measured -0.19: PSS splits the
    # pages both map, the trainer's RSS does not); as its own interpreter it adds about half
    # (0.49). Compared with each other rather than with fixed bounds: other processes that map
    # libtorch (a Ray session left by an earlier test) lower every PSS, and moved the two to
    # -0.47 and 0.29.
    assert added["process"] - added["fork"] > 0.3, added


def test_small_real_tokenizer_is_49152_entries_and_chats():
    from opd.benchmarks import step_real

    tok = step_real.bpe_tokenizer()
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>" and tok.pad_token_id == 0
    text = "What is the capital of France?"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and len(ids) < len(text)   # merges apply: fewer tokens than bytes
    chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n") and text in chat


def test_presets_fill_what_is_not_given():
    import argparse

    p = argparse.ArgumentParser()
    step.add_arguments(p)
    a = p.parse_args(["--preset", "small-real", "--k", "16"])
    step._settle(a)
    assert (a.batch, a.new_tokens, a.k, a.steps) == (4, 32, 16, 6) and "trl-distill" in a.systems
    # the teacher server a core fewer than the trainer (it works beside the student's rollout)
    assert a.teacher_threads == max(1, a.threads - 1)
    a = p.parse_args(["--preset", "small-real", "--teacher-threads", "3"])
    step._settle(a)
    assert a.teacher_threads == 3
    a = p.parse_args(["--preset", "small-real", "--quick", "--steps", "9"])
    step._settle(a)
    assert (a.steps, a.warmup, a.rounds) == (2, 1, 1)
    a = p.parse_args([])
    step._settle(a)
    assert (a.batch, a.k, a.threads, a.steps, a.teacher_threads) == (8, 32, 1, 60, None)


@pytest.mark.slow
def test_small_real_preset_runs_quick(tmp_path):
    # Builds the 135M teacher and 8-layer student (~0.7 GB on disk) and runs one opd step.
    out = tmp_path / "step.json"
    subprocess.run([sys.executable, "-m", "opd.cli", "bench", "step", "--preset", "small-real", "--quick",
                    "--systems", "opd-topk", "--json", str(out)], check=True, timeout=1200)
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["system"] == "opd-topk" and rows[0]["tokens_per_s"] > 0 and rows[0]["fully_on_policy"]


def test_the_bench_datasets_repeat_no_prompt(tmp_path):
    # A prompt seen again in a run costs opd's teacher nothing (its prompt cache), which a real
    # run over a dataset far bigger than the cache does not see; so a run's prompts are distinct.
    from opd.benchmarks.step_real import prompts_file

    tiny = step.sums(480)   # the tiny preset's 60 steps x 8 prompts
    real = [json.loads(line)["prompt"] for line in prompts_file(tmp_path, 24).read_text().splitlines()]
    assert len(set(tiny)) == len(tiny) == 480 and len(set(real)) == len(real) == 24
    assert all(len(p) == 7 and p.endswith("=?") for p in tiny)   # two two-digit numbers each
    # A run is given a prompt for each of its steps' rows (given model directories: no build).
    parser = argparse.ArgumentParser()
    step.add_arguments(parser)
    args = parser.parse_args(["--preset", "small-real", "--student", str(tmp_path), "--teacher", str(tmp_path),
                              "--steps", "5", "--batch", "3"])
    step._settle(args)
    _, _, data = step.prepare(args, tmp_path)
    assert len({json.loads(line)["prompt"] for line in data.read_text().splitlines()}) == 15
