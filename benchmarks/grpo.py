"""`opd bench grpo`: GRPO's per-token log-probs + entropy + backward, with and without [B, T, V].

Two paths over the same stand-in model, the decoder body's output hidden [B, T, H] (a leaf
tensor: the body itself is the same on both sides and left out) and an LM head weight [V, H]:

    before  logits [B, T, V] = hidden @ W.T, then opd.spine.rows.token_logprobs + the entropy
            (opd.spine.terms.entropy), as GRPO did before rl/logprobs.py (on the model's own
            logits, even [B, L, V])
    after   rl/logprobs.py: the mask's N rows of hidden, the fused log-prob kernel
            (rows_logprobs_and_entropy) and the chunked entropy

then the same token-mean policy-gradient loss and its backward to hidden and W. Every response
fills its T positions (N = B x T), so "after" gains nothing from skipping padding.

Each path runs in its own subprocess, so peak memory is honest (as in `opd bench kernels`):
on CPU peak RSS beyond the inputs (/proc/self/clear_refs), on CUDA max_memory_allocated
beyond them. The weight gradient ([V, H], 594 MiB in fp32 at full size) counts on both sides.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from opd.benchmarks import standalone
from opd.benchmarks.cases import PeakMemory, pick_device, run_case, write_rows
from opd.rl import grpo
from opd.rl.logprobs import chunked_entropy, rows_logprobs_and_entropy
from opd.spine import terms
from opd.spine.rows import token_logprobs

FULL = dict(B=8, T=256, V=152064, H=1024)
QUICK = dict(B=2, T=16, V=4096, H=64)
CASES = ("before", "after")
PHASES = ("forward", "backward", "entropy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, help="write the rows to this JSON file")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES,
                        help="before: [B, T, V] logits and token_logprobs + entropy; "
                             "after: rl/logprobs.py's chunked path")
    parser.add_argument("--quick", action="store_true", help=f"small shapes {QUICK} (smoke test); else {FULL}")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype of the hidden states and the LM head (log-probs are fp32 either way)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per case (median)")
    parser.add_argument("--device", default="auto", help="cpu | cuda | auto")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per case")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))), flush=True)
        return 0
    device = pick_device(args.device)
    shape = QUICK if args.quick else FULL
    rows = []
    for case in args.cases:
        spec = dict(shape, case=case, dtype=args.dtype, repeats=args.repeats, device=device,
                    warmup=args.quick or device == "cuda")
        rows.append(_in_subprocess(spec, args.timeout))
        _print_row(rows[-1], header=len(rows) == 1)
    write_rows(args.json, rows)
    return 0


def _in_subprocess(spec: dict, timeout: float) -> dict:
    return run_case("opd.benchmarks.grpo", spec, timeout, _row)


def _row(spec: dict, peak: int | None = None, phases: dict | None = None, error: str | None = None) -> dict:
    phases = phases or {}
    totals = [sum(run) for run in zip(*phases.values())] if phases else []
    return {"case": spec["case"], "B": spec["B"], "T": spec["T"], "N": spec["B"] * spec["T"], "V": spec["V"],
            "H": spec["H"], "dtype": spec["dtype"], "device": spec["device"], "peak_extra_bytes": peak,
            "median_s": statistics.median(totals) if totals else None,
            "phases_s": {k: statistics.median(v) for k, v in phases.items()}, "runs": len(totals), "error": error}


def _print_row(row: dict, header: bool) -> None:
    if header:
        print(f"{'case':<8}{'B x T':>10}{'V':>8}{'H':>6} {'dtype':<9}{'peak extra MiB':>15}{'median s':>10}  phases (s)")
    peak = "-" if row["peak_extra_bytes"] is None else f"{row['peak_extra_bytes'] / 2**20:.0f}"
    secs = "-" if row["median_s"] is None else f"{row['median_s']:.3f}"
    phases = ", ".join(f"{k} {v:.3f}" for k, v in row["phases_s"].items())
    print(f"{row['case']:<8}{row['B']:>4} x {row['T']:<3}{row['V']:>8}{row['H']:>6} {row['dtype']:<9}{peak:>15}"
          f"{secs:>10}  {phases}" + (f"  {row['error']}" if row["error"] else ""), flush=True)


# ---- worker (one subprocess per case) -----------------------------------------------------

def _inputs(spec: dict, torch, device):
    """Inputs built in place (no temporaries), so the baseline RSS is the inputs only."""
    g = torch.Generator(device="cpu").manual_seed(0)
    dtype = getattr(torch, spec["dtype"])
    B, T, V, H = spec["B"], spec["T"], spec["V"], spec["H"]

    def randn(*shape, scale=1.0):
        t = torch.empty(*shape, dtype=torch.float32)
        t.normal_(generator=g).mul_(scale)
        return t.to(device=device, dtype=dtype) if (dtype != torch.float32 or device.type != "cpu") else t

    return dict(hidden_B_T_H=randn(B, T, H).requires_grad_(),
                weight_V_H=randn(V, H, scale=H ** -0.5).requires_grad_(),
                targets_B_T=torch.randint(0, V, (B, T), generator=g).to(device),
                mask_B_T=torch.ones(B, T, device=device),
                adv_B=torch.randn(B, generator=g).to(device))


def _step_fn(spec: dict, inputs: dict, torch):
    """step() -> {phase: seconds}: log-probs (forward), their backward, the entropy."""
    h, w, targets, mask, adv = (inputs[k] for k in ("hidden_B_T_H", "weight_V_H", "targets_B_T", "mask_B_T", "adv_B"))
    sync = torch.cuda.synchronize if h.device.type == "cuda" else (lambda: None)

    b_N, t_N = (mask > 0).nonzero(as_tuple=True)   # the rows, sequence by sequence
    lengths = [int(n) for n in mask.sum(1).tolist()]

    def loss_of(lp_N):   # rl/trainer.py's policy-gradient term at ratio 1, token mean
        return grpo.aggregate(-lp_N * adv[b_N], lengths, "token_mean")

    # The order of rl/trainer.py's update: log-probs, loss.backward(), then the entropy metric
    # (there on the logits the step still holds).
    def before():
        t0 = time.perf_counter()
        logits_B_T_V = h @ w.T
        lp_B_T = token_logprobs(logits_B_T_V, targets)
        sync()
        t1 = time.perf_counter()
        loss_of(lp_B_T[b_N, t_N]).backward()
        sync()
        t2 = time.perf_counter()
        with torch.no_grad():
            ent_B_T = terms.entropy(logits_B_T_V.detach())
        sync()
        del logits_B_T_V, ent_B_T
        return {"forward": t1 - t0, "backward": t2 - t1, "entropy": time.perf_counter() - t2}

    def after():   # rows_logprobs_and_entropy's two parts, timed apart
        t0 = time.perf_counter()
        hidden_N_H = h[b_N, t_N]
        lp_N, _ = rows_logprobs_and_entropy(hidden_N_H, w, targets[b_N, t_N], with_entropy=False)
        sync()
        t1 = time.perf_counter()
        loss_of(lp_N).backward()
        sync()
        t2 = time.perf_counter()
        ent_N = chunked_entropy(hidden_N_H.detach(), w.detach())
        sync()
        del ent_N
        return {"forward": t1 - t0, "backward": t2 - t1, "entropy": time.perf_counter() - t2}

    return before if spec["case"] == "before" else after, [h, w]


def _worker(spec: dict) -> dict:
    import torch
    device = torch.device(spec["device"])
    inputs = _inputs(spec, torch, device)
    step, leaves = _step_fn(spec, inputs, torch)
    memory = PeakMemory(torch, device)
    if spec.get("warmup"):   # quick shapes, or CUDA (Triton compiles on the first call)
        step()
    phases: dict[str, list[float]] = {k: [] for k in PHASES}
    for _ in range(max(1, spec["repeats"])):
        for t in leaves:
            t.grad = None
        for k, v in step().items():
            phases[k].append(v)
    return _row(spec, peak=memory.extra(), phases=phases)


if __name__ == "__main__":
    sys.exit(standalone(sys.modules[__name__]))
