"""The objective terms of opd.spine.terms: their maths, and that opd train and opd rl both add
them. One step with the entropy bonus against one without, from the same weights and seed
(the same rollouts): the losses differ by exactly -c x the step's weighted entropy, which each
loop also reports (opd train: signal/entropy, the token mean; opd rl: entropy, token_mean)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from opd.config import from_dict
from opd.spine.terms import TermsConfig, entropy, token_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rl"))


def test_the_entropy_and_its_gradient():
    torch.manual_seed(0)
    assert torch.allclose(entropy(torch.zeros(3, 7)), torch.full((3,), math.log(7)))
    z = torch.randn(4, 11, dtype=torch.float64, requires_grad=True)
    entropy(z).sum().backward()
    p = torch.softmax(z.detach(), -1)
    h = -(p * p.log()).sum(-1, keepdim=True)
    assert torch.allclose(z.grad, -p * (p.log() + h), atol=1e-6)   # dH/dz = -p (log p + H)
    assert token_loss(TermsConfig(), entropy=torch.ones(2)) is None
    assert torch.equal(token_loss(TermsConfig(entropy_bonus=0.5), entropy=torch.ones(2)), torch.full((2,), -0.5))


def _first_rows(out: Path) -> dict:
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


def test_opd_rl_adds_the_entropy_bonus_to_its_loss(tmp_path, tiny_model_dir):
    from test_rl_e2e import make_config
    from opd.rl.trainer import GRPOTrainer

    rows = {}
    for c in (0.0, 0.3):
        d = tmp_path / f"c{c}"
        d.mkdir()
        cfg = make_config(d, tiny_model_dir, algorithm={"epochs": 1, "kl_beta": 0.0, "loss_aggregation": "token_mean"},
                          run={"steps": 1}, terms={"entropy_bonus": c})
        GRPOTrainer(cfg).train()
        rows[c] = _first_rows(d / "run")
    assert rows[0.0]["entropy"] == pytest.approx(rows[0.3]["entropy"], rel=1e-6)   # the same rollouts
    assert rows[0.3]["loss"] - rows[0.0]["loss"] == pytest.approx(-0.3 * rows[0.3]["entropy"], rel=1e-4, abs=1e-6)
    card = json.loads((tmp_path / "c0.3" / "run" / "card.json").read_text())
    assert card["objective"]["entropy bonus"].startswith("0.3 x")


def test_opd_train_adds_the_entropy_bonus_to_its_loss(tmp_path, tiny_model_dir):
    from opd.data import write_jsonl
    from opd.distill.config import TrainConfig
    from opd.distill.trainer import Trainer
    from opd.teachers.hf_backend import HFBackend
    from opd.teachers.server import serving_in_thread
    from opd.tiny import lm_head_teacher

    teacher = lm_head_teacher(tiny_model_dir, tmp_path / "teacher")
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"q{i}: what is {i}+{i}?"} for i in range(8)])
    rows = {}
    with serving_in_thread(HFBackend(teacher, name="t", max_k=8)) as server:
        for c in (0.0, 0.3):
            cfg = from_dict({
                "student": {"path": str(tiny_model_dir)},
                "merge": {"teachers": [{"name": "t", "address": server.address, "k": 8}],
                          "datasets": [{"domain": "gen", "path": str(tmp_path / "train.jsonl")}]},
                "rollout": {"prompts_per_step": 4, "max_new_tokens": 8},
                "terms": {"entropy_bonus": c},
                "run": {"steps": 1, "out_dir": str(tmp_path / f"c{c}"), "progress": False, "tensorboard": False}},
                TrainConfig)
            Trainer(cfg).run()
            rows[c] = _first_rows(tmp_path / f"c{c}")
    assert "signal/entropy" not in rows[0.0]   # off: nothing computed
    ent = rows[0.3]["signal/entropy"]
    assert 0 < ent <= math.log(260)
    assert rows[0.3]["loss"] - rows[0.0]["loss"] == pytest.approx(-0.3 * ent, rel=1e-4, abs=1e-6)
    with pytest.raises(ValueError, match="fused_linear"):
        from_dict({**json.loads(json.dumps({"student": {"path": "s"}})),
                   "merge": {"teachers": [{"name": "t", "address": "tcp://x:1"}],
                             "datasets": [{"domain": "gen", "path": "p"}]},
                   "loss": {"fused_linear": True}, "terms": {"entropy_bonus": 0.1}}, TrainConfig)
