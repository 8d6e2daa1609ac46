"""`opd train CONFIG.yaml`: on-policy distillation of a student from live teacher servers.

The config (opd/distill/config.py) is checked completely before anything loads; every
teacher is then checked (reachable, same tokenizer as the student) before any compute.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from opd.cluster.cores import share_cores
from opd.cluster.ranks import launcher
from opd.config import ConfigError, describe, positive_int
from opd.distill.config import TrainConfig, load_train_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("config", type=Path, help="YAML train config (see configs/train_single.yaml)")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
                   help="continue from the latest checkpoint under run.out_dir (or the given checkpoint dir); "
                        "the first step after resuming has the loss the uninterrupted run had")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh even if run.out_dir holds an earlier run: delete its checkpoints, metrics, "
                        "plots, card and model first (without it such a run is refused)")
    p.add_argument("--steps", type=positive_int, default=None, help="override run.steps (e.g. to extend a finished run)")
    p.add_argument("--out-dir", type=Path, default=None, help="override run.out_dir")
    p.epilog = ("Config keys (YAML; unknown keys are refused with file:line; relative paths are relative "
                "to the config file):\n\n" + describe(TrainConfig, "  "))


def run(args: argparse.Namespace) -> int:
    if args.resume and args.overwrite:
        print("error: --resume continues the run in run.out_dir, --overwrite deletes it: pass one", file=sys.stderr)
        return 2
    try:
        cfg = load_train_config(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.steps is not None:
        cfg = replace(cfg, run=replace(cfg.run, steps=args.steps))
    if args.out_dir is not None:
        cfg = replace(cfg, run=replace(cfg.run, out_dir=str(args.out_dir)))
    share_cores(cfg.cluster)   # before torch is imported: libgomp reads it once
    # Imported here, not at the top: see opd.cli (`--help` needs no torch).
    from opd.distill.trainer import Trainer
    from opd.spine.dist import close_world, ranks_for
    shards = cfg.cluster.student
    world = ranks_for(shards.num_workers, args._argv, cfg.student.device, shards.backend, shards.collective_timeout_s,
                      launcher(cfg.cluster, cfg.student.device))
    if world is None:   # the ranks this process started have run
        print(f"done: {cfg.run.steps} steps on {shards.num_workers} ranks; run directory {cfg.run.out_dir}")
        return 0
    # A TrainError, DataError, ... is printed as one line by opd.cli, exit 1.
    try:
        result = Trainer(cfg, resume=args.resume, base_dir=Path(args.config).resolve().parent,
                         fork_teachers=True, overwrite=args.overwrite, world=world).run()
    finally:
        close_world()
    if not world.main:
        return 0
    last = result["evals"][-1] if result["evals"] else {}
    kl = f"held-out KL {last['eval/kl']:.4f}" if "eval/kl" in last else "no held-out set (datasets[].eval_path)"
    print(f"done: {result['step']} steps, {kl}; "
          f"run directory {result['out_dir']} (card.md, metrics.jsonl, plots/, checkpoints/)")
    return 0
