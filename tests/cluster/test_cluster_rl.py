"""`opd rl` with `cluster: {mode: ray}`: two rollout actors sample the groups, and after each
step the trainer's new weights reach them by file (the next step's rollout log-probs are those
of the updated policy, not of the starting one)."""

from __future__ import annotations

import json
import time

import pytest
import torch
import yaml

from opd.cli import main
from opd.config import ConfigError, from_dict
from opd.rl.config import RLConfig

pytestmark = pytest.mark.timeout(240)

# Varies between any two different responses, so no group is flat and every step moves the weights.
REWARD_PY = "def bytesum(sample, text):\n    return float(sum(map(ord, text)) % 5)\n"


def write_config(tmp_path, model_dir) -> dict:
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"Number {i}:", "answer": str(i)}) + "\n"
                                                  for i in range(8)))
    (tmp_path / "bytesum.py").write_text(REWARD_PY)
    return {
        "model": {"path": str(model_dir)},
        "data": {"train": "train.jsonl"},
        "rollout": {"prompts_per_step": 2, "samples_per_prompt": 4, "max_new_tokens": 4, "actors": 2, "actor_cpus": 0.5},
        "rewards": [{"name": "python", "path": "bytesum.py:bytesum"}],
        "optim": {"lr": 0.05},
        "run": {"steps": 3, "ckpt_every": 0, "out_dir": "run", "seed": 0},
        # Joins the module's Ray session (started by the fixture), so the run must leave it running.
        "cluster": {"mode": "ray", "address": None},
    }


def forward_logprobs(model_dir, state_dict, rollouts) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of the sampled tokens under `state_dict`, the rollouts' own log-probs), [N] each."""
    from transformers import AutoModelForCausalLM

    from opd.spine.rows import token_logprobs
    from opd.rl.batch import collate
    from oracles import response_logits

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.load_state_dict(state_dict)
    batch = collate(rollouts, pad_id=0)
    with torch.no_grad():
        lp_N = token_logprobs(response_logits(model, batch), batch.packed.targets_N)
    return lp_N, batch.old_logprobs_N


def test_opd_rl_on_ray_samples_on_both_actors_and_pushes_weights(tmp_path, tiny_model_dir, ray_cluster,
                                                                 monkeypatch):
    from opd.cluster.rollout import RolloutPool
    from opd.rl.trainer import GRPOTrainer

    calls, weights = [], []
    generate, update = RolloutPool.generate, GRPOTrainer.update

    def recording_generate(self, prompts, params):
        out = generate(self, prompts, params)
        calls.append({"rollouts": out, "per_actor": self.samples_generated()})
        return out

    def recording_update(self, *args):
        result = update(self, *args)
        weights.append({k: v.detach().clone() for k, v in self.model.state_dict().items()})
        return result

    monkeypatch.setattr(RolloutPool, "generate", recording_generate)
    monkeypatch.setattr(GRPOTrainer, "update", recording_update)
    path = tmp_path / "rl_ray.yaml"
    path.write_text(yaml.safe_dump(write_config(tmp_path, tiny_model_dir)))
    assert main(["rl", str(path)]) == 0

    # 3 steps of 2 prompts x 4 samples; each actor answered one prompt per step.
    assert len(calls) == 3 and all(len(c["rollouts"]) == 8 for c in calls)
    assert [c["per_actor"] for c in calls] == [[4, 4], [8, 8], [12, 12]]
    # Step 2 sampled from the weights after step 1: the actors' log-probs equal a transformers
    # forward pass of those weights, and are far from the starting weights' (the push mattered).
    from opd.spine.config import ModelConfig
    from opd.spine.model import load_policy

    lp, rollout_lp = forward_logprobs(tiny_model_dir, weights[0], calls[1]["rollouts"])
    assert torch.allclose(lp, rollout_lp, atol=1e-3), (lp - rollout_lp).abs().max()
    start = load_policy(ModelConfig(path=str(tiny_model_dir)), train=False)[0].state_dict()
    lp0, _ = forward_logprobs(tiny_model_dir, start, calls[1]["rollouts"])
    assert (lp0 - rollout_lp).abs().max() > 0.05

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (tmp_path / "run" / "rollout_weights.safetensors").is_file()
    assert "rollout actors (Ray)" in (tmp_path / "run" / "card.md").read_text()
    # The run joined this session: it is left running, with the actors' CPUs given back.
    assert ray_cluster.is_initialized()
    deadline = time.time() + 15
    while ray_cluster.available_resources().get("CPU", 0) < 2 and time.time() < deadline:
        time.sleep(0.2)
    assert ray_cluster.available_resources().get("CPU", 0) == 2


@pytest.mark.parametrize("change, words", [
    ({"model": {"lora": {"rank": 4}}}, "LoRA"),
    ({"rollout": {"engine": "vllm"}}, "hf engine"),
    ({"cluster": {"mode": "ray", "teachers": [{"name": "t", "model": "m"}]}}, "no teachers"),
])
def test_unsupported_ray_combinations_are_config_errors(tmp_path, change, words):
    cfg = write_config(tmp_path, "model")
    for key, value in change.items():
        cfg[key] = {**cfg[key], **value}
    with pytest.raises(ConfigError, match=words):
        from_dict(cfg, RLConfig)


def test_with_the_policys_ranks_on_ray_it_samples_from_its_shards_so_lora_is_allowed(tmp_path):
    # The refusals above are the rollout actors'; ranks on Ray sample as torchrun's ranks do.
    cfg = write_config(tmp_path, "model")
    cfg["model"]["lora"] = {"rank": 4}
    cfg["cluster"]["student"] = {"num_workers": 2}
    rl = from_dict(cfg, RLConfig)
    assert rl.cluster.ranks_on_ray and rl.model.lora.rank == 4
    cfg["rollout"]["engine"] = "vllm"   # rank 0's engine runs under torchrun's ranks only, for now
    with pytest.raises(ConfigError, match="rollout.engine vllm beside the student's ranks on Ray"):
        from_dict(cfg, RLConfig)


def test_rollout_actors_hold_the_policy_in_its_dtype(tmp_path, tiny_model_dir, ray_cluster):
    # They loaded fp32 whatever model.dtype said: against a bf16 policy the first ratio was off
    # 1 before any update (up to exp(0.12) on a peaked model).
    from opd.spine.rows import token_logprobs
    from opd.rl.batch import collate
    from opd.rl.trainer import GRPOTrainer
    from oracles import response_logits
    from opd.rollout import SamplingParams

    cfg = write_config(tmp_path, tiny_model_dir)
    cfg["model"]["dtype"] = "bfloat16"
    cfg["rollout"]["actors"] = 1
    cfg["data"]["train"] = str(tmp_path / "train.jsonl")
    cfg["rewards"][0]["path"] = str(tmp_path / "bytesum.py") + ":bytesum"
    cfg["run"]["out_dir"] = str(tmp_path / "run")
    trainer = GRPOTrainer(from_dict(cfg, RLConfig))
    try:
        batch = collate(trainer.engine.generate([[65, 66, 67], [70, 71]], SamplingParams(max_new_tokens=4, n=2,
                                                                                           seed=0)), trainer.pad_id)
        with torch.no_grad():
            policy = token_logprobs(response_logits(trainer.model, batch).float(), batch.packed.targets_N)
    finally:
        trainer.engine.close()
        trainer.close_cluster()
    gap = (batch.old_logprobs_N - policy).abs().max()
    # 0 here (same dtype, same ops); an fp32 actor gave 1.4e-3 on this tiny model
    assert trainer.model.dtype == torch.bfloat16 and gap < 2e-4, gap
