"""Checkpoints of a model sharded over several ranks, with torch.distributed.checkpoint (DCP).

    RUN/checkpoints/step_000120/
        dcp/              every rank's shards of the trained weights (requires_grad ones: a
                          LoRA run's adapter, not its frozen base) and of the optimizer state
        schedule.pt       the learning-rate schedule (the same on every rank; rank 0 writes it)
        rng/rank_R.pt     each rank's random generators (rank R's dropout and sampling draws)
        state.json        step, data positions, the config (rank 0)

Atomic as one process's checkpoints are (opd.checkpoint): every rank writes into the
`step_X.tmp-TOKEN` rank 0 named, then rank 0 syncs it to disk and renames it to `step_X`,
and only then moves `latest`. A crash at any point leaves the previous checkpoint loadable;
the next save removes what a crashed one left. DCP reshards on load, so a run may resume on
another number of ranks, or in one process. The ranks must share the run directory (one
machine, or a shared filesystem across several).
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from opd import checkpoint as ckpt_io
from opd.spine.dist import World

TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)


def is_sharded_checkpoint(path: str | Path) -> bool:
    return (Path(path) / "dcp").is_dir()


def save_sharded(root: str | Path, step: int, *, model, optimizer, scheduler, state: dict, keep: int,
                 world: World) -> Path:
    """Checkpoint `step` of every rank under `root` (a collective: every rank calls it)."""
    root = Path(root)
    final = root / f"step_{step:06d}"

    def prepare() -> str:
        root.mkdir(parents=True, exist_ok=True)
        ckpt_io.clear_stale(root)
        return f"{final.name}.tmp-{uuid.uuid4().hex[:8]}"

    tmp = root / world.main_first(prepare)
    try:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        (tmp / "rng").mkdir(parents=True, exist_ok=True)
        torch.save(ckpt_io.rng_state(), tmp / "rng" / f"rank_{world.rank}.pt")
    except (OSError, RuntimeError) as e:
        failed = e
    else:
        failed = None
    failures = [f for f in world.gather(None if failed is None else str(failed)) if f]

    def publish() -> Path:
        if failures:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ckpt_io.write_failed(final, failures[0])
        try:
            torch.save({"scheduler": scheduler.state_dict() if scheduler is not None else None}, tmp / "schedule.pt")
            (tmp / "state.json").write_text(json.dumps({"step": step, "ranks": world.size, **state}, indent=1))
            ckpt_io.publish(tmp, final)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ckpt_io.write_failed(final, e.strerror or e) from e
        ckpt_io.prune(root, final, keep)
        return final

    return world.main_first(publish)


def load_sharded(path: str | Path, *, model, optimizer=None, scheduler=None, world: World) -> dict:
    """Load a sharded checkpoint into this rank's shards (a collective); state.json's dict."""
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED) if optimizer is not None else \
        (get_model_state_dict(model, options=TRAINED), {})
    target = {"model": model_sd, **({"optim": optim_sd} if optimizer is not None else {})}
    dcp.load(target, checkpoint_id=str(path / "dcp"))
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=target["model"],
                   optim_state_dict=target.get("optim", {}), options=TRAINED)
    if scheduler is not None:
        saved = torch.load(path / "schedule.pt", weights_only=True)["scheduler"]
        if saved is not None:
            scheduler.load_state_dict(saved)
    rng = path / "rng" / f"rank_{world.rank}.pt"
    if rng.is_file():   # resumed on more ranks than saved: the new ones start from their seeds
        ckpt_io.set_rng_state(torch.load(rng, weights_only=True))
    return json.loads((path / "state.json").read_text())


def load_whole_into_shards(path: str | Path, *, model, optimizer=None, scheduler=None, world: World) -> dict:
    """A checkpoint written by one process (opd.checkpoint) into this rank's shards: rank 0 alone
    reads its trained weights and optimizer state and broadcasts them (a collective), the
    schedule and state.json go to every rank, and rank 0 takes the saved random generators
    (the other ranks start from their seeds, as when a sharded run resumes on more ranks).
    The optimizer state is saved by parameter index; the index is the trained parameters'
    order, the same in the sharded model, so it is renamed to the names DCP's API takes."""
    path = Path(path)
    blob, weights = None, {}
    if world.main:
        weights = load_file(str(path / "trainable.safetensors"))
        blob = ckpt_io.load_optimizer_blob(path)
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                  strict=False))
    del weights
    small = world.broadcast({"scheduler": blob["scheduler"], "has_optim": blob["optimizer"] is not None}
                            if world.main else None)
    if optimizer is not None and small["has_optim"]:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        full = {}
        if world.main:
            saved = blob["optimizer"]
            full = {"state": {names[i]: v for i, v in saved["state"].items()},
                    "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, full,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    if scheduler is not None and small["scheduler"] is not None:
        scheduler.load_state_dict(small["scheduler"])
    if world.main:
        ckpt_io.set_rng_state(blob["rng"])
    return json.loads((path / "state.json").read_text())


def broadcast_from_rank0(model, whole: dict[str, torch.Tensor], world: World) -> None:
    """Rank 0's weights (`whole`, its full state dict; {} on the other ranks) into every rank's
    shards of `model`, and its buffers (a rotary embedding's inverse frequencies are not in the
    state dict) into every rank's: what lets the ranks other than 0 build the model on the meta
    device instead of each reading it whole (8 ranks x an 8B model in fp32: 256 GB of host
    memory on one node). A collective."""
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    saved = set(model.state_dict())
    for name, buf in model.named_buffers():
        if name not in saved:
            dist.broadcast(buf, src=0)


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Every weight of a sharded model, whole, on rank 0's CPU ({} on the other ranks; a
    collective). What the final model directory and a vLLM engine are written from."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
