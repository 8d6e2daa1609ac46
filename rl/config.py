"""`opd rl` configuration: one frozen dataclass per part, loaded from YAML (unknown keys refused).

    model:      what is trained (a local model dir; full fine-tuning or a LoRA adapter)
    rollout:    how the G responses per prompt are sampled
    data:       prompts (JSONL with `answer` or `tests` for the verifiers)
    algorithm:  advantages, clipping, epochs, KL to the reference, loss aggregation
    rewards:    a weighted list of reward functions
    optim, run: optimizer and clipping; steps, evaluation, checkpoints, seed, output folder
    cluster:    local, or ray: the G responses are sampled by rollout actors on a Ray cluster
    teachers:   optional teacher servers (mode sampled): each token's advantage gains
                -lambda * (log pi - log pi_teacher), discounted with gamma (opd.spine.objective)
    agent:      optional multi-turn trajectories with tools (opd.agent; rl/agentic.py), and
    agent_shaping:  a reward per valid / failed tool call added to each trajectory's reward

`model`, and the shared fields of `rollout`, `optim` and `run`, are the training spine's
sections (opd/spine/config.py), the same classes `opd train` uses. Two keys were renamed when
the loops began sharing them, and the old names are still read: `rollout.max_model_len` is
`rollout.vllm_max_model_len`, `run.ckpt_every` is `run.checkpoint_every`;
`algorithm.max_grad_norm` moved to `optim.grad_clip`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from opd.agent.config import AgentConfig
from opd.cluster.config import ClusterConfig, StudentWorkers, TeacherReplicas
from opd.routing.config import TeacherClientSettings
from opd.routing.config import TeacherSpec
from opd.config import check_vllm_lora, field
from opd.spine import config as spine
from opd.spine.terms import TermsConfig
from opd.spine.config import RewardConfig  # noqa: F401  (opd rl's rewards; opd train takes them too)


@dataclass(frozen=True)
class RolloutConfig(spine.RolloutConfig):
    max_new_tokens: int = field(256, help="response length limit (also the Dr. GRPO normalizer); with `agent` "
                                          "each turn's limit", min=1)
    RETIRED: ClassVar[dict[str, str]] = {"group_size": "it is rollout.samples_per_prompt now (opd train's name for it)"}
    prompts_per_step: int = field(8, help="P: prompts per step; a step trains on P x samples_per_prompt responses",
                                  min=1)
    samples_per_prompt: int = field(8, help="G: responses sampled per prompt, the group its advantage compares",
                                    min=2)
    # --- on Ray (cluster.mode: ray): hf engines as actors, the prompts split between them
    actors: int = field(1, help="cluster.mode ray: rollout actors, each with its own copy of the policy", min=1)
    actor_cpus: float = field(1.0, help="cluster.mode ray: CPUs reserved per rollout actor (its torch threads)",
                              min=0.0)
    actor_gpus: float = field(0.0, help="cluster.mode ray: GPUs reserved per rollout actor", min=0.0)


@dataclass(frozen=True)
class DataConfig:
    RETIRED: ClassVar[dict[str, str]] = {
        "prompts_per_step": "it moved to rollout.prompts_per_step (where opd train has it)"}
    train: str = field(help="training prompts, JSONL (prompt, domain, answer or tests)")
    eval: str | None = field(None, help="held-out prompts for periodic evaluation (mean reward, greedy)")
    eval_prompts: int = field(64, help="at most this many eval prompts per evaluation", min=1)
    on_error: Literal["stop", "skip"] = field("stop", help="a malformed JSONL line stops the run or is skipped and counted")


@dataclass(frozen=True)
class AlgorithmConfig:
    RETIRED: ClassVar[dict[str, str]] = {"max_grad_norm": "it is optim.grad_clip now; move it there"}
    advantage: Literal["grpo", "dr_grpo", "batch_std", "rloo"] = field(
        "grpo", help="grpo: (r-mean)/(std+eps) per group; dr_grpo: r-mean; batch_std: one std for the batch; "
                     "rloo: leave-one-out baseline")
    eps_low: float = field(0.2, help="clip the importance ratio below at 1 - eps_low", min=0.0)
    eps_high: float = field(0.28, help="clip above at 1 + eps_high (> eps_low is DAPO's clip-higher)", min=0.0)
    epochs: int = field(1, help="optimizer passes over each batch of rollouts (>1 makes the clip matter)", min=1)
    minibatches: int = field(1, help="optimizer steps per epoch (the batch is split in this many near-equal "
                                     "parts; at most prompts_per_step x samples_per_prompt)", min=1)
    micro_batch_size: int = field(16, help="sequences per forward/backward (gradient accumulation; memory only)", min=1)
    kl_beta: float = field(0.0, help="weight of the KL penalty to the reference (0 switches it and the "
                                     "reference forward pass off)", min=0.0)
    kl_estimator: Literal["k1", "k3"] = field("k3", help="per-token KL estimator: k1 = log pi/ref, k3 = r - 1 - log r")
    loss_aggregation: Literal["token_mean", "seq_mean", "dr_grpo"] = field(
        "token_mean", help="token_mean (DAPO), seq_mean (original GRPO), dr_grpo (sum / (B * max_new_tokens))")
    dynamic_sampling: int = field(0, help="DAPO's dynamic sampling: a group whose rewards are all equal carries no "
                                          "gradient, so up to this many more draws of prompts_per_step prompts a step "
                                          "replace such groups (groups/flat_drawn, groups/draws); the batch keeps P x G "
                                          "responses, padded with flat groups when the draws run out. 0: off", min=0)


@dataclass(frozen=True)
class OptimConfig(spine.OptimConfig):
    lr: float = field(1e-6, help="peak AdamW learning rate", min=0.0)


@dataclass(frozen=True)
class RunConfig(spine.RunConfig):
    out_dir: str = field("runs/rl", help="run folder: metrics.jsonl, plots/, card.md, checkpoints/, model/")
    eval_every: int = field(0, help="evaluate on data.eval every N steps (0: only at the end, if eval is set)",
                            min=0)
    checkpoint_every: int = field(50, help="checkpoint every N steps (0: only at the end)", min=0,
                                  aliases=("ckpt_every",))
    drown_factor: float = field(10.0, help="with teachers: warn when the reward's or the teachers' mean advantage "
                                           "per token is this many times the other's", min=1.0)
    flat_warning: float = field(0.8, help="warn when more than this share of groups got all-equal rewards", min=0.0,
                                max=1.0)


@dataclass(frozen=True)
class AgentShaping:
    """Per-call shaping of a multi-turn trajectory's reward (with `agent`): added to what the
    reward functions give its final answer, so the whole sum is the episode's reward."""
    valid_call: float = field(0.0, help="added per tool call that ran and answered (e.g. 0.05); max_turns bounds "
                                        "how many a trajectory makes")
    failed_call: float = field(0.0, help="added per failed call: malformed, an unknown tool or argument, the tool "
                                         "raised, timed out or crashed (e.g. -0.1)")
    turn_limit: float = field(0.0, help="added when agent.max_turns cut a trajectory that was still calling tools")


