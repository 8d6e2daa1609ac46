"""`opd bench sampled-noise`: what one batch's sampled-token update is worth, through `opd train`.

Two trainers on one teacher server and one student: `mode: sampled` (with --baseline and
--gamma) and `mode: full, beta: 1`, the exact per-position reverse KL. Each of --batches
on-policy batches is sampled once (`Trainer._sample_batch`) and both trainers compute their
gradient on it (`_submit`, `_train_batch`: trimming, row weights, the baseline, temperature).
Reported:

    ratio         |mean difference|^2 / its summed squared standard error: about 1 when the
                  sampled update is unbiased for the exact one (gamma 0), far above when not
    cosine        of the two mean updates, and of one batch's two updates (mean over batches)
    squared SNR   |mean update|^2 / the summed per-coordinate variance of one batch's update,
                  for each trainer: how much of a batch's update is signal

    opd bench sampled-noise --student runs/demo/sft_base/model --teacher runs/demo/rl_math/model \\
        --prompts runs/demo/data/math_train.jsonl [--batches 300] [--baseline batch] [--gamma 0]

Benchmarks report numbers; they do not assert them (tests/distill/test_sampled_gradient.py does).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

from opd.benchmarks import standalone


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--student", required=True, help="the student's model directory")
    p.add_argument("--teacher", required=True, help="the teacher's model directory (served here by opd serve-teacher)")
    p.add_argument("--prompts", required=True, help="JSONL with `prompt`: what the student answers")
    p.add_argument("--batches", type=int, default=300, help="on-policy batches")
    p.add_argument("--prompts-per-step", type=int, default=32, help="sequences per batch (one sample per prompt)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="response length limit")
    p.add_argument("--baseline", choices=["batch", "none"], default="batch", help="the sampled teacher's baseline")
    p.add_argument("--gamma", type=float, default=0.0, help="the sampled teacher's discount")
    p.add_argument("--temperature", type=float, default=1.0, help="rollout and teacher temperature")
    p.add_argument("--json", type=Path, default=None, help="also write the row here")
    p.add_argument("--positions", type=int, default=0,
                   help="instead: at this many sampled positions, the exact variance of the estimate's logit "
                        "gradient under the student's own distribution, for the plain form, a batch-mean baseline, "
                        "the exact KL as baseline and the estimate clipped to [-2, 2]")


def _trainer(args, server, root: Path, name: str, mode: str):
    from opd.config import from_dict
    from opd.distill.config import TrainConfig
    from opd.distill.trainer import Trainer

    extra = {"baseline": args.baseline, "gamma": args.gamma} if mode == "sampled" else {"beta": 1.0}
    cfg = from_dict({
        "student": {"path": args.student},
        "merge": {"teachers": [{"name": "t", "address": server.address, "mode": mode, "k": 8,
                                "temperature": args.temperature, **extra}],
                  "datasets": [{"domain": "d", "path": args.prompts}]},
        "rollout": {"prompts_per_step": args.prompts_per_step, "max_new_tokens": args.max_new_tokens,
                    "temperature": args.temperature},
        "optim": {"micro_batch_size": args.prompts_per_step},
        "run": {"steps": 1, "out_dir": str(root / name), "progress": False, "tensorboard": False, "pipeline": False},
    }, TrainConfig)
    tr = Trainer(cfg, overwrite=True)
    tr.setup()
    return tr


def _gradient(tr, batch):
    """The gradient [P] (fp64) that `opd train` accumulates for `batch`, sent afresh."""
    import torch
    from opd.distill.stats import StepStats

    tr.optimizer.zero_grad(set_to_none=True)
    b = copy.copy(batch)
    b.futures, b.members = {}, {}
    tr._submit(b)
    tr._train_batch(b, StepStats(), 1.0)
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in tr.params]).double()


def per_position(args) -> dict:
    """Per-position squared SNR of the logit gradient of each form of the estimate, computed
    exactly over the student's distribution (no sampling noise in the figures themselves), at
    positions the student reaches by sampling its answers to the prompts (one a prompt step)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.data import load_jsonl

    student = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(args.student)
    torch.manual_seed(0)
    positions = []
    with torch.no_grad():
        for sample in load_jsonl(args.prompts)[0]:
            ids = torch.tensor([tok(sample.prompt, add_special_tokens=False)["input_ids"]])
            for _ in range(args.max_new_tokens):
                lp = torch.log_softmax(student(ids).logits[0, -1], -1)
                positions.append((lp, torch.log_softmax(teacher(ids).logits[0, -1], -1)))
                x = int(torch.multinomial(lp.exp(), 1))
                ids = torch.cat([ids, torch.tensor([[x]])], 1)
                if x == tok.eos_token_id or len(positions) >= args.positions:
                    break
            if len(positions) >= args.positions:
                break
    mean_kl = sum(float((lp.exp() * (lp - lq)).sum()) for lp, lq in positions) / len(positions)
    mean_ce = sum(float((lp.exp() * -lq).sum()) for lp, lq in positions) / len(positions)
    # Each form: (an exact logit gradient it adds, the sampled token's weight on grad log pi).
    # entropy_exact_*: the student's half of the KL, -H(pi), taken exactly from its own logits,
    # and only the cross-entropy -log q(x) sampled (plain, or less its batch mean).
    # neg_h: d(-H(pi)) / d logits at the position, exact.
    forms = {"plain": lambda est, kl, lq, neg_h: (0.0, est),
             "batch_mean_baseline": lambda est, kl, lq, neg_h: (0.0, est - mean_kl),
             "exact_kl_baseline": lambda est, kl, lq, neg_h: (0.0, est - kl),
             "clipped_2": lambda est, kl, lq, neg_h: (0.0, est.clamp(-2, 2)),
             "entropy_exact": lambda est, kl, lq, neg_h: (neg_h, -lq),
             "entropy_exact_batch_mean_baseline": lambda est, kl, lq, neg_h: (neg_h, -lq - mean_ce)}
    out = {k: [0.0, 0.0] for k in forms}   # summed variance, summed squared bias
    signal = 0.0
    for lp, lq in positions:
        p, est = lp.exp(), lp - lq
        kl = float((p * est).sum())
        exact = p * (est - kl)                                # d KL / d logits
        eye = torch.eye(len(p))
        neg_h = p * (lp - (p * lp).sum())
        signal += float((exact ** 2).sum())
        for k, form in forms.items():
            det, weight = form(est, kl, lq, neg_h)
            g = det + weight[:, None] * (eye - p[None, :])    # the update's logit gradient if x is drawn
            m = (p[:, None] * g).sum(0)
            out[k][0] += float((p * ((g - m) ** 2).sum(1)).sum())
            out[k][1] += float(((m - exact) ** 2).sum())
    return {"positions": len(positions), "mean_kl": mean_kl,
            **{k: {"squared_snr": signal / v, "squared_bias_over_signal": b / signal} for k, (v, b) in out.items()}}


