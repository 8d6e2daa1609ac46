"""The config of `opd sft`: one flat, frozen struct loaded from YAML (unknown keys refused).

It predates the sectioned configs of `opd train` and `opd rl` and keeps its keys; the spine's
sections it maps to are built by `model_config` and `optim_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from opd.agent.config import ToolSpec
from opd.config import check_device, field, near
from opd.lora import LoraSpec
from opd.spine.config import ModelConfig, OptimConfig


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
class SFTDataset:
    path: str = field(help="JSONL with `prompt` or `messages` (a conversation; its final assistant message is "
                           "the response) and `response` (relative to the config file)")
    ratio: float = field(1.0, help="share of the batches drawn from this file (normalized over files; one file per batch)", min=0.0)
    domain: str | None = field(None, help="domain name for per-domain eval loss (a row's own `domain` wins)")


@dataclass(frozen=True)
class SFTConfig:
    # core
    out_dir: str = field(help="run directory (relative to the config file); the model lands in OUT/model")
    train: list[SFTDataset] = field(help="training sets and their mixture ratios")
    model: str | None = field(None, help="local model directory to start from (relative to the config file)")
    tiny: TinyModelSpec | None = field(None, help="start from a freshly initialised tiny model instead of `model`")
    lora: LoraSpec | None = field(None, help="train a peft LoRA adapter instead of every weight (omit: full "
                                             "fine-tuning; model/ holds the adapter merged in)")
    eval: list[SFTDataset] = field(default_factory=list, help="held-out sets: eval loss per domain")
    tools: list[ToolSpec] = field(default_factory=list, help="tools whose JSON schemas every prompt is rendered "
                                  "with (the chat template's `tools=`), as an `agent:` section's tools render "
                                  "them in opd train / opd rl: a response may then call them as text; e.g. "
                                  "[{function: calculator}]")
    # optimisation
    steps: int = field(200, help="optimizer steps", min=1)
    batch_size: int = field(16, help="sequences per step", min=1)
    lr: float = field(1e-3, help="peak AdamW learning rate", min=0.0)
    weight_decay: float = field(0.0, help="AdamW weight decay", min=0.0)
    warmup_steps: int = field(10, help="linear warmup steps", min=0)
    schedule: Literal["cosine", "constant"] = field("cosine", help="learning-rate decay after warmup")
    grad_clip: float = field(1.0, help="clip the global gradient norm (0: off)", min=0.0)
    fused: bool = field(True, help="AdamW's fused kernel where torch has it for the parameters (optim.fused of "
                                   "opd train / opd rl): faster; false: foreach, the same update with other "
                                   "rounding")
    max_length: int = field(128, help="truncate prompt+response to this many tokens", min=2)
    seed: int = field(0, help="data order and dropout seed")
    # logging
    log_every: int = field(10, help="write metrics every N steps", min=1)
    eval_every: int = field(0, help="eval loss every N steps (0: only at the end)", min=0)
    checkpoint_every: int = field(0, help="checkpoint every N steps, for --resume (0: none; model/ is saved at "
                                          "the end either way)", min=0)
    keep_checkpoints: int = field(2, help="newest checkpoints kept on disk", min=1)
    threads: int = field(0, help="torch CPU threads (0: torch's default)", min=0)
    device: str = field("auto", help="torch device of the model: auto (cuda when available), cpu, cuda, cuda:N")
    num_workers: int = field(1, help="ranks the model is sharded over (FSDP2); more than 1 starts them with "
                                     "torchrun's launcher on this machine, each training on its share of every "
                                     "batch (batch_size must divide among them)", min=1)
    cpu_offload: bool = field(False, help="with num_workers > 1: keep the shards and their optimizer state in CPU "
                                          "memory")

    def __post_init__(self):
        if (self.model is None) == (self.tiny is None):
            raise ValueError("set exactly one of `model` (a model directory) or `tiny` (a fresh tiny model)")
        if not self.train:
            raise ValueError("`train` needs at least one data set")
        # The mixture draws each batch's set by ratio: with every ratio 0 there is nothing to
        # draw from (MixtureSampler failed with a traceback once the model had loaded).
        if not any(s.ratio > 0 for s in self.train):
            raise ValueError(f"every train[].ratio is 0 ({', '.join(s.path for s in self.train)}): at least one "
                             f"training set needs a ratio above 0")
        check_device(self.device, auto=True)
        names = [t.name or t.function.rsplit(":", 1)[-1] for t in self.tools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"tools: two tools are called {dup}; give one a `name`")
        if self.batch_size % self.num_workers:
            raise ValueError(f"batch_size {self.batch_size} does not divide among num_workers {self.num_workers} "
                             f"ranks: each trains on an equal share of every batch")

    def model_config(self, path: str) -> ModelConfig:
        """The spine's model section of this run, starting from `path`: fp32, every weight or LoRA."""
        return ModelConfig(path=str(path), dtype="float32", device=self.device, lora=self.lora)

    def optim_config(self) -> OptimConfig:
        """The spine's optimizer section of this run: AdamW, warm-up, then cosine to 0 or constant."""
        return OptimConfig(lr=self.lr, schedule=self.schedule, warmup_steps=self.warmup_steps,
                           weight_decay=self.weight_decay, grad_clip=self.grad_clip, fused=self.fused)


def resolve(cfg_path: Path, p: str | None) -> Path | None:
    """A path of the config, relative to the config file's folder."""
    return None if p is None else Path(near(cfg_path.parent, p)).resolve()
