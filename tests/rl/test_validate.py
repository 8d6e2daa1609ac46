"""opd validate: pass@k maths, scoring through the real verifiers, and the CLI report on tiny models."""

import json
import subprocess
import sys

import pytest

from opd.config import ConfigError, from_dict
from opd.rl import validate as V
from opd.rollout import Rollout


def test_pass_at_k_hand_computed():
    assert V.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert V.pass_at_k(4, 1, 2) == pytest.approx(0.5)      # 1 - C(3,2)/C(4,2)
    assert V.pass_at_k(4, 0, 2) == 0.0
    assert V.pass_at_k(4, 3, 2) == 1.0
    assert V.pass_at_k(10, 5, 3) == pytest.approx(1 - (5 * 4 * 3) / (10 * 9 * 8))
    assert V.pass_at_k(4, 0, 4) == 0.0 and V.pass_at_k(4, 4, 4) == 1.0 and V.pass_at_k(4, 1, 4) == 1.0


@pytest.mark.parametrize("n,c,k,error", [
    (4, 0, 5, r"1 <= k <= n, got k=5, n=4"),      # answered 1.0 with no correct sample
    (4, 1, 5, r"1 <= k <= n, got k=5, n=4"),
    (4, 0, 0, r"1 <= k <= n, got k=0, n=4"),
    (4, 5, 1, r"0 <= c <= n correct samples, got c=5, n=4"),   # answered 1.0
    (4, -1, 1, r"0 <= c <= n correct samples, got c=-1, n=4"),
])
def test_pass_at_k_outside_its_domain_is_refused(n, c, k, error):
    with pytest.raises(ValueError, match=error):
        V.pass_at_k(n, c, k)


class ScriptedEngine:
    """Answers each prompt with a fixed list of responses (cycled over the n samples)."""

    def __init__(self, tok, script):
        self.tok, self.script = tok, script

    def generate(self, prompts, params):
        out = []
        for i, p in enumerate(prompts):
            answers = self.script[self.tok.decode(p)]
            for j in range(params.n):
                text = answers[0] if params.temperature == 0 else answers[j % len(answers)]
                out.append(Rollout(p, self.tok.encode(text), [0.0] * len(text), "length", i))
        return out

    def close(self):
        pass


