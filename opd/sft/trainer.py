"""`opd sft`'s loop: supervised fine-tuning on prompt/response JSONL, the recipe's start point.

Full fine-tuning of a causal LM on (prompt, response + EOS) pairs; the loss is the
token-mean cross-entropy over response tokens only (the prompt is context, never a
target). A `messages` row is a conversation: everything before its final assistant message
(earlier turns, tool calls and tool answers included) is the prompt, rendered by the chat
template with the `tools` schemas exactly as an agentic rollout renders it (opd.agent), so
the SFT'd model sees the prompt it later answers; only the final message + EOS is learnt.
The model starts from a local model directory (`model.path`) or, for the demo and tests, from
a freshly initialised tiny Qwen2-style model (`model.tiny`, see opd.tiny).

Each step: one batch from one training set (SetPerBatchSampler), loss, backward, and the
spine's optimizer step (opd.spine: AdamW, warm-up then cosine or constant, clipping, a
non-finite step skipped). Writes to `run.out_dir` (opd.spine.run.RunDir):
    model/          the trained model + tokenizer (save_pretrained): what later stages load
    checkpoints/    every `run.checkpoint_every` steps: weights, optimizer, schedule, RNG and data
                    positions, so that `--resume` continues exactly where the run stopped
    metrics.jsonl   loss, lr, grad norm per logged step; eval loss per domain
    plots/*.png     the same, over steps
    card.md/.json   every setting that changes the result
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from opd.agent.config import AgentConfig
from opd.agent.tools import build_toolbox
from opd.card import write_card
from opd.config import ConfigError, to_dict
from opd.data import Cycler, DataError, encode_prompt, load_jsonl
from opd.metrics import read_metrics
from opd.sft.config import SFTConfig, SFTDataset, flat_to_sections, resolve
from opd.spine.dist import World, memory_per_rank
from opd.spine.model import load_policy
from opd.spine.optim import NonfiniteSteps, build_optimizer, optimizer_step
from opd.spine.rows import padded_cross_entropy
from opd.spine.run import RunDir
from opd.tiny import build_tiny_model


# ----------------------------------------------------------------------------- data


def encode_pair(tokenizer, prompt: str | list[dict], response: str, max_length: int,
                tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """(input ids, labels): labels are -100 on the prompt, the response ids + EOS after it.
    prompt: a row's `Sample.chat` (a prompt string or the conversation up to the model's turn);
    tools: the JSON schemas the chat template renders with it."""
    p = encode_prompt(tokenizer, prompt, tools=tools)
    r = list(tokenizer(response, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
    ids = (p + r)[:max_length]
    labels = ([-100] * len(p) + r)[:max_length]
    return ids, labels


def collate(pairs: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded (input ids, labels, attention mask), each [B, T]."""
    width = max(len(ids) for ids, _ in pairs)
    input_B_T = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    labels_B_T = torch.full((len(pairs), width), -100, dtype=torch.long)
    mask_B_T = torch.zeros((len(pairs), width), dtype=torch.long)
    for b, (ids, labels) in enumerate(pairs):
        input_B_T[b, :len(ids)] = torch.tensor(ids)
        labels_B_T[b, :len(labels)] = torch.tensor(labels)
        mask_B_T[b, :len(ids)] = 1
    return input_B_T, labels_B_T, mask_B_T


def response_loss(model, input_B_T, labels_B_T, mask_B_T, tokens: float | None = None):
    """Token-mean cross-entropy over response positions (labels != -100). tokens: the response
    tokens of the whole step when this batch is one rank's share of it (their summed loss over
    all ranks' tokens: the ranks' gradients then sum to one process's)."""
    # collate builds the batch on the CPU; the model may be on a GPU (`device: cuda`)
    device = next(model.parameters()).device
    input_B_T, labels_B_T, mask_B_T = (t.to(device) for t in (input_B_T, labels_B_T, mask_B_T))
    if tokens is None:
        return padded_cross_entropy(model, input_B_T, labels_B_T, mask_B_T)
    return padded_cross_entropy(model, input_B_T, labels_B_T, mask_B_T, "sum") / max(tokens, 1.0)


class SetPerBatchSampler:
    """Each batch comes from one data set, chosen by ratio; each set is cycled in shuffled passes.

    One set per batch (not per row, as opd.routing.mixture.MixtureSampler mixes the domains of
    `opd train`) keeps padding short when lengths differ by domain: a batch of 5-token
    arithmetic answers does not pay for the longest code sample.
    """

    def __init__(self, sets: list[list], ratios: list[float], seed: int):
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


