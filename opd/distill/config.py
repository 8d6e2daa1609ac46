"""The config of `opd train`: one frozen struct per part of the job, loaded from YAML.

    student   what is trained (model dir, dtype, device, full fine-tuning or LoRA)
    merge     the teachers, the prompt sets and how samples find their teacher
              (routing/config.py's MergeConfig; a single-teacher run lists one teacher)
    rollout   how the student samples (engine, temperature, top-p, lengths)
    loss      what is done with the teacher's answers (normalization, trimming, fused path)
    optim     AdamW and its schedule, accumulation, micro-batches
    run       steps, evaluation, checkpoints, seed, output directory, pipelining
    agent     multi-turn trajectories with tools (opd.agent; opd/distill/agentic.py); unset: one turn
    cluster   local; fork: opd train starts its teachers; ray: teacher replicas on Ray (opd/cluster)

`student`, and the shared fields of `rollout`, `optim` and `run`, are the training spine's
sections (opd/spine/config.py), the same classes `opd rl` uses.

Per-teacher loss settings (mode, k, beta, temperature, T^2, weight) live on each teacher
in `merge.teachers`, because in a merge every teacher may need its own. Relative paths
(student path, data sets, out_dir, key files, cluster teacher models) are relative to the
config file.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from opd.agent.config import AgentConfig
from opd.spine import config as spine
from opd.cluster.config import ClusterConfig
from opd.config import check_vllm_lora, field, load_yaml, near
from opd.routing.config import DatasetSpec, MergeConfig, TeacherClientSettings
from opd.spine.terms import TermsConfig
from opd.store.config import StoredSource


@dataclass(frozen=True)
class RolloutConfig(spine.RolloutConfig):
    prompts_per_step: int = field(8, help="prompts drawn per optimizer step", min=1)
    samples_per_prompt: int = field(1, help="responses sampled per prompt", min=1)


@dataclass(frozen=True)
class LossConfig:
    length_norm: Literal["token", "sequence"] = field(
        "token", help="token: every response token weighs the same; sequence: each response's mean, "
                      "then the mean over responses (short answers are not drowned by long ones)")
    trim: Literal["none", "eos", "marker"] = field(
        "eos", help="drop positions after the answer is complete: eos: after the first EOS; marker: after "
                    "the first occurrence of answer_end_marker (and after EOS); none: keep all")
    answer_end_marker: str | None = field(None, help="text that ends an answer (trim: marker), e.g. '</answer>'")
    fused_linear: bool = field(False, help="compute the loss from hidden states and the LM head weight in "
                                           "chunks, so the student's [tokens x vocab] logits never exist "
                                           "(refused for a head with a bias, LoRA adapter, soft-cap or scale)")
    impl: Literal["auto", "torch", "triton"] = field("auto", help="kernel implementation passed to opd.kernels")
    full_dtype: Literal["float32", "bfloat16", "float16"] = field(
        "float32", help="full mode: dtype of teacher logits on the wire and in memory")
    reward_weight: float = field(1.0, help="with `rewards`: alpha, the weight of the verifier's group-relative "
                                           "advantage in each token's advantage (opd.spine.objective)", min=0.0)
    reward_advantage: Literal["grpo", "dr_grpo", "batch_std", "rloo", "batch"] = field(
        "grpo", help="with `rewards`: the group advantage over a prompt's samples_per_prompt responses (opd.rl.grpo); "
                     "batch: the reward less the mean of the step's other responses, no groups needed "
                     "(samples_per_prompt 1 keeps every prompt of the step distinct for the teachers)")
    drown_factor: float = field(10.0, help="warn when the reward's or the teachers' mean signal per token is this "
                                           "many times the other's", min=1.0)
    off_policy: spine.OffPolicyConfig = field(default_factory=spine.OffPolicyConfig,
                                              help="correction of rows sampled by older weights (run.pipeline, "
                                                   "run.max_staleness)")

    def __post_init__(self):
        if self.trim == "marker" and not self.answer_end_marker:
            raise ValueError("trim: marker needs answer_end_marker")


@dataclass(frozen=True)
class OptimConfig(spine.OptimConfig):
    grad_accum: int = field(1, help="optimizer steps accumulate this many step batches", min=1)
    micro_batch_size: int = field(8, help="sequences per forward/backward pass (memory bound); the step's "
                                          "loss is the same for any value", min=1)


@dataclass(frozen=True)
class RunConfig(spine.RunConfig):
    eval_every: int = field(0, help="evaluate on the held-out prompts every N steps (0: only at start and end)",
                            min=0)
    pipeline: bool = field(True, help="sample the next batch and send it to the teachers before training the "
                                      "current one; its rollouts then come from weights one step old")
    max_staleness: int | None = field(None, help="rollouts run ahead of training in a thread of their own, with "
                                                 "their own copy of the weights (pushed after each step), at most "
                                                 "this many optimizer steps (0: fully on-policy; null: run.pipeline "
                                                 "decides)", min=0)
    eval_prompts: int = field(16, help="held-out prompts per evaluation (from datasets' eval_path)", min=1)
    ngram: int = field(4, help="n of the repeated n-gram ratio diagnostic", min=1)
    lopsided_factor: float = field(3.0, help="warn when a domain's loss share or eval accuracy is this many "
                                             "times above (or below 1/this of) the median over domains", min=1.01)
    on_data_error: Literal["stop", "skip"] = field("stop", help="malformed JSONL lines: stop, or skip and count")


@dataclass(frozen=True)
class TrainConfig:
    student: spine.ModelConfig = field(help="the model being trained")
    merge: MergeConfig | None = field(None, help="teachers, prompt sets, routing, SFT mix, domain weights (leave "
                                                "it out with `store`: the store is the teacher and the data)")
    rollout: RolloutConfig = field(default_factory=RolloutConfig, help="student sampling")
    loss: LossConfig = field(default_factory=LossConfig, help="normalization, trimming, kernel path")
    terms: TermsConfig = field(default_factory=TermsConfig, help="objective terms beside the teachers and the "
                                                                 "reward, as opd rl takes them (opd.spine.terms): "
                                                                 "the entropy bonus")
    optim: OptimConfig = field(default_factory=OptimConfig, help="optimizer and schedule")
    teacher_client: TeacherClientSettings = field(default_factory=TeacherClientSettings,
                                                  help="timeouts and retries towards the teacher servers")
    run: RunConfig = field(default_factory=RunConfig, help="steps, evaluation, checkpoints, seed, output")
    rewards: list[spine.RewardConfig] = field(default_factory=list,
                                              help="verifiable rewards beside the teachers (as opd rl's): their group "
                                                   "advantage, times loss.reward_weight, joins every response "
                                                   "token's advantage; empty: distillation alone")
    cluster: ClusterConfig = field(default_factory=ClusterConfig,
                                   help="local (default); fork: opd train starts cluster.teachers itself, on "
                                        "this machine (docs/train.md); or ray: teachers of cluster.teachers run "
                                        "as replicas placed on a Ray cluster (docs/multi_machine.md)")
    agent: AgentConfig | None = field(None, help="multi-turn rollouts: the student calls tools and reads their "
                                                 "answers; only its own tokens are trained and scored "
                                                 "(docs/agentic.md); unset: one turn per rollout")
    store: StoredSource | None = field(None, help="train against a teacher logit store written by `opd store`, no "
                                                  "teacher running: its sequences (off-policy, fixed) and its "
                                                  "answers, on the same {top-k, tail} objective (docs/train.md)")

    def response_budget(self) -> tuple[str, int]:
        """(its key, tokens): the room a prompt must leave after it within the positions of the
        student and its teachers: one response, or with `agent` the whole trajectory."""
        if self.agent is not None:
            return "agent.max_tokens", self.agent.max_tokens
        return "rollout.max_new_tokens", self.rollout.max_new_tokens

    def __post_init__(self):
        self._stored()
        names = [t.name for t in self.merge.teachers]
        if any(t.model == "self" for t in self.cluster.teachers):   # the student's start, served frozen
            object.__setattr__(self, "cluster", replace(self.cluster, teachers=[
                replace(t, model=self.student.path) if t.model == "self" else t for t in self.cluster.teachers]))
        extra = [t.name for t in self.cluster.teachers if t.name not in names]
        if extra:
            raise ValueError(f"cluster.teachers {extra} are not teachers of merge.teachers ({names})")
        self._cross_teachers()
        # The sampled-token estimate (log S(x) - log T(x)) grad log S(x) is unbiased for reverse KL only
        # when x is drawn from the S it scores: the teacher's temperature, no nucleus cut.
        r = self.rollout
        if r.engine == "vllm" and self.student.lora is not None:
            check_vllm_lora(self.student.lora.target_modules, "student.lora.target_modules")
        off = [t.name for t in self.merge.teachers if t.mode == "sampled" and (t.temperature != r.temperature
                                                                                or r.top_p < 1)]
        if off:
            raise ValueError(f"merge.teachers {off}: mode sampled scores the student at the teacher's temperature, "
                             f"but rollout samples at temperature {r.temperature}, top_p {r.top_p}; its reverse-KL "
                             f"estimate is unbiased only for tokens drawn from the distribution it scores: set "
                             f"rollout.temperature to the teacher's temperature and rollout.top_p to 1")
        if self.rewards and r.samples_per_prompt < 2 and self.loss.reward_advantage != "batch":
            raise ValueError(f"rewards: the reward advantage {self.loss.reward_advantage} is relative to a prompt's "
                             f"group of responses; rollout.samples_per_prompt is {r.samples_per_prompt}: set it to 2 "
                             f"or more, or loss.reward_advantage to batch")
        ranks = self.cluster.student.num_workers
        if self.run.max_staleness is not None and r.engine == "vllm" and self.student.lora is not None:
            raise ValueError("run.max_staleness with rollout.engine vllm and a LoRA student is not supported yet: "
                             "use the hf engine, or run.pipeline")
        if self.run.max_staleness and ranks > 1:
            raise ValueError("run.max_staleness with cluster.student.num_workers > 1 is not supported: rollouts "
                             "run ahead on one process (its own copy of the weights)")
        spine.check_sharded_sampling(ranks, "rollout.prompts_per_step", r.prompts_per_step, r.engine,
                                     self.cluster.ranks_on_ray)
        if self.agent is not None and not self.agent.tools:
            raise ValueError("agent.tools is empty: name the tools the model may call (e.g. {function: calculator}),"
                             " or leave `agent` out for single-turn rollouts")
        if self.agent is not None and r.engine == "vllm" and self.agent.max_tokens >= r.vllm_max_model_len:
            raise ValueError(f"agent.max_tokens {self.agent.max_tokens} leaves no room for a prompt in "
                             f"rollout.vllm_max_model_len {r.vllm_max_model_len} (prompt + trajectory)")
        if self.agent is not None and ranks > 1:
            # A sharded model's forward is a collective: every rank would have to sample as many
            # turns as the others, and a rank whose trajectories have all ended does not.
            raise ValueError("agent with cluster.student.num_workers > 1 is not supported yet: multi-turn rollouts "
                             "sample from one process")
        if ranks > 1:
            if self.merge.sft is not None and self.merge.sft.batch_size % ranks:
                raise ValueError(f"merge.sft.batch_size {self.merge.sft.batch_size} does not divide among "
                                 f"cluster.student.num_workers {ranks} ranks")


    def _stored(self) -> None:
        """With `store`, `merge` is the store's one teacher (named "store") and its sequences; what
        needs live teachers or sampling is refused."""
        if self.store is None:
            if self.merge is None:
                raise ValueError("`merge` (the teachers and prompt sets) is required, or `store` (a teacher logit "
                                 "store written by `opd store`)")
            return
        merge = MergeConfig(teachers=[self.store.teacher_spec("store")],
                            datasets=[DatasetSpec(domain="stored", path=self.store.path)])
        if self.merge is not None and self.merge != merge:
            raise ValueError("give `store` or `merge`, not both: a store is the run's teacher and its data")
        object.__setattr__(self, "merge", merge)
        refused = [key for key, on in (("rewards", bool(self.rewards)), ("agent", self.agent is not None),
                                       ("run.max_staleness", self.run.max_staleness is not None),
                                       ("cluster.teachers", bool(self.cluster.teachers)),
                                       ("cluster.mode ray", self.cluster.mode == "ray"),
                                       ("cluster.student.num_workers > 1", self.cluster.student.num_workers > 1))
                   if on]
        if refused:
            raise ValueError(f"store: trains on stored sequences with no teacher running and nothing sampled; "
                             f"remove {', '.join(refused)}")

    def _cross_teachers(self) -> None:
        """tokenizer: cross teachers (opd.teachers.align): their tokenizer, by default their forked
        model's; what they cannot be combined with yet."""
        models = {t.name: t.model for t in self.cluster.teachers}
        teachers = []
        for t in self.merge.teachers:
            if t.tokenizer == "cross" and t.cross.tokenizer_path is None:
                if t.name not in models:
                    raise ValueError(f"merge.teachers {t.name!r}: tokenizer cross needs cross.tokenizer_path (the "
                                     f"teacher's tokenizer or model directory), or the teacher in cluster.teachers")
                t = replace(t, cross=replace(t.cross, tokenizer_path=models[t.name]))
            teachers.append(t)
        object.__setattr__(self, "merge", replace(self.merge, teachers=teachers))
        cross = [t.name for t in teachers if t.tokenizer == "cross"]
        if cross and self.agent is not None:
            raise ValueError(f"merge.teachers {cross}: tokenizer cross with `agent` is not supported yet (a "
                             f"trajectory's tool observations would need aligning too)")
        if cross and self.loss.fused_linear:
            raise ValueError(f"merge.teachers {cross}: tokenizer cross needs the student's logits of a span's first "
                             f"rows; set loss.fused_linear to false")
        if self.terms.needs_entropy and self.loss.fused_linear:
            raise ValueError("terms.entropy_bonus needs the student's logits of each micro-batch's rows, which "
                             "loss.fused_linear never builds; set one of them off")


