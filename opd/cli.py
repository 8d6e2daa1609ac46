"""`opd`: one command line, one subcommand per pipeline stage.

Each subcommand lives in its own module, which defines `add_arguments(parser)` and
`run(args) -> int`. The table below is the whole dispatch; a module is imported only
when its command is run (or its `--help` is asked for): `opd --help` imports none. The
training commands (sft, train, rl) import their trainer and opd.spine.dist inside `run()`,
after the config has loaded, so that `--help` and a refused config answer without seconds of
torch, transformers, peft and Ray imports (measured in docs/architecture.md).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "sft": ("opd.sft.cli", "supervised fine-tuning on prompt/response JSONL: the start point of the recipe"),
    "generate": ("opd.generate.cli", "sample a teacher (local model or OpenAI-compatible endpoint) into SFT data: "
                                     "n per prompt, verifier-filtered, deduplicated"),
    "serve-teacher": ("opd.teachers.serve", "serve a frozen teacher model over ZeroMQ (top-k or full-vocabulary answers)"),
    "keys": ("opd.teachers.keys", "generate CURVE key pairs that authenticate and encrypt teacher traffic"),
    "store": ("opd.store.cli", "score sequences once with a teacher server into a teacher logit store that opd train "
                               "replays with no teacher running"),
    "train": ("opd.distill.cli", "on-policy distillation of a student from live teacher servers (single or multi-teacher)"),
    "probe": ("opd.distill.probe", "before a run: initial KL, top-k overlap and tail mass between a student and a teacher"),
    "route": ("opd.routing.cli", "fit or inspect the domain router (text classifier) of a merge config"),
    "rl": ("opd.rl.train", "GRPO training of a domain expert against verifiable rewards"),
    "validate": ("opd.rl.validate", "evaluate checkpoints on held-out verifiable sets (pass@1, pass@k), optional short GRPO"),
    "bench": ("opd.benchmarks", "benchmarks: kernels, transport, step (writes JSON and a table)"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opd",
        description="Distillation-first post-training: SFT start -> GRPO experts -> multi-teacher "
                    "on-policy distillation -> verifier validation.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `opd COMMAND --help` for the options of a command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        if name == only:
            importlib.import_module(module).add_arguments(p)
            p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Import only the module of the command being run (fast startup, no heavy imports for --help).
    only = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only if only in COMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    args._argv = argv   # what a command asked to run on several ranks starts them with
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except KeyboardInterrupt:
        resume = " (--resume continues from its last checkpoint)" if args.command in ("train", "rl", "sft") else ""
        print(f"opd {args.command}: interrupted{resume}", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get("OPD_TRACEBACK") or not _user_error(e):
            raise
        print(f"opd {args.command}: error: {e}", file=sys.stderr)
        return 1


# A user's mistake (a config value, a missing file, an unreachable teacher): the message says
# what and where, so it is printed as one line. Anything else is a bug and keeps its traceback;
# OPD_TRACEBACK=1 shows the traceback of these too.
_FILE_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError, PermissionError)
_USER_ERRORS = {"opd.config": "ConfigError", "opd.data": "DataError", "opd.checkpoint": "CheckpointError",
                "opd.spine.optim": "TrainError", "opd.routing.router": "RoutingError",
                "opd.routing.checks": "TeacherCheckError", "opd.teachers.client": "TeacherError",
                "opd.fingerprint": "ModelDirError", "opd.generate.sample": "EndpointError", "opd.store.shards": "StoreError"}


def _user_error(e: BaseException) -> bool:
    # Only modules already imported can have raised their errors: nothing is imported here.
    return isinstance(e, _FILE_ERRORS) or any(
        isinstance(e, getattr(sys.modules[m], name)) for m, name in _USER_ERRORS.items() if m in sys.modules)


if __name__ == "__main__":
    sys.exit(main())
