"""Which config keys a resumed `opd rl` run must keep, and how a checkpoint's saved config is
read for the comparison (opd.checkpoint.resume_changes, through opd.spine.run.RunDir)."""

from __future__ import annotations

from opd.rewards.combine import reward_labels

# Config keys a resumed run must share with its checkpoint (opd.checkpoint.resume_changes):
# they define the objective, so another value would make the card's one description of the run
# false for the steps before the resume (resumed with samples_per_prompt 2 / temperature 0.3 after
# steps trained with G=4 / T=1.0, the card said G=2, T=0.3). The others (run.steps, eval,
# checkpoints, optim.lr, cluster, ...) may change and are listed in the card. model.device and
# algorithm.micro_batch_size are free: where the weights sit and how a batch is split for
# memory change nothing the policy learns.
FIXED = ("model.*", "rollout.samples_per_prompt", "rollout.temperature", "rollout.top_p", "rollout.max_new_tokens",
         "algorithm.*", "rewards", "rewards.*", "data.train", "rollout.prompts_per_step", "run.seed",
         "teachers", "teachers.*", "agent", "agent.*", "agent_shaping", "agent_shaping.*", "terms.*")
FREE = ("agent.workers", "teachers.*.address", "teachers.*.curve_server_key", "model.device",
        "model.gradient_checkpointing", "algorithm.micro_batch_size",
        "algorithm.max_grad_norm")   # retired: optim.grad_clip (a checkpoint from before has it)


# Keys a checkpoint written before their rename holds: (section, old) -> (section, new).
RENAMED = {("rollout", "group_size"): ("rollout", "samples_per_prompt"),
           ("data", "prompts_per_step"): ("rollout", "prompts_per_step")}


def view(config: dict | None) -> dict | None:
    """The saved (or current) config as resume_changes compares it: renamed keys under their new
    names (RENAMED), the rewards keyed by their label (math, python:fn, format#2, as the metrics
    name them), so that two rewards of one name are two entries rather than one overwriting the
    other."""
    if config is None:
        return None
    config = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    for (section, old), (to, new) in RENAMED.items():
        if old in config.get(section, {}):
            config.setdefault(to, {})[new] = config[section].pop(old)
    rewards = config.get("rewards") or []
    labels = reward_labels([(r.get("name"), r.get("path")) for r in rewards])
    return {**config, "rewards": {label: r for label, r in zip(labels, rewards)}}
