"""`opd bench store-quality`: where the students of a stored teacher and of a live one end up.

One student, one teacher server, the same number of steps and sequences a step for each arm:

    on-policy          `opd train` against the live teacher, the student sampling every batch
    replay, student    `opd train` with `store:`, a store of the student's own rollouts at the
                       start (Lightning-OPD's source), n per training prompt
    replay, teacher    the same with a store of the teacher's own samples (the teacher's answers
                       to the prompts, with its distribution at each of their tokens)

Each final model is then measured as `opd probe` measures a student before a run: it answers
held-out prompts (seed fixed, temperature 1) and the teacher scores them; the figure is the
forward KL over {the teacher's top k, tail} per response token, on the model's own answers,
which is what on-policy distillation lowers. Wall seconds include writing the store. The
default models are opd.tiny's: the teacher is the student with a rank-4 change of its LM
head, about 2 nats away and reachable (opd.tiny.lm_head_teacher). `--inputs DIR` takes
`opd bench long`'s prepared chain task instead (its teacher and mid-strength student, the
prompts of `--length`), where each model's greedy accuracy on the 100 held-out starts is
measured too.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from opd.config import from_dict
from opd.data import encode_prompt, load_jsonl, write_jsonl
from opd.distill.config import TrainConfig
from opd.distill.probe import probe
from opd.distill.trainer import Trainer
from opd.rewards import accuracy, verify_batch
from opd.rollout.base import SamplingParams
from opd.rollout.hf import HFRolloutEngine
from opd.spine.config import ModelConfig
from opd.spine.model import load_policy, load_tokenizer
from opd.store.config import StoreConfig
from opd.store.write import build_store
from opd.teachers.launch import start_server_process
from opd.tiny import build_tiny_model, lm_head_teacher


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per arm")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate of every arm")
    p.add_argument("--k", type=int, default=16, help="top-k stored, trained and probed")
    p.add_argument("--n", type=int, default=4, help="stored responses per training prompt")
    p.add_argument("--prompts", type=int, default=32, help="training prompts (and as many held out)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="response length limit")
    p.add_argument("--beta", type=float, default=0.0, help="every arm's divergence: 0 forward KL, 1 reverse")
    p.add_argument("--seed", type=int, default=0, help="run.seed of every arm")
    p.add_argument("--inputs", default=None, help="`opd bench long --prepare-only`'s inputs (prepared.json): the "
                                                  "chain task's teacher, mid student and prompts")
    p.add_argument("--length", type=int, default=64, help="with --inputs: the chain length (16, 64 or 256 tokens)")
    p.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--json", default=None, help="write the rows to this JSON file")


def _train(root: Path, name: str, args, student: str, source: dict) -> tuple[str, float]:
    """(the trained model's directory, wall seconds) of one arm; `source`: its `store` or `merge`."""
    cfg = from_dict({"student": {"path": student}, **source,
                     "rollout": {"prompts_per_step": args.batch, "max_new_tokens": args.max_new_tokens},
                     "optim": {"lr": args.lr, "micro_batch_size": args.batch, "schedule": "constant",
                               "warmup_steps": 5},
                     "run": {"steps": args.steps, "out_dir": str(root / name), "progress": False,
                             "tensorboard": False, "seed": args.seed}}, TrainConfig)
    t0 = time.perf_counter()
    Trainer(cfg, overwrite=True).run()
    return str(root / name / "model"), time.perf_counter() - t0


def _store(root: Path, name: str, args, sampler: str, address: str) -> tuple[Path, float]:
    """A store of `sampler`'s answers to the training prompts, scored by the teacher at `address`."""
    cfg = from_dict({"student": {"path": sampler}, "teacher": {"address": address, "name": "t"},
                     "sequences": {"prompts": str(root / "train.jsonl"), "n": args.n,
                                   "max_new_tokens": args.max_new_tokens, "seed": args.seed},
                     "out": str(root / name), "k": args.k, "shard_size": 64 * args.n}, StoreConfig)
    t0 = time.perf_counter()
    build_store(cfg, root / f"{name}.yaml")
    return root / name, time.perf_counter() - t0


def _accuracy(model: str, samples: list, max_new_tokens: int) -> float:
    """Greedy held-out accuracy: the share of answers the verifier scores 1 (as opd validate)."""
    tok = load_tokenizer(model, "model")
    policy, tok = load_policy(ModelConfig(path=model, device="cpu"), tokenizer=tok, train=False, what="model")
    engine = HFRolloutEngine(policy, tok, batch_size=128)
    rollouts = engine.generate([encode_prompt(tok, s.prompt) for s in samples],
                               SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
    texts = [tok.decode(r.response_ids[:-1] if r.finish_reason == "eos" else r.response_ids, skip_special_tokens=True)
             for r in rollouts]
    return accuracy([v or 0.0 for v in verify_batch(samples, texts)])


def run(args) -> int:
    root = Path(args.out or tempfile.mkdtemp(prefix="opd_bench_store_quality_"))
    root.mkdir(parents=True, exist_ok=True)
    evals = None
    if args.inputs:   # the chain task of `opd bench long`
        prepared = json.loads((Path(args.inputs) / "prepared.json").read_text())
        student, teacher = prepared["models"]["mid"], prepared["models"]["teacher"]
        sets = prepared["sets"][str(args.length)]
        train = [s.prompt for s in load_jsonl(sets["train"])[0][:args.prompts]]
        evals = load_jsonl(sets["eval"])[0]
        held_out = [s.prompt for s in evals]
    else:
        student = str(build_tiny_model(root / "student", seed=0))
        teacher = str(lm_head_teacher(student, root / "teacher"))
        train = [f"q{i}: what is {i}+{i}?" for i in range(args.prompts)]
        held_out = [f"q{i}: what is {i}+{i}?" for i in range(1000, 1000 + args.prompts)]
    write_jsonl(root / "train.jsonl", [{"prompt": p} for p in train])
    server = start_server_process(["--model", teacher, "--max-k", str(max(64, args.k)), "--name", "t"],
                                  env={"TOKENIZERS_PARALLELISM": "false"})
    arms: dict[str, dict] = {}
    try:
        def measure(model: str) -> dict:
            r = probe(model, server.address, held_out, k=args.k, max_new_tokens=args.max_new_tokens, seed=1)
            return {"forward_kl_topk": r["forward_kl_topk"], "reverse_kl_topk": r["reverse_kl_topk"],
                    "mean_response_len": r["mean_response_len"],
                    **({"accuracy": _accuracy(model, evals, args.max_new_tokens)} if evals else {})}

        arms["start"] = {**measure(student), "wall_s": 0.0}
        merge = {"merge": {"teachers": [{"name": "t", "address": server.address, "mode": "topk", "k": args.k,
                                         "beta": args.beta}],
                           "datasets": [{"domain": "gen", "path": str(root / "train.jsonl")}]}}
        model, wall = _train(root, "on_policy", args, student, merge)
        arms["on-policy"] = {**measure(model), "wall_s": wall}
        for name, sampler in (("replay, student", student), ("replay, teacher", teacher)):
            path, store_s = _store(root, f"store_{name.split()[-1]}", args, sampler, server.address)
            model, wall = _train(root, name.replace(", ", "_"), args, student,
                                 {"store": {"path": str(path), "k": args.k, "beta": args.beta}})
            arms[name] = {**measure(model), "wall_s": wall + store_s, "store_s": store_s}
            print(f"[bench store-quality] {name}: {arms[name]}", flush=True)
    finally:
        server.stop()
    print(f"\n{os.cpu_count()} CPUs, OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}; {args.steps} steps x "
          f"{args.batch} sequences, lr {args.lr}, top-{args.k}, beta {args.beta}; stores of {args.prompts} prompts x {args.n}; "
          f"held-out: {len(held_out)} prompts, each model's own answers\n")
    print("| arm | held-out forward KL (top-k) | reverse KL (top-k) | greedy accuracy | wall s (with the store) |\n"
          "|---|---|---|---|---|")
    for name, a in arms.items():
        acc = f"{a['accuracy']:.2f}" if "accuracy" in a else "-"
        print(f"| {name} | {a['forward_kl_topk']:.3f} | {a['reverse_kl_topk']:.3f} | {acc} | {a['wall_s']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "arms": arms}, indent=1))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
