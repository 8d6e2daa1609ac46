"""GRPO end to end on the tiny random model: reward rises, resume continues, LoRA's reference is the base."""

import json
import re
import subprocess
import sys

import pytest
import torch

from opd.config import from_dict, to_dict
from opd.rl.config import RLConfig

# A toy verifiable task a randomly initialised byte-level model can learn in a few GRPO
# steps: the reward is the share of digit characters in a 4-token response (about 4 % at
# the start: 10 of 260 tokens are digits).
REWARD_PY = "def digits(sample, text):\n    return sum(c.isdigit() for c in text) / max(len(text), 1)\n"


def make_config(tmp_path, model_dir, **overrides) -> RLConfig:
    rows = [{"prompt": f"Number {i}:", "answer": str(i)} for i in range(16)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "digits.py").write_text(REWARD_PY)
    cfg = {
        "model": {"path": str(model_dir)},
        "data": {"train": str(tmp_path / "train.jsonl")},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 8, "max_new_tokens": 4, "temperature": 1.0},
        "algorithm": {"epochs": 2, "kl_beta": 0.01},
        "rewards": [{"name": "python", "path": str(tmp_path / "digits.py") + ":digits"}],
        "optim": {"lr": 0.01},
        "run": {"steps": 10, "ckpt_every": 5, "out_dir": str(tmp_path / "run"), "seed": 0},
    }
    for key, value in overrides.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return from_dict(cfg, RLConfig)


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)   # the box is shared; one thread is faster than contending for two
    yield
    torch.set_num_threads(n)


def test_mean_reward_rises_and_resume_continues(tmp_path, tiny_model_dir, one_thread):
    from opd.checkpoint import latest_checkpoint
    from opd.rl.trainer import GRPOTrainer

    cfg = make_config(tmp_path, tiny_model_dir)
    summary = GRPOTrainer(cfg).train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows]
    assert len(rewards) == 10
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first < 0.2 and last > first + 0.25, rewards
    assert summary["reward_rose"] is True
    for key in ("reward/group_std", "groups/all_equal", "length/mean", "clip_fraction", "kl", "entropy"):
        assert all(isinstance(r[key], float) for r in rows), key
    assert rows[-1]["entropy"] < rows[0]["entropy"]     # the policy concentrates on digits
    assert rows[-1]["kl"] > 0.0                         # and moved away from the reference
    card = (tmp_path / "run" / "card.md").read_text()
    for fact in ("group size G", "kl beta", "eps_high", "loss aggregation", "python:digits", "temperature"):
        assert fact in card
    assert (tmp_path / "run" / "model" / "config.json").is_file()
    assert list((tmp_path / "run" / "plots").glob("reward.png"))
    assert latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step_000010"

    # --resume: continues at step 10 and logs each step once
    resumed = GRPOTrainer(make_config(tmp_path, tiny_model_dir, run={"steps": 12}), resume=True)
    assert resumed.start_step == 10
    whole = resumed.train()
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))
    # the summary covers the whole run, not the 2 steps after the resume
    assert whole["steps"] == 12 and whole["reward_first"] == summary["reward_first"]


