"""`opd rl CONFIG.yaml`: GRPO training of a domain expert against verifiable rewards.

Writes RUN/metrics.jsonl, RUN/plots/, RUN/card.md, RUN/checkpoints/ (resumable) and
RUN/model/ (a full model directory, LoRA merged) that `opd serve-teacher` can load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from opd.cluster.ranks import launcher
from opd.config import ConfigError, describe, load_yaml, near, positive_int
from opd.rl.config import RLConfig


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Option defaults shown, and the config keys (the epilog) printed as written."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="RL config YAML (see configs/rl_math.yaml and the keys below)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in RUN/checkpoints")
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh even if run.out_dir holds an earlier run: delete its checkpoints, metrics, "
                             "plots, card and model first (without it such a run is refused)")
    parser.add_argument("--steps", type=positive_int, default=None, help="override run.steps")
    parser.add_argument("--out", "--out-dir", dest="out", default=None, help="override run.out_dir")
    parser.epilog = "config keys:\n" + describe(RLConfig)
    parser.formatter_class = HelpFormatter


def load_config(path: str, steps: int | None = None, out: str | None = None):
    """Load an RL config; relative paths in it are taken relative to its folder (as in every opd
    config); --steps and --out override (--out relative to the current directory)."""
    cfg = load_yaml(path, RLConfig)
    base = Path(path).resolve().parent
    rewards = [dataclasses.replace(r, path=near(base, r.path)) if r.path else r for r in cfg.rewards]
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, path=near(base, cfg.model.path)),
        data=dataclasses.replace(cfg.data, train=near(base, cfg.data.train), eval=near(base, cfg.data.eval)),
        run=dataclasses.replace(cfg.run, out_dir=near(base, cfg.run.out_dir)), rewards=rewards)
    run = cfg.run
    if steps is not None:
        run = dataclasses.replace(run, steps=steps)
    if out is not None:
        run = dataclasses.replace(run, out_dir=out)
    return dataclasses.replace(cfg, run=run)


def run(args: argparse.Namespace) -> int:
    if args.resume and args.overwrite:
        print("opd rl: --resume continues the run in run.out_dir, --overwrite deletes it: pass one", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.steps, args.out)
    except ConfigError as e:
        print(f"opd rl: {e}", file=sys.stderr)
        return 2
    # Imported here, not at the top: see opd.cli (`--help` needs no torch).
    from opd.rl.trainer import GRPOTrainer
    from opd.spine.dist import close_world, ranks_for
    shards = cfg.cluster.student
    world = ranks_for(shards.num_workers, args._argv, cfg.model.device, shards.backend, shards.collective_timeout_s,
                      launcher(cfg.cluster, cfg.model.device))
    if world is None:   # the ranks this process started have run
        print(f"run folder: {cfg.run.out_dir} (metrics.jsonl, plots/, card.md, model/; {shards.num_workers} ranks)")
        return 0
    # A CheckpointError, DataError, ... is printed as one line by opd.cli, exit 1.
    try:
        trainer = GRPOTrainer(cfg, config_dir=Path(args.config).resolve().parent, resume=args.resume,
                              overwrite=args.overwrite, world=world)
        summary = trainer.train()
    finally:
        close_world()
    if world.main and not world.sharded:
        print(json.dumps(summary, indent=1))
        print(f"run folder: {cfg.run.out_dir} (metrics.jsonl, plots/, card.md, model/)")
    return 0