@dataclass(frozen=True)
class RLClusterConfig(ClusterConfig):
    """`opd train`'s cluster section (opd.cluster.ClusterConfig, so RayCluster takes it as it
    is) with the help `opd rl --help` prints: opd rl has no teachers, so `mode: fork` (opd train
    starts its teachers) is refused, and so are teachers (RLConfig.__post_init__)."""
    mode: Literal["local", "fork", "ray"] = field(
        "local", help="local: rollouts sampled in this process (rollout.engine); ray: rollout.actors Ray actors "
                      "sample them (hf engine), the new weights pushed to them after each step, or with "
                      "student.num_workers > 1 the policy's ranks are Ray actors. fork is opd train's (it starts "
                      "the teachers) and is refused: opd rl has none")
    bind: Literal["auto", "loopback", "node_ip"] = field(
        "auto", help="opd train's teacher servers only; not used by opd rl")
    teachers: list[TeacherReplicas] = field(default_factory=list,
                                            help="opd train's teacher replicas; opd rl has no teachers: leave it "
                                                 "empty (refused otherwise)")
    student: StudentWorkers = field(default_factory=StudentWorkers,
                                    help="the ranks the policy is sharded over (FSDP2); with mode ray and "
                                         "num_workers 1 rollout.actors samples and the policy trains in one "
                                         "process, with num_workers > 1 the ranks are Ray actors, each sampling "
                                         "from its shards (rollout.actors unused)")
    request_timeout_s: float = field(120.0, help="opd train's teacher replica pools; not used by opd rl", min=0.1)
    recheck_s: float = field(2.0, help="opd train's teacher replica pools; not used by opd rl", min=0.05)