def test_lora_reference_is_the_base_model_with_the_adapter_off(tmp_path, tiny_model_dir, one_thread):
    from transformers import AutoModelForCausalLM

    from opd.spine.rows import token_logprobs
    from opd.rl.batch import collate
    from opd.rl.trainer import GRPOTrainer
    from oracles import response_logits
    from opd.rollout import SamplingParams

    cfg = make_config(tmp_path, tiny_model_dir, model={"lora": {"rank": 4}}, run={"steps": 1})
    trainer = GRPOTrainer(cfg)
    assert trainer.reference is None                   # no second copy of the model
    with torch.no_grad():                              # make the adapter matter
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    rollouts = trainer.engine.generate([[65, 66, 67]], SamplingParams(max_new_tokens=3, n=2, seed=0))
    batch = collate(rollouts, trainer.pad_id)
    ref = trainer.reference_logprobs(batch)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = token_logprobs(response_logits(base, batch), batch.packed.targets_N)
        policy_logits = response_logits(trainer.model, batch)
        policy = token_logprobs(policy_logits, batch.packed.targets_N.to(policy_logits.device)).cpu()
    assert torch.allclose(ref, expected, atol=1e-5)
    assert not torch.allclose(policy, expected, atol=1e-3)
    # the rollout engine's log-probs are the policy's own (ratio 1 in the first epoch)
    assert torch.allclose(batch.old_logprobs_N, policy, atol=1e-4)

    # a LoRA run checkpoints the adapter, resumes from it, and leaves a merged full model
    trainer.train()
    resumed = GRPOTrainer(make_config(tmp_path, tiny_model_dir, model={"lora": {"rank": 4}}, run={"steps": 2}),
                          resume=True)
    assert resumed.start_step == 1
    lora_b = {n: p.detach().clone() for n, p in resumed.model.named_parameters() if "lora_B" in n}
    assert all(float(v.abs().max()) > 0.1 for v in lora_b.values())   # the trained adapter came back
    resumed.train()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "model"), dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())


def test_the_policy_has_no_dropout_so_the_first_epoch_ratio_is_one(tmp_path, tiny_model_dir, one_thread):
    # The engines sample without dropout; with LoRA dropout on in the update, 39 % of a first
    # epoch's tokens were clipped (ratios 0.2-2.5) where every ratio should be 1.
    from opd.spine.rows import token_logprobs
    from opd.rl.batch import collate
    from opd.rl.trainer import GRPOTrainer
    from oracles import response_logits
    from opd.rollout import SamplingParams

    trainer = GRPOTrainer(make_config(tmp_path, tiny_model_dir, model={"lora": {"rank": 4, "dropout": 0.5}},
                                      run={"steps": 1}))
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    batch = collate(trainer.engine.generate([[65, 66, 67], [70, 71]], SamplingParams(max_new_tokens=4, n=4, seed=0)),
                    trainer.pad_id)
    assert trainer.model.training                      # the update's own mode
    with torch.no_grad():
        policy = token_logprobs(response_logits(trainer.model, batch), batch.packed.targets_N)
    assert torch.allclose(batch.old_logprobs_N, policy, atol=1e-4)


