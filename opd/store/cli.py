"""`opd store CONFIG.yaml`: score a set of sequences once with a teacher server and write them
as a teacher logit store (opd.store), which `opd train` with `store:` trains against."""

from __future__ import annotations

import argparse
from pathlib import Path

from opd.config import config_arguments, config_from_args
from opd.store.config import StoreConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config_arguments(parser, StoreConfig, "store", "configs/store.yaml", about=(
        "Scores sequences once with a teacher server (a running `opd serve-teacher`, or teacher.model served for "
        "the run) and writes, per response token, the teacher's top-k ids (uint16 where the vocabulary allows), "
        "their log-probs (fp16), the exact tail log-mass and the token's log-prob (fp32), one .npz shard per "
        "shard_size sequences, with OUT/manifest.json (teacher and tokenizer fingerprints, k, temperature, V, "
        "dtypes). The sequences: prompt/response JSONL (what `opd generate` writes), or the student's own "
        "rollouts of a prompt file. Run it again after an interruption: it resumes after the last whole shard.\n\n"
        "Train against it with no teacher running: a train config with `store: {path: OUT, k: K}` instead of "
        "`merge` (docs/train.md)."))


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, StoreConfig, "store", "configs/store.yaml")
    if isinstance(cfg, int):
        return cfg
    from opd.store.write import build_store   # torch and the client: only once the config is good
    m = build_store(cfg, Path(args.config).resolve())
    rows = sum(e["rows"] for e in m["shards"])
    size = sum(e["bytes"] for e in m["shards"])
    print(f"store: {m['sequences']} sequences, {rows} answer rows in {len(m['shards'])} shards, "
          f"{size / max(rows, 1):.1f} bytes per response token -> {Path(args.config).resolve().parent / cfg.out}")
    return 0
