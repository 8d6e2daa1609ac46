"""The train config: every option documented, shown by --help, and present in the example."""

import dataclasses
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from opd.config import ConfigError, from_dict
from opd.distill.config import TrainConfig, load_train_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "configs" / "train_single.yaml"


def _fields(cls, prefix=""):
    """Every (dotted key, field) of a config class, nested dataclasses and list items included."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        yield key, f
        tp = hints[f.name]
        args = typing.get_args(tp)
        inner = [a for a in (tp, *args, *[x for a in args for x in typing.get_args(a)]) if dataclasses.is_dataclass(a)]
        if inner:
            yield from _fields(inner[0], key + ".")


def _yaml_keys(node, prefix=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield f"{prefix}{k}"
            yield from _yaml_keys(v, f"{prefix}{k}.")
    elif isinstance(node, list):
        for item in node:
            yield from _yaml_keys(item, prefix)


def test_every_field_has_help():
    missing = [k for k, f in _fields(TrainConfig) if not f.metadata.get("help")]
    assert missing == []


def test_example_config_loads_and_covers_every_option():
    cfg = load_train_config(EXAMPLE)
    assert cfg.student.lora is not None and cfg.merge.sft is not None
    assert Path(cfg.student.path).is_absolute()  # resolved against the config's folder
    present = set(_yaml_keys(yaml.safe_load(EXAMPLE.read_text())))
    # `agent:` makes every rollout multi-turn: its keys are spelled out in the agentic example
    present |= set(_yaml_keys(yaml.safe_load((ROOT / "configs" / "agentic_train.yaml").read_text())))
    # `store:` replaces `merge`: its keys are spelled out in the stored-mode example
    present |= set(_yaml_keys(yaml.safe_load((ROOT / "configs" / "train_stored.yaml").read_text())))
    # a teacher's `cross:` (tokenizer: cross): spelled out in the cross-tokenizer example
    present |= set(_yaml_keys(yaml.safe_load((ROOT / "configs" / "train_cross_tokenizer.yaml").read_text())))
    # dict-valued fields (domain_weights, pass_rates) have user keys below them; ignore those
    absent = [k for k, _ in _fields(TrainConfig) if k not in present]
    assert absent == []


def test_help_describes_every_option():
    out = subprocess.run([sys.executable, "-m", "opd.cli", "train", "--help"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    for key, f in _fields(TrainConfig):
        name = key.split(".")[-1]
        assert f"{name} " in out or f"{name}:" in out, key
    assert "--resume" in out and "unknown keys are refused" in out


def test_bad_config_names_file_line_and_key(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("student:\n  path: s\nmerge:\n  teachers: [{name: a, address: 'tcp://x:1'}]\n"
                 "  datasets: [{domain: d, path: p.jsonl}]\noptim:\n  lr: 1.0e-3\n  lerning_rate: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:8: unknown key 'optim.lerning_rate'"):
        load_train_config(p)
    p.write_text("student:\n  path: s\nmerge:\n  teachers: [{name: a, address: 'tcp://x:1', mode: best}]\n"
                 "  datasets: [{domain: d, path: p.jsonl}]\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:4: key 'merge.teachers\[0\].mode' expects one of"):
        load_train_config(p)
    p.write_text("student:\n  path: s\nmerge:\n  teachers: [{name: a, address: 'tcp://x:1'}]\n"
                 "  datasets: [{domain: d, path: p.jsonl}]\nloss:\n  trim: marker\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:7: .*answer_end_marker"):
        load_train_config(p)
    base = "student:\n  path: s\nmerge:\n  teachers: [{name: a, address: 'tcp://x:1'}]\n" \
           "  datasets: [{domain: d, path: p.jsonl}]\n"
    p.write_text(base + "optim:\n  lr: 1.0e-6\n  lr: 5.0\n")         # YAML alone keeps the last
    with pytest.raises(ConfigError, match=r"bad.yaml:8: key 'optim.lr' given twice"):
        load_train_config(p)
    p.write_text(base + "rollout:\n  top_p: .nan\n")                   # NaN passes 0 <= x <= 1
    with pytest.raises(ConfigError, match=r"bad.yaml:7: key 'rollout.top_p' must be a finite number"):
        load_train_config(p)
    p.write_text(base.replace("  path: s\n", "  path: s\n  device: cpuu\n"))   # failed at the model's .to()
    with pytest.raises(ConfigError, match=r"device 'cpuu': expected auto, cpu, cuda or cuda:N"):
        load_train_config(p)


def test_a_rate_written_as_users_write_it_is_a_float(tmp_path):
    """`lr: 1e-4` is a string to YAML 1.1 (no dot); it is taken as the float it reads as, as
    Hugging Face's argument parsing takes it. A quoted value stays a string, and is refused."""
    p = tmp_path / "c.yaml"
    base = "student:\n  path: s\nmerge:\n  teachers: [{name: a, address: 'tcp://x:1', temperature: 7e-1}]\n" \
           "  datasets: [{domain: d, path: p.jsonl}]\n"
    p.write_text(base + "optim:\n  lr: 1e-4\n  eps: 1E-8\n  betas: [9e-1, 0.95]\n")
    cfg = load_train_config(p)
    assert (cfg.optim.lr, cfg.optim.eps, cfg.optim.betas, cfg.merge.teachers[0].temperature) == (1e-4, 1e-8, [0.9, 0.95], 0.7)
    for bad in ("'1e-4'", "1e-4x", "e-4"):
        p.write_text(base + f"optim:\n  lr: {bad}\n")
        with pytest.raises(ConfigError, match=r"c.yaml:7: key 'optim.lr' expects float"):
            load_train_config(p)


