"""The config of `opd sft`: one frozen dataclass per section, loaded from YAML (unknown keys
refused). The sections are those of `opd rl` and `opd train`, with the same keys where they
mean the same, and the spine's classes (opd/spine/config.py) where they fit:

    model:    what is trained: a local model directory (`path`) or a fresh tiny model (`tiny`),
              device, dtype, LoRA (the spine's ModelConfig, with `tiny`)
    data:     training sets and their mixture ratios, held-out sets, the batch, truncation,
              the tools every prompt is rendered with
    optim:    AdamW, warm-up and schedule, clipping (the spine's OptimConfig, SFT's defaults)
    run:      steps, seed, output directory, logging, evaluation and checkpoints (the spine's
              RunConfig, with log_every and threads)
    cluster:  `student`: the ranks the model is sharded over (the keys of opd train's and
              opd rl's cluster.student that opd sft reads)

A key of the flat layout opd sft once had (`lr`, `batch_size`, ...) is refused with the key it
is now (MOVED); `flat_to_sections` reads such a layout, for checkpoints written with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from opd.agent.config import ToolSpec
from opd.config import field, near, to_dict
from opd.spine import config as spine


@dataclass(frozen=True)
class TinyModelSpec:
    layers: int = field(2, help="transformer layers", min=1)
    hidden: int = field(64, help="hidden size", min=8)
    heads: int = field(4, help="attention heads", min=1)
    kv_heads: int = field(2, help="key/value heads (grouped-query attention)", min=1)
    intermediate: int = field(128, help="MLP width", min=8)
    max_positions: int = field(256, help="maximum sequence length", min=16)
    seed: int = field(0, help="initialisation seed (the same seed gives bit-identical weights)")
    chat: bool = field(False, help="the chat tokenizer (ChatML turns, Hermes tool calls, <|im_end|> as EOS): "
                                   "for `messages` rows, `tools` and agentic rollouts (opd.tiny.build_tokenizer)")


@dataclass(frozen=True)
class ModelConfig(spine.ModelConfig):
    # `model: DIR` was the whole section in the flat layout: say where the directory goes.
    RETIRED_SCALAR: ClassVar[str] = "a model directory is `model.path` now (model: {path: DIR})"
    path: str | None = field(None, help="local model directory to start from (relative to the config file); "
                                        "or `tiny`")
    tiny: TinyModelSpec | None = field(None, help="start from a freshly initialised tiny model instead of `path`")

    def __post_init__(self):
        super().__post_init__()
        if (self.path is None) == (self.tiny is None):
            raise ValueError("set exactly one of model.path (a model directory) or model.tiny (a fresh tiny model)")

    def at(self, path: str | Path) -> spine.ModelConfig:
        """The spine's model section of this run once its start point is the directory `path`."""
        return spine.ModelConfig(path=str(path), dtype=self.dtype, device=self.device, lora=self.lora,
                                 gradient_checkpointing=self.gradient_checkpointing)


@dataclass(frozen=True)
class SFTDataset:
    path: str = field(help="JSONL with `prompt` or `messages` (a conversation; its final assistant message is "
                           "the response) and `response` (relative to the config file)")
    ratio: float = field(1.0, help="share of the batches drawn from this file (normalized over files; one file per batch)", min=0.0)
    domain: str | None = field(None, help="domain name for per-domain eval loss (a row's own `domain` wins)")


@dataclass(frozen=True)
class DataConfig:
    train: list[SFTDataset] = field(help="training sets and their mixture ratios")
    eval: list[SFTDataset] = field(default_factory=list, help="held-out sets: eval loss per domain")
    batch_size: int = field(16, help="sequences per optimizer step", min=1)
    max_length: int = field(128, help="truncate prompt+response to this many tokens", min=2)
    tools: list[ToolSpec] = field(default_factory=list, help="tools whose JSON schemas every prompt is rendered "
                                  "with (the chat template's `tools=`), as an `agent:` section's tools render "
                                  "them in opd train / opd rl: a response may then call them as text; e.g. "
                                  "[{function: calculator}]")

    def __post_init__(self):
        if not self.train:
            raise ValueError("`train` needs at least one data set")
        # The mixture draws each batch's set by ratio: with every ratio 0 there is nothing to draw from.
        if not any(s.ratio > 0 for s in self.train):
            raise ValueError(f"every train[].ratio is 0 ({', '.join(s.path for s in self.train)}): at least one "
                             f"training set needs a ratio above 0")
        names = [t.name or t.function.rsplit(":", 1)[-1] for t in self.tools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"tools: two tools are called {dup}; give one a `name`")


