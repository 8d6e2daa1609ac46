"""Smoke test of `opd bench step` (this project's side; TRL is a benchmark extra)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from opd.bench import step


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


@pytest.mark.parametrize("launch", ["fork", "process"])
def test_opd_step_row(tmp_path, launch):
    student, teacher, data = step.build_models(tmp_path)
    row = step.run_opd(tmp_path, student, teacher, data, "topk", steps=3, warmup=1, launch=launch)
    metrics = [json.loads(line) for line in (tmp_path / "opd-topk" / "metrics.jsonl").read_text().splitlines()]
    measured = [m for m in metrics if "step_s" in m][1:]
    assert row["steps_measured"] == len(measured) == 2 and row["teacher_launch"] == launch
    assert abs(row["tokens_per_s"] - sum(m["tokens"] for m in measured) / sum(m["step_s"] for m in measured)) < 1e-6
    phases = row["phases_s"]
    assert phases["rollout"] > 0 and phases["teacher_wait"] >= 0 and phases["loss_backward_optim"] > 0
    trainer, teacher_rss, total = row["peak_rss_trainer"], row["peak_rss_teacher"], row["peak_pss_total"]
    # Both processes are counted, their shared pages once: above either one's private
    # half, below the sum of their RSS (which counts libtorch's pages twice).
    assert max(trainer, teacher_rss) * 0.5 < total < trainer + teacher_rss
    # What the teacher adds beyond the trainer's RSS: a forked teacher shares the trainer's
    # runtime (~260 MiB of heap) and adds little (measured: about nothing); one started as
    # its own interpreter adds about half its RSS (all but the libtorch pages both map).
    added = total - trainer
    if launch == "fork":
        assert added < 0.3 * teacher_rss, (added, teacher_rss)
    else:
        assert added > 0.3 * teacher_rss, (added, teacher_rss)
    assert row["peak_rss_teacher"] > 100 << 20