def test_cli_help():
    helps = {}
    for cmd in ("rl", "validate"):
        helps[cmd] = out = subprocess.run([sys.executable, "-m", "opd.cli", cmd, "--help"], capture_output=True,
                                          text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "config" in out.stdout
    out = helps["rl"]
    assert "samples_per_prompt" in out.stdout and "--resume" in out.stdout
    # cluster.mode: it described opd train's fork mode (starting teachers), which opd rl refuses
    mode = next(line for line in out.stdout.splitlines() if line.strip().startswith("mode (") and "'local'" in line)
    assert "fork: opd train starts" not in mode and "teachers at the merge config" not in mode
    assert "ray: rollout.actors Ray actors" in mode and "fork is opd train's" in mode and "refused" in mode


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("lora", [False, True])
def test_grpo_with_the_vllm_engine(tmp_path, vllm_model_dir, one_thread, lora):
    """The vLLM engine's raw log-probs match the trainer's forward pass: the first ratio is 1."""
    from opd.rl.trainer import GRPOTrainer

    over = {"rollout": {"engine": "vllm", "max_model_len": 128}, "algorithm": {"epochs": 1, "kl_beta": 0.01},
            "run": {"steps": 2, "ckpt_every": 0}}
    if lora:
        over["model"] = {"lora": {"rank": 4}}
    trainer = GRPOTrainer(make_config(tmp_path, vllm_model_dir, **over))
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert rows[0]["ratio/mean"] == pytest.approx(1.0, abs=2e-3)
    assert rows[1]["ratio/mean"] == pytest.approx(1.0, abs=2e-3)   # weights were pushed after step 1


def test_every_reward_kind_runs_in_the_loop_with_eval(tmp_path, tiny_model_dir, one_thread, monkeypatch):
    from opd.rl import evaluate as rl_eval
    from opd.rl.trainer import GRPOTrainer

    seen = []   # evaluation verifies code with the code reward's own limits, as training does
    verify_batch = rl_eval.verify_batch
    monkeypatch.setattr(rl_eval, "verify_batch", lambda *a, **kw: (seen.append(kw), verify_batch(*a, **kw))[1])

    rows = [{"prompt": "1+1=", "answer": "2", "domain": "math"},
            {"prompt": "def inc", "tests": "assert inc(1) == 2", "domain": "code"}]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_config(tmp_path, tiny_model_dir,
                      data={"train": str(tmp_path / "mixed.jsonl"), "eval": str(tmp_path / "mixed.jsonl")},
                      rollout={"prompts_per_step": 2, "samples_per_prompt": 2}, optim={"warmup_steps": 2},
                      run={"steps": 2, "ckpt_every": 0})
    cfg = from_dict({**to_dict(cfg), "rewards": [
        {"name": "math"}, {"name": "code", "options": {"timeout_s": 2.0, "workers": 2}},
        {"name": "format", "weight": 0.1}, {"name": "length", "weight": 0.1, "options": {"soft_max": 2, "hard_max": 4}},
        {"name": "python", "path": str(tmp_path / "digits.py") + ":digits"}]}, RLConfig)
    GRPOTrainer(cfg).train()
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in logged] == pytest.approx([0.005, 0.01])   # the rates the steps used (warm-up)
    assert seen and all(kw == {"timeout_s": 2.0, "workers": 2} for kw in seen), seen
    last = logged[-1]
    for key in ("reward/math", "reward/code", "reward/format", "reward/length", "reward/python:digits",
                "eval/reward", "eval/accuracy"):
        assert key in last, key
    assert last["reward/length"] <= 0.0


@pytest.mark.parametrize("reward, error", [
    ({"name": "format", "options": {"pattern": "("}}, r"rewards\[0\] \(format\): option pattern '\('"),
    ({"name": "length", "options": {"soft_max": 10, "hard_max": 5}},
     r"rewards\[0\] \(length\): option hard_max 5 must be greater than option soft_max 10"),
])
def test_reward_option_values_are_refused_before_the_model_loads(tmp_path, tiny_model_dir, monkeypatch, reward, error):
    # They failed at the first step's rewards with a traceback (re.error, ValueError), after the
    # model load and the first rollout, leaving a card for a run that never trained.
    from opd.cli import _user_error
    from opd.config import ConfigError
    from opd.rl import trainer as rl_trainer
    from opd.rl.trainer import GRPOTrainer

    monkeypatch.setattr(rl_trainer, "load_policy", lambda *a, **kw: pytest.fail("the model was loaded"))
    cfg = from_dict({**to_dict(make_config(tmp_path, tiny_model_dir)), "rewards": [reward]}, RLConfig)
    with pytest.raises(ConfigError, match=error) as e:
        GRPOTrainer(cfg)
    assert _user_error(e.value)                      # opd rl prints it as one line, exit 1
    assert not (tmp_path / "run" / "card.md").exists()


