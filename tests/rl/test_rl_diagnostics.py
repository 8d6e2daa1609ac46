"""Per-step diagnostics: the share of all-equal groups, and the warning when most groups carry no signal."""

from types import SimpleNamespace

import pytest
import torch

from opd.rl.config import RLConfig
from opd.config import from_dict
from opd.rl.trainer import GRPOTrainer
from opd.rollout import Rollout
from opd.spine.dist import World


def _trainer_stub():
    cfg = from_dict({"model": {"path": "m"}, "data": {"train": "t"}, "rollout": {"samples_per_prompt": 4, "temperature": 0.3}},
                    RLConfig)
    return SimpleNamespace(cfg=cfg, last_flat_warning=-10**9, warnings=[], world=World())


def _metrics(rewards):
    r = torch.tensor(rewards, dtype=torch.float32)
    rollouts = [Rollout([1], [2, 3], [0.0, 0.0], "eos") for _ in range(r.numel())]
    return GRPOTrainer.step_metrics(None, r, {"math": r.flatten().tolist()}, rollouts, {})


def test_step_metrics_group_shares():
    m = _metrics([[1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0], [1, 1, 1, 1]])
    assert m["groups/all_equal"] == 0.75
    assert m["groups/all_top"] == 0.5 and m["groups/all_bottom"] == 0.25
    assert m["reward/mean"] == pytest.approx(9 / 16)
    assert m["reward/group_std"] == pytest.approx(0.5 / 4)   # only the mixed group has spread (std 0.5)
    assert m["length/mean"] == 2.0 and m["reward/math"] == pytest.approx(9 / 16)


@pytest.mark.parametrize("rewards,expect", [
    ([[0, 0, 0, 0]] * 5, "too hard"),
    ([[1, 1, 1, 1]] * 5, "too easy"),
    ([[1, 1, 1, 1]] * 4 + [[0, 0, 0, 0]], "too easy"),
    ([[1, 0, 0, 0]] * 5, None),
])
def test_flat_groups_warning(rewards, expect, capsys):
    stub = _trainer_stub()
    GRPOTrainer.warn_if_flat(stub, 3, _metrics(rewards))
    out = capsys.readouterr().out
    if expect is None:
        assert out == ""
    else:
        assert expect in out and "temperature (0.3)" in out and "no gradient" in out
        GRPOTrainer.warn_if_flat(stub, 4, _metrics(rewards))       # not repeated every step
        assert capsys.readouterr().out == ""
        assert len(stub.warnings) == 1 and expect in stub.warnings[0]   # kept for the card


def test_bad_config_is_refused_with_file_and_line(tmp_path, capsys):
    from opd.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: m}\ndata: {train: t}\nalgorithm:\n  eps_hihg: 0.3\n")
    assert main(["rl", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:4" in err and "eps_hihg" in err and "eps_high" in err
    bad.write_text("model: {path: m}\ndata: {train: t}\nrewards: [{name: python}]\n")
    assert main(["rl", str(bad)]) == 2
    assert "FILE.py:function" in capsys.readouterr().err


def test_a_fresh_run_into_a_used_run_dir_is_refused_before_loading(tmp_path, capsys):
    # The model path does not exist: the refusal comes before anything loads.
    from opd.cli import main

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 3}\n')
    cfg = tmp_path / "rl.yaml"
    cfg.write_text("model: {path: m}\ndata: {train: t}\nrun: {out_dir: run}\n")
    assert main(["rl", str(cfg)]) == 1
    assert "already holds a run (metrics.jsonl); pass --resume" in capsys.readouterr().err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 3}\n'
    assert main(["rl", str(cfg), "--resume", "--overwrite"]) == 2


def _metrics_math_format(math_P_G, format_P_G):
    """configs/rl_math.yaml's rewards: math (weight 1) + format (weight 0.1)."""
    math_r, fmt = torch.tensor(math_P_G, dtype=torch.float32), torch.tensor(format_P_G, dtype=torch.float32)
    rollouts = [Rollout([1], [2, 3], [0.0, 0.0], "eos") for _ in range(math_r.numel())]
    parts = {"math": math_r.flatten().tolist(), "format": fmt.flatten().tolist()}
    return GRPOTrainer.step_metrics(None, math_r + 0.1 * fmt, parts, rollouts, {})


def test_correct_and_wrong_come_from_the_verifier_not_the_batch_maximum(capsys):
    # Every answer well formatted and wrong: the batch is flat at its own maximum (0.1), and
    # was reported as "all-correct: the data are too easy".
    m = _metrics_math_format([[0, 0, 0, 0]] * 5, [[1, 1, 1, 1]] * 5)
    assert (m["groups/all_equal"], m["groups/all_top"], m["groups/all_bottom"]) == (1.0, 0.0, 1.0)
    GRPOTrainer.warn_if_flat(_trainer_stub(), 3, m)
    out = capsys.readouterr().out
    assert "0% of groups are all-correct and 100% all-wrong by the verifier: the data are too hard" in out
    # one all-correct group (1.1), four all-wrong formatted (0.1), one mixed group
    m = _metrics_math_format([[1] * 4] + [[0] * 4] * 4 + [[0, 1, 0, 0]], [[1] * 4] * 6)
    assert m["groups/all_equal"] == pytest.approx(5 / 6)
    assert m["groups/all_top"] == pytest.approx(1 / 6) and m["groups/all_bottom"] == pytest.approx(4 / 6)
    # all correct, some without the format: flat groups at 1.0 and 1.1, both all-correct
    m = _metrics_math_format([[1] * 4] * 2, [[0] * 4, [1] * 4])
    assert (m["groups/all_top"], m["groups/all_bottom"]) == (1.0, 0.0)


def test_without_a_verifier_flat_groups_are_not_called_correct_or_wrong(capsys):
    r = torch.ones(5, 4)
    rollouts = [Rollout([1], [2, 3], [0.0, 0.0], "eos") for _ in range(r.numel())]
    m = GRPOTrainer.step_metrics(None, r, {"python:digits": r.flatten().tolist()}, rollouts, {})
    assert m["groups/all_equal"] == 1.0 and "groups/all_top" not in m and "groups/all_bottom" not in m
    GRPOTrainer.warn_if_flat(_trainer_stub(), 3, m)
    out = capsys.readouterr().out
    assert "responses in a group get identical rewards" in out and "too easy" not in out and "too hard" not in out
