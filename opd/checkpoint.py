"""Checkpoints that resume exactly and never corrupt the last good one.

Layout of RUN/checkpoints/step_000120/:
    trainable.safetensors   every parameter with requires_grad (the whole model for full
                            fine-tuning, the adapter alone for LoRA): what resume loads
    model/                  the same weights as a loadable directory (save_pretrained:
                            a full model dir, or a peft adapter dir)
    optimizer.pt            optimizer + LR scheduler state (torch.save, loaded weights_only)
    state.json              step, data positions, RNG states, anything the trainer adds

Atomicity: everything is written into `step_X.tmp-PID`, fsynced, then renamed to
`step_X`; the `latest` file is replaced atomically afterwards. A crash (or a full disk)
at any point leaves the previous checkpoint and `latest` untouched.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file


class CheckpointError(RuntimeError):
    pass


def rng_state() -> dict:
    """Every generator's state, in types torch.load(weights_only=True) accepts (numpy's key
    array as a tensor)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def save_checkpoint(root: str | Path, step: int, *, model, optimizer=None, scheduler=None,
                    state: dict | None = None, keep: int = 2) -> Path:
    """Write checkpoint `step` under `root` atomically; keep the newest `keep` checkpoints."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    clear_stale(root)
    try:
        tmp.mkdir()
        trainable = {n: p.detach().cpu().clone().contiguous() for n, p in model.named_parameters() if p.requires_grad}
        save_file(trainable, str(tmp / "trainable.safetensors"))
        model.save_pretrained(str(tmp / "model"), safe_serialization=True)
        torch.save({"optimizer": optimizer.state_dict() if optimizer else None,
                    "scheduler": scheduler.state_dict() if scheduler else None,
                    "rng": rng_state()}, tmp / "optimizer.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, **(state or {})}, indent=1))
        publish(tmp, final)
    except (OSError, SafetensorError, RuntimeError) as e:  # safetensors reports ENOSPC/EFBIG as its own error
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failed(final, getattr(e, "strerror", None) or e) from e
    prune(root, final, keep)
    return final


# ---- the steps every checkpoint writer shares (one process's above, opd.spine.shards' sharded one)

def clear_stale(root: Path) -> None:
    """What crashed saves left under `root`: half-written checkpoints (each a full model copy)
    and the `latest` pointer of a process killed between writing and renaming it."""
    for stale in root.glob("step_*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob("latest.tmp-*"):
        stale.unlink(missing_ok=True)


def publish(tmp: Path, final: Path) -> None:
    """Make the completely written `tmp` the checkpoint `final`: synced to disk, renamed, and
    only then `latest` moved to it (an atomic rename too). Raises OSError."""
    root = final.parent
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root / f"latest.tmp-{os.getpid()}"
    pointer.write_text(final.name)
    os.replace(pointer, root / "latest")
    _fsync_dir(root)


def prune(root: Path, final: Path, keep: int) -> None:
    """Remove the checkpoints older than the newest `keep` (never `final`, never a save in progress)."""
    for old in sorted(root.glob("step_*"))[:-keep] if keep > 0 else []:
        if old != final and ".tmp-" not in old.name:
            shutil.rmtree(old, ignore_errors=True)


def write_failed(final: Path, why) -> CheckpointError:
    """The error of a save that did not complete: what failed, and the checkpoint still good."""
    return CheckpointError(f"could not write checkpoint {final} ({why}); the last good checkpoint is "
                           f"{latest_checkpoint(final.parent)}")


def latest_checkpoint(root: str | Path) -> Path | None:
    """The last complete checkpoint, or None. Half-written `.tmp-*` dirs are ignored."""
    root = Path(root)
    pointer = root / "latest"
    if pointer.is_file():
        p = root / pointer.read_text().strip()
        if (p / "state.json").is_file():
            return p
    done = [p for p in sorted(root.glob("step_*")) if ".tmp-" not in p.name and (p / "state.json").is_file()]
    return done[-1] if done else None


# What `opd train` and `opd rl` write into their run directory; --overwrite removes these and
# nothing else (a run directory may sit beside the user's own files).
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tb", "plots", "model", "card.md", "card.json", "summary.json",
               "samples")


def claim_run_dir(out: str | Path, *, resume: bool, overwrite: bool) -> None:
    """Make sure a fresh run starts in a directory without an earlier run in it.

    Without this a fresh run deleted the earlier run's metrics.jsonl, wrote its checkpoints
    beside the earlier ones, and a crash before its first checkpoint left `--resume` to pick
    up the earlier run with the new config. A resumed run keeps everything; a fresh run into a
    used directory is refused unless `overwrite`, which removes the earlier run's outputs."""
    if resume:
        return
    out = Path(out)
    ckpt = latest_checkpoint(out / "checkpoints") if (out / "checkpoints").is_dir() else None
    metrics = out / "metrics.jsonl"
    found = ([f"checkpoint {ckpt.name}"] if ckpt else []) + \
            (["metrics.jsonl"] if metrics.is_file() and metrics.stat().st_size else []) + \
            (["model/"] if (out / "model").is_dir() else [])
    if not found:
        return
    if not overwrite:
        raise CheckpointError(f"{out} already holds a run ({', '.join(found)}); pass --resume to continue it, "
                              f"--overwrite to delete it and start again, or choose another out_dir")
    for name in RUN_OUTPUTS:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)


