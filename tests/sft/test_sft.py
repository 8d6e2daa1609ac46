"""opd sft: the loss sees response tokens only, and a short run learns and saves a loadable model."""

from __future__ import annotations

import json

import pytest

from opd.config import ConfigError, from_dict
from opd.sft.config import SFTConfig
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


def test_config_needs_exactly_one_start():
    with pytest.raises(ConfigError, match="exactly one"):
        from_dict({"out_dir": "x", "train": [{"path": "a.jsonl"}]}, SFTConfig)
    cfg = from_dict({"out_dir": "x", "train": [{"path": "a.jsonl"}], "tiny": {"layers": 1},
                     "steps": 10, "warmup_steps": 2, "lr": 0.01}, SFTConfig)
    lr_at = lr_lambda(cfg.optim_config(), cfg.steps)   # the multiplier of cfg.lr at each step
    assert cfg.lr * lr_at(0) == pytest.approx(0.005) and cfg.lr * lr_at(2) == pytest.approx(0.01)
    assert cfg.lr * lr_at(9) < 0.001
    assert cfg.optim_config().fused   # AdamW's fused kernel by default, as transformers' Trainer
    assert not from_dict({"out_dir": "x", "train": [{"path": "a.jsonl"}], "tiny": {"layers": 1}, "fused": False},
                         SFTConfig).optim_config().fused


def test_short_run_lowers_eval_loss_and_saves_model(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from opd.cli import main
    from opd.data import write_jsonl

    rows = [{"prompt": f"{a}+1=", "response": str(a + 1)} for a in range(10, 40)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    (tmp_path / "sft.yaml").write_text(
        "out_dir: run\ntiny: {layers: 1, hidden: 32, heads: 2, kv_heads: 1, intermediate: 64}\n"
        "train: [{path: train.jsonl}]\neval: [{path: train.jsonl, domain: add}]\n"
        "steps: 40\nbatch_size: 16\nlr: 0.01\nwarmup_steps: 2\nlog_every: 5\neval_every: 5\nthreads: 1\n")
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
                                       .replace("tiny: {layers: 1, hidden: 32, heads: 2, kv_heads: 1, intermediate: 64}",
                                                "model: notok").replace("out_dir: run", "out_dir: run2"))
    assert main(["sft", str(tmp_path / "sft.yaml")]) == 1
    assert "`model` " in (err := capsys.readouterr().err) and "notok: no tokenizer files (tokenizer.json" in err


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
    base = ("tiny: {layers: 1, hidden: 32, heads: 2, kv_heads: 1, intermediate: 64}\n"
            "train: [{path: add.jsonl, ratio: 1}, {path: sub.jsonl, ratio: 2}]\neval: [{path: add.jsonl}]\n"
            "steps: 8\nbatch_size: 4\nlr: 0.01\nwarmup_steps: 2\nlog_every: 1\ncheckpoint_every: 3\nthreads: 1\n")
    (tmp_path / "a.yaml").write_text("out_dir: a\n" + base)
    (tmp_path / "b.yaml").write_text("out_dir: b\n" + base)
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
    (tmp_path / "b2.yaml").write_text("out_dir: b\n" + base.replace("batch_size: 4", "batch_size: 5"))
    capsys.readouterr()
    assert main(["sft", str(tmp_path / "b2.yaml"), "--resume"]) == 1
    assert "trained with other settings that define the run (batch_size: 4 -> 5)" in capsys.readouterr().err

    assert main(["sft", str(tmp_path / "b.yaml"), "--resume"]) == 0
    rows_a = [{k: v for k, v in r.items() if k != "time"} for r in read_metrics(tmp_path / "a" / "metrics.jsonl")]
    rows_b = [{k: v for k, v in r.items() if k != "time"} for r in read_metrics(tmp_path / "b" / "metrics.jsonl")]
    assert [r["step"] for r in rows_b] == list(range(1, 9)) and rows_b == rows_a
    wa = load_file(str(tmp_path / "a" / "model" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    card = (tmp_path / "b" / "card.md").read_text()
    assert "resumed_at_step" in card and "changed_since_checkpoint" in card
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").glob("step_*")) == ["step_000003", "step_000006"]


def test_all_zero_ratios_are_refused_at_load(tmp_path, monkeypatch, capsys):
    # With every train[].ratio 0 the mixture has nothing to draw from: the model loaded, then
    # MixtureSampler raised a ValueError traceback. Refused with the config file's line instead.
    import opd.sft.trainer as sft
    from opd.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the config was refused")

    monkeypatch.setattr(sft, "load_policy", no_model)
    (tmp_path / "sft.yaml").write_text("out_dir: run\nmodel: m\n"
                                       "train: [{path: a.jsonl, ratio: 0}, {path: b.jsonl, ratio: 0.0}]\n")
    assert main(["sft", str(tmp_path / "sft.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'sft.yaml'}:1: SFTConfig: every train[].ratio is 0 (a.jsonl, b.jsonl)" in err
    assert not (tmp_path / "run").exists()
    # One set with a share above 0 is enough.
    cfg = from_dict({"out_dir": "x", "model": "m", "train": [{"path": "a.jsonl", "ratio": 0},
                                                            {"path": "b.jsonl", "ratio": 0.5}]}, SFTConfig)
    assert [s.ratio for s in cfg.train] == [0.0, 0.5]


def test_no_config_is_a_usage_error_and_describe_lists_the_keys(capsys):
    # Without a config it printed the key list to stdout and exited 2 with no error message.
    from opd.cli import main

    assert main(["sft"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("opd sft: error: a config file is needed: opd sft CONFIG.yaml "
                                 "(e.g. configs/demo/sft_base.yaml; --describe lists its keys)\n")
    assert main(["sft", "--describe"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("out_dir (str, required): ") and "\ntrain:  training sets" in out