def resolve_paths(cfg: TrainConfig, base_dir: str | Path) -> TrainConfig:
    """Make every relative path of `cfg` relative to `base_dir` (the config file's folder)."""
    base = Path(base_dir)
    merge = cfg.merge
    merge = replace(
        merge,
        teachers=[replace(t, curve_server_key=near(base, t.curve_server_key),
                          cross=replace(t.cross, tokenizer_path=near(base, t.cross.tokenizer_path)))
                  for t in merge.teachers],
        datasets=[replace(d, path=near(base, d.path), eval_path=near(base, d.eval_path))
                  for d in merge.datasets],
        sft=replace(merge.sft, path=near(base, merge.sft.path)) if merge.sft else None,
    )
    cluster = replace(cfg.cluster, teachers=[replace(t, model=near(base, t.model)) for t in cfg.cluster.teachers])
    store = replace(cfg.store, path=near(base, cfg.store.path)) if cfg.store is not None else None
    return replace(cfg, student=replace(cfg.student, path=near(base, cfg.student.path)), merge=merge, store=store,
                   teacher_client=replace(cfg.teacher_client,
                                          curve_secret_key=near(base, cfg.teacher_client.curve_secret_key)),
                   run=replace(cfg.run, out_dir=near(base, cfg.run.out_dir)), cluster=cluster)


def load_train_config(path: str | Path) -> TrainConfig:
    """Load and check a train config; relative paths resolved against the file's folder."""
    cfg = load_yaml(path, TrainConfig)
    return resolve_paths(cfg, Path(path).resolve().parent)