def _flatten(value, key: str = "") -> dict[str, object]:
    """{dotted key: leaf} of a config dict; a list of named entries is keyed by name
    (merge.teachers.math.k), so reordering a list is not a change."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{key}.{k}" if key else str(k)))
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) and "name" in v for v in value):
        out = {}
        for v in value:
            out.update(_flatten(v, f"{key}.{v['name']}"))
        return out
    return {key: value}


def resume_changes(saved: dict | None, now: dict, fixed: tuple[str, ...], free: tuple[str, ...] = ()) -> list[str]:
    """The config keys (dotted) that differ between a checkpoint's config and the resuming
    one, as "key: old -> new". A changed key matching a `fixed` pattern (fnmatch, e.g. "merge.teachers.*.k") makes
    the checkpoint another run's, unless it also matches a `free` pattern (a teacher's
    address may move): refused. The others are returned, for the card: a resumed run's card
    must say what the steps before the resume were trained with. `saved` None: a checkpoint
    from before configs were saved in it; nothing to compare."""
    if saved is None:
        return []
    a, b = _flatten(saved), _flatten(now)
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k, "(unset)") != b.get(k, "(unset)"))
    clash = [k for k in changed if any(fnmatch.fnmatchcase(k, p) for p in fixed)
             and not any(fnmatch.fnmatchcase(k, p) for p in free)]
    if clash:
        shown = ", ".join(f"{k}: {a.get(k, '(unset)')!r} -> {b.get(k, '(unset)')!r}" for k in clash[:6])
        raise CheckpointError(f"--resume: the checkpoint was trained with other settings that define the run "
                              f"({shown}{', ...' if len(clash) > 6 else ''}); a resumed run continues the "
                              f"same objective. Restore them, or start a new run (--overwrite or another "
                              f"out_dir) from the checkpoint's model/")
    return [f"{k}: {a.get(k, '(unset)')!r} -> {b.get(k, '(unset)')!r}" for k in changed]


def load_optimizer_blob(path: Path) -> dict:
    """A checkpoint's optimizer.pt: {"optimizer", "scheduler", "rng"} (tensors and plain values)."""
    try:   # tensors and plain containers only: unpickling could run code
        return torch.load(path / "optimizer.pt", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path / 'optimizer.pt'} holds more than tensors and plain values (written by "
                              f"an older version of opd, or not by opd): {str(e)[:200]}") from None


def load_checkpoint(path: str | Path, *, model, optimizer=None, scheduler=None, restore_rng: bool = True) -> dict:
    """Load weights, optimizer, scheduler and RNG from `path`; return state.json's dict."""
    path = Path(path)
    if not (path / "state.json").is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no state.json)")
    weights = load_file(str(path / "trainable.safetensors"))
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in weights]
    unknown = [n for n in weights if n not in params]
    if missing or unknown:
        raise CheckpointError(f"{path}: checkpoint does not fit the model "
                              f"(missing {missing[:3]}, unexpected {unknown[:3]})")
    with torch.no_grad():
        for n, w in weights.items():
            params[n].copy_(w)
    blob = load_optimizer_blob(path)
    if optimizer is not None and blob["optimizer"] is not None:
        optimizer.load_state_dict(blob["optimizer"])
    if scheduler is not None and blob["scheduler"] is not None:
        scheduler.load_state_dict(blob["scheduler"])
    if restore_rng:
        set_rng_state(blob["rng"])
    return json.loads((path / "state.json").read_text())


def save_final_model(model, tokenizer, target: str | Path) -> Path:
    """A full, loadable model directory with its tokenizer (a peft LoRA adapter is merged in),
    ready for `opd serve-teacher --model`, `opd validate` or the next stage of the recipe."""
    target = Path(target)
    if hasattr(model, "merge_and_unload"):  # peft: merge a copy, keep training weights untouched
        model = copy.deepcopy(model).merge_and_unload()
    model.save_pretrained(str(target), safe_serialization=True)
    tokenizer.save_pretrained(str(target))
    return target
