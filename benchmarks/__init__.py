"""`opd bench`: benchmarks, one module per subject, each writing JSON rows and a table.

    opd bench kernels    fused distillation losses vs the naive reference (and Liger)
    opd bench transport  teacher transport vs bare ZeroMQ and HTTP/JSON
    opd bench step       one on-policy distillation step vs TRL's GKDTrainer
    opd bench grpo       GRPO's token log-probs + entropy + backward, with and without [B, T, V]
    opd bench staleness  opd train's steps/s: on-policy, pipelined, rollouts up to K steps ahead
    opd bench recipes    GRPO, offline distillation, OPD and OPD + reward: accuracy against CPU-s
    opd bench self-distill  a self teacher shown the answer vs SFT on it, held-out accuracy
    opd bench long       every recipe on answers 16 to 256 tokens long: CPU-s to 80 % of the teacher
    opd bench sampled-noise  the sampled-token update against the exact reverse KL: bias and noise
    opd bench store      a teacher logit store: bytes per token; replay steps/s against a live teacher
    opd bench store-quality  on-policy OPD against replayed stores: held-out divergence, accuracy
    opd bench all        the three, plus runs/bench/summary.md

Benchmarks are not tests: they report numbers, they do not assert them.
"""

from __future__ import annotations

import argparse
import importlib

SUBJECTS = {
    "kernels": ("opd.benchmarks.kernels", "distillation loss kernels: peak extra memory and median time"),
    "transport": ("opd.benchmarks.transport", "teacher transport: positions/s vs bare ZeroMQ and HTTP/JSON"),
    "step": ("opd.benchmarks.step", "one OPD training step vs TRL GKDTrainer (lmbda=1)"),
    "grpo": ("opd.benchmarks.grpo", "GRPO token log-probs + entropy + backward: [B, T, V] logits vs chunked"),
    "staleness": ("opd.benchmarks.staleness", "opd train steps/s: on-policy, run.pipeline, run.max_staleness 0 "
                                              "and 2"),
    "recipes": ("opd.benchmarks.recipes", ("held-out accuracy against CPU-s and tokens: GRPO, offline "
                                           "distillation, OPD (sampled, top-k), OPD + reward, from the demo")),
    "self-distill": ("opd.benchmarks.self_distill", ("self-distillation, the answer in the teacher's context, "
                                                     "against SFT on the answers: held-out accuracy")),
    "long": ("opd.benchmarks.long_horizon", ("long generations (opd.tiny.chain, 16-256 tokens): offline "
                                             "distillation, OPD, GRPO, TRL, accuracy against CPU-s")),
    "sampled-noise": ("opd.benchmarks.sampled_noise", ("one batch's sampled-token update against the exact "
                                                       "reverse KL's: bias, cosine, signal-to-noise")),
    "store": ("opd.benchmarks.store", ("a teacher logit store: bytes per token, and replay steps/s against a live "
                                       "teacher (stored sequences, on-policy)")),
    "store-quality": ("opd.benchmarks.store_quality", ("held-out divergence (and chain-task accuracy) after the same "
                                                       "steps: on-policy OPD against replayed stores")),
    "all": ("opd.benchmarks.all", "run kernels, transport and step and write summary.md"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="subject", metavar="SUBJECT", required=True)
    for name, (module, help_) in SUBJECTS.items():
        p = sub.add_parser(name, help=help_, description=help_,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_bench_module=module)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(args._bench_module).run(args) or 0)


def standalone(module, argv: list[str] | None = None) -> int:
    """`python -m opd.benchmarks.X [ARGS]`: subject X's own parser and run, as `opd bench X` runs them."""
    p = argparse.ArgumentParser(prog=f"python -m {module.__spec__.name}", description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(p)
    return int(module.run(p.parse_args(argv)) or 0)
