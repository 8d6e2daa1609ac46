"""The config sections every training loop shares: the model it trains, how it samples, how it
optimizes and how its run is kept.

    ModelConfig    the trained model: local directory, dtype, device, LoRA, checkpointing
    RolloutConfig  how the model samples: engine, temperature, top-p, lengths (a loop adds
                   its batch shape: prompts and samples per step, or GRPO's group size)
    OptimConfig    AdamW, its learning-rate schedule and gradient clipping
    RunConfig      steps, seed, output directory, evaluation and checkpoint cadence

`opd train` (student:, rollout:, optim:, run:), `opd rl` (model:, rollout:, optim:, run:) and
`opd sft` (model:, optim:, run:) use these, each subclassing where it adds fields or has other
defaults. One class per section means one loader, one optimizer and one checkpoint cadence
for all three (opd.spine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from opd.config import check_device, check_top_p, field
from opd.lora import LoraSpec

DType = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class ModelConfig:
    path: str = field(help="local model directory (transformers format; a peft adapter directory is merged "
                           "into its base)")
    dtype: DType = field("float32", help="dtype of the trained weights")
    device: str = field("auto", help="torch device: auto (cuda when available), cpu, cuda, cuda:N")
    lora: LoraSpec | None = field(None, help="train a peft LoRA adapter instead of every weight (omit: full "
                                             "fine-tuning; a reference policy is then the base with the adapter off)")
    gradient_checkpointing: bool = field(False, help="recompute activations in backward (less memory, slower)")

    def __post_init__(self):
        check_device(self.device, auto=True)


@dataclass(frozen=True)
class RolloutConfig:
    engine: Literal["hf", "vllm"] = field("hf", help="hf: a KV-cached sampling loop over the trained model itself "
                                                     "(exact); vllm: a vLLM engine that receives the weights after "
                                                     "each optimizer step")
    temperature: float = field(1.0, help="sampling temperature (0: greedy)", min=0.0)
    top_p: float = field(1.0, help="nucleus sampling threshold", min=0.0, max=1.0)
    max_new_tokens: int = field(64, help="length limit of a response", min=1)
    batch_size: int = field(64, help="sequences generated together (hf engine)", min=1)
    vllm_max_model_len: int = field(2048, help="vllm engine: longest prompt + response it holds", min=16,
                                    aliases=("max_model_len",))
    vllm_gpu_memory_utilization: float = field(0.3, help="vllm engine: share of GPU memory it may take (the "
                                                         "trained model shares the GPU)", min=0.01, max=1.0)
    vllm_tensor_parallel_size: int = field(1, help="vllm engine: GPUs it spreads the model over (vLLM's own "
                                                   "tensor parallelism)", min=1)
    vllm_enforce_eager: bool | None = field(None, help="vllm engine: no CUDA graphs (null: eager on the CPU, "
                                                       "CUDA graphs on GPUs)")

    def __post_init__(self):
        check_top_p(self.top_p, "rollout.top_p")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = field(1e-5, help="peak AdamW learning rate", min=0.0)
    schedule: Literal["constant", "cosine", "linear"] = field("constant", help="learning-rate schedule after warm-up")
    warmup_steps: int = field(0, help="linear warm-up steps from 0 to lr", min=0)
    min_lr_ratio: float = field(0.0, help="cosine/linear: final lr as a fraction of lr", min=0.0, max=1.0)
    weight_decay: float = field(0.0, help="AdamW weight decay", min=0.0)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999], help="AdamW betas")
    eps: float = field(1e-8, help="AdamW epsilon", min=0.0)
    grad_clip: float = field(1.0, help="clip the global gradient norm to this (0: no clipping)", min=0.0)
    # On by default, as transformers' Trainer has it: a user who writes nothing gets the faster
    # step (measured in docs/train.md and docs/benchmarks.md).
    fused: bool = field(True, help="AdamW's fused kernel (transformers' Trainer default), where torch has it for "
                                   "the parameters (not FSDP2-sharded ones): one pass per tensor, faster than "
                                   "foreach's dozen; false: foreach, the same update with other rounding")

    def __post_init__(self):
        if len(self.betas) != 2:
            raise ValueError(f"betas needs two values, got {self.betas}")


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
class OffPolicyConfig:
    """How tokens sampled by older weights than those trained are corrected (opd.spine.objective)."""
    correction: Literal["tis", "mask", "none"] = field(
        "tis", help="tis: importance ratio pi_now/pi_sampler truncated at cap; mask: tokens whose ratio "
                    "leaves band get weight 0; none: no correction (staleness-0 rows always weigh 1)")
    cap: float = field(2.0, help="tis: ratios (and prefix ratios, for top-k / full divergences) above this "
                                 "are cut to it", min=1.0)
    band: list[float] = field(default_factory=lambda: [0.5, 2.0], help="mask: [low, high] of the ratios kept")

    def __post_init__(self):
        if len(self.band) != 2 or not (0 <= self.band[0] <= 1 <= self.band[1]):
            raise ValueError(f"off_policy.band needs [low, high] with low <= 1 <= high, got {self.band}")


@dataclass(frozen=True)
class RunConfig:
    steps: int = field(100, help="optimizer steps", min=1)
    out_dir: str = field("runs/opd", help="run directory: metrics.jsonl, plots/, checkpoints/, card.md, model/")
    seed: int = field(0, help="seed of sampling, data order and initialization", min=0)
    eval_every: int = field(0, help="evaluate on the held-out prompts every N steps (0: only at the end)", min=0)
    checkpoint_every: int = field(0, help="checkpoint every N steps (0: only at the end)", min=0,
                                  aliases=("ckpt_every",))
    keep_checkpoints: int = field(2, help="newest checkpoints kept on disk", min=1)
    progress: bool = field(True, help="show a progress bar")
    tensorboard: bool = field(True, help="also write TensorBoard events when it is installed")
    dump_samples: int = field(4, help="held-out answers written to RUN/samples/step_N.md at each evaluation (prompt, "
                                      "answer, verifier score) for a person to read; 0: none", min=0)


def check_sharded_sampling(ranks: int, prompts_key: str, prompts: int, engine: str, on_ray: bool) -> None:
    """What a loop that samples (opd train, opd rl) needs on `ranks` > 1 ranks: the step's prompts
    divide evenly among them (each samples its share, with the hf engine from the shards
    themselves, with vllm through rank 0's engine: opd.spine.engine, under torchrun's ranks)."""
    if ranks <= 1:
        return
    if prompts % ranks:
        raise ValueError(f"{prompts_key} {prompts} does not divide among cluster.student.num_workers {ranks} "
                         f"ranks: each samples an equal share of the step's prompts")
    if engine == "vllm" and on_ray:
        raise ValueError("rollout.engine vllm beside the student's ranks on Ray (cluster.mode ray) is not supported "
                         "yet: rank 0's engine runs under torchrun's ranks (cluster.mode local or fork), or sample "
                         "with rollout.engine hf from the shards themselves")