def tool_schemas(cfg: SFTConfig, cfg_path: Path) -> list[dict] | None:
    """The JSON schemas of `data.tools` as an `agent:` section with those tools gives them to the
    chat template (opd.agent.tools; FILE.py paths relative to the config); None without tools."""
    if not cfg.data.tools:
        return None
    try:
        return build_toolbox(AgentConfig(tools=list(cfg.data.tools)), cfg_path.parent).schemas()
    except ValueError as e:
        raise ConfigError(f"{cfg_path}: data.tools: {e}") from None


def _load_sets(cfg_path: Path, specs: list[SFTDataset], tokenizer, max_length: int,
               tools: list[dict] | None = None):
    sets, names = [], []
    for spec in specs:
        path = resolve(cfg_path, spec.path)
        samples, _ = load_jsonl(path)
        missing = [i for i, s in enumerate(samples) if s.response is None]
        if missing:
            raise ConfigError(f"{path}: {len(missing)} rows have no `response` (first: row {missing[0] + 1}); "
                              f"SFT needs a reference response per prompt")
        try:
            pairs = [encode_pair(tokenizer, s.chat, s.response, max_length, tools) for s in samples]
        except DataError as e:   # messages rows or tools, and a tokenizer without a chat template
            raise ConfigError(f"{path}: {e} (a tiny model has one with `model.tiny: {{chat: true}}`)") from None
        # A prompt that fills max_length leaves no response token to learn: such a row would
        # train nothing, and a batch of only such rows has a NaN loss.
        kept = [pair for pair in pairs if any(label != -100 for label in pair[1][1:])]
        if not kept:
            raise ConfigError(f"{path}: every prompt fills max_length ({max_length} tokens): no response token "
                              f"is left to learn; raise data.max_length")
        if len(kept) < len(pairs):
            print(f"warning: {path}: {len(pairs) - len(kept)} of {len(pairs)} rows dropped: their prompt fills "
                  f"max_length ({max_length} tokens)", flush=True)
        sets.append(kept)
        names.append(spec.domain or samples[0].domain or path.stem)
    return sets, names


def eval_loss(model, sets: list[list], pad_id: int, batch_size: int) -> list[float]:
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


# ----------------------------------------------------------------------------- training


# What a resumed run must share with the checkpointed one to continue it: another value of any
# of these makes the checkpoint's weights, optimizer or data positions belong to another run.
SAME_RUN = ("model.path", "model.tiny", "model.tiny.*", "model.dtype", "model.lora", "model.lora.*", "data.train",
            "data.tools", "data.batch_size", "data.max_length", "run.seed")
PLOTS = {"loss": ["loss", "eval_loss"], "lr": ["lr"], "grad_norm": ["grad_norm"]}


def start_point(cfg: SFTConfig, cfg_path: Path, out: Path) -> Path:
    """The model directory the run starts from: `model.path`, or a fresh tiny model built in OUT/init."""
    t = cfg.model.tiny
    if t is None:
        return resolve(cfg_path, cfg.model.path)
    return build_tiny_model(out / "init", layers=t.layers, hidden=t.hidden, heads=t.heads, kv_heads=t.kv_heads,
                            intermediate=t.intermediate, max_positions=t.max_positions, seed=t.seed, chat=t.chat)


