"""The training spine on its own: the shared config sections, the one loader, the optimizer step
and the run directory, as all three loops use them."""

from __future__ import annotations

import json

import pytest
import torch

from opd.checkpoint import CheckpointError
from opd.config import ConfigError, from_dict, to_dict
from opd.spine.config import ModelConfig, OptimConfig, RunConfig
from opd.spine.model import load_policy
from opd.spine.optim import NonfiniteSteps, TrainError, build_optimizer, fusable, lr_lambda, optimizer_step
from opd.spine.run import RunDir


def test_a_renamed_key_is_still_read_and_not_twice():
    assert from_dict({"ckpt_every": 7}, RunConfig).checkpoint_every == 7     # opd rl's earlier name
    assert "ckpt_every" not in to_dict(from_dict({"ckpt_every": 7}, RunConfig))
    with pytest.raises(ConfigError, match="key 'checkpoint_every' given twice \\(as 'ckpt_every', an earlier name"):
        from_dict({"checkpoint_every": 1, "ckpt_every": 2}, RunConfig)


def test_the_schedule_warms_up_then_decays_to_its_floor():
    f = lr_lambda(OptimConfig(schedule="cosine", warmup_steps=4, min_lr_ratio=0.1), steps=14)
    assert [f(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5) and f(14) == pytest.approx(0.1) and f(40) == pytest.approx(0.1)
    linear = lr_lambda(OptimConfig(schedule="linear"), steps=10)
    assert linear(5) == pytest.approx(0.5)
    assert lr_lambda(OptimConfig(), steps=10)(7) == 1.0


def test_a_step_with_a_nonfinite_gradient_leaves_the_weights_and_three_stop_the_run():
    model = torch.nn.Linear(3, 2)
    opt, schedule = build_optimizer(model, OptimConfig(lr=0.1, grad_clip=0.5), steps=5)
    params = list(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    norm, applied = optimizer_step(opt, params, 0.5)
    assert applied and norm > 0.5 and all(p.grad is None for p in params)
    before = [p.detach().clone() for p in params]
    (model(torch.ones(1, 3)).sum() * float("nan")).backward()
    norm, applied = optimizer_step(opt, params, 0.5)
    assert not applied and norm != norm and all(torch.equal(p, b) for p, b in zip(params, before))
    guard = NonfiniteSteps("check the data")
    assert guard.check(1, True) is None
    assert guard.check(2, False, " (loss nan)") == ("step 2: the gradient is not finite (loss nan); the step was "
                                                   "skipped, the weights are unchanged")
    guard.check(3, False)
    assert guard.check(4, True) is None          # a good step in between resets the count
    guard.check(5, False), guard.check(6, False)
    with pytest.raises(TrainError, match="3 steps in a row had a gradient that is not finite.*check the data"):
        guard.check(7, False)


def test_optim_fused_takes_adamws_fused_kernel_which_steps_as_foreach_does():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    twin = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    twin.load_state_dict(model.state_dict())
    cfg = OptimConfig(lr=0.01, weight_decay=0.1, grad_clip=1.0, fused=True)
    opt, _ = build_optimizer(model, cfg, steps=10)
    assert opt.defaults["fused"] is True
    assert build_optimizer(twin, OptimConfig(), steps=1)[0].defaults["fused"] is True   # on by default
    assert build_optimizer(twin, OptimConfig(fused=False), steps=1)[0].defaults["fused"] is None
    ref = torch.optim.AdamW(twin.parameters(), lr=0.01, weight_decay=0.1, foreach=True)
    start = model[0].weight.detach().clone()
    for _ in range(5):
        x = torch.randn(8, 16)
        for m, o in ((model, opt), (twin, ref)):
            m(x).square().mean().backward()
            optimizer_step(o, list(m.parameters()), 1.0)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert (model[0].weight - start).abs().max() > 0.01   # five steps of lr 0.01 moved it
    # a resume follows the config, not the kernel the checkpoint was saved with
    ref.load_state_dict(opt.state_dict())
    assert ref.param_groups[0]["fused"] is True   # a plain AdamW takes the saved kernel ...
    again, _ = build_optimizer(twin, OptimConfig(fused=False), steps=1)
    again.load_state_dict(opt.state_dict())
    assert again.param_groups[0]["fused"] is None and len(again.state) == 4   # ... build_optimizer's keeps its own
    # what the fused kernel does not take: integer tensors, a meta device, nothing at all
    assert not fusable([torch.zeros(2, dtype=torch.long)])
    assert not fusable([torch.zeros(2, device="meta")]) and not fusable([])


def test_the_one_loader_trains_lora_with_dropout_off_or_loads_a_frozen_copy(tiny_model_dir, tmp_path):
    lora = {"rank": 4, "dropout": 0.3, "target_modules": ["q_proj", "v_proj"]}
    cfg = from_dict({"path": str(tiny_model_dir), "device": "cpu", "lora": lora}, ModelConfig)
    model, tok = load_policy(cfg, seed=0, dropout=False)
    assert model.training and tok.pad_token_id is not None
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))   # the adapter's 0.3 too
    # A saved adapter directory loads merged into its base, as a frozen copy.
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).fill_(0.5)
    model.save_pretrained(tmp_path / "adapter")
    tok.save_pretrained(tmp_path / "adapter")
    frozen, _ = load_policy(ModelConfig(path=str(tmp_path / "adapter")), train=False)
    ids = torch.tensor([[5, 6, 7]])
    assert not frozen.training and not hasattr(frozen, "peft_config")
    torch.testing.assert_close(frozen(input_ids=ids).logits, model.eval()(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_a_run_directory_refuses_a_second_run_and_a_resume_under_another_objective(tiny_model_dir, tmp_path):
    model, _ = load_policy(ModelConfig(path=str(tiny_model_dir), device="cpu"))
    opt, schedule = build_optimizer(model, OptimConfig(lr=1.0, schedule="linear"), steps=4)
    config = {"lr": 1.0, "seed": 0}
    run = RunDir(tmp_path / "run", config, fixed=("seed",))
    with pytest.raises(CheckpointError, match="no complete checkpoint under .* \\(write them\\)"):
        RunDir(tmp_path / "other", config, resume=True, hint=" (write them)")
    for _ in range(2):
        opt.step()
        schedule.step()
    run.save(2, model, opt, schedule, state={"position": 7}, keep=1)
    with pytest.raises(CheckpointError, match="already holds a run"):
        RunDir(tmp_path / "run", config)
    with pytest.raises(CheckpointError, match="seed: 0 -> 1"):
        RunDir(tmp_path / "run", {**config, "seed": 1}, resume=True, fixed=("seed",))
    resumed = RunDir(tmp_path / "run", {**config, "lr": 0.5}, resume=True, fixed=("seed",))
    assert resumed.changed == ["lr: 1.0 -> 0.5"]
    # Twice as many steps now: the resumed step's rate is this run's schedule at step 2.
    opt2, schedule2 = build_optimizer(model, OptimConfig(lr=1.0, schedule="linear"), steps=8)
    state = resumed.restore(model, opt2, schedule2)
    assert state["position"] == 7 and state["config"] == config
    assert opt2.param_groups[0]["lr"] == pytest.approx(1 - 2 / 8)
    # A checkpoint that holds no schedule (opd sft wrote none before): placed at its step.
    path = tmp_path / "run" / "checkpoints" / "step_000002" / "optimizer.pt"
    blob = torch.load(path, weights_only=True)
    torch.save({**blob, "scheduler": None}, path)
    opt3, schedule3 = build_optimizer(model, OptimConfig(lr=1.0, schedule="linear"), steps=4)
    RunDir(tmp_path / "run", config, resume=True).restore(model, opt3, schedule3)
    assert schedule3.last_epoch == 2 and opt3.param_groups[0]["lr"] == pytest.approx(0.5)
    assert json.loads((tmp_path / "run" / "checkpoints" / "step_000002" / "state.json").read_text())["step"] == 2


def test_a_sharded_run_needs_prompts_that_divide_among_its_ranks_and_the_hf_engine():
    from opd.distill.config import TrainConfig
    from opd.rl.config import RLConfig

    shards = {"student": {"num_workers": 2}}
    rl = {"model": {"path": "m"}, "data": {"train": "t.jsonl"}, "rollout": {"prompts_per_step": 3}, "cluster": shards}
    with pytest.raises(ConfigError, match="rollout.prompts_per_step 3 does not divide among cluster.student.num_workers 2"):
        from_dict(rl, RLConfig)
    rl["rollout"]["prompts_per_step"] = 4
    assert from_dict(rl, RLConfig).cluster.student.num_workers == 2
    train = {"student": {"path": "s"}, "cluster": shards, "rollout": {"prompts_per_step": 4, "engine": "vllm"},
             "merge": {"teachers": [{"name": "t", "address": "tcp://127.0.0.1:1"}],
                       "datasets": [{"domain": "d", "path": "p.jsonl"}]}}
    assert from_dict(train, TrainConfig).rollout.engine == "vllm"   # rank 0's engine serves both ranks
    train["rollout"]["engine"] = "hf"
    assert from_dict(train, TrainConfig).rollout.prompts_per_step == 4
