"""How often one `opd train` step crosses a folder boundary of this repository, traced.

    python scripts/step_crossings.py [--list]

A tiny student and teacher (opd.tiny), a teacher server, and `Trainer.step` run twice
(`run.pipeline: false`, so the step's own thread samples, submits, trains and steps the
optimizer); the second step is traced with `sys.setprofile` on that thread. A crossing is a
call whose callee's folder (opd/distill, opd/spine, teachers, kernels, ...) is not its
caller's, the caller being the nearest frame in this repository (a call through torch, e.g. a
module's forward, counts from the project frame that made it). Each distinct call site
(caller file:line -> callee file:function) counts once, however often the loop repeats it.
docs/architecture.md gives the count for this tree and for the tree issue 45 counted.

The script only uses APIs both trees have, so it runs on an older checkout too:
`git worktree add /tmp/old REV && cd /tmp/old && python /path/to/step_crossings.py`.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path.cwd().resolve()
FOLDERS = ("opd", "teachers", "kernels", "routing", "rl", "rewards", "agent")


def folder(filename: str) -> str | None:
    """The repository folder of a source file (opd/distill, teachers, ...), None outside it."""
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    if not rel.parts or rel.parts[0] not in FOLDERS:
        return None
    return rel.parent.as_posix()


def trace_step(step) -> collections.Counter:
    """{(caller site, callee): times} of the calls `step()` makes across folders."""
    sites: collections.Counter = collections.Counter()
    cache: dict[str, str | None] = {}

    def where(code) -> str | None:
        f = code.co_filename
        if f not in cache:
            cache[f] = folder(f)
        return cache[f]

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = where(frame.f_code)
        if callee is None:
            return
        caller = frame.f_back
        while caller is not None and where(caller.f_code) is None:
            caller = caller.f_back
        if caller is None:
            return
        if where(caller.f_code) != callee:
            rel = lambda c: Path(c.co_filename).resolve().relative_to(ROOT).as_posix()   # noqa: E731
            sites[(f"{rel(caller.f_code)}:{caller.f_lineno}", f"{rel(frame.f_code)}:{frame.f_code.co_name}")] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return sites


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="print every crossing call site")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from opd.config import from_dict
    from opd.data import write_jsonl
    from opd.distill.config import TrainConfig
    from opd.distill.trainer import Trainer
    from opd.teachers.launch import start_server_process
    from opd.tiny import build_tiny_model, perturb_model

    if folder(sys.modules[Trainer.__module__].__file__) is None:
        p.error(f"opd is imported from {sys.modules[Trainer.__module__].__file__}, not from {ROOT}: run from the tree's root")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        student = build_tiny_model(tmp / "student", seed=0)
        teacher = perturb_model(student, tmp / "teacher", scale=1.0, seed=1)
        write_jsonl(tmp / "train.jsonl", [{"prompt": f"{i}+1="} for i in range(64)])
        server = start_server_process(["--model", str(teacher), "--max-k", "16", "--name", "t"])
        try:
            cfg = from_dict({
                "student": {"path": str(student)},
                "merge": {"teachers": [{"name": "t", "address": server.address, "mode": "topk", "k": 8}],
                          "datasets": [{"domain": "d", "path": str(tmp / "train.jsonl")}]},
                "rollout": {"prompts_per_step": 4, "max_new_tokens": 8},
                "run": {"steps": 3, "out_dir": str(tmp / "run"), "progress": False, "tensorboard": False,
                        "pipeline": False},
            }, TrainConfig)
            tr = Trainer(cfg, overwrite=True)
            try:
                tr.setup()
                tr.step()                      # the first step: lazy imports and caches out of the way
                sites = trace_step(tr.step)
            finally:
                tr.close()
        finally:
            server.stop()
    into = collections.Counter(callee.rsplit("/", 1)[0] for _, callee in sites)
    print(f"folder crossings in one opd train step: {len(sites)} call sites "
          f"({sum(sites.values())} calls); by the folder entered: "
          + ", ".join(f"{k} {v}" for k, v in into.most_common()))
    if args.list:
        for (caller, callee), n in sorted(sites.items()):
            print(f"  {caller} -> {callee}" + (f"  x{n}" if n > 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