def train(cfg: SFTConfig, cfg_path: Path, *, overwrite: bool = False, resume: bool = False,
          world: World = World()) -> Path:
    """overwrite: replace an earlier run in out_dir (else it is refused: opd.checkpoint.claim_run_dir).
    resume: continue from the newest checkpoint in OUT/checkpoints, drawing the batches and
    dropout masks the uninterrupted run would have drawn. world: the ranks the model is sharded
    over; each trains on its share of every batch (data.batch_size divides among them)."""
    data, r = cfg.data, cfg.run
    if r.threads:
        torch.set_num_threads(r.threads)
    out = resolve(cfg_path, r.out_dir)
    # view: a checkpoint written with the flat layout compares by the keys it has now
    run = RunDir(out, to_dict(cfg), resume=resume, overwrite=overwrite, fixed=SAME_RUN, view=flat_to_sections,
                 hint=" (set run.checkpoint_every to write them)", world=world)
    random.seed(r.seed)
    torch.manual_seed(r.seed)
    src = world.main_first(lambda: start_point(cfg, cfg_path, out))
    # seed: a LoRA adapter's init the same on every rank (rank 0 alone built a tiny start point)
    model, tokenizer = load_policy(cfg.model.at(src), seed=r.seed, what=f"{cfg_path}: `model.path`", world=world,
                                   cpu_offload=cfg.cluster.student.cpu_offload)
    pad_id = tokenizer.pad_token_id
    tools = tool_schemas(cfg, cfg_path)
    train_sets, train_names = _load_sets(cfg_path, data.train, tokenizer, data.max_length, tools)
    eval_sets, eval_names = _load_sets(cfg_path, data.eval, tokenizer, data.max_length, tools) if data.eval else ([], [])
    sampler = SetPerBatchSampler(train_sets, [s.ratio for s in data.train], r.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt, schedule = build_optimizer(model, cfg.optim, r.steps)
    nonfinite = NonfiniteSteps("Check the data and optim.lr")
    state = run.restore(model, opt, schedule)
    if state:
        sampler.load_state(state["sampler"])
    start = int(state.get("step", 0))
    log = run.metrics(tensorboard=r.tensorboard)
    warnings: list[str] = []
    t0 = time.time()
    bar = tqdm(range(start, r.steps), initial=start, total=r.steps, desc="sft", unit="step", dynamic_ncols=True,
               disable=not (world.main and r.progress))
    for step in bar:
        lr = opt.param_groups[0]["lr"]
        batch = collate(world.shard(sampler.take(data.batch_size)), pad_id)   # this rank's share of the batch
        if world.sharded:
            tokens = world.sum({"n": float((batch[1][:, 1:] != -100).sum())})["n"]
            loss = response_loss(model, *batch, tokens=tokens)
        else:
            loss = response_loss(model, *batch)
        loss.backward()
        gnorm, applied = optimizer_step(opt, params, cfg.optim.grad_clip)
        value = world.sum({"loss": loss.item()})["loss"]   # the step's loss: the ranks' shares summed
        if not applied:
            warnings.append(nonfinite.check(step + 1, applied, f" (loss {value:.4g})"))
            if world.main:
                tqdm.write(f"warning: {warnings[-1]}")
        schedule.step()
        bar.set_postfix(loss=f"{value:.3f}", lr=f"{lr:.2e}")
        metrics = {}
        if (step + 1) % r.log_every == 0 or step == r.steps - 1:
            metrics = {"loss": value, "lr": lr, "grad_norm": gnorm}
        if eval_sets and ((r.eval_every and (step + 1) % r.eval_every == 0) or step == r.steps - 1):
            for name, v in zip(eval_names, eval_loss(model, eval_sets, pad_id, 64)):
                metrics[f"eval_loss/{name}"] = v
        if metrics:
            log.log(step + 1, metrics)
        if r.checkpoint_every and (step + 1) % r.checkpoint_every == 0:
            run.save(step + 1, model, opt, schedule, state={"sampler": sampler.state()}, keep=r.keep_checkpoints)
    bar.close()
    log.close()
    elapsed = time.time() - t0
    memory = memory_per_rank(model, opt)
    run.finish(model, tokenizer, PLOTS, cfg.model.at(src))
    if not world.main:
        return out / "model"
    # The last step's row (always logged); after a resume it may come from the earlier session.
    last = read_metrics(out / "metrics.jsonl")[-1]
    n_params = sum(p.numel() for p in model.parameters())
    m, o, lora = cfg.model, cfg.optim, cfg.model.lora
    write_card(out, "SFT run", {
        "model": {"start": str(src), "parameters": n_params, "tiny": to_dict(m.tiny) if m.tiny else "no",
                  "dtype": m.dtype,
                  "training": (f"LoRA r={lora.rank} alpha={lora.alpha} on {', '.join(lora.target_modules)}"
                               if lora else "full fine-tuning"),
                  "trained_parameters": sum(p.numel() for p in params), "output": str(out / "model")},
        "objective": {"loss": "token-mean cross-entropy on response tokens + EOS (prompt masked)",
                      "max_length": data.max_length,
                      "tools": ([t.function if t.name is None else f"{t.function} (called {t.name!r})"
                                 for t in data.tools] or "none")},
        "data": {f"train[{i}]": f"{resolve(cfg_path, s.path)} (ratio {s.ratio}, {len(train_sets[i])} rows)"
                 for i, s in enumerate(data.train)},
        "optimisation": {"steps": r.steps, "batch_size": data.batch_size, "lr": o.lr, "schedule": o.schedule,
                         "warmup_steps": o.warmup_steps, "weight_decay": o.weight_decay,
                         "grad_clip": o.grad_clip, "seed": r.seed,
                         "checkpoint_every": r.checkpoint_every or "never",
                         "ranks": f"{world.size} (FSDP2, each rank {data.batch_size // world.size} sequences a step)"
                         if world.sharded else "1", "memory_per_rank_bytes": memory},
        "result": {"final_loss": last["loss"], "wall_s": round(elapsed, 1),
                   **({"resumed_at_step": start, "changed_since_checkpoint": ", ".join(run.changed or []) or "nothing"}
                      if resume else {}),
                   **{k: v for k, v in last.items() if k.startswith("eval_loss/")},
                   "warnings": warnings or "none"},
    })
    return out / "model"
