"""Reward functions: math extraction and comparison, format, length, user functions, combination, verify."""

import pytest

from opd.data import Sample
from opd.rl.config import RewardConfig
from opd.rewards import build_reward, extract_answer, extract_code, verify
from opd.rewards.math import answers_match
from opd.rewards.shaping import DEFAULT_FORMAT, format_reward, length_penalty


@pytest.mark.parametrize("text,expected", [
    ("so the result is \\boxed{42}.", "42"),
    ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("work... #### 1,234", "1,234"),
    ("Answer: 17 apples", "17"),
    ("The final answer is -3.5.", "-3.5"),
    ("3 + 4 = 7, and 7 * 2 = 14", "14"),
    ("Answer: x+1", "x+1"),
    ("no digits here", None),
    ("unclosed \\boxed{12", "12"),   # falls back to the last number
    ("Answer: 12, since 3*4=12.", "12"),             # a comma after a number is not part of it
    ("So the total is 12, which is even", "12"),
    ("the sum is 1,234,567 in all", "1,234,567"),
    ("pick from 3,4,5", "5"),
    # a minus after a digit, letter or ")" subtracts; it was read as the answer's sign
    ("The missing pages are 12-15", "15"),
    ("So 7 is the result (check: 10-3).", "3"),
    ("then f(2)-4 and x-6", "6"),
    ("so x = -4", "-4"),
    ("it is (-2)", "-2"),
    ("Answer: $-7$", "-7"),
    ("#### -.5", "-.5"),
    # a worked answer line: what follows its last "=" (the first number was taken)
    ("#### 6 * 7 = 42", "42"),
    ("Answer: 1/2 + 1/3 = 5/6", "5/6"),
    ("Answer: x = 5", "5"),
    ("The final answer is: 2 + 2 == 4.", "4"),
    ("Answer: y = x+1", "x+1"),
    ("Answer: x >= 3", "x >= 3"),    # not an "=" to split at
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("pred,ref,ok", [
    ("42", "42", True), ("42.0", "42", True), ("1,234", "1234", True), ("1/2", "0.5", True),
    ("\\frac{1}{2}", "0.5", True), ("$7$", "7", True), ("41", "42", False), (None, "1", False),
    ("x+1", "x + 1", True), ("0.3333", "1/3", False), ("0.3333333", "1/3", True),
    # a sign before \frac (it was only allowed inside the numerator)
    ("-\\frac{1}{2}", "-1/2", True), ("-\\dfrac{3}{4}", "-0.75", True), ("-0.5", "-\\tfrac{1}{2}", True),
    ("-\\frac{-1}{2}", "0.5", True), ("+\\frac{1}{2}", "0.5", True), ("-\\frac{1}{2}", "1/2", False),
    # written-out forms of the same answer, as MATH-style references and responses write them
    ("\\frac34", "0.75", True), ("\\dfrac12", "\\frac{1}{2}", True), ("x=5", "5", True), ("x = -3", "-3", True),
    ("50\\%", "50", True), ("12%", "12", True), ("+5", "5", True), ("\u22123", "-3", True),
    ("x=5", "6", False), ("x==5", "5", False), ("\\frac34", "0.34", False),
])
def test_answers_match(pred, ref, ok):
    assert answers_match(pred, ref) is ok


def test_math_reward_of_a_negative_boxed_fraction():
    assert verify(Sample(prompt="1/2 - 1?", answer="-1/2"), "so \\boxed{-\\frac{1}{2}}") == 1.0
    assert verify(Sample(prompt="1 - 1/2?", answer="1/2"), "so \\boxed{-\\frac{1}{2}}") == 0.0


def test_verify_dispatches_by_domain():
    math_s = Sample(prompt="2+2?", answer="4")
    assert verify(math_s, "it is \\boxed{4}") == 1.0
    assert verify(math_s, "it is 5") == 0.0
    code_s = Sample(prompt="add", tests="assert add(1, 1) == 2\nassert add(0, 0) == 0\nassert add(2, 1) == 3")
    assert verify(code_s, "```python\ndef add(a, b):\n    return a + b\n```") == 1.0
    assert verify(code_s, "def add(a, b):\n    return 2 * a\n") == pytest.approx(2 / 3)
    assert verify(Sample(prompt="hello"), "hi") is None


def test_extract_code():
    assert extract_code("text\n```python\nx = 1\n```\nmore\n```py\ny = 2\n```") == "y = 2\n"
    assert extract_code("```\nz = 3\n```") == "z = 3\n"
    assert extract_code("```python\ncut = 1") == "cut = 1"       # truncated by the length limit
    assert extract_code("w = 4") == "w = 4"


def test_format_and_length():
    s = Sample(prompt="p")
    assert format_reward(s, "so \\boxed{3}") == 1.0
    assert format_reward(s, "Answer: 3") == 1.0
    assert format_reward(s, "three") == 0.0
    assert length_penalty(s, "x" * 10, soft_max=10, hard_max=20) == 0.0
    assert length_penalty(s, "x" * 15, soft_max=10, hard_max=20) == pytest.approx(-0.5)
    assert length_penalty(s, "x" * 99, soft_max=10, hard_max=20) == -1.0


def test_combined_with_user_function(tmp_path):
    (tmp_path / "mine.py").write_text("def short(sample, text):\n    return 1.0 if len(text) < 5 else 0.0\n")
    specs = [RewardConfig(name="math", weight=1.0), RewardConfig(name="format", weight=0.5),
             RewardConfig(name="python", weight=2.0, path="mine.py:short")]
    reward = build_reward(specs, base_dir=tmp_path)
    samples = [Sample(prompt="q", answer="4")] * 3
    total, parts = reward(samples, ["Answer: 4", "4", "wrong answer"])
    assert parts["math"] == [1.0, 1.0, 0.0]
    assert parts["format"] == [1.0, 0.0, 0.0]
    assert parts["python:short"] == [0.0, 1.0, 0.0]
    assert total == [1.5, 3.0, 0.0]
    assert {k: v["weight"] for k, v in reward.describe().items()} == {"math": 1.0, "format": 0.5, "python:short": 2.0}


def test_shipped_configs_load_and_paths_are_relative_to_the_config():
    from pathlib import Path

    from opd.config import load_yaml
    from opd.rl.train import load_config
    from opd.rl.validate import ValidateConfig, resolve_paths

    root = Path(__file__).resolve().parents[2] / "configs"
    for name in ("rl_math.yaml", "rl_code.yaml"):
        cfg = load_config(str(root / name))
        assert Path(cfg.data.train).is_absolute() and cfg.data.train.startswith(str(root))
        assert cfg.rollout.samples_per_prompt >= 2
    v = resolve_paths(load_yaml(root / "validate_demo.yaml", ValidateConfig), root)
    assert {m.role for m in v.models} >= {"teacher", "student"}
    assert all(Path(s.path).is_absolute() for s in v.sets)


def test_the_validate_example_names_what_make_demo_writes():
    # docs/grpo.md's `opd validate configs/validate_demo.yaml` failed after `make demo`: its
    # student-after was runs/demo/merge_math_code/model, the demo writes runs/demo/merge/model.
    from pathlib import Path

    from opd.config import load_yaml
    from opd.rl.validate import ValidateConfig, resolve_paths

    configs = Path(__file__).resolve().parents[2] / "configs"
    runs = (configs.parent / "runs" / "demo").resolve()
    example = resolve_paths(load_yaml(configs / "validate_demo.yaml", ValidateConfig), configs)
    demo = resolve_paths(load_yaml(configs / "demo" / "validate.yaml", ValidateConfig), configs / "demo")
    paths = {m.name: Path(m.path).resolve() for m in example.models}
    assert paths["student-after"] == runs / "merge" / "model"
    assert paths["student-before"] == runs / "student"        # scripts/demo.py: the base's copy
    for m in demo.models:                                      # the demo stage's own models
        if m.name in paths:
            assert paths[m.name] == Path(m.path).resolve(), m.name
    assert [(s.domain, Path(s.path).resolve()) for s in example.sets] == \
        [(s.domain, Path(s.path).resolve()) for s in demo.sets]
    assert Path(example.out_dir).resolve() == runs / "validate"


@pytest.mark.parametrize("name,options,error", [
    ("math", {"tolerance": 0.1}, r"rewards\[0\] \(math\): reward 'math_reward': options \['tolerance'\] do not fit; "
                                 r"it takes none"),       # was ignored: math_reward took **_options
    ("format", {"patern": "x"}, r"options \['patern'\] do not fit; it takes \['pattern'\]"),   # was step 1's TypeError
    ("code", {"timeout": 3}, r"unknown code reward option\(s\) \['timeout'\]"),
])
def test_reward_options_that_do_not_fit_are_refused_at_start_up(name, options, error):
    from opd.config import ConfigError

    with pytest.raises(ConfigError, match=error):
        build_reward([RewardConfig(name=name, options=options)])


@pytest.mark.parametrize("name,options,error", [
    # both failed at the first step's rewards, after the model load and the first rollout,
    # with a traceback (re.error, ValueError) and a card for a run that never trained
    ("format", {"pattern": "("}, r"rewards\[0\] \(format\): option pattern '\(' is not a valid regular "
                                 r"expression: missing \), unterminated subpattern at position 0"),
    ("length", {"soft_max": 10, "hard_max": 5}, r"rewards\[0\] \(length\): option hard_max 5 must be greater "
                                                r"than option soft_max 10"),
    ("length", {"hard_max": 100}, r"option hard_max 100 must be greater than option soft_max 512 \(the default\)"),
    ("format", {"pattern": 5}, r"option pattern: expected a regular expression \(a string\), got 5"),
    ("length", {"soft_max": "ten"}, r"option soft_max: expected a number of characters >= 0, got 'ten'"),
    # a float memory_mb made the sandbox child's setrlimit raise: every answer scored 0, silently
    ("code", {"memory_mb": 512.5}, r"rewards\[0\] \(code\): option memory_mb: expected a whole number >= 1, "
                                   r"got 512.5"),
    ("code", {"timeout_s": 0}, r"option timeout_s: expected a number of seconds > 0, got 0"),
    ("code", {"workers": 0}, r"option workers: expected a whole number >= 1, got 0"),
    ("code", {"allow_subprocess": "yes"}, r"option allow_subprocess: expected true or false, got 'yes'"),
])
def test_reward_option_values_that_cannot_work_are_refused_at_start_up(name, options, error):
    from opd.config import ConfigError

    with pytest.raises(ConfigError, match=error):
        build_reward([RewardConfig(name=name, options=options)])


def test_the_validation_code_options_are_checked_with_the_config():
    from opd.config import ConfigError, from_dict
    from opd.rl.validate import ValidateConfig

    with pytest.raises(ConfigError, match=r"code: option memory_mb: expected a whole number >= 1, got 512.5"):
        from_dict({"models": [{"name": "a", "path": "x"}], "sets": [{"domain": "code", "path": "y"}],
                   "code": {"memory_mb": 512.5}}, ValidateConfig)


def test_the_reward_description_has_every_option_each_function_runs_with(tmp_path):
    (tmp_path / "mine.py").write_text("def short(sample, text, limit=3):\n    return float(len(text) <= limit)\n")
    reward = build_reward([RewardConfig(name="math"), RewardConfig(name="format", weight=0.5),
                           RewardConfig(name="length", weight=0.1, options={"hard_max": 2000}),
                           RewardConfig(name="code", options={"timeout_s": 2.0}),
                           RewardConfig(name="python", path="mine.py:short", options={"limit": 5})], base_dir=tmp_path)
    d = reward.describe()
    assert d["math"] == {"weight": 1.0}
    assert d["format"] == {"weight": 0.5, "pattern": DEFAULT_FORMAT}             # the default, as used
    assert d["length"] == {"weight": 0.1, "soft_max": 512, "hard_max": 2000}
    assert d["code"] == {"weight": 1.0, "timeout_s": 2.0, "memory_mb": 512, "max_file_mb": 16, "max_processes": 64,
                         "allow_subprocess": False, "workers": 2}
    assert d["python:short"] == {"weight": 1.0, "path": "mine.py:short", "limit": 5}


def test_a_verifier_no_row_can_satisfy_is_refused():
    # The math reward on rows without `answer` scored 0 everywhere, and opd rl blamed the
    # data's difficulty or the temperature; mixed data (some rows without it) is fine.
    from opd.config import ConfigError
    from opd.rewards.combine import check_reward_fields

    code_rows = [Sample(prompt="f", tests="assert f(1) == 2"), Sample(prompt="g", tests="assert g() == 0")]
    with pytest.raises(ConfigError, match=r"the math reward scores each row's `answer`, and no row of d.jsonl has one"):
        check_reward_fields([RewardConfig(name="math")], code_rows, "d.jsonl")
    check_reward_fields([RewardConfig(name="math"), RewardConfig(name="code")],
                        code_rows + [Sample(prompt="1+1=", answer="2")], "d.jsonl")


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_a_non_finite_reward_is_refused_naming_the_function_and_sample(tmp_path, bad):
    # NaN made its group's advantages NaN, then the loss, then every weight after the step
    from opd.cli import _user_error
    from opd.config import ConfigError

    (tmp_path / "mine.py").write_text(f"def ratio(sample, text):\n    return len(text) / 4 if text else float({bad!r})\n")
    reward = build_reward([RewardConfig(name="math"), RewardConfig(name="python", path="mine.py:ratio")],
                          base_dir=tmp_path)
    samples = [Sample(prompt="q", answer="4")] * 3
    assert reward(samples, ["4", "12a", "abcd"])[0] == [1.25, 0.75, 1.0]
    with pytest.raises(ConfigError, match=rf"reward 'python:ratio' is {bad} for sample 1 of the batch "
                                          r"\(response ''\); a reward must be a finite number") as e:
        reward(samples, ["4", "", "abcd"])
    assert _user_error(e.value)       # opd rl prints it as one line, without a traceback


def test_a_non_finite_weight_is_refused():
    from opd.config import ConfigError

    with pytest.raises(ConfigError, match=r"rewards\[1\] \(format\): weight must be a finite number, got inf"):
        build_reward([RewardConfig(name="math"), RewardConfig(name="format", weight=float("inf"))])