def test_scores_pass_at_k_and_teacher_share(tmp_path, monkeypatch, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    (tmp_path / "math.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+3=", "answer": "5"}\n')
    (tmp_path / "code.jsonl").write_text(json.dumps({"prompt": "write inc", "tests": "assert inc(1) == 2\nassert inc(5) == 6"}) + "\n")
    good = {"1+1=": ["2", "2"], "2+3=": ["5", "4"], "write inc": ["def inc(x):\n    return x + 1\n"]}
    weak = {"1+1=": ["3", "2"], "2+3=": ["1", "1"], "write inc": ["def inc(x):\n    return 2\n"]}
    scripts = {"teacher": good, "student": weak}
    monkeypatch.setattr(V, "_engine", lambda cfg, path: (ScriptedEngine(tok, scripts[path]), tok))
    monkeypatch.setattr(V, "check_model_dir", lambda path, what: path)   # "teacher", "student": no dirs
    cfg = from_dict({"models": [{"name": "T", "path": "teacher", "role": "teacher"},
                                {"name": "S", "path": "student", "role": "student"}],
                     "sets": [{"domain": "math", "path": str(tmp_path / "math.jsonl")},
                              {"domain": "code", "path": str(tmp_path / "code.jsonl")}],
                     "samples": 2, "k": [1, 2], "out_dir": str(tmp_path / "out")}, V.ValidateConfig)
    res = V.validate(cfg)
    T, S = res["results"]["T"], res["results"]["S"]
    assert T["math"]["pass@1"] == pytest.approx(0.75) and T["math"]["pass@2"] == pytest.approx(1.0)
    assert T["math"]["greedy"] == 1.0 and T["code"]["greedy"] == 1.0
    assert S["math"]["pass@1"] == pytest.approx(0.25) and S["math"]["pass@2"] == pytest.approx(0.5)
    assert S["code"]["score"] == pytest.approx(0.5) and S["code"]["pass@1"] == 0.0   # partial credit only in score
    # greedy is an accuracy, as pass@k counts: one of two tests passed is wrong (it was 0.5)
    assert S["code"]["greedy"] == 0.0 and S["code"]["greedy_score"] == pytest.approx(0.5)
    assert res["teacher_shares"]["shares"]["S"] == {"math": 0.0, "code": 0.0}
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| S | student |" in md and "of the teacher" in md
    assert json.loads((tmp_path / "out" / "report.json").read_text())["results"]["T"]["math"]["pass@2"] == 1.0


def test_greedy_is_the_share_fully_correct_and_the_mean_score_has_its_own_column(tmp_path, monkeypatch,
                                                                                    tiny_model_dir):
    # The audit's case: greedy code scores [1, 0, 1/3, 1, 1, 0, 1, 1] were reported as greedy
    # 0.667 (the mean, partial credit) and called accuracy; 5 of the 8 answers are correct.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tests = "assert f(1) == 1\nassert f(2) == 2\nassert f(3) == 3"
    answers = {"all": "def f(x):\n    return x\n", "none": "def f(x):\n    return 0\n",
               "third": "def f(x):\n    return 1\n"}
    kinds = ["all", "none", "third", "all", "all", "none", "all", "all"]
    (tmp_path / "code.jsonl").write_text("".join(json.dumps({"prompt": f"task {i}", "tests": tests}) + "\n"
                                                 for i in range(8)))
    script = {f"task {i}": [answers[k]] for i, k in enumerate(kinds)}
    monkeypatch.setattr(V, "_engine", lambda cfg, path: (ScriptedEngine(tok, script), tok))
    monkeypatch.setattr(V, "check_model_dir", lambda path, what: path)
    cfg = from_dict({"models": [{"name": "S", "path": "s", "role": "student"}],
                     "sets": [{"domain": "code", "path": str(tmp_path / "code.jsonl")}],
                     "samples": 1, "k": [1], "out_dir": str(tmp_path / "out")}, V.ValidateConfig)
    r = V.validate(cfg)["results"]["S"]["code"]
    assert r["greedy"] == pytest.approx(5 / 8)                  # was 0.667
    assert r["greedy_score"] == pytest.approx((5 + 1 / 3) / 8)  # the mean, under its own name
    assert r["pass@1"] == pytest.approx(5 / 8)                  # greedy = sampled here: the same answers
    report = json.loads((tmp_path / "out" / "report.json").read_text())["results"]["S"]["code"]
    assert report["greedy"] == pytest.approx(0.625) and report["greedy_score"] == pytest.approx(0.6667, abs=1e-4)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| model | role | pass@1 | score | greedy | greedy_score |" in md
    assert "| S | student | 0.625 | 0.667 | 0.625 | 0.667 |" in md
    assert "`greedy`: accuracy of one temperature-0 answer per prompt (the share correct)" in md


def test_the_exit_checks_count_each_kind_of_failure_give_verdicts_and_dump_examples(tmp_path, monkeypatch,
                                                                                      tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    rows = [{"prompt": f"m{i}", "answer": "7"} for i in range(4)] + [{"prompt": f"c{i}", "tests": "assert f() == 1"}
                                                                      for i in range(4)]
    (tmp_path / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    (tmp_path / "code.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[4:]))
    script = {"m0": ["7"], "m1": ["no idea"], "m2": [""], "m3": ["ab ab ab ab ab ab ab ab ab ab"],
              "c0": ["def f():\n    return 1\n"], "c1": ["def f():\n    while True: pass\n"],
              "c2": ["def f(:"], "c3": ["def f():\n    return 2\n"]}
    monkeypatch.setattr(V, "_engine", lambda cfg, path: (ScriptedEngine(tok, script), tok))
    monkeypatch.setattr(V, "check_model_dir", lambda path, what: path)
    cfg = from_dict({"models": [{"name": "S", "path": "s", "role": "student"}],
                     "sets": [{"domain": "math", "path": str(tmp_path / "math.jsonl")},
                              {"domain": "code", "path": str(tmp_path / "code.jsonl")}],
                     "samples": 1, "k": [1], "greedy": False, "dump": 1, "code": {"timeout_s": 1},
                     "out_dir": str(tmp_path / "out")}, V.ValidateConfig)
    res = V.validate(cfg)["results"]["S"]
    m, c = res["math"]["checks"]["rows"], res["code"]["checks"]["rows"]
    # math: "no idea" and "" have no answer; "ab ab ..." has none either ("7" is the only one read).
    assert m["answer_extracted"]["value"] == 0.25 and m["answer_extracted"]["verdict"] == "fail"
    assert m["empty"]["value"] == 0.25 and m["repeated"]["value"] == 0.25 and m["repeated"]["verdict"] == "fail"
    assert m["length_capped"]["value"] == 1.0    # the scripted engine says "length" for every answer
    assert "code_ran" not in m and "answer_extracted" not in c
    # code: one passes, one fails its test (both ran), one loops (timeout), one does not parse (error).
    assert (c["code_ran"]["value"], c["timeouts"]["value"], c["errors"]["value"]) == (0.5, 0.25, 0.25)
    assert [c[k]["verdict"] for k in ("code_ran", "timeouts", "errors")] == ["fail", "fail", "fail"]
    ex = res["code"]["checks"]["examples"]
    assert ex["timeouts"][0]["prompt"] == "c1" and ex["timeouts"][0]["verifier"] == "timeout"
    assert len(res["math"]["checks"]["examples"]["answer_extracted"]) == 1   # dump: 1
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Checks before leaving this stage" in md and "| S | code |" in md and "0.25 (fail)" in md
    samples = (tmp_path / "out" / "samples.md").read_text()
    assert "## S, code: timeouts" in samples and "while True: pass" in samples


def test_hidden_tests_are_reported_beside_the_visible_ones_with_a_warning(tmp_path, monkeypatch, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    rows = [{"prompt": f"c{i}", "tests": "assert f(1) == 1", "hidden_tests": "assert f(2) == 2"} for i in range(4)]
    (tmp_path / "code.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    honest, hacker = "def f(x):\n    return x\n", "def f(x):\n    return 1\n"
    scripts = {"h": {f"c{i}": [honest] for i in range(4)}, "x": {f"c{i}": [hacker if i else honest] for i in range(4)}}
    monkeypatch.setattr(V, "_engine", lambda cfg, path: (ScriptedEngine(tok, scripts[path]), tok))
    monkeypatch.setattr(V, "check_model_dir", lambda path, what: path)
    cfg = from_dict({"models": [{"name": "H", "path": "h"}, {"name": "X", "path": "x"}],
                     "sets": [{"domain": "code", "path": str(tmp_path / "code.jsonl")}],
                     "samples": 1, "k": [1], "greedy": False, "out_dir": str(tmp_path / "out")}, V.ValidateConfig)
    res = V.validate(cfg)["results"]
    assert res["H"]["code"]["hidden"] == {"visible_accuracy": 1.0, "hidden_accuracy": 1.0}
    assert res["X"]["code"]["pass@1"] == 1.0 and res["X"]["code"]["hidden"]["hidden_accuracy"] == 0.25
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| X | code | 1.000 | 0.250 |" in md and "- **warning**, X, code: 100% of the answers" in md
    assert "**warning**, H" not in md


def test_reworded_prompts_keep_the_task_and_a_model_that_learned_the_format_is_warned_about(tmp_path, monkeypatch,
                                                                                              tiny_model_dir):
    from transformers import AutoTokenizer

    from opd.data import Sample
    from opd.rl.checks import perturbed

    assert perturbed(Sample(prompt="41-5="), "spaces").prompt == "41 - 5 ="
    assert perturbed(Sample(prompt="41-5="), "prefix").prompt == "Question: 41-5="
    chat = Sample(prompt="hi", messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}])
    assert perturbed(chat, "suffix").messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "hi\n"}]
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(4)]
    (tmp_path / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    robust = {}
    for kind in ("", "spaces", "prefix"):   # answers every form of the prompt right
        robust.update({perturbed(Sample(prompt=r["prompt"]), kind).prompt if kind else r["prompt"]: [r["answer"]]
                       for r in rows})
    brittle = {k: (v if "=" in k and " " not in k else ["?"]) for k, v in robust.items()}   # the plain form only
    scripts = {"r": robust, "b": brittle}
    monkeypatch.setattr(V, "_engine", lambda cfg, path: (ScriptedEngine(tok, scripts[path]), tok))
    monkeypatch.setattr(V, "check_model_dir", lambda path, what: path)
    cfg = from_dict({"models": [{"name": "R", "path": "r"}, {"name": "B", "path": "b"}],
                     "sets": [{"domain": "math", "path": str(tmp_path / "math.jsonl")}], "samples": 1, "k": [1],
                     "perturb": ["spaces", "prefix"], "out_dir": str(tmp_path / "out")}, V.ValidateConfig)
    res = V.validate(cfg)["results"]
    assert (res["R"]["math"]["greedy"], res["R"]["math"]["greedy/spaces"], res["R"]["math"]["greedy/prefix"]) == (1, 1, 1)
    assert (res["B"]["math"]["greedy"], res["B"]["math"]["greedy/spaces"], res["B"]["math"]["greedy/prefix"]) == (1, 0, 0)
    assert "format_warnings" not in res["R"]["math"] and len(res["B"]["math"]["format_warnings"]) == 2
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| greedy/spaces | greedy/prefix |" in md and "(spaces): the model may rely on the prompt's exact form" in md
    with pytest.raises(ConfigError, match="perturb compares greedy answers"):
        from_dict({"models": [{"name": "R", "path": "r"}], "sets": [{"domain": "math", "path": "x"}], "greedy": False,
                   "perturb": ["suffix"]}, V.ValidateConfig)


def test_a_progress_bar_counts_the_prompts_of_every_model_and_set(tmp_path, monkeypatch, tiny_model_dir, capsys):
    # opd validate printed one line per model and nothing while its sets were evaluated
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    (tmp_path / "math.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+3=", "answer": "5"}\n')
    (tmp_path / "code.jsonl").write_text(json.dumps({"prompt": "write inc", "tests": "assert inc(1) == 2"}) + "\n")
    script = {"1+1=": ["2"], "2+3=": ["5"], "write inc": ["def inc(x):\n    return x + 1\n"]}
    monkeypatch.setattr(V, "_engine", lambda cfg, path: (ScriptedEngine(tok, script), tok))
    monkeypatch.setattr(V, "check_model_dir", lambda path, what: path)
    cfg = from_dict({"models": [{"name": "A", "path": "a"}, {"name": "B", "path": "b"}],
                     "sets": [{"domain": "math", "path": str(tmp_path / "math.jsonl")},
                              {"domain": "code", "path": str(tmp_path / "code.jsonl")}],
                     "samples": 1, "k": [1], "out_dir": str(tmp_path / "out")}, V.ValidateConfig)
    V.validate(cfg)
    err = capsys.readouterr().err
    assert "validate: 100%" in err and "6/6" in err            # 2 models x (2 + 1) prompts
    assert "[opd validate] A: a" in err and "[opd validate] B: b" in err


def test_config_refuses_k_above_samples():
    with pytest.raises(ValueError, match="every k"):
        from_dict({"models": [{"name": "a", "path": "x"}], "sets": [{"domain": "m", "path": "y"}],
                   "samples": 2, "k": [4]}, V.ValidateConfig)
    with pytest.raises(ValueError, match="one held-out set per domain"):
        from_dict({"models": [{"name": "a", "path": "x"}], "sets": [{"domain": "m", "path": "y"},
                                                                  {"domain": "m", "path": "z"}]}, V.ValidateConfig)


@pytest.mark.slow   # ~23 s: in make test-all (the suite's 20-min budget); the refusal below stays in make test
def test_cli_on_tiny_models_with_grpo_check(tmp_path, tiny_model_dir, tiny_teacher_dir):
    (tmp_path / "math.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                                 for i in range(3)))
    (tmp_path / "rl.yaml").write_text(
        f"model: {{path: {tiny_model_dir}}}\n"
        f"data: {{train: {tmp_path / 'math.jsonl'}}}\n"
        "rollout: {prompts_per_step: 2, samples_per_prompt: 2, max_new_tokens: 3}\n"
        "rewards: [{name: math}, {name: format, weight: 0.1}]\n")
    (tmp_path / "validate.yaml").write_text(
        f"models:\n  - {{name: base, path: {tiny_model_dir}, role: student}}\n"
        f"  - {{name: teacher, path: {tiny_teacher_dir}, role: teacher, domains: [math]}}\n"
        f"sets: [{{domain: math, path: {tmp_path / 'math.jsonl'}}}]\n"
        "samples: 2\nk: [1, 2]\nmax_new_tokens: 3\n"
        "grpo: {config: rl.yaml, model: base, steps: 2, lr: 1.0e-6}\n"
        f"out_dir: {tmp_path / 'report'}\n")
    out = subprocess.run([sys.executable, "-m", "opd.cli", "validate", str(tmp_path / "validate.yaml")],
                         capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert set(report["results"]) == {"base", "teacher"}
    for r in report["results"].values():
        assert 0.0 <= r["math"]["pass@1"] <= r["math"]["pass@2"] <= 1.0
    assert report["grpo_check"]["steps"] == 2 and "reward_rose" in report["grpo_check"]
    assert "Short GRPO pass" in (tmp_path / "report" / "report.md").read_text()

    # A rerun replaces the report and its GRPO check (it crashed on OUT/grpo_check, after
    # every evaluation); a path that is not a model is refused before the first evaluation.
    cmd = [sys.executable, "-m", "opd.cli", "validate", str(tmp_path / "validate.yaml")]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 0, again.stderr[-2000:]


def test_cli_refuses_a_path_that_is_not_a_model_before_the_first_evaluation(tmp_path, tiny_model_dir):
    (tmp_path / "math.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    (tmp_path / "validate.yaml").write_text(
        f"models:\n  - {{name: base, path: {tiny_model_dir}, role: student}}\n"
        f"  - {{name: teacher, path: {tmp_path / 'ghost'}, role: teacher, domains: [math]}}\n"
        f"sets: [{{domain: math, path: {tmp_path / 'math.jsonl'}}}]\n"
        f"samples: 2\nk: [1]\nmax_new_tokens: 3\nout_dir: {tmp_path / 'report'}\n")
    bad = subprocess.run([sys.executable, "-m", "opd.cli", "validate", str(tmp_path / "validate.yaml")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "[opd validate] base" not in bad.stderr
    assert f"error: models['teacher'].path {tmp_path / 'ghost'}: no such directory" in bad.stderr


def test_an_agents_tool_calls_are_checked_per_call_and_its_turn_limit_per_trajectory():
    from opd.data import Sample
    from opd.rl.checks import exit_checks
    from opd.rollout.base import Rollout

    metas = [{"turns": 3, "tool_calls": 4, "tool_failures": 1, "turn_limit": True},   # 1 bad call of 4
             {"turns": 2, "tool_calls": 1, "tool_failures": 0, "turn_limit": False},
             {"turns": 1, "tool_calls": 0, "tool_failures": 0, "turn_limit": False},
             {"turns": 3, "tool_calls": 5, "tool_failures": 0, "turn_limit": True}]
    rollouts = [Rollout(prompt_ids=[1], response_ids=[5, 6, 7], logprobs=[0.0] * 3, finish_reason="eos", meta=m)
                for m in metas]
    samples = [Sample(prompt=f"q{i}", answer="7") for i in range(4)]
    out = exit_checks(samples, ["7"] * 4, rollouts, [(1.0, "answer")] * 4, dump=2)
    rows = out["rows"]
    assert rows["tool_calls_valid"]["of"] == 10 and rows["tool_calls_valid"]["value"] == pytest.approx(0.9)
    assert rows["tool_calls_valid"]["verdict"] == "warn"     # 0.9: below 0.95, above 0.80
    assert (rows["turn_limit"]["of"], rows["turn_limit"]["value"], rows["turn_limit"]["verdict"]) == (4, 0.5, "fail")
    assert [e["prompt"] for e in out["examples"]["turn_limit"]] == ["q0", "q3"]
    assert [e["prompt"] for e in out["examples"]["tool_calls_valid"]] == ["q0"]
    # answers that are not trajectories have neither row
    plain = [Rollout(prompt_ids=[1], response_ids=[5], logprobs=[0.0], finish_reason="eos") for _ in range(2)]
    rows = exit_checks(samples[:2], ["7"] * 2, plain, [(1.0, "answer")] * 2, dump=1)["rows"]
    assert "tool_calls_valid" not in rows and "turn_limit" not in rows


def test_each_model_is_compared_with_the_base_and_a_regression_is_warned_about(tmp_path, monkeypatch, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    (tmp_path / "math.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+3=", "answer": "5"}\n')
    (tmp_path / "general.jsonl").write_text('{"prompt": "len: ab", "answer": "2"}\n{"prompt": "len: abc", "answer": "3"}\n')
    base = {"1+1=": ["2"], "2+3=": ["4"], "len: ab": ["2"], "len: abc": ["3"]}      # math 0.5, general 1
    tuned = {"1+1=": ["2"], "2+3=": ["5"], "len: ab": ["2"], "len: abc": ["7"]}     # math 1, general 0.5
    monkeypatch.setattr(V, "_engine", lambda cfg, path: (ScriptedEngine(tok, {"b": base, "s": tuned}[path]), tok))
    monkeypatch.setattr(V, "check_model_dir", lambda path, what: path)
    cfg = from_dict({"models": [{"name": "B", "path": "b", "role": "base"}, {"name": "S", "path": "s", "role": "student"}],
                     "sets": [{"domain": "math", "path": str(tmp_path / "math.jsonl")},
                              {"domain": "general", "path": str(tmp_path / "general.jsonl")}],
                     "samples": 1, "k": [1], "out_dir": str(tmp_path / "out")}, V.ValidateConfig)
    res = V.validate(cfg)["against_base"]
    assert res["base"] == "B" and res["metric"] == "greedy"
    assert res["deltas"] == {"S": {"math": pytest.approx(0.5), "general": pytest.approx(-0.5)}}
    assert res["warnings"] == ["S, general: greedy 0.500 against the base's 1.000 (-0.500)"]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Against the base model B (greedy)" in md and "- **S**: math: +0.500, general: -0.500" in md
    assert "- **warning**, regression: S, general" in md
    # without a base model there is nothing to compare with
    assert V.against_base(V.ValidateConfig(**{**vars(cfg), "models": cfg.models[1:]}), {}) == {}