@pytest.mark.parametrize("merge,error", [
    ("  teachers: [{name: a, address: '127.0.0.1:5555'}]\n  datasets: [{domain: d, path: p.jsonl}]\n",
     r"bad.yaml:4: .*address '127.0.0.1:5555' needs its transport"),
    ("  teachers: [{name: a, address: 'tcp://x:1'}]\n  datasets: []\n", "at least one prompt set"),
    ("  teachers: [{name: a, address: 'tcp://x:1'}]\n  datasets: [{domain: d, path: p.jsonl, ratio: 0}]\n",
     "every ratio is 0"),
    # Each set's ratio went into one dict per domain: the first math set's 0.8 was dropped.
    ("  teachers: [{name: a, address: 'tcp://x:1'}]\n  datasets: [{domain: math, path: a.jsonl, ratio: 0.8}, "
     "{domain: code, path: b.jsonl, ratio: 0.2}, {domain: math, path: c.jsonl, ratio: 0.0}]\n",
     r"one prompt set per domain .*\['math', 'code', 'math'\]"),
    ("  teachers: [{name: a, address: 'tcp://x:1'}]\n  datasets: [{domain: d, path: p.jsonl}]\n"
     "  routing: {weighting: pass_rate, pass_rates: {d: {b: 0.5}}}\n", r"pass_rates\['d'\] names \['b'\]"),
    ("  teachers: [{name: a, address: 'tcp://x:1'}, {name: b, address: 'tcp://x:2'}]\n"
     "  datasets: [{domain: d, path: p.jsonl}]\n  routing: {weighting: pass_rate, pass_rates: {d: {a: -0.5, b: 1.0}}}\n",
     r"pass_rates\['d'\]: pass rates are shares of problems solved, in \[0, 1\]; got \{'a': -0.5\}"),
    # Sampled mode scores the student at the teacher's temperature: its estimate was biased for
    # responses drawn at another one or with a nucleus cut, and a JSD beta was ignored.
    ("  teachers: [{name: a, address: 'tcp://x:1', mode: sampled}]\n  datasets: [{domain: d, path: p.jsonl}]\n"
     "rollout: {temperature: 0.7}\n", r"merge.teachers \['a'\]: mode sampled scores the student at the teacher's "
                                       r"temperature, but rollout samples at temperature 0.7, top_p 1.0"),
    ("  teachers: [{name: a, address: 'tcp://x:1', mode: sampled}]\n  datasets: [{domain: d, path: p.jsonl}]\n"
     "rollout: {top_p: 0.9}\n", r"rollout samples at temperature 1.0, top_p 0.9"),
    ("  teachers: [{name: a, address: 'tcp://x:1', mode: sampled, beta: 0.5}]\n  datasets: [{domain: d, path: p.jsonl}]\n",
     r"mode sampled trains reverse KL .*beta 0.5 would not be used"),
])
def test_merge_mistakes_that_used_to_pass_silently_are_refused(tmp_path, merge, error):
    p = tmp_path / "bad.yaml"
    p.write_text("student:\n  path: s\nmerge:\n" + merge)
    with pytest.raises(ConfigError, match=error):
        load_train_config(p)