def test_eval_accuracy_is_the_share_fully_correct(tmp_path, tiny_model_dir, one_thread):
    # eval/accuracy was the mean verifier score: a code answer passing 1 of 3 tests counted 1/3
    from opd.rl.trainer import GRPOTrainer

    tests = "assert f(1) == 1\nassert f(2) == 2\nassert f(3) == 3"
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"prompt": f"task {i}", "tests": tests}) + "\n"
                                                 for i in range(4)))
    cfg = make_config(tmp_path, tiny_model_dir, run={"steps": 1}, data={"eval": str(tmp_path / "eval.jsonl")})
    trainer = GRPOTrainer(cfg)
    answers = ["def f(x):\n    return x\n", "def f(x):\n    return 1\n", "def f(x):\n    return 0\n",
               "def f(x):\n    return x\n"]                      # scores 1, 1/3, 0, 1
    trainer.decode = lambda rollout: answers[rollout.prompt_index]
    try:
        out = trainer.evaluate()
    finally:
        trainer.engine.close()
    assert out["eval/accuracy"] == pytest.approx(0.5)              # was 0.583
    assert out["eval/verifier_score"] == pytest.approx((2 + 1 / 3) / 4)


def test_eval_reports_the_hidden_tests_beside_the_visible_ones_and_warns_when_they_part(tmp_path, tiny_model_dir,
                                                                                         one_thread):
    from opd.rl.trainer import GRPOTrainer

    rows = [{"prompt": f"task {i}", "tests": "assert f(1) == 1", "hidden_tests": "assert f(2) == 2\nassert f(3) == 3"}
            for i in range(4)]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_config(tmp_path, tiny_model_dir, run={"steps": 1}, data={"eval": str(tmp_path / "eval.jsonl")})
    trainer = GRPOTrainer(cfg)
    # "return 1" passes the one visible test and neither hidden one: what a policy fitting its
    # reward's tests writes.
    answers = ["def f(x):\n    return x\n", "def f(x):\n    return 1\n", "def f(x):\n    return 1\n",
               "def f(x):\n    return x\n"]
    trainer.decode = lambda rollout: answers[rollout.prompt_index]
    try:
        out = trainer.evaluate(7)
    finally:
        trainer.engine.close()
    assert out["eval/accuracy"] == 1.0 and out["eval/visible_accuracy"] == 1.0
    assert out["eval/hidden_accuracy"] == 0.5 and "warning" not in out
    assert trainer.warnings[-1].startswith("step 7: 100% of the answers pass their visible tests but 50% their hidden")
    dump = (tmp_path / "run" / "samples" / "step_000007.md").read_text()
    assert dump.count("\nprompt:") == 4 and "## 2 (score 1)\n\nprompt:\n\n```\ntask 1\n```" in dump
    assert "def f(x):\n    return 1" in dump


def _variant(cfg: RLConfig, **changes) -> RLConfig:
    """cfg with dotted keys replaced ("rollout.samples_per_prompt": 2) or top-level ones (rewards=[...])."""
    d = to_dict(cfg)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = d
        for key in parents:
            node = node[key]
        node[leaf] = value
    return from_dict(d, RLConfig)


