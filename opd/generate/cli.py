"""`opd generate CONFIG.yaml`: a teacher's answers to prompts as `opd sft` data (opd.generate)."""

from __future__ import annotations

import argparse
from pathlib import Path

from opd.config import config_from_args, describe
from opd.generate.config import GenerateConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("config", nargs="?", help="generate config YAML (e.g. configs/generate.yaml)")
    parser.add_argument("--describe", action="store_true", help="print every config key with its help and exit")
    parser.add_argument("--overwrite", action="store_true", help="replace `out` (and its card) if it exists")
    parser.epilog = ("Samples a teacher (a local model with the hf or vLLM engine, or an OpenAI-compatible "
                     "endpoint) n times per prompt, keeps what the domain verifier accepts (rejection "
                     "sampling), drops duplicates, and writes JSONL `opd sft` trains on, with OUT.card.md.\n\n"
                     "Config keys (YAML; unknown keys are refused with file:line; relative paths are relative "
                     "to the config file):\n\n" + describe(GenerateConfig, "  "))


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
