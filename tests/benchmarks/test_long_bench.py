"""`opd bench long`: every arm's config trains the same batch on the chain task, the report's
'CPU-s to 80 % of the teacher' is the compute at the first checkpoint that gets there, and the
table and plot come out of a report. (The benchmark itself takes hours; `--quick`, a few
minutes, is its smoke test.)"""

from __future__ import annotations

from types import SimpleNamespace

from opd.benchmarks import SUBJECTS
from opd.benchmarks.long_horizon import ARMS, Plan, grpo_config, sft_config, train_config
from opd.benchmarks.long_horizon_report import markdown, plot, summarize
from opd.config import from_dict
from opd.sft.config import SFTConfig


def _plan(tmp_path) -> Plan:
    plan = Plan(out=tmp_path, lengths=[16, 256], starts=["mid"], seeds=[0, 1], arms=list(ARMS),
                budget={16: 60.0, 256: 450.0}, evals=6, eval_prompts=100, lrs={a: 1e-3 for a in ARMS}, beta=1.0,
                trl_python=None)
    plan.inputs = {"sets": {"16": {"train": "t16.jsonl"}, "256": {"train": "t256.jsonl"}},
                   "models": {"teacher": "T", "weak": "W", "mid": "M"}}
    plan.server = SimpleNamespace(port=5999)
    return plan


def test_every_arm_trains_32_sequences_a_step_on_its_length(tmp_path):
    plan = _plan(tmp_path)
    modes = {}
    for arm in ("opd_topk", "opd_sampled", "opd_full", "opd_reward", "offline_then_opd"):
        c = train_config(plan, arm, 256, "mid", tmp_path / arm, 1, "M")
        r, t = c["rollout"], c["merge"]["teachers"][0]
        assert r["prompts_per_step"] * r["samples_per_prompt"] == 32 and r["max_new_tokens"] == 256 + 8
        assert c["merge"]["datasets"][0]["path"] == "t256.jsonl" and t["address"] == "tcp://127.0.0.1:5999"
        assert ("rewards" in c) == (arm == "opd_reward") and r["samples_per_prompt"] == 1
        assert c["loss"].get("reward_advantage") == ("batch" if arm == "opd_reward" else None)
        assert c["loss"]["length_norm"] == "token" and c["optim"]["schedule"] == "constant"
        modes[arm] = (t["mode"], t.get("beta"))
    assert modes == {"opd_topk": ("topk", 1.0), "opd_sampled": ("sampled", None), "opd_full": ("full", 1.0),
                     "opd_reward": ("topk", 1.0), "offline_then_opd": ("topk", 1.0)}
    g = grpo_config(plan, 16, tmp_path / "g", 0, "M")
    assert g["rollout"]["prompts_per_step"] * g["rollout"]["samples_per_prompt"] == 32 and g["rewards"] == [{"name": "math"}]
    s = sft_config(plan, "offline", 16, tmp_path / "s", 0, "M", tmp_path / "d.jsonl")
    assert s["data"]["batch_size"] == 32 and s["model"]["path"] == "M"
    assert from_dict(s, SFTConfig).run.steps == 100000   # a config opd sft takes
    # cheaper steps checkpoint less often in steps, about 3 x evals in the budget
    assert plan.every("offline", 256) > plan.every("opd_topk", 256) >= 1


def _report():
    def run(arm, seed, accs, cpus):
        return {"arm": arm, "length": 256, "start": "mid", "seed": seed, "rc": 0,
                "points": [{"step": i, "cpu_s": c, "acc": a} for i, (a, c) in enumerate(zip(accs, cpus))]}
    results = [run("offline", 0, [0.5, 0.8, 0.9], [100, 200, 300]), run("offline", 1, [0.7, 0.7, 0.75], [100, 200, 300]),
               run("opd_topk", 0, [0.76, 0.9], [50, 400]), run("opd_topk", 1, [0.2, 0.95], [50, 400])]
    plan = {"lengths": [256], "starts": ["mid"], "seeds": [0, 1], "arms": ["offline", "opd_topk"], "budget": {"256": 450},
            "evals": 3, "eval_prompts": 100, "lrs": {"offline": 1e-3, "opd_topk": 1e-3}, "beta": 1.0, "batch": 32,
            "teacher": {"layers": 4, "hidden": 128}, "student": {"layers": 2, "hidden": 64}}
    report = {"plan": plan, "results": results, "refs": {"256": {"teacher": {"all": 0.95}, "mid": {"all": 0.4}}}}
    report["rows"] = summarize(report)
    return report


