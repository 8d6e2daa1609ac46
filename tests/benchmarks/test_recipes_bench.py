"""`opd bench recipes`: the CPU accounting counts a process's children, every arm gets the same
budget, and the table's 'CPU-s to reach X' is the compute at the first checkpoint that gets there.
(The benchmark itself needs the demo's models and minutes; `--quick` is its smoke test.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from opd.benchmarks import SUBJECTS
from opd.benchmarks.recipes import (
    ARMS,
    GRPO_GROUP,
    Plan,
    acc_at,
    at,
    grpo_config,
    markdown,
    opd_config,
    parse_betas,
    parse_lrs,
    pick,
    reach,
    run_counted,
    sft_config,
    snapshot_demo,
    summarize,
    tree_cpu,
)
from opd.config import from_dict
from opd.sft.config import SFTConfig

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_a_running_grandchild_counts_in_its_grandparents_tree():
    # The child only sleeps; the CPU its tree shows can only be the grandchild's.
    child = subprocess.Popen([sys.executable, "-c",
                              "import subprocess, sys, time\n"
                              f"g = subprocess.Popen([sys.executable, '-c', {BURN.format(s=0.6) + 'time.sleep(30)'!r}])\n"
                              "print(g.pid, flush=True)\n"
                              "time.sleep(30)\n"], stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    try:
        deadline, seen = time.time() + 20, 0.0
        while time.time() < deadline and seen < 0.55:
            seen = tree_cpu([child.pid])
            time.sleep(0.1)
        assert seen >= 0.55
    finally:
        os.kill(grandchild, signal.SIGKILL)
        child.kill()
        child.wait()


def test_run_counted_includes_a_finished_child_and_keeps_a_rising_timeline(tmp_path):
    cmd = [sys.executable, "-c", "import subprocess, sys\n"
           f"subprocess.run([sys.executable, '-c', {BURN.format(s=0.5)!r}], check=True)\n" + BURN.format(s=0.2)]
    run = run_counted(cmd, tmp_path / "log", env=None, interval=0.05)
    assert run.rc == 0 and not run.stopped and run.wall_s > 0
    assert run.cpu_s >= 0.65          # 0.5 s of the child's + 0.2 s of its own (a child-less count: ~0.2)
    assert all(b[1] >= a[1] and b[0] >= a[0] for a, b in zip(run.line, run.line[1:]))
    assert at(run.line, run.line[0][0] - 1) == run.line[0][1] and at(run.line, run.line[-1][0] + 1) == run.cpu_s


def test_the_budget_stops_a_run_and_counts_the_servers_beside_it(tmp_path):
    # A "teacher server" that burns 0.4 s then idles, and a trainer that would burn forever:
    # stopped once both together (plus the offset) reach the budget.
    server = subprocess.Popen([sys.executable, "-c", BURN.format(s=0.4) + "time.sleep(60)"])
    try:
        time.sleep(0.05)
        run = run_counted([sys.executable, "-c", "while True: pass"], tmp_path / "log", env=None,
                          also=[server.pid], offset=0.2, budget=1.2, interval=0.05)
    finally:
        server.kill()
        server.wait()
    assert run.stopped and run.rc != 0
    assert run.extra[-1][1] >= 0.3                 # the server's CPU while the run ran is the run's
    assert 1.0 <= 0.2 + run.cpu_s <= 2.5           # stopped near the budget, not at the end of time
    assert run.line[-1][1] < 1.0                   # so the trainer itself got less than the budget


def test_interpolation_reach_and_the_checkpoints_picked_at_cpu_marks():
    line = [(0.0, 0.0), (10.0, 5.0), (20.0, 25.0)]
    assert at(line, 5.0) == 2.5 and at(line, 15.0) == 15.0
    pts = [{"step": 10 * i, "acc": a, "cpu_s": c}
           for i, (a, c) in enumerate([(0.2, 1.0), (0.5, 2.0), (0.4, 3.0), (0.9, 4.0)], start=1)]
    assert reach(pts, 0.45) == 2.0 and reach(pts, 0.9) == 4.0 and reach(pts, 0.95) is None
    assert acc_at(pts, 0.5, start=0.1) == 0.1 and acc_at(pts, 3.5, start=0.1) == 0.4
    assert [p["step"] for p in pick(pts, [0.5, 1.5, 2.2, 3.9, 4.0])] == [10, 20, 30, 40]


def _plan(tmp_path: Path) -> Plan:
    merge = {"student": {"path": "x"},
             "merge": {"teachers": [{"name": d, "address": "tcp://x:1", "domains": [d], "mode": "topk", "k": 16}
                                    for d in ("math", "code")],
                       "datasets": [{"domain": "math", "path": "m", "eval_path": "me", "ratio": 0.65},
                                    {"domain": "code", "path": "c", "eval_path": "ce", "ratio": 0.35}]},
             "rollout": {"prompts_per_step": 32, "samples_per_prompt": 1},
             "optim": {"lr": 1e-3}, "run": {"steps": 600, "eval_every": 100, "eval_prompts": 32}}
    data = {k: tmp_path / f"{k}.jsonl" for k in ("grpo_train", "math_train", "code_train")}
    return Plan(out=tmp_path, steps=40, batch=32, evals=4, budget=0.0, max_new_tokens=24,
                lrs={"grpo": 1e-4, "offline": 1e-3, "opd_sampled": 3e-4, "opd_topk": 1e-3, "opd_reward": 1e-3,
                     "opd_full": 1e-3},
                ratios={"math": 0.65, "code": 0.35}, data=data,
                models={"start": {"path": "start"}}, merge=merge, ports={"math": 5601, "code": 5602})


def test_every_arm_samples_the_same_sequences_per_step_and_checkpoints_alike(tmp_path):
    plan = _plan(tmp_path)
    g = grpo_config(plan, tmp_path / "g", 3)
    assert g["rollout"]["prompts_per_step"] * g["rollout"]["samples_per_prompt"] == plan.batch == 4 * GRPO_GROUP
    assert [r["name"] for r in g["rewards"]] == ["math", "code"]
    for arm in ("opd_sampled", "opd_topk", "opd_reward", "opd_full"):
        c = opd_config(plan, arm, tmp_path / arm, 3)
        r = c["rollout"]
        assert r["prompts_per_step"] * r["samples_per_prompt"] == plan.batch
        mode = {"opd_sampled": "sampled", "opd_full": "full"}.get(arm, "topk")
        assert {t["mode"] for t in c["merge"]["teachers"]} == {mode}
        if arm == "opd_full":   # the exact reverse KL, whose one-sample estimate opd_sampled is
            assert all(t["beta"] == 1.0 and "k" not in t for t in c["merge"]["teachers"])
        assert [t["address"] for t in c["merge"]["teachers"]] == ["tcp://127.0.0.1:5601", "tcp://127.0.0.1:5602"]
        assert all("eval_path" not in d for d in c["merge"]["datasets"])   # no in-process (counted) evaluation
        assert ("rewards" in c) == (arm == "opd_reward") and r["samples_per_prompt"] == 1   # the batch advantage
        if arm == "opd_reward":
            assert c["loss"]["reward_advantage"] == "batch"
            plan.reward_advantage = "grpo"                    # a group advantage needs its groups
            grouped = opd_config(plan, arm, tmp_path / arm, 3)
            assert grouped["rollout"]["samples_per_prompt"] == 4 and grouped["loss"]["reward_advantage"] == "grpo"
            plan.reward_advantage = "batch"
        assert c["run"]["steps"] == plan.steps and c["run"]["checkpoint_every"] == plan.every(arm) == 10
        assert c["run"]["seed"] == 3 and "eval_prompts" not in c["run"]
        assert c["optim"]["schedule"] == "constant" and c["optim"]["lr"] == plan.lrs[arm]
    assert plan.merge["merge"]["teachers"][0]["mode"] == "topk"   # the demo's config itself untouched
    s = sft_config(plan, tmp_path / "s", 3, {"math": tmp_path / "m", "code": tmp_path / "c"})
    assert s["run"]["steps"] == plan.steps and s["data"]["batch_size"] == plan.batch
    assert s["run"]["checkpoint_every"] == plan.every("offline")
    assert g["run"]["checkpoint_every"] == plan.every("grpo")
    assert s["optim"]["schedule"] == g["optim"]["schedule"] == "constant"
    assert from_dict(s, SFTConfig).optim.lr == plan.lrs["offline"]   # a config opd sft takes
    # Under a CPU budget, cheaper steps checkpoint less often in steps: about 2 x evals within the budget.
    plan.budget, plan.steps = 100.0, 100000
    assert plan.every("offline") > plan.every("opd_topk") > plan.every("grpo") >= 2


def test_an_arms_rate_and_betas_reach_its_config_and_bad_ones_are_refused_with_the_flag(tmp_path):
    assert parse_lrs(["opd_topk=3e-4"]) == {"opd_topk": 3e-4}
    assert parse_betas(["opd_sampled=0.99,0.999"]) == {"opd_sampled": [0.99, 0.999]}
    for parse, item, says in ((parse_lrs, "nope=1e-3", "--lr 'nope=1e-3': unknown arm"),
                              (parse_lrs, "grpo=0", "a learning rate is positive"),
                              (parse_betas, "grpo=0.9,0.999", "--betas 'grpo=0.9,0.999': unknown arm"),
                              (parse_betas, "opd_topk=0.9", "two values in [0, 1)")):
        with pytest.raises(SystemExit, match=re.escape(says)):
            parse([item])
    plan = _plan(tmp_path)
    plan.betas = {"opd_sampled": [0.99, 0.999]}
    assert opd_config(plan, "opd_sampled", tmp_path / "s", 0)["optim"]["betas"] == [0.99, 0.999]
    assert "betas" not in opd_config(plan, "opd_topk", tmp_path / "t", 0)["optim"]   # the merge config's


def test_table_reports_reach_and_final_accuracy_over_seeds():
    def result(arm, seed, accs, cpus):
        return {"arm": arm, "seed": seed, "rc": 0, "cpu_s": cpus[-1], "tokens": 100.0 * len(accs), "wall_s": 9.0,
                "phases": {"training": {"to_first_step_cpu_s": 4.0}},
                "points": [{"step": 10 * (i + 1), "acc": a, "math": a, "code": a, "cpu_s": c, "tokens": 100.0 * (i + 1)}
                           for i, (a, c) in enumerate(zip(accs, cpus))]}

    results = [result("grpo", 0, [0.3, 0.5], [10, 20]), result("grpo", 1, [0.6, 0.7], [12, 22]),
               result("opd_topk", 0, [0.2, 0.3], [5, 9]), result("opd_topk", 1, [0.2, 0.4], [5, 9]),
               {"arm": "opd_reward", "seed": 0, "rc": 1, "error": "ConfigError: unknown key rewards"}]
    rows = {r["arm"]: r for r in summarize(results, start_acc=0.1, targets=[0.5, 0.35])}
    g = rows["grpo"]
    assert g["seeds"] == 2 and g["final_acc"] == pytest.approx(0.6) and g["final_acc_std"] == pytest.approx(0.1414, abs=1e-3)
    assert g["reach"]["0.500"] == {"cpu_s": 16.0, "tokens": 150.0, "reached": 2, "of": 2}   # (20 + 12) / 2
    assert rows["opd_topk"]["reach"]["0.500"]["reached"] == 0
    assert rows["opd_topk"]["reach"]["0.350"] == {"cpu_s": 9.0, "tokens": 200.0, "reached": 1, "of": 2}
    assert rows["opd_reward"]["seeds"] == 0 and "unknown key" in rows["opd_reward"]["error"]
    report = {"plan": {"eval_prompts": 32, "cpu_budget": 30.0, "steps": 100000, "batch": 32, "max_new_tokens": 24,
                       "evals": 2, "offline_samples": 6400, "lrs": {"grpo": 1e-4, "opd_topk": 1e-3},
                       "ratios": {"math": 0.65, "code": 0.35}, "seeds": [0, 1]},
              "code": {"rev": "0123456789abc", "working_tree": True, "uncommitted_changes": []},
              "start": {"all": 0.1, "math": 0.1, "code": 0.1}, "teachers": {"math": 0.8, "code": 0.8}, "teacher_acc": 0.8,
              "targets": [0.5, 0.35], "rows": list(rows.values()), "server_startup_cpu": 7.0, "machine": "m", "wall_s": 1.0}
    text = markdown(report)
    header = next(line for line in text.splitlines() if line.startswith("| arm |"))
    assert "CPU-s to reach 0.50" in header and "tokens to reach 0.35" in header and "accuracy at the end" in header
    assert "| GRPO alone (opd rl) | 2 | 0.600 ± 0.141 |" in text
    assert "not reached (0/2)" in text and "9 (1/2)" in text and "failed: ConfigError" in text
    widths = {line.count("|") for line in text.splitlines() if line.startswith("|")}
    assert len(widths) == 1   # every row has the header's columns


def test_a_missing_demo_says_to_run_make_demo(tmp_path):
    with pytest.raises(SystemExit, match="make demo"):
        snapshot_demo(tmp_path / "nodemo", tmp_path / "out")


def test_listed_as_a_bench_subject():
    assert SUBJECTS["recipes"][0] == "opd.benchmarks.recipes" and len(ARMS) == 6