def test_resume_refuses_another_objective_and_the_card_lists_what_changed(tmp_path, tiny_model_dir, one_thread,
                                                                          monkeypatch):
    # Resumed with samples_per_prompt 2 / temperature 0.3 after steps trained with G=4 / T=1.0, the run
    # was accepted silently and its card described the whole run as G=2, T=0.3.
    from opd.checkpoint import CheckpointError
    from opd.rl import trainer as rl_trainer
    from opd.rl.trainer import GRPOTrainer

    loads = []
    load_policy = rl_trainer.load_policy
    monkeypatch.setattr(rl_trainer, "load_policy", lambda *a, **kw: (loads.append(1), load_policy(*a, **kw))[1])
    cfg = _variant(make_config(tmp_path, tiny_model_dir), **{
        "rollout.samples_per_prompt": 4, "rollout.temperature": 1.0, "rollout.prompts_per_step": 2, "algorithm.epochs": 1,
        "run.steps": 2, "run.checkpoint_every": 2})
    GRPOTrainer(cfg).train()
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["config"] == to_dict(cfg)

    digits = str(tmp_path / "digits.py") + ":digits"
    for changes, said in [
        ({"rollout.samples_per_prompt": 2}, "rollout.samples_per_prompt: 4 -> 2"),
        ({"rollout.temperature": 0.3}, "rollout.temperature: 1.0 -> 0.3"),
        ({"rollout.top_p": 0.9}, "rollout.top_p: 1.0 -> 0.9"),
        ({"rollout.max_new_tokens": 6}, "rollout.max_new_tokens: 4 -> 6"),
        ({"algorithm.kl_beta": 0.1}, "algorithm.kl_beta: 0.01 -> 0.1"),
        ({"model.dtype": "bfloat16"}, "model.dtype: 'float32' -> 'bfloat16'"),
        ({"rollout.prompts_per_step": 3}, "rollout.prompts_per_step: 2 -> 3"),
        ({"run.seed": 5}, "run.seed: 0 -> 5"),
        ({"rewards": [{"name": "python", "path": digits, "weight": 0.5}]}, "rewards.python:digits.weight: 1.0 -> 0.5"),
        # a second reward of the same name is its own entry, not one overwriting the other
        ({"rewards": [{"name": "python", "path": digits}, {"name": "python", "path": digits, "weight": 0.5}]},
         "rewards.python:digits#1.name: '(unset)' -> 'python'"),
    ]:
        with pytest.raises(CheckpointError, match=re.escape(said)):
            GRPOTrainer(_variant(cfg, **{"run.steps": 4, **changes}), resume=True)
    assert loads == [1]                  # each refused before its model load

    # Keys that do not define the objective may change; the card says which, old -> new.
    resumed = GRPOTrainer(_variant(cfg, **{"run.steps": 4, "optim.lr": 0.005, "algorithm.micro_batch_size": 3}),
                          resume=True)
    resumed.train()
    card = json.loads((tmp_path / "run" / "card.json").read_text())
    assert card["resumes"] == {"resumed at step 2 (step_000002)": "changed since the checkpoint: "
                               "algorithm.micro_batch_size: 16 -> 3; optim.lr: 0.01 -> 0.005; run.steps: 2 -> 4"}
    assert card["objective"]["group size G"] == 4 and card["sampling"]["temperature"] == 1.0
    assert "resumed at step 2 (step_000002)**: changed since the checkpoint: algorithm.micro_batch_size: 16 -> 3" \
        in (tmp_path / "run" / "card.md").read_text()

    # A checkpoint from before configs were saved in it: nothing to compare, and the card says so.
    path = tmp_path / "run" / "checkpoints" / "step_000004" / "state.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "config"}))
    GRPOTrainer(_variant(cfg, **{"run.steps": 5, "rollout.temperature": 0.3}), resume=True).train()
    card = json.loads((tmp_path / "run" / "card.json").read_text())
    assert list(card["resumes"]) == ["resumed at step 2 (step_000002)", "resumed at step 4 (step_000004)"]
    assert card["resumes"]["resumed at step 4 (step_000004)"] == \
        "changed since the checkpoint: unknown (the checkpoint has no saved config)"