def test_cpu_seconds_to_80_percent_of_the_teacher_is_the_first_checkpoint_there(tmp_path):
    report = _report()
    rows = {r["arm"]: r for r in report["rows"]}
    assert rows["offline"]["target"] == 0.8 * 0.95
    assert rows["offline"]["to_target_cpu_s"] == 200 and rows["offline"]["reached"] == 1   # seed 1 never gets there
    assert rows["opd_topk"]["to_target_cpu_s"] == (50 + 400) / 2 and rows["opd_topk"]["reached"] == 2
    assert abs(rows["offline"]["final_acc"] - 0.825) < 1e-9
    md = markdown(report)
    assert "| offline distillation (SFT on teacher samples) | 0.82 ± 0.11 | 200 (1/2) |" in md
    plot(report, tmp_path / "long.png")
    assert (tmp_path / "long.png").stat().st_size > 10_000


def test_listed_as_a_bench_subject():
    assert SUBJECTS["long"][0] == "opd.benchmarks.long_horizon" and len(ARMS) == 9


def test_a_study_run_in_parts_merges_into_one_report(tmp_path):
    import json

    from opd.benchmarks.long_horizon import merge

    a, b = _report(), _report()
    b["plan"] = {**b["plan"], "lengths": [16], "budget": {"16": 60}}
    b["refs"] = {"16": {"teacher": {"all": 1.0}, "mid": {"all": 0.5}}}
    b["results"] = [{**r, "length": 16} for r in b["results"]]
    for d, r in (("a", a), ("b", b)):
        (tmp_path / d).mkdir()
        (tmp_path / d / "long.json").write_text(json.dumps({**r, "wall_s": 1.0}))
    redo = _report()   # one run done again: it replaces the first part's
    redo["plan"] = {**redo["plan"], "arms": ["offline"]}
    redo["results"] = [{**redo["results"][0], "points": [{"step": 1, "cpu_s": 10, "acc": 0.9}]}]
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "long.json").write_text(json.dumps({**redo, "wall_s": 1.0}))
    assert merge([tmp_path / "a", tmp_path / "b", tmp_path / "c"], tmp_path / "all") == 0
    merged = json.loads((tmp_path / "all" / "long.json").read_text())
    assert merged["plan"]["lengths"] == [16, 256] and len(merged["rows"]) == 4 and len(merged["results"]) == 8
    assert {r["length"]: r["target"] for r in merged["rows"]} == {16: 0.8, 256: 0.8 * 0.95}
    offline = next(r for r in merged["rows"] if r["length"] == 256 and r["arm"] == "offline")
    assert offline["to_target_cpu_s"] == 10 and offline["reached"] == 1   # seed 0 redone at 10; seed 1 never


def test_the_teachers_sampling_cost_is_measured_once_per_length_for_the_parts_sharing_inputs(tmp_path, monkeypatch):
    """Start-up and per-sample CPU-s from two runs 16 batches apart; a later part with the same
    inputs reads them back and samples nothing, and measures only a length it lacks."""
    from opd.benchmarks import long_horizon

    calls = []

    def fake_sample(plan, length, run_dir, seed, n, filtered):
        calls.append((length, n))
        return None, SimpleNamespace(cpu_s=5.0 + 0.01 * length * n / 16), n

    monkeypatch.setattr(long_horizon, "sample_teacher", fake_sample)
    plan = _plan(tmp_path)
    plan.lengths = [16]
    (tmp_path / "inputs").mkdir()   # prepare() made it
    cost = long_horizon.measure_sampling(plan, tmp_path / "inputs")
    assert calls == [(16, 64), (16, 1088)]
    assert abs(cost["16"]["per_sample_cpu_s"] - 0.01) < 1e-12 and abs(cost["16"]["startup_cpu_s"] - 5.0) < 1e-9
    plan.lengths = [16, 256]
    again = long_horizon.measure_sampling(plan, tmp_path / "inputs")
    assert calls[2:] == [(256, 64), (256, 1088)] and again["16"] == cost["16"]
    assert abs(again["256"]["per_sample_cpu_s"] - 0.16) < 1e-9