@dataclass(frozen=True)
class OptimConfig(spine.OptimConfig):
    lr: float = field(1e-3, help="peak AdamW learning rate", min=0.0)
    schedule: Literal["constant", "cosine", "linear"] = field("cosine", help="learning-rate schedule after warm-up")
    warmup_steps: int = field(10, help="linear warm-up steps from 0 to lr", min=0)


@dataclass(frozen=True)
class RunConfig(spine.RunConfig):
    steps: int = field(200, help="optimizer steps", min=1)
    out_dir: str = field("runs/sft", help="run directory (relative to the config file): metrics.jsonl, plots/, "
                                          "checkpoints/, card.md; the model lands in OUT/model")
    seed: int = field(0, help="seed of data order, dropout and a LoRA adapter's initialization", min=0)
    eval_every: int = field(0, help="eval loss on data.eval every N steps (0: only at the end)", min=0)
    checkpoint_every: int = field(0, help="checkpoint every N steps, for --resume (0: none; model/ is saved at "
                                          "the end either way)", min=0)
    tensorboard: bool = field(False, help="also write TensorBoard events (RUN/tb) when it is installed")
    dump_samples: int = field(0, help="opd train's and opd rl's held-out answers; opd sft samples none: leave "
                                      "it 0", min=0)
    log_every: int = field(10, help="write metrics every N steps", min=1)
    threads: int = field(0, help="torch CPU threads (0: torch's default)", min=0)

    def __post_init__(self):
        if self.dump_samples:
            raise ValueError("run.dump_samples: opd sft samples no answers to write; leave it 0")


@dataclass(frozen=True)
class StudentRanks:
    num_workers: int = field(1, help="ranks the model is sharded over with FSDP2; more than 1 starts them with "
                                     "torchrun's launcher on this machine (or run the command under torchrun), "
                                     "each training on its share of every batch (data.batch_size must divide "
                                     "among them)", min=1)
    cpu_offload: bool = field(False, help="sharded: keep the shards and their optimizer state in CPU memory")


@dataclass(frozen=True)
class ClusterConfig:
    student: StudentRanks = field(default_factory=StudentRanks, help="the ranks the model is sharded over (FSDP2)")


# Where each key of the flat layout went.
MOVED = {"model": "model.path", "tiny": "model.tiny", "lora": "model.lora", "device": "model.device",
         **{k: f"data.{k}" for k in ("train", "eval", "batch_size", "max_length", "tools")},
         **{k: f"optim.{k}" for k in ("lr", "weight_decay", "warmup_steps", "schedule", "grad_clip", "fused")},
         **{k: f"run.{k}" for k in ("steps", "out_dir", "seed", "log_every", "eval_every", "checkpoint_every",
                                    "keep_checkpoints", "threads")},
         **{k: f"cluster.student.{k}" for k in ("num_workers", "cpu_offload")}}


@dataclass(frozen=True)
class SFTConfig:
    RETIRED: ClassVar[dict[str, str]] = {k: f"it moved to `{v}` (opd sft's keys are in sections, as opd rl's)"
                                         for k, v in MOVED.items() if k != "model"}
    model: ModelConfig = field(help="the model trained: `path` (a model directory) or `tiny` (a fresh tiny model)")
    data: DataConfig = field(help="training and held-out sets, batch, truncation, tools")
    optim: OptimConfig = field(default_factory=OptimConfig, help="optimizer, schedule and gradient clipping")
    run: RunConfig = field(default_factory=RunConfig, help="steps, seed, output, logging, evaluation, checkpoints")
    cluster: ClusterConfig = field(default_factory=ClusterConfig, help="the ranks the model is sharded over")

    def __post_init__(self):
        ranks = self.cluster.student.num_workers
        if self.data.batch_size % ranks:
            raise ValueError(f"data.batch_size {self.data.batch_size} does not divide among "
                             f"cluster.student.num_workers {ranks} ranks: each trains on an equal share of every batch")


def flat_to_sections(config: dict) -> dict:
    """A config dict (opd.config.to_dict) in sections, also one written in the flat layout (the
    config a checkpoint of that layout saved): each flat key moved to its place (MOVED), and the
    keys it did not have set to what that layout trained with (float32, the sections' defaults),
    so that a resumed run compares like with like."""
    if "run" in config:
        return config
    out = {"model": {"dtype": "float32", "gradient_checkpointing": False}, "data": {},
           **{name: to_dict(section()) for name, section in (("optim", OptimConfig), ("run", RunConfig),
                                                                 ("cluster", ClusterConfig))}}
    for key, value in config.items():
        *parents, leaf = MOVED.get(key, key).split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def resolve(cfg_path: Path, p: str | None) -> Path | None:
    """A path of the config, relative to the config file's folder."""
    return None if p is None else Path(near(cfg_path.parent, p)).resolve()
