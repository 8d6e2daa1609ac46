"""Per-step diagnostics: the share of all-equal groups, and the warning when most groups carry no signal."""

from types import SimpleNamespace

import pytest
import torch

from opd.rl.config import RLConfig
from opd.config import from_dict
from opd.rl.trainer import GRPOTrainer
from opd.rollout import Rollout


def _trainer_stub():
    cfg = from_dict({"model": {"path": "m"}, "data": {"train": "t"}, "rollout": {"group_size": 4, "temperature": 0.3}},
                    RLConfig)
    return SimpleNamespace(cfg=cfg, last_flat_warning=-10**9)


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
