"""`opd rl` configuration: one frozen dataclass per part, loaded from YAML (unknown keys refused).

    model:      what is trained (a local model dir; full fine-tuning or a LoRA adapter)
    rollout:    how the G responses per prompt are sampled
    data:       prompts (JSONL with `answer` or `tests` for the verifiers)
    algorithm:  advantages, clipping, epochs, KL to the reference, loss aggregation
    rewards:    a weighted list of reward functions
    optim, run: optimizer; steps, evaluation, checkpoints, seed, output folder
    cluster:    local, or ray: the G responses are sampled by rollout actors on a Ray cluster
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from opd.cluster import ClusterConfig, StudentWorkers, TeacherReplicas
from opd.config import check_device, check_top_p, check_vllm_lora, field
from opd.lora import LoraSpec


@dataclass(frozen=True)
class ModelConfig:
    path: str = field(help="local model directory (transformers format) to start from")
    lora: LoraSpec | None = field(None, help="train a peft LoRA adapter instead of all weights; "
                                               "the reference is then the base with the adapter switched off")
    dtype: Literal["float32", "bfloat16", "float16"] = field("float32", help="weights dtype")
    device: str = field("auto", help="'auto' (cuda when available), 'cpu' or 'cuda:N'")

    def __post_init__(self):
        check_device(self.device, auto=True)


@dataclass(frozen=True)
class RolloutConfig:
    engine: Literal["hf", "vllm"] = field("hf", help="hf: a KV-cached sampling loop over the transformers model "
                                                     "(exact); vllm: the vLLM engine")
    group_size: int = field(8, help="G: responses sampled per prompt", min=2)
    temperature: float = field(1.0, help="sampling temperature (too low -> groups of identical answers)", min=0.0)
    top_p: float = field(1.0, help="nucleus sampling", min=0.0, max=1.0)
    max_new_tokens: int = field(256, help="response length limit (also the Dr. GRPO normalizer)", min=1)
    batch_size: int = field(64, help="sequences sampled together (hf engine)", min=1)
    max_model_len: int = field(2048, help="vLLM engine: prompt + response length limit", min=16)
    # --- on Ray (cluster.mode: ray): hf engines as actors, the prompts split between them
    actors: int = field(1, help="cluster.mode ray: rollout actors, each with its own copy of the policy", min=1)
    actor_cpus: float = field(1.0, help="cluster.mode ray: CPUs reserved per rollout actor (its torch threads)",
                              min=0.0)
    actor_gpus: float = field(0.0, help="cluster.mode ray: GPUs reserved per rollout actor", min=0.0)

    def __post_init__(self):
        check_top_p(self.top_p, "rollout.top_p")


@dataclass(frozen=True)
class DataConfig:
    train: str = field(help="training prompts, JSONL (prompt, domain, answer or tests)")
    eval: str | None = field(None, help="held-out prompts for periodic evaluation (mean reward, greedy)")
    prompts_per_step: int = field(8, help="P: prompts per step; a step trains on P * G responses", min=1)
    eval_prompts: int = field(64, help="at most this many eval prompts per evaluation", min=1)
    on_error: Literal["stop", "skip"] = field("stop", help="a malformed JSONL line stops the run or is skipped and counted")


@dataclass(frozen=True)
class AlgorithmConfig:
    advantage: Literal["grpo", "dr_grpo", "batch_std", "rloo"] = field(
        "grpo", help="grpo: (r-mean)/(std+eps) per group; dr_grpo: r-mean; batch_std: one std for the batch; "
                     "rloo: leave-one-out baseline")
    eps_low: float = field(0.2, help="clip the importance ratio below at 1 - eps_low", min=0.0)
    eps_high: float = field(0.28, help="clip above at 1 + eps_high (> eps_low is DAPO's clip-higher)", min=0.0)
    epochs: int = field(1, help="optimizer passes over each batch of rollouts (>1 makes the clip matter)", min=1)
    minibatches: int = field(1, help="optimizer steps per epoch (the batch is split in this many near-equal "
                                     "parts; at most prompts_per_step x group_size)", min=1)
    micro_batch_size: int = field(16, help="sequences per forward/backward (gradient accumulation; memory only)", min=1)
    kl_beta: float = field(0.0, help="weight of the KL penalty to the reference (0 switches it and the "
                                     "reference forward pass off)", min=0.0)
    kl_estimator: Literal["k1", "k3"] = field("k3", help="per-token KL estimator: k1 = log pi/ref, k3 = r - 1 - log r")
    loss_aggregation: Literal["token_mean", "seq_mean", "dr_grpo"] = field(
        "token_mean", help="token_mean (DAPO), seq_mean (original GRPO), dr_grpo (sum / (B * max_new_tokens))")
    max_grad_norm: float = field(1.0, help="gradient clipping (0 = off)", min=0.0)


@dataclass(frozen=True)
class RewardConfig:
    name: Literal["math", "code", "format", "length", "python"] = field(
        help="math: answer vs `answer`; code: unit tests in `tests` (sandboxed); format: regex; "
             "length: overlong penalty; python: a user function")
    weight: float = field(1.0, help="weight in the sum of rewards")
    options: dict[str, Any] = field(default_factory=dict, help="keyword options of the reward function "
                                    "(code: timeout_s, memory_mb, workers; format: pattern; length: soft_max, hard_max)")
    path: str | None = field(None, help="python reward: 'FILE.py:function', called f(sample, response_text) -> float")

    def __post_init__(self):
        if self.name == "python" and not self.path:
            raise ValueError("a 'python' reward needs path: 'FILE.py:function'")
        if self.name != "python" and self.path:
            raise ValueError(f"'path' is only for 'python' rewards, not {self.name!r}")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = field(1e-6, help="AdamW learning rate", min=0.0)
    weight_decay: float = field(0.0, help="AdamW weight decay", min=0.0)
    warmup_steps: int = field(0, help="linear warm-up steps, then constant", min=0)


@dataclass(frozen=True)
class RunConfig:
    steps: int = field(100, help="training steps (one rollout batch each)", min=1)
    eval_every: int = field(0, help="evaluate on data.eval every N steps (0 = only at the end, if eval is set)", min=0)
    ckpt_every: int = field(50, help="checkpoint every N steps (0 = only at the end)", min=0)
    keep_checkpoints: int = field(2, help="keep the newest N checkpoints", min=1)
    seed: int = field(0, help="seed for data order, sampling and initialisation")
    out_dir: str = field("runs/rl", help="run folder: metrics.jsonl, plots/, card.md, checkpoints/, model/")
    flat_warning: float = field(0.8, help="warn when more than this share of groups got all-equal rewards", min=0.0, max=1.0)


@dataclass(frozen=True)
class RLClusterConfig(ClusterConfig):
    """`opd train`'s cluster section (opd.cluster.ClusterConfig, so RayCluster takes it as it
    is) with the help `opd rl --help` prints: opd rl has no teachers and one training process,
    so `mode: fork` (opd train starts its teachers) is refused, and so are teachers and more
    than one student worker (RLConfig.__post_init__)."""
    mode: Literal["local", "fork", "ray"] = field(
        "local", help="local: rollouts sampled in this process (rollout.engine); ray: rollout.actors Ray actors "
                      "sample them (hf engine), the new weights pushed to them after each step. fork is opd "
                      "train's (it starts the teachers) and is refused: opd rl has none")
    bind: Literal["auto", "loopback", "node_ip"] = field(
        "auto", help="opd train's teacher servers only; not used by opd rl")
    teachers: list[TeacherReplicas] = field(default_factory=list,
                                            help="opd train's teacher replicas; opd rl has no teachers: leave it "
                                                 "empty (refused otherwise)")
    student: StudentWorkers = field(default_factory=StudentWorkers,
                                    help="opd train's data-parallel workers; opd rl trains in one process: "
                                         "num_workers must stay 1 (rollout.actors sets the rollout actors)")
    request_timeout_s: float = field(120.0, help="opd train's teacher replica pools; not used by opd rl", min=0.1)
    recheck_s: float = field(2.0, help="opd train's teacher replica pools; not used by opd rl", min=0.05)


@dataclass(frozen=True)
class RLConfig:
    model: ModelConfig = field(help="the policy being trained")
    data: DataConfig = field(help="prompts")
    rollout: RolloutConfig = field(default_factory=RolloutConfig, help="sampling G responses per prompt")
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig, help="GRPO objective")
    rewards: list[RewardConfig] = field(default_factory=lambda: [RewardConfig(name="math")],
                                        help="reward functions, summed with their weights")
    optim: OptimConfig = field(default_factory=OptimConfig, help="optimizer")
    run: RunConfig = field(default_factory=RunConfig, help="steps, evaluation, checkpoints, output")
    cluster: RLClusterConfig = field(default_factory=RLClusterConfig,
                                     help="local (default), or ray: rollout.actors rollout engines as Ray actors, "
                                          "new weights pushed to them by file after each step "
                                          "(docs/multi_machine.md)")

    def __post_init__(self):
        batch = self.data.prompts_per_step * self.rollout.group_size
        if self.algorithm.minibatches > batch:   # a part would be empty: fewer steps than promised
            raise ValueError(f"algorithm.minibatches ({self.algorithm.minibatches}) is more than the "
                             f"{batch} responses of a step (data.prompts_per_step {self.data.prompts_per_step} "
                             f"x rollout.group_size {self.rollout.group_size}); each optimizer step needs one")
        if self.rollout.engine == "vllm" and self.model.lora is not None:
            check_vllm_lora(self.model.lora.target_modules, "model.lora.target_modules")
        if self.cluster.mode == "fork":
            raise ValueError("cluster.mode fork starts the teachers of `opd train`; opd rl has none "
                             "(use local or ray)")
        if self.cluster.mode != "ray":
            return
        if self.model.lora is not None:
            raise ValueError("cluster.mode ray: rollout actors hold full models and load full weights; "
                             "LoRA (model.lora) is not supported there, use cluster.mode local")
        if self.rollout.engine != "hf":
            raise ValueError(f"cluster.mode ray: rollout actors run the hf engine, not rollout.engine "
                             f"{self.rollout.engine!r}")
        if self.cluster.teachers:
            raise ValueError("cluster.teachers: opd rl has no teachers; leave the list empty")
        if self.cluster.student.num_workers != 1:
            raise ValueError("cluster.student.num_workers: opd rl trains the policy in one process; "
                             "it must be 1 (rollout.actors sets the rollout actors)")