@dataclass(frozen=True)
class RLConfig:
    model: spine.ModelConfig = field(help="the policy being trained")
    data: DataConfig = field(help="prompts")
    rollout: RolloutConfig = field(default_factory=RolloutConfig, help="sampling G responses per prompt")
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig, help="GRPO objective")
    rewards: list[RewardConfig] = field(default_factory=lambda: [RewardConfig(name="math")],
                                        help="reward functions, summed with their weights")
    optim: OptimConfig = field(default_factory=OptimConfig, help="optimizer, schedule and gradient clipping")
    terms: TermsConfig = field(default_factory=TermsConfig, help="objective terms beside the clipped surrogate, as "
                                                                 "opd train takes them (opd.spine.terms): the "
                                                                 "entropy bonus")
    run: RunConfig = field(default_factory=RunConfig, help="steps, evaluation, checkpoints, output")
    teachers: list[TeacherSpec] = field(default_factory=list,
                                        help="teacher servers whose sampled-token reverse KL joins each token's "
                                             "advantage, weight lambda (`weight`) and discount `gamma`; mode "
                                             "sampled; `domains` limits a teacher to those samples' domains")
    teacher_client: TeacherClientSettings = field(default_factory=TeacherClientSettings,
                                                  help="timeouts and retries towards the teacher servers")
    cluster: RLClusterConfig = field(default_factory=RLClusterConfig,
                                     help="local (default), or ray: rollout.actors rollout engines as Ray actors, "
                                          "new weights pushed to them by file after each step "
                                          "(docs/multi_machine.md)")
    agent: AgentConfig | None = field(None, help="multi-turn trajectories: the policy calls tools and reads their "
                                                 "answers; only its own tokens are trained (docs/agentic.md); "
                                                 "unset: one turn per response")
    agent_shaping: AgentShaping | None = field(None, help="with `agent`: rewards per valid / failed tool call, "
                                                          "added to the trajectory's reward (reward/agent_shaping)")

    def __post_init__(self):
        batch = self.rollout.prompts_per_step * self.rollout.samples_per_prompt
        if self.algorithm.minibatches > batch:   # a part would be empty: fewer steps than promised
            raise ValueError(f"algorithm.minibatches ({self.algorithm.minibatches}) is more than the "
                             f"{batch} responses of a step (rollout.prompts_per_step {self.rollout.prompts_per_step} "
                             f"x rollout.samples_per_prompt {self.rollout.samples_per_prompt}); each optimizer step "
                             "needs one")
        if self.rollout.engine == "vllm" and self.model.lora is not None:
            check_vllm_lora(self.model.lora.target_modules, "model.lora.target_modules")
        off = [t.name for t in self.teachers if t.mode != "sampled"]
        if off:
            raise ValueError(f"teachers {off}: opd rl adds a teacher as the sampled-token advantage (mode sampled); "
                             f"top-k and full divergences are opd train's (add `rewards` to a merge config)")
        ctx = [t.name for t in self.teachers if t.context is not None]
        if ctx:
            raise ValueError(f"teachers {ctx}: a teacher context (privileged-context teachers) is opd train's; opd rl's "
                             f"teachers score the policy's own prompt: remove `context`, or train with opd train and "
                             f"`rewards:`")
        if self.teachers and (self.rollout.temperature != 1.0 or self.rollout.top_p < 1
                              or any(t.temperature != 1.0 for t in self.teachers)):
            raise ValueError("teachers: the reverse-KL advantage compares the policy's raw log-probs with the "
                             "teacher's; it is unbiased for tokens drawn from that distribution: set "
                             "rollout.temperature 1, rollout.top_p 1 and the teachers' temperature 1")
        if self.teachers and self.cluster.student.num_workers > 1:
            raise ValueError("teachers with cluster.student.num_workers > 1 are opd train's (add `rewards` to a "
                             "merge config); opd rl scores them on one process")
        if self.cluster.mode == "fork":
            raise ValueError("cluster.mode fork starts the teachers of `opd train`; opd rl has none "
                             "(use local or ray)")
        ranks = self.cluster.student.num_workers
        self._check_agent(ranks)
        # Whole groups per rank: a group's G responses are sampled and scored on one rank.
        spine.check_sharded_sampling(ranks, "rollout.prompts_per_step", self.rollout.prompts_per_step,
                                     self.rollout.engine, self.cluster.ranks_on_ray)
        if self.cluster.mode != "ray":
            return
        if self.cluster.teachers:
            raise ValueError("cluster.teachers: opd rl has no teachers; leave the list empty")
        if ranks > 1:   # the policy's ranks are Ray actors, each sampling from its shards as under torchrun
            return
        if self.model.lora is not None:
            raise ValueError("cluster.mode ray: rollout actors hold full models and load full weights; "
                             "LoRA (model.lora) is not supported there, use cluster.mode local (or shard the "
                             "policy over Ray ranks: cluster.student.num_workers > 1)")
        if self.rollout.engine != "hf":
            raise ValueError(f"cluster.mode ray: rollout actors run the hf engine, not rollout.engine "
                             f"{self.rollout.engine!r}")

    def _check_agent(self, ranks: int) -> None:
        """What `agent` cannot be combined with, said before anything loads."""
        if self.agent is None:
            if self.agent_shaping is not None:
                raise ValueError("agent_shaping rewards tool calls of multi-turn trajectories: it needs `agent`")
            return
        if not self.agent.tools:
            raise ValueError("agent.tools is empty: name the tools the policy may call (e.g. {function: calculator}), "
                             "or leave `agent` out for single-turn rollouts")
        if self.rollout.engine == "vllm" and self.agent.max_tokens >= self.rollout.vllm_max_model_len:
            raise ValueError(f"agent.max_tokens {self.agent.max_tokens} leaves no room for a prompt in "
                             f"rollout.vllm_max_model_len {self.rollout.vllm_max_model_len} (prompt + trajectory)")
        if self.cluster.mode == "ray":
            raise ValueError("agent with cluster.mode ray is not supported: the multi-turn loop samples through "
                             "this process's engine (use cluster.mode local)")
        if ranks > 1:
            # A sharded policy's forward is a collective: every rank would have to sample as many
            # turns as the others, and a rank whose trajectories have all ended does not.
            raise ValueError("agent with cluster.student.num_workers > 1 is not supported: multi-turn rollouts "
                             "sample from one process")
