"""A run directory, the same for every loop: claimed, resumed, checkpointed, finished.

    RUN/metrics.jsonl   one JSON line per logged step (opd.metrics), TensorBoard in RUN/tb
    RUN/checkpoints/    step_NNNNNN/ written atomically every run.checkpoint_every steps and at
                        the end (opd.checkpoint); `--resume` continues from the newest
    RUN/plots/*.png     the metrics over steps, at the end
    RUN/model/          the trained model as a loadable directory (a LoRA adapter merged in)
    RUN/card.md, .json  every setting that changes the result (each loop writes its facts)

`RunDir` does what all three loops did alike: refuse a fresh run into a directory that holds
one (unless --overwrite), find the checkpoint --resume continues and refuse it when a setting
that defines the objective changed (the loop's `fixed` keys; the rest are listed for the card),
restore weights, optimizer, schedule and random state, and save them again.

With a model sharded over several ranks (opd.spine.dist) every method is called on every
rank: rank 0 makes the checks and writes the files, checkpoints are sharded
(opd.spine.shards), and the final model is gathered to rank 0 and written whole.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from opd.checkpoint import (CheckpointError, claim_run_dir, latest_checkpoint, load_checkpoint, resume_changes,
                            save_checkpoint)
from opd.metrics import MetricsLogger, plot_metrics
from opd.spine.dist import World, is_sharded
from opd.spine.model import export_model
from opd.spine.optim import align_schedule
from opd.spine.shards import is_sharded_checkpoint, load_sharded, load_whole_into_shards, save_sharded


class RunDir:
    def __init__(self, out: str | Path, config: dict, *, resume: bool | str | Path | None = None,
                 overwrite: bool = False, fixed: tuple[str, ...] = (), free: tuple[str, ...] = (),
                 view: Callable[[dict], dict] = lambda config: config, hint: str = "", world: World = World()):
        """config: the run's config as a plain dict (opd.config.to_dict), saved in every checkpoint.
        resume: True for the newest checkpoint under OUT/checkpoints, or a checkpoint directory
        (or a checkpoints/ folder); None/False for a fresh run. fixed / free: fnmatch patterns of
        the keys a resumed run must keep / may change anyway (opd.checkpoint.resume_changes), as
        they appear in `view(config)` (e.g. a list keyed by its entries' labels).
        hint: what the "no checkpoint" error adds (e.g. the key that writes them).
        world: the ranks of a sharded run (rank 0 checks and writes)."""
        self.out = Path(out)
        self.config = config
        self.checkpoints = self.out / "checkpoints"
        self.world = world

        def claim():
            claim_run_dir(self.out, resume=bool(resume), overwrite=overwrite)
            found, changed = None, []
            if resume:
                found = self._find(resume, hint)
                saved = json.loads((found / "state.json").read_text()).get("config")
                changed = None if saved is None else resume_changes(view(saved), view(config), fixed, free)
            self.out.mkdir(parents=True, exist_ok=True)
            return found, changed

        self.resume_from: Path | None
        self.changed: list[str] | None   # keys changed since the checkpoint; None: it saved no config
        self.resume_from, self.changed = world.main_first(claim)

    def _find(self, resume, hint: str) -> Path:
        ckpt = Path(resume) if not isinstance(resume, bool) else latest_checkpoint(self.checkpoints)
        if ckpt is not None and ckpt.name == "checkpoints":
            ckpt = latest_checkpoint(ckpt)
        if ckpt is None or not (ckpt / "state.json").is_file():
            raise CheckpointError(f"--resume: no complete checkpoint under {self.checkpoints}{hint}")
        return ckpt

    def restore(self, model, optimizer=None, scheduler=None) -> dict:
        """Load the resumed checkpoint into the model, optimizer, schedule and random generators;
        its state.json as a dict ({} for a fresh run). The schedule gives the resumed step the
        rate this run's schedule has there (`align_schedule`), also for a checkpoint that holds
        no schedule (it is then placed at the checkpoint's step)."""
        if self.resume_from is None:
            return {}
        if is_sharded_checkpoint(self.resume_from):
            state = load_sharded(self.resume_from, model=model, optimizer=optimizer, scheduler=scheduler,
                                 world=self.world)
        elif is_sharded(model):   # written by one process: rank 0 reads it, the others receive their shards
            state = load_whole_into_shards(self.resume_from, model=model, optimizer=optimizer, scheduler=scheduler,
                                           world=self.world)
        else:
            state = load_checkpoint(self.resume_from, model=model, optimizer=optimizer, scheduler=scheduler)
        if scheduler is not None:
            if scheduler.last_epoch == 0:   # a checkpoint without a schedule (`opd sft` wrote none before)
                scheduler.last_epoch = int(state["step"])
            align_schedule(scheduler)
        return state

    def save(self, step: int, model, optimizer=None, scheduler=None, *, state: dict, keep: int) -> Path:
        """Checkpoint `step` (atomic; the newest `keep` are kept) with `state` and the config."""
        state = {**state, "config": self.config}
        if is_sharded(model):
            return save_sharded(self.checkpoints, step, model=model, optimizer=optimizer, scheduler=scheduler,
                                state=state, keep=keep, world=self.world)
        return save_checkpoint(self.checkpoints, step, model=model, optimizer=optimizer, scheduler=scheduler,
                               state=state, keep=keep)

    def metrics(self, *, tensorboard: bool = True) -> MetricsLogger:
        """The metrics log (rank 0's; the other ranks' logs write nothing): a resumed run drops
        the lines past its checkpoint's step."""
        if not self.world.main:
            return _Silent()
        step = None
        if self.resume_from is not None:
            step = int(json.loads((self.resume_from / "state.json").read_text())["step"])
        return MetricsLogger(self.out, tensorboard=tensorboard, resume_step=step)

    def write_samples(self, step: int, rows: list[dict], n: int) -> Path | None:
        """RUN/samples/step_N.md: the first `n` held-out answers of an evaluation, each a dict of
        prompt, answer and what was measured of it (score, domain, ...), for a person to read:
        a number that rises while the answers read wrong is the first sign of reward hacking."""
        if n <= 0 or not rows:
            return None
        path = self.out / "samples" / f"step_{step:06d}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [f"# Held-out answers at step {step}", ""]
        for i, r in enumerate(rows[:n]):
            facts = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                              if k not in ("prompt", "answer") and v is not None)
            lines += [f"## {i + 1}" + (f" ({facts})" if facts else ""), "", "prompt:", "", "```", str(r["prompt"]),
                      "```", "", "answer:", "", "```", str(r["answer"]), "```", ""]
        path.write_text("\n".join(lines))
        return path

    def finish(self, model, tokenizer, plots: dict[str, list[str]], model_cfg) -> Path:
        """RUN/model (LoRA merged in, with the tokenizer) and RUN/plots; returns RUN/model.
        model_cfg: the run's ModelConfig (a sharded model is rebuilt whole from it on rank 0)."""
        target = export_model(model, tokenizer, model_cfg, self.out / "model", self.world)
        if self.world.main:
            plot_metrics(self.out, plots)
        return target


class _Silent(MetricsLogger):
    """The metrics log of a rank other than 0: it takes every line and writes none."""

    def __init__(self):
        pass

    def log(self, step: int, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass
