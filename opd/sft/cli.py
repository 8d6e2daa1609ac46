"""`opd sft CONFIG.yaml`: supervised fine-tuning, the recipe's start point (opd.sft.trainer)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from opd.config import config_arguments, config_from_args
from opd.sft.config import SFTConfig, resolve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config_arguments(parser, SFTConfig, "SFT", "configs/demo/sft_base.yaml")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in run.out_dir from its newest checkpoint (see run.checkpoint_every)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh even if run.out_dir holds an earlier run: delete its metrics, plots, card, "
                             "checkpoints and model first (without it such a run is refused)")


def run(args: argparse.Namespace) -> int:
    if args.config and args.resume and args.overwrite:
        print("opd sft: --resume continues the run in run.out_dir, --overwrite deletes it: pass one", file=sys.stderr)
        return 2
    cfg = config_from_args(args, SFTConfig, "sft", "configs/demo/sft_base.yaml")
    if isinstance(cfg, int):
        return cfg
    cfg_path = Path(args.config).resolve()
    # Imported here, not at the top: see opd.cli (`--help` needs no torch).
    from opd.sft.trainer import train
    from opd.spine.dist import close_world, ranks_for
    ranks = cfg.cluster.student.num_workers
    world = ranks_for(ranks, args._argv, cfg.model.device)
    if world is None:   # the ranks this process started have run
        print(f"sft: model saved to {resolve(cfg_path, cfg.run.out_dir) / 'model'} ({ranks} ranks)")
        return 0
    try:
        model_dir = train(cfg, cfg_path, overwrite=args.overwrite, resume=args.resume, world=world)
    finally:
        close_world()
    if world.main:
        print(f"sft: model saved to {model_dir}")
    return 0
