"""opd sft: the loss sees response tokens only, a short run learns and saves a loadable model, and
the config's sections are those of opd rl and opd train (the flat keys refused with their new place)."""

from __future__ import annotations

import json

import pytest

from opd.config import ConfigError, from_dict
from opd.sft.config import MOVED, SFTConfig, flat_to_sections
from opd.sft.trainer import encode_pair
from opd.spine.optim import lr_lambda


def test_prompt_is_masked_and_eos_is_a_target(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids, labels = encode_pair(tok, "12+3=", "15", max_length=64)
    assert len(ids) == len(labels) == 5 + 2 + 1
    assert labels[:5] == [-100] * 5
    assert labels[5:] == ids[5:] and labels[-1] == tok.eos_token_id


def test_rows_whose_prompt_fills_max_length_are_dropped(tiny_model_dir, tmp_path, capsys):
    # They have no response token left to learn from: a batch of only such rows had a NaN loss.
    from transformers import AutoTokenizer

    from opd.data import write_jsonl
    from opd.sft.config import SFTDataset
    from opd.sft.trainer import _load_sets

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x" * 40, "response": "y"}, {"prompt": "1+1=", "response": "2"}])
    cfg_path = tmp_path / "sft.yaml"
    [pairs], _ = _load_sets(cfg_path, [SFTDataset(path="d.jsonl")], tok, max_length=16)
    assert len(pairs) == 1 and pairs[0][0][:4] == tok("1+1=")["input_ids"][:4]
    assert "1 of 2 rows dropped" in capsys.readouterr().out
    write_jsonl(tmp_path / "long.jsonl", [{"prompt": "x" * 40, "response": "y"}])
    with pytest.raises(ConfigError, match="every prompt fills max_length"):
        _load_sets(cfg_path, [SFTDataset(path="long.jsonl")], tok, max_length=16)


TRAIN = {"train": [{"path": "a.jsonl"}]}


def test_config_needs_exactly_one_start():
    with pytest.raises(ConfigError, match="exactly one of model.path"):
        from_dict({"model": {}, "data": TRAIN}, SFTConfig)
    cfg = from_dict({"model": {"tiny": {"layers": 1}}, "data": TRAIN, "optim": {"warmup_steps": 2, "lr": 0.01},
                     "run": {"steps": 10}}, SFTConfig)
    o = cfg.optim   # the spine's optimizer section itself, with SFT's defaults
    lr_at = lr_lambda(o, cfg.run.steps)   # the multiplier of optim.lr at each step
    assert o.lr * lr_at(0) == pytest.approx(0.005) and o.lr * lr_at(2) == pytest.approx(0.01)
    assert o.lr * lr_at(9) < 0.001 and o.schedule == "cosine"
    assert o.fused   # AdamW's fused kernel by default, as transformers' Trainer
    assert not from_dict({"model": {"tiny": {}}, "data": TRAIN, "optim": {"fused": False}}, SFTConfig).optim.fused
    m = from_dict({"model": {"path": "m", "device": "cpu"}, "data": TRAIN}, SFTConfig).model.at("/abs/m")
    assert (m.path, m.dtype, m.device, m.lora) == ("/abs/m", "float32", "cpu", None)


def _holds(got, want) -> bool:
    """`got` (a config as a dict) has what `want` sets; the keys `want` leaves out are defaults."""
    if isinstance(want, dict):
        return all(_holds(got[k], v) for k, v in want.items())
    if isinstance(want, list):
        return len(got) == len(want) and all(_holds(g, w) for g, w in zip(got, want))
    return got == want


def test_the_flat_keys_are_refused_with_the_key_they_moved_to(tmp_path, capsys):
    from opd.cli import main
    from opd.config import from_yaml_text, to_dict

    # Each key of the flat layout, alone beside a valid config: one line that names its new place.
    given = {"tiny": {"layers": 1}, "lora": {"rank": 4}, "device": "cpu", "train": [{"path": "a.jsonl"}],
             "eval": [], "batch_size": 4, "max_length": 64, "tools": [], "lr": 0.01, "weight_decay": 0.1,
             "warmup_steps": 2, "schedule": "constant", "grad_clip": 0.5, "fused": False, "steps": 3,
             "out_dir": "x", "seed": 1, "log_every": 1, "eval_every": 1, "checkpoint_every": 1,
             "keep_checkpoints": 1, "threads": 1, "num_workers": 2, "cpu_offload": True}
    assert sorted(given) == sorted(k for k in MOVED if k != "model")
    for key, value in given.items():
        with pytest.raises(ConfigError) as e:
            from_dict({"model": {"path": "m"}, "data": TRAIN, key: value}, SFTConfig)
        assert str(e.value).endswith(f"key '{key}' is no longer read here: it moved to `{MOVED[key]}` (opd sft's "
                                     f"keys are in sections, as opd rl's)"), e.value
        # and its new place takes it
        sectioned = {"model": {} if key == "tiny" else {"path": "m"}, "data": dict(TRAIN)}
        *parents, leaf = MOVED[key].split(".")
        node = sectioned
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
        found = from_dict(sectioned, SFTConfig)
        for name in MOVED[key].split("."):
            found = getattr(found, name)
        assert _holds(to_dict(found), value), key
    # `model: DIR` (a directory where the section is now) says where the directory goes.
    with pytest.raises(ConfigError, match=r"f.yaml:2: key 'model' expects a mapping \(ModelConfig\), got 'm': a "
                                          r"model directory is `model.path` now \(model: \{path: DIR\}\)"):
        from_yaml_text("data: {train: [{path: a.jsonl}]}\nmodel: m\n", SFTConfig, source="f.yaml")
    # A whole flat config, as the demo's were: refused at its first key, with file:line, one line.
    (tmp_path / "old.yaml").write_text("out_dir: run\nmodel: m\ntrain: [{path: a.jsonl}]\nsteps: 3\nlr: 0.01\n")
    assert main(["sft", str(tmp_path / "old.yaml")]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'old.yaml'}:1: key 'out_dir' is no longer read here: it "
                                       f"moved to `run.out_dir` (opd sft's keys are in sections, as opd rl's)\n")


