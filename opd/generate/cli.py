"""`opd generate CONFIG.yaml`: a teacher's answers to prompts as `opd sft` data (opd.generate)."""

from __future__ import annotations

import argparse
from pathlib import Path

from opd.config import config_arguments, config_from_args
from opd.generate.config import GenerateConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config_arguments(parser, GenerateConfig, "generate", "configs/generate.yaml", about=(
        "Samples a teacher (a local model with the hf or vLLM engine, or an OpenAI-compatible endpoint) n times "
        "per prompt, keeps what the domain verifier accepts (rejection sampling), drops duplicates, and writes "
        "JSONL `opd sft` trains on, with OUT.card.md."))
    parser.add_argument("--overwrite", action="store_true", help="replace `out` (and its card) if it exists")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, GenerateConfig, "generate", "configs/generate.yaml")
    if isinstance(cfg, int):
        return cfg
    cfg_path = Path(args.config).resolve()
    from opd.generate.sample import generate   # torch and the engines: only once the config is good
    card = generate(cfg, cfg_path, overwrite=args.overwrite)
    print(f"generate: {card['rows']} rows of {card['responses_sampled']} sampled -> {card['out']} "
          f"(card: {Path(card['out']).with_suffix('')}.card.md)")
    return 0