def test_cli_reports_config_error(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("student:\n  path: s\n  colour: red\n")
    r = subprocess.run([sys.executable, "-m", "opd.cli", "train", str(p)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert "bad.yaml:3: unknown key 'student.colour'" in r.stderr


def test_counts_given_on_the_command_line_are_checked_like_the_configs(capsys):
    # An override skips the config's range checks: `--steps -3` ran 0 steps and wrote an
    # untrained model/ and card, exit 0.
    from opd.cli import main

    for cmd in (["train", "x.yaml", "--steps", "-3"], ["rl", "x.yaml", "--steps", "0"],
                ["serve-teacher", "--model", "m", "--max-k", "0"]):
        with pytest.raises(SystemExit) as e:
            main(cmd)
        assert e.value.code == 2 and "must be at least 1, got" in capsys.readouterr().err, cmd


def test_settings_an_engine_cannot_take_are_refused_with_the_config():
    # top_p 0 made the hf engine greedy and vLLM refuse at the first rollout; a LoRA adapter on
    # the LM head killed the vLLM engine at the first rollout (it adapts the blocks' projections).
    from opd.rl.config import RLConfig
    from opd.rl.validate import ValidateConfig

    train = {"student": {"path": "s"}, "merge": {"teachers": [{"name": "a", "address": "tcp://x:1"}],
                                                 "datasets": [{"domain": "d", "path": "p.jsonl"}]}}
    rl = {"model": {"path": "m"}, "data": {"train": "t"}}
    head = {"rank": 4, "target_modules": ["q_proj", "lm_head"]}
    for cfg, cls, error in [
        ({**train, "rollout": {"top_p": 0.0}}, TrainConfig, r"rollout.top_p 0.0: expected a value in \(0, 1\]"),
        ({**rl, "rollout": {"top_p": 0.0}}, RLConfig, r"rollout.top_p 0.0: expected a value in \(0, 1\]"),
        ({"models": [{"name": "b", "path": "m"}], "sets": [{"domain": "d", "path": "p"}], "top_p": 0.0},
         ValidateConfig, r"top_p 0.0: expected"),
        ({**train, "student": {"path": "s", "lora": head}, "rollout": {"engine": "vllm"}}, TrainConfig,
         r"student.lora.target_modules: rollout.engine vllm cannot load a LoRA adapter on \['lm_head'\]"),
        ({**rl, "model": {"path": "m", "lora": head}, "rollout": {"engine": "vllm"}}, RLConfig,
         r"model.lora.target_modules: rollout.engine vllm cannot load a LoRA adapter on \['lm_head'\]"),
    ]:
        with pytest.raises(ConfigError, match=error):
            from_dict(cfg, cls)
    # the same adapter with the hf engine, and the blocks' projections with vLLM, are fine
    assert from_dict({**train, "student": {"path": "s", "lora": head}}, TrainConfig).student.lora.rank == 4
    assert from_dict({**rl, "model": {"path": "m", "lora": {"rank": 4}}, "rollout": {"engine": "vllm"}},
                     RLConfig).rollout.engine == "vllm"


def test_opd_train_sets_the_passive_wait_policy_before_the_trainer_when_it_forks_its_teacher(
        tmp_path, monkeypatch, tiny_model_dir):
    # The CLI, not the Trainer, sets it (libgomp reads it when torch loads): the Trainer here is a
    # recorder of the environment it was built in.
    import opd.distill.trainer as T
    from opd.cli import main

    seen = []

    class Recorder:
        def __init__(self, cfg, **kwargs):
            seen.append((cfg.cluster.mode, os.environ.get("OMP_WAIT_POLICY")))

        def run(self):
            return {"evals": [], "step": 0, "out_dir": "x"}

    monkeypatch.setattr(T, "Trainer", Recorder)
    monkeypatch.setenv("OMP_WAIT_POLICY", "")   # recorded first, so that teardown restores what was there
    monkeypatch.delenv("OMP_WAIT_POLICY")
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "domain": "math"}\n')
    for mode in ("local", "fork"):
        cfg = {"student": {"path": str(tiny_model_dir)},
               "merge": {"teachers": [{"name": "t", "address": "tcp://127.0.0.1:*" if mode == "fork"
                                       else "tcp://127.0.0.1:5999", "domains": ["math"]}],
                         "datasets": [{"domain": "math", "path": str(tmp_path / "d.jsonl")}]},
               "run": {"out_dir": str(tmp_path / mode)}}
        if mode == "fork":
            cfg["cluster"] = {"mode": "fork", "teachers": [{"name": "t", "model": str(tiny_model_dir)}]}
        (tmp_path / f"{mode}.yaml").write_text(yaml.safe_dump(cfg))
        assert main(["train", str(tmp_path / f"{mode}.yaml")]) == 0
    assert seen == [("local", None), ("fork", "PASSIVE")]