def test_the_card_is_rewritten_with_the_results_of_the_whole_run(tmp_path, tiny_model_dir, one_thread, capsys):
    # The card was written at the start only: no reward, no evaluation, no warning, and the
    # reward options it listed were the weights alone.
    from opd.rl.trainer import GRPOTrainer

    cfg = _variant(make_config(tmp_path, tiny_model_dir), **{
        "rollout.samples_per_prompt": 2, "rollout.prompts_per_step": 2, "data.eval": str(tmp_path / "train.jsonl"),
        "data.eval_prompts": 2, "algorithm.epochs": 1, "run.steps": 3, "run.checkpoint_every": 3, "run.flat_warning": 0.4})
    cfg = _variant(cfg, rewards=[*to_dict(cfg)["rewards"],
                                 {"name": "length", "weight": 0.1, "options": {"hard_max": 30, "soft_max": 20}}])
    trainer = GRPOTrainer(cfg)
    trainer.write_card()                 # what train() writes first: a run that stops leaves it so
    assert json.loads((tmp_path / "run" / "card.json").read_text())["results"] == {
        "status": "in progress from step 0 (rewritten with the results when the run ends)"}
    trainer.train()
    GRPOTrainer(_variant(cfg, **{"run.steps": 14}), resume=True).train()   # warnings from both sessions
    printed = [line.split("[opd rl] ", 1)[1] for line in capsys.readouterr().out.splitlines()
               if line.startswith("[opd rl] warning")]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 15))
    card = json.loads((tmp_path / "run" / "card.json").read_text())
    res = card["results"]
    assert res["steps trained"] == 14
    assert res["final reward"] == pytest.approx(rows[-1]["reward/mean"])
    assert res["mean reward"] == pytest.approx(sum(r["reward/mean"] for r in rows) / 14)
    flat = [r["groups/all_equal"] for r in rows]
    assert res["all-equal groups, mean"] == pytest.approx(sum(flat) / 14)
    assert res["all-equal groups, last step"] == flat[-1]
    assert res["eval reward (greedy, held-out)"] == f"{rows[-1]['eval/reward']:.4g} (step 14)"
    assert res["eval accuracy (share fully correct)"] == f"{rows[-1]['eval/accuracy']:.4g} (step 14)"
    assert len(printed) >= 2 and res["flat-group warnings"] == f"{len(printed)} printed"
    assert [res[f"warning {i + 1}"] for i in range(len(printed))] == printed
    assert any(w.startswith("warning at step 1") for w in printed) and \
        any(int(w.split()[3].rstrip(":")) > 3 for w in printed)    # before and after the resume
    assert card["rewards"]["length"] == {"weight": 0.1, "soft_max": 20, "hard_max": 30}
    assert card["rewards"]["python:digits"] == {"weight": 1.0, "path": str(tmp_path / "digits.py") + ":digits"}
    md = (tmp_path / "run" / "card.md").read_text()
    assert "## results" in md and "- **length**: weight: 0.1; soft_max: 20; hard_max: 30" in md


# Only prompts whose answer is a multiple of 4 (4 of the 16) get rewards that differ within a
# group (the first character's code mod 7, near uniform from the random model); every other
# group is all 0: flat, no gradient.
SPARSE_PY = ("def sparse(sample, text):\n"
             "    return (ord(text[0]) % 7) / 6 if int(sample.answer) % 4 == 0 and text else 0.0\n")


def test_dynamic_sampling_replaces_the_groups_whose_rewards_are_all_equal(tmp_path, tiny_model_dir, one_thread):
    from opd.rl.trainer import GRPOTrainer

    (tmp_path / "sparse.py").write_text(SPARSE_PY)
    rows = {}
    for draws in (0, 8):
        out = tmp_path / f"run{draws}"
        cfg = make_config(tmp_path, tiny_model_dir, algorithm={"dynamic_sampling": draws, "kl_beta": 0.0},
                          run={"steps": 3, "out_dir": str(out)})
        cfg = from_dict({**to_dict(cfg), "rewards": [{"name": "python", "path": f"{tmp_path / 'sparse.py'}:sparse"}]},
                        RLConfig)
        GRPOTrainer(cfg).train()
        rows[draws] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["groups/all_equal"] for r in rows[0]) / 3 >= 0.5     # without it, most groups are flat
    assert "groups/draws" not in rows[0][0]
    # 8 more draws of 4 prompts cover a whole epoch of the 16: every step finds its 4 groups.
    assert [r["groups/all_equal"] for r in rows[8]] == [0.0, 0.0, 0.0]
    assert all(r["groups/draws"] >= 2 and 0.5 <= r["groups/flat_drawn"] < 1 for r in rows[8])
    assert all(r["reward/mean"] > 0 for r in rows[8])