def test_the_sections_are_the_spines_with_the_keys_of_opd_rl():
    # Where a key means the same, it has opd rl's name and place (and the spine's class).
    from opd.config import to_dict
    from opd.rl.config import RLConfig
    from opd.spine import config as spine

    cfg = from_dict({"model": {"path": "m"}, "data": TRAIN}, SFTConfig)
    for section, cls in (("model", spine.ModelConfig), ("optim", spine.OptimConfig), ("run", spine.RunConfig)):
        assert isinstance(getattr(cfg, section), cls)
    rl = to_dict(from_dict({"model": {"path": "m"}, "data": {"train": "a.jsonl"}}, RLConfig))
    sft = to_dict(cfg)
    for section in ("model", "optim", "run"):
        assert set(rl[section]) <= set(sft[section]) | {"drown_factor", "flat_warning"}, section
    assert set(sft["cluster"]["student"]) <= set(rl["cluster"]["student"])
    with pytest.raises(ConfigError, match="run.dump_samples: opd sft samples no answers"):
        from_dict({"model": {"path": "m"}, "data": TRAIN, "run": {"dump_samples": 2}}, SFTConfig)
    with pytest.raises(ConfigError, match="data.batch_size 5 does not divide among cluster.student.num_workers 2"):
        from_dict({"model": {"path": "m"}, "data": {**TRAIN, "batch_size": 5},
                   "cluster": {"student": {"num_workers": 2}}}, SFTConfig)


