"""`opd sft CONFIG.yaml`: supervised fine-tuning on prompt/response JSONL, the recipe's start point.

Full fine-tuning of a causal LM on (prompt, response + EOS) pairs; the loss is the
token-mean cross-entropy over response tokens only (the prompt is context, never a
target). The model starts from a local model directory (`model:`) or, for the demo and
tests, from a freshly initialised tiny Qwen2-style model (`tiny:`, see opd.tiny).

Writes to `out_dir`:
    model/          the trained model + tokenizer (save_pretrained): what later stages load
    checkpoints/    every `checkpoint_every` steps: weights, optimizer, RNG and data
                    positions, so that `--resume` continues exactly where the run stopped
    metrics.jsonl   loss, lr, grad norm per logged step; eval loss per domain
    plots/*.png     the same, over steps
    card.md/.json   every setting that changes the result
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from opd.config import ConfigError, describe, field, load_yaml, near, to_dict


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class TinyModelSpec:
    layers: int = field(2, help="transformer layers", min=1)
    hidden: int = field(64, help="hidden size", min=8)
    heads: int = field(4, help="attention heads", min=1)
    kv_heads: int = field(2, help="key/value heads (grouped-query attention)", min=1)
    intermediate: int = field(128, help="MLP width", min=8)
    max_positions: int = field(256, help="maximum sequence length", min=16)
    seed: int = field(0, help="initialisation seed (the same seed gives bit-identical weights)")


@dataclass(frozen=True)
class SFTDataset:
    path: str = field(help="JSONL with `prompt` and `response` (relative to the config file)")
    ratio: float = field(1.0, help="share of the batches drawn from this file (normalized over files; one file per batch)", min=0.0)
    domain: str | None = field(None, help="domain name for per-domain eval loss (a row's own `domain` wins)")


@dataclass(frozen=True)
class SFTConfig:
    # core
    out_dir: str = field(help="run directory (relative to the config file); the model lands in OUT/model")
    train: list[SFTDataset] = field(help="training sets and their mixture ratios")
    model: str | None = field(None, help="local model directory to start from (relative to the config file)")
    tiny: TinyModelSpec | None = field(None, help="start from a freshly initialised tiny model instead of `model`")
    eval: list[SFTDataset] = field(default_factory=list, help="held-out sets: eval loss per domain")
    # optimisation
    steps: int = field(200, help="optimizer steps", min=1)
    batch_size: int = field(16, help="sequences per step", min=1)
    lr: float = field(1e-3, help="peak AdamW learning rate", min=0.0)
    weight_decay: float = field(0.0, help="AdamW weight decay", min=0.0)
    warmup_steps: int = field(10, help="linear warmup steps", min=0)
    schedule: Literal["cosine", "constant"] = field("cosine", help="learning-rate decay after warmup")
    grad_clip: float = field(1.0, help="clip the global gradient norm (0: off)", min=0.0)
    max_length: int = field(128, help="truncate prompt+response to this many tokens", min=2)
    seed: int = field(0, help="data order and dropout seed")
    # logging
    log_every: int = field(10, help="write metrics every N steps", min=1)
    eval_every: int = field(0, help="eval loss every N steps (0: only at the end)", min=0)
    checkpoint_every: int = field(0, help="checkpoint every N steps, for --resume (0: none; model/ is saved at "
                                          "the end either way)", min=0)
    keep_checkpoints: int = field(2, help="newest checkpoints kept on disk", min=1)
    threads: int = field(0, help="torch CPU threads (0: torch's default)", min=0)

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


def resolve(cfg_path: Path, p: str | None) -> Path | None:
    return None if p is None else Path(near(cfg_path.parent, p)).resolve()


# ----------------------------------------------------------------------------- data


def encode_pair(tokenizer, prompt: str, response: str, max_length: int) -> tuple[list[int], list[int]]:
    """(input ids, labels): labels are -100 on the prompt, the response ids + EOS after it."""
    from opd.data import encode_prompt

    p = encode_prompt(tokenizer, prompt)
    r = list(tokenizer(response, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
    ids = (p + r)[:max_length]
    labels = ([-100] * len(p) + r)[:max_length]
    return ids, labels


def collate(pairs: list[tuple[list[int], list[int]]], pad_id: int):
    import torch

    width = max(len(ids) for ids, _ in pairs)
    input_B_T = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    labels_B_T = torch.full((len(pairs), width), -100, dtype=torch.long)
    mask_B_T = torch.zeros((len(pairs), width), dtype=torch.long)
    for b, (ids, labels) in enumerate(pairs):
        input_B_T[b, :len(ids)] = torch.tensor(ids)
        labels_B_T[b, :len(labels)] = torch.tensor(labels)
        mask_B_T[b, :len(ids)] = 1
    return input_B_T, labels_B_T, mask_B_T


def response_loss(model, input_B_T, labels_B_T, mask_B_T):
    """Token-mean cross-entropy over response positions (labels != -100)."""
    from opd.distill import padded_cross_entropy

    return padded_cross_entropy(model, input_B_T, labels_B_T, mask_B_T)


class MixtureSampler:
    """Each batch comes from one data set, chosen by ratio; each set is cycled in shuffled passes.

    One set per batch (not per row) keeps padding short when lengths differ by domain: a
    batch of 5-token arithmetic answers does not pay for the longest code sample.
    """

    def __init__(self, sets: list[list], ratios: list[float], seed: int):
        from opd.data import Cycler

        total = sum(ratios)
        if total <= 0:
            raise ValueError("the mixture ratios of the training sets sum to 0")
        self.weights = [r / total for r in ratios]
        self.cyclers = [Cycler(s, seed=seed + i) for i, s in enumerate(sets)]
        self.rng = random.Random(seed)

    def take(self, n: int) -> list:
        i = self.rng.choices(range(len(self.cyclers)), weights=self.weights, k=1)[0]
        return self.cyclers[i].take(n)

    def state(self) -> dict:
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss], "cyclers": [c.state() for c in self.cyclers]}

    def load_state(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        for c, st in zip(self.cyclers, state["cyclers"], strict=True):
            c.load_state(st)


# ----------------------------------------------------------------------------- training


def lr_at(step: int, cfg: SFTConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _load_sets(cfg_path: Path, specs: list[SFTDataset], tokenizer, max_length: int):
    from opd.data import load_jsonl

    sets, names = [], []
    for spec in specs:
        path = resolve(cfg_path, spec.path)
        samples, _ = load_jsonl(path)
        missing = [i for i, s in enumerate(samples) if s.response is None]
        if missing:
            raise ConfigError(f"{path}: {len(missing)} rows have no `response` (first: row {missing[0] + 1}); "
                              f"SFT needs a reference response per prompt")
        pairs = [encode_pair(tokenizer, s.prompt, s.response, max_length) for s in samples]
        # A prompt that fills max_length leaves no response token to learn: such a row would
        # train nothing, and a batch of only such rows has a NaN loss.
        kept = [pair for pair in pairs if any(label != -100 for label in pair[1][1:])]
        if not kept:
            raise ConfigError(f"{path}: every prompt fills max_length ({max_length} tokens): no response token "
                              f"is left to learn; raise max_length")
        if len(kept) < len(pairs):
            print(f"warning: {path}: {len(pairs) - len(kept)} of {len(pairs)} rows dropped: their prompt fills "
                  f"max_length ({max_length} tokens)", flush=True)
        sets.append(kept)
        names.append(spec.domain or samples[0].domain or path.stem)
    return sets, names


def _build_model(cfg: SFTConfig, cfg_path: Path, out: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from opd.fingerprint import load_model_tokenizer

    if cfg.tiny is not None:
        from opd.tiny import build_tiny_model

        t = cfg.tiny
        src = build_tiny_model(out / "init", layers=t.layers, hidden=t.hidden, heads=t.heads, kv_heads=t.kv_heads,
                               intermediate=t.intermediate, max_positions=t.max_positions, seed=t.seed)
    else:
        src = resolve(cfg_path, cfg.model)
    tokenizer = load_model_tokenizer(src, f"{cfg_path}: `model`")
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    return model, tokenizer, src


def eval_loss(model, sets: list[list], pad_id: int, batch_size: int) -> list[float]:
    import torch

    model.eval()
    out = []
    with torch.no_grad():
        for pairs in sets:
            total, n = 0.0, 0
            for i in range(0, len(pairs), batch_size):
                chunk = pairs[i:i + batch_size]
                batch = collate(chunk, pad_id)
                tokens = int((batch[1][:, 1:] != -100).sum())
                total += float(response_loss(model, *batch)) * tokens
                n += tokens
            out.append(total / max(1, n))
    model.train()
    return out


# What a resumed run must share with the checkpointed one to continue it: another value of any
# of these makes the checkpoint's weights, optimizer or data positions belong to another run.
_SAME_RUN = ("model", "tiny", "tiny.*", "train", "batch_size", "max_length", "seed")


def _resume(out: Path, cfg: SFTConfig, model, opt, sampler) -> tuple[int, list[str]]:
    """Load the newest checkpoint under OUT/checkpoints: (its step, the config keys changed since)."""
    from opd.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, resume_changes

    ckpt = latest_checkpoint(out / "checkpoints")
    if ckpt is None:
        raise CheckpointError(f"--resume: no complete checkpoint under {out / 'checkpoints'} (set checkpoint_every "
                              f"to write them)")
    saved = json.loads((ckpt / "state.json").read_text()).get("config")
    changed = resume_changes(saved, to_dict(cfg), _SAME_RUN)
    state = load_checkpoint(ckpt, model=model, optimizer=opt)
    sampler.load_state(state["sampler"])
    return int(state["step"]), changed


def train(cfg: SFTConfig, cfg_path: Path, *, overwrite: bool = False, resume: bool = False) -> Path:
    """overwrite: replace an earlier run in out_dir (else it is refused: opd.checkpoint.claim_run_dir).
    resume: continue from the newest checkpoint in OUT/checkpoints, drawing the batches and
    dropout masks the uninterrupted run would have drawn."""
    import torch
    from tqdm import tqdm

    from opd.card import write_card
    from opd.checkpoint import claim_run_dir, save_checkpoint, save_final_model
    from opd.metrics import MetricsLogger, plot_metrics, read_metrics

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = resolve(cfg_path, cfg.out_dir)
    claim_run_dir(out, resume=resume, overwrite=overwrite)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model, tokenizer, src = _build_model(cfg, cfg_path, out)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_sets, train_names = _load_sets(cfg_path, cfg.train, tokenizer, cfg.max_length)
    eval_sets, eval_names = _load_sets(cfg_path, cfg.eval, tokenizer, cfg.max_length) if cfg.eval else ([], [])
    sampler = MixtureSampler(train_sets, [s.ratio for s in cfg.train], cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    start, changed = _resume(out, cfg, model, opt, sampler) if resume else (0, [])
    log = MetricsLogger(out, tensorboard=False, resume_step=start if resume else None)
    model.train()
    t0 = time.time()
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="sft", unit="step", dynamic_ncols=True)
    for step in bar:
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = collate(sampler.take(cfg.batch_size), pad_id)
        loss = response_loss(model, *batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.2e}")
        metrics = {}
        if (step + 1) % cfg.log_every == 0 or step == cfg.steps - 1:
            metrics = {"loss": loss.item(), "lr": lr, "grad_norm": float(gnorm)}
        if eval_sets and ((cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step == cfg.steps - 1):
            for name, v in zip(eval_names, eval_loss(model, eval_sets, pad_id, 64)):
                metrics[f"eval_loss/{name}"] = v
        if metrics:
            log.log(step + 1, metrics)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            save_checkpoint(out / "checkpoints", step + 1, model=model, optimizer=opt, keep=cfg.keep_checkpoints,
                            state={"sampler": sampler.state(), "config": to_dict(cfg)})
    bar.close()
    log.close()
    elapsed = time.time() - t0
    # The last step's row (always logged); after a resume it may come from the earlier session.
    last = read_metrics(out / "metrics.jsonl")[-1]
    save_final_model(model, tokenizer, out / "model")
    plot_metrics(out, {"loss": ["loss", "eval_loss"], "lr": ["lr"], "grad_norm": ["grad_norm"]})
    n_params = sum(p.numel() for p in model.parameters())
    write_card(out, "SFT run", {
        "model": {"start": str(src), "parameters": n_params, "tiny": to_dict(cfg.tiny) if cfg.tiny else "no",
                  "output": str(out / "model")},
        "objective": {"loss": "token-mean cross-entropy on response tokens + EOS (prompt masked)",
                      "max_length": cfg.max_length},
        "data": {f"train[{i}]": f"{resolve(cfg_path, s.path)} (ratio {s.ratio}, {len(train_sets[i])} rows)"
                 for i, s in enumerate(cfg.train)},
        "optimisation": {"steps": cfg.steps, "batch_size": cfg.batch_size, "lr": cfg.lr, "schedule": cfg.schedule,
                         "warmup_steps": cfg.warmup_steps, "weight_decay": cfg.weight_decay,
                         "grad_clip": cfg.grad_clip, "seed": cfg.seed,
                         "checkpoint_every": cfg.checkpoint_every or "never"},
        "result": {"final_loss": last["loss"], "wall_s": round(elapsed, 1),
                   **({"resumed_at_step": start, "changed_since_checkpoint": ", ".join(changed) or "nothing"}
                      if resume else {}),
                   **{k: v for k, v in last.items() if k.startswith("eval_loss/")}},
    })
    return out / "model"


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("config", nargs="?", help="SFT config YAML (e.g. configs/demo/sft_base.yaml)")
    parser.add_argument("--describe", action="store_true", help="print every config key with its help and exit")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in out_dir from its newest checkpoint (see checkpoint_every)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh even if out_dir holds an earlier run: delete its metrics, plots, card, "
                             "checkpoints and model first (without it such a run is refused)")
    parser.epilog = ("Config keys (YAML; unknown keys are refused with file:line; relative paths are relative "
                     "to the config file):\n\n" + describe(SFTConfig, "  "))


def run(args: argparse.Namespace) -> int:
    if args.describe:
        print(describe(SFTConfig))
        return 0
    if not args.config:
        print("opd sft: error: a config file is needed: opd sft CONFIG.yaml (e.g. configs/demo/sft_base.yaml; "
              "--describe lists its keys)", file=sys.stderr)
        return 2
    if args.resume and args.overwrite:
        print("opd sft: --resume continues the run in out_dir, --overwrite deletes it: pass one", file=sys.stderr)
        return 2
    cfg_path = Path(args.config).resolve()
    try:
        cfg = load_yaml(cfg_path, SFTConfig)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model_dir = train(cfg, cfg_path, overwrite=args.overwrite, resume=args.resume)
    print(f"sft: model saved to {model_dir}")
    return 0