def run(args: argparse.Namespace) -> int:
    import torch
    from opd.teachers.launch import start_server_process

    torch.set_num_threads(1)
    if args.positions:
        row = per_position(args)
        print(json.dumps(row, indent=1), flush=True)
        if args.json:
            args.json.write_text(json.dumps(row, indent=1))
        return 0
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp, \
            start_server_process(["--model", args.teacher, "--max-k", "16", "--name", "t"]) as server:
        sampled, full = (_trainer(args, server, Path(tmp), n, m) for n, m in (("s", "sampled"), ("f", "full")))
        try:
            n, sums, cos_batch = args.batches, {}, 0.0
            for _ in range(n):
                batch = sampled._sample_batch()
                s, f = _gradient(sampled, batch), _gradient(full, batch)
                for k, v in (("s", s), ("f", f), ("d", s - f), ("s2", s * s), ("f2", f * f), ("d2", (s - f) ** 2)):
                    sums[k] = sums.get(k, 0.0) + v
                cos_batch += float(s @ f / (s.norm() * f.norm()))
        finally:
            sampled.close()
            full.close()
    mean = {k: sums[k] / n for k in ("s", "f", "d")}
    var = {k: (sums[k + "2"] / n - mean[k] ** 2) * n / (n - 1) for k in ("s", "f", "d")}   # per coordinate
    signal = float(mean["f"].norm() ** 2)
    row = {"batches": n, "baseline": args.baseline, "gamma": args.gamma, "temperature": args.temperature,
           "ratio": float(mean["d"].norm() ** 2 / (var["d"].sum() / n)),
           "cosine_of_means": float(mean["s"] @ mean["f"] / (mean["s"].norm() * mean["f"].norm())),
           "cosine_per_batch": cos_batch / n,
           "squared_snr_sampled": signal / float(var["s"].sum()), "squared_snr_exact": signal / float(var["f"].sum()),
           "wall_s": time.time() - t0}
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(row, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    return standalone(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