def test_short_run_lowers_eval_loss_and_saves_model(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from opd.cli import main
    from opd.data import write_jsonl

    rows = [{"prompt": f"{a}+1=", "response": str(a + 1)} for a in range(10, 40)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    (tmp_path / "sft.yaml").write_text(
        "model: {tiny: {layers: 1, hidden: 32, heads: 2, kv_heads: 1, intermediate: 64}}\n"
        "data: {train: [{path: train.jsonl}], eval: [{path: train.jsonl, domain: add}], batch_size: 16}\n"
        "optim: {lr: 0.01, warmup_steps: 2}\n"
        "run: {out_dir: run, steps: 40, log_every: 5, eval_every: 5, threads: 1}\n")
    assert main(["sft", str(tmp_path / "sft.yaml")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss/add"] for r in rows if "eval_loss/add" in r]
    assert len(evals) == 8 and evals[-1] < 0.5 * evals[0]
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "model"))
    assert model.config.num_hidden_layers == 1
    assert (tmp_path / "run" / "card.md").read_text().count("token-mean cross-entropy on response tokens") == 1

    # A second run into the same out_dir is refused (it replaced the first one silently),
    # --overwrite replaces it; a model directory without a tokenizer is named as such.
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["sft", str(tmp_path / "sft.yaml")]) == 1
    assert "already holds a run (metrics.jsonl, model/); pass --resume to continue it, --overwrite" \
        in capsys.readouterr().err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before
    assert main(["sft", str(tmp_path / "sft.yaml"), "--overwrite"]) == 0
    (tmp_path / "notok").mkdir()
    (tmp_path / "notok" / "config.json").write_text((tmp_path / "run" / "model" / "config.json").read_text())
    (tmp_path / "sft.yaml").write_text((tmp_path / "sft.yaml").read_text()
                                       .replace("{tiny: {layers: 1, hidden: 32, heads: 2, kv_heads: 1, intermediate: 64}}",
                                                "{path: notok}").replace("out_dir: run", "out_dir: run2"))
    assert main(["sft", str(tmp_path / "sft.yaml")]) == 1
    assert "`model.path` " in (err := capsys.readouterr().err) and "notok: no tokenizer files (tokenizer.json" in err


def test_an_interrupted_run_resumes_exactly(tmp_path, monkeypatch, capsys):
    """Stopped after step 5 with a checkpoint at step 3, `--resume` ends with the weights and
    metrics of the run that was never stopped: same batches from the two-set mixture, same
    optimizer moments, the log past the checkpoint rewritten rather than repeated."""
    import torch
    from safetensors.torch import load_file

    import opd.sft.trainer as sft
    from opd.cli import main
    from opd.data import write_jsonl
    from opd.metrics import read_metrics

    write_jsonl(tmp_path / "add.jsonl", [{"prompt": f"{a}+1=", "response": str(a + 1)} for a in range(10, 30)])
    write_jsonl(tmp_path / "sub.jsonl", [{"prompt": f"{a}-1=", "response": str(a - 1)} for a in range(10, 30)])
    base = ("model: {tiny: {layers: 1, hidden: 32, heads: 2, kv_heads: 1, intermediate: 64}}\n"
            "data: {train: [{path: add.jsonl, ratio: 1}, {path: sub.jsonl, ratio: 2}], eval: [{path: add.jsonl}], "
            "batch_size: 4}\noptim: {lr: 0.01, warmup_steps: 2}\n"
            "run: {out_dir: OUT, steps: 8, log_every: 1, checkpoint_every: 3, threads: 1}\n")
    (tmp_path / "a.yaml").write_text(base.replace("OUT", "a"))
    (tmp_path / "b.yaml").write_text(base.replace("OUT", "b"))
    assert main(["sft", str(tmp_path / "a.yaml")]) == 0

    real, calls = sft.response_loss, []

    def stop_at_step_6(*args):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(sft, "response_loss", stop_at_step_6)
    assert main(["sft", str(tmp_path / "b.yaml")]) == 130
    assert "interrupted (--resume continues" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    monkeypatch.setattr(sft, "response_loss", real)

    # Mistakes first: both flags, or a setting that makes the checkpoint another run's.
    assert main(["sft", str(tmp_path / "b.yaml"), "--resume", "--overwrite"]) == 2
    (tmp_path / "b2.yaml").write_text(base.replace("OUT", "b").replace("batch_size: 4", "batch_size: 5"))
    capsys.readouterr()
    assert main(["sft", str(tmp_path / "b2.yaml"), "--resume"]) == 1
    assert "trained with other settings that define the run (data.batch_size: 4 -> 5)" in capsys.readouterr().err
    # A checkpoint whose state.json holds the flat layout's config is the same run, keys moved.
    state = tmp_path / "b" / "checkpoints" / "step_000003" / "state.json"
    saved = json.loads(state.read_text())
    flat = {}
    for key, place in MOVED.items():
        node = saved["config"]
        for p in place.split("."):
            node = node[p]
        flat[key] = node
    assert flat_to_sections(flat) == saved["config"]
    state.write_text(json.dumps({**saved, "config": flat}))

    assert main(["sft", str(tmp_path / "b.yaml"), "--resume"]) == 0
    rows_a = [{k: v for k, v in r.items() if k != "time"} for r in read_metrics(tmp_path / "a" / "metrics.jsonl")]
    rows_b = [{k: v for k, v in r.items() if k != "time"} for r in read_metrics(tmp_path / "b" / "metrics.jsonl")]
    assert [r["step"] for r in rows_b] == list(range(1, 9)) and rows_b == rows_a
    wa = load_file(str(tmp_path / "a" / "model" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    card = json.loads((tmp_path / "b" / "card.json").read_text())["result"]
    assert card["resumed_at_step"] == 3 and card["changed_since_checkpoint"] == "nothing"
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").glob("step_*")) == ["step_000003", "step_000006"]


def test_all_zero_ratios_are_refused_at_load(tmp_path, monkeypatch, capsys):
    # With every train[].ratio 0 the mixture has nothing to draw from: the model loaded, then
    # MixtureSampler raised a ValueError traceback. Refused with the config file's line instead.
    import opd.sft.trainer as sft
    from opd.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the config was refused")

    monkeypatch.setattr(sft, "load_policy", no_model)
    (tmp_path / "sft.yaml").write_text("run: {out_dir: run}\nmodel: {path: m}\n"
                                       "data:\n  train: [{path: a.jsonl, ratio: 0}, {path: b.jsonl, ratio: 0.0}]\n")
    assert main(["sft", str(tmp_path / "sft.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'sft.yaml'}:4: data: every train[].ratio is 0 (a.jsonl, b.jsonl)" in err
    assert not (tmp_path / "run").exists()
    # One set with a share above 0 is enough.
    cfg = from_dict({"model": {"path": "m"}, "data": {"train": [{"path": "a.jsonl", "ratio": 0},
                                                               {"path": "b.jsonl", "ratio": 0.5}]}}, SFTConfig)
    assert [s.ratio for s in cfg.data.train] == [0.0, 0.5]


def test_no_config_is_a_usage_error_and_describe_lists_the_keys(capsys):
    # Without a config it printed the key list to stdout and exited 2 with no error message.
    from opd.cli import main

    assert main(["sft"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("opd sft: error: a config file is needed: opd sft CONFIG.yaml "
                                 "(e.g. configs/demo/sft_base.yaml; --describe lists its keys)\n")
    assert main(["sft", "--describe"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("model:  the model trained") and "\n  train:  training sets" in out
    assert "\noptim:  " in out and "\n    num_workers (int, default 1): " in out
