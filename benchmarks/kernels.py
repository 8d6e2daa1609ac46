"""`opd bench kernels`: distillation losses, forward + backward: extra peak memory and time.

Providers side by side: the naive reference (kernels/reference.py), this project's
implementation (impl="auto": chunked PyTorch on CPU, Triton on CUDA) and, when
`liger_kernel` is importable, Liger-Kernel's JSD / fused linear JSD at the same beta. Liger
is Triton only: on CPU it runs with --quick alone, in Triton's interpreter (a smoke test of
the side-by-side, not a timing); otherwise its CPU rows say "not run".

Every (case, provider) runs in its own subprocess so peak memory is honest: on CPU the
peak RSS is reset after the inputs exist (/proc/self/clear_refs, falling back to
ru_maxrss) and `peak_extra_bytes` = peak RSS during the runs - RSS with only the inputs;
on CUDA it is torch.cuda.max_memory_allocated over the inputs. The gradient itself counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from opd.benchmarks import standalone
from opd.benchmarks.cases import PeakMemory, pick_device, run_case, write_rows
from opd.kernels import TopKTeacher, distill_loss, fused_linear_distill_loss
from opd.kernels.maths import divergence_name

# name -> (fused, teacher kind, beta, N, V, H)
CASES = {
    "kl_full": (False, "full", 0.0, 2048, 152064, 0),
    "jsd_full": (False, "full", 0.5, 2048, 152064, 0),
    "kl_topk": (False, "topk", 0.0, 2048, 152064, 0),
    "fused_kl_full": (True, "full", 0.0, 2048, 152064, 1024),
    "fused_kl_topk": (True, "topk", 0.0, 2048, 152064, 1024),
    # issue 4's GPU target: a Llama-3-8B head (V=128,256, H=4096) over 8192 rows, JSD as Liger
    "fused_jsd_llama": (True, "full", 0.5, 8192, 128256, 4096),
}
QUICK = dict(N=64, V=4096, H=64)
LIGER_ON_CPU = "not run: Liger's Triton kernels need a GPU (on CPU, --quick runs them in Triton's interpreter)"
PLAIN_ONLY = "not run: plain is TRL's loss on full logits, neither fused nor top-k"
TOPK = 64
PROVIDERS = ("reference", "plain", "opd", "liger")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, help="write the rows to this JSON file")
    parser.add_argument("--cases", nargs="+", default=["kl_full", "fused_kl_full"], choices=sorted(CASES),
                        help="cases to run")
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS,
                        help="implementations side by side: reference (kernels/reference.py, -inf-safe PyTorch), "
                             "plain (the loss as TRL's GKDTrainer writes it: log_softmax + kl_div; full teacher, "
                             "not fused), opd (this project's: chunked PyTorch on CPU, Triton on CUDA), liger "
                             "(Liger-Kernel, if installed)")
    parser.add_argument("--quick", action="store_true", help=f"small shapes {QUICK} (smoke test)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype of the student's logits (fused cases: hidden states and LM head) and of a "
                             "full teacher's logits; top-k teacher answers stay float32")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case (median)")
    parser.add_argument("--device", default="auto", help="cpu | cuda | auto")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per (case, provider)")
    parser.add_argument("--fused-blocks", default=None, metavar="BN,BV,BH,WARPS,STAGES",
                        help="CUDA only: launch config of the fused Triton kernels for this run "
                             "instead of opd.kernels.triton_ops.FUSED_CONFIG")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)


def _liger_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("liger_kernel") is not None


def _spec(case: str, quick: bool) -> dict:
    fused, teacher, beta, n, v, h = CASES[case]
    if quick:
        n, v, h = QUICK["N"], QUICK["V"], QUICK["H"] if fused else 0
    return dict(case=case, fused=fused, teacher=teacher, beta=beta, N=n, V=v, H=h)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))), flush=True)
        return 0
    device = pick_device(args.device)
    rows = []
    for case in args.cases:
        for provider in args.providers:
            if provider == "liger" and not _liger_available():
                continue
            spec = dict(_spec(case, args.quick), provider=provider, dtype=args.dtype,
                        repeats=args.repeats, device=device, warmup=args.quick or device == "cuda",
                        fused_blocks=args.fused_blocks if provider == "opd" else None)
            if provider == "liger" and device == "cpu" and not args.quick:
                rows.append(_row(spec, error=LIGER_ON_CPU))
            elif provider == "plain" and (spec["fused"] or spec["teacher"] != "full"):
                rows.append(_row(spec, error=PLAIN_ONLY))
            else:
                rows.append(_in_subprocess(spec, args.timeout))
            _print_row(rows[-1], header=len(rows) == 1)
    write_rows(args.json, rows)
    if not _liger_available() and "liger" in args.providers:
        print("(liger_kernel not importable: Liger rows skipped; pip install 'opd[bench]')")
    return 0


def _in_subprocess(spec: dict, timeout: float) -> dict:
    env = dict(os.environ)
    if spec["provider"] == "liger" and spec["device"] == "cpu":
        env["TRITON_INTERPRET"] = "1"   # Triton has no CPU backend; its interpreter runs tiny shapes
    return run_case("opd.benchmarks.kernels", spec, timeout, _row, env)


def _row(spec: dict, peak: int | None = None, times: list[float] | None = None, error: str | None = None):
    return {"case": spec["case"], "impl": spec["provider"], "divergence": divergence_name(spec["beta"]),
            "teacher": spec["teacher"], "fused": spec["fused"], "N": spec["N"], "V": spec["V"],
            "H": spec["H"], "dtype": spec["dtype"], "device": spec["device"],
            "peak_extra_bytes": peak, "median_ms": statistics.median(times) * 1e3 if times else None,
            "runs": len(times or []), "fused_blocks": spec.get("fused_blocks"), "error": error}


def _print_row(row: dict, header: bool) -> None:
    if header:
        print(f"{'case':<17}{'impl':<11}{'div':<12}{'N':>6}{'V':>8}{'H':>6} {'dtype':<9}"
              f"{'peak extra MB':>14}{'median ms':>11}")
    peak = "-" if row["peak_extra_bytes"] is None else f"{row['peak_extra_bytes'] / 2**20:.0f}"
    ms = "-" if row["median_ms"] is None else f"{row['median_ms']:.1f}"  # GPU rows are a few ms
    print(f"{row['case']:<17}{row['impl']:<11}{row['divergence']:<12}{row['N']:>6}{row['V']:>8}"
          f"{row['H']:>6} {row['dtype']:<9}{peak:>14}{ms:>11}" + (f"  {row['error']}" if row["error"] else "")
          + (f"  blocks {row['fused_blocks']}" if row.get("fused_blocks") else ""),
          flush=True)


# ---- worker (one subprocess per case and provider) -------------------------------------

def _inputs(spec: dict, torch, device):
    """Inputs built in place (no temporaries), so the baseline RSS is the inputs only."""
    g = torch.Generator(device="cpu").manual_seed(0)
    dtype = getattr(torch, spec["dtype"])
    n, v, h = spec["N"], spec["V"], spec["H"]

    def randn(*shape, scale=1.0):
        t = torch.empty(*shape, dtype=torch.float32)
        t.normal_(generator=g).mul_(scale)
        return t.to(device=device, dtype=dtype) if (dtype != torch.float32 or device != "cpu") else t

    inputs = {}
    if spec["fused"]:
        inputs["hidden"], inputs["weight"] = randn(n, h), randn(v, h, scale=h ** -0.5)
        if spec["provider"] == "liger":
            inputs["teacher_hidden"], inputs["teacher_weight"] = randn(n, h), randn(v, h, scale=h ** -0.5)
    else:
        inputs["student"] = randn(n, v, scale=2.0)
    if spec["teacher"] == "full":
        if not (spec["fused"] and spec["provider"] == "liger"):
            inputs["teacher"] = randn(n, v, scale=2.0)
    else:
        step = v // TOPK
        offsets = torch.randint(0, step, (n, 1), generator=g)
        ids = (offsets + torch.arange(TOPK) * step).to(device)                 # distinct per row
        lp = torch.log_softmax(torch.randn(n, TOPK + 1, generator=g) * 3, -1).to(device)
        inputs["teacher"] = TopKTeacher(ids, lp[:, :TOPK].contiguous(), lp[:, TOPK].contiguous())
    return inputs


def _step_fn(spec: dict, inputs: dict, torch):
    impl = "reference" if spec["provider"] == "reference" else "auto"
    beta = spec["beta"]
    leaves = [inputs["hidden"], inputs["weight"]] if spec["fused"] else [inputs["student"]]
    for t in leaves:
        t.requires_grad_(True)
    if spec["provider"] == "liger":
        return _liger_step(spec, inputs, leaves, torch)
    if spec["provider"] == "plain":
        return _plain_step(spec, inputs, leaves, torch)

    def step():
        if spec["fused"]:
            loss = fused_linear_distill_loss(inputs["hidden"], inputs["weight"], inputs["teacher"],
                                             beta=beta, impl=impl)
        else:
            loss = distill_loss(inputs["student"], inputs["teacher"], beta=beta, impl=impl)
        loss.backward()
    return step, leaves


def _plain_step(spec, inputs, leaves, torch):
    """The plainest loss: TRL's GKDTrainer.generalized_jsd_loss (log_softmax of both, then kl_div,
    the mixture for 0 < beta < 1), mean over rows. The reference adds -inf guards on top."""
    if spec["fused"] or spec["teacher"] != "full":
        raise SystemExit(PLAIN_ONLY)
    import math

    F, beta = torch.nn.functional, spec["beta"]

    def step():
        log_s = F.log_softmax(inputs["student"].float(), -1)
        log_t = F.log_softmax(inputs["teacher"].float(), -1)
        if beta == 0.0:
            loss = F.kl_div(log_s, log_t, reduction="none", log_target=True)
        elif beta == 1.0:
            loss = F.kl_div(log_t, log_s, reduction="none", log_target=True)
        else:
            log_m = torch.logsumexp(torch.stack([log_s + math.log(1 - beta), log_t + math.log(beta)]), 0)
            loss = beta * F.kl_div(log_m, log_t, reduction="none", log_target=True) + \
                (1 - beta) * F.kl_div(log_m, log_s, reduction="none", log_target=True)
        (loss.sum() / loss.shape[0]).backward()
    return step, leaves


def _liger_step(spec, inputs, leaves, torch):
    if spec["teacher"] != "full":
        raise SystemExit("liger has no top-k teacher loss")
    # Liger's beta is ours (0 forward KL(T || S), 1 reverse KL, JSD between), both ends exact.
    if spec["fused"]:
        from liger_kernel.transformers import LigerFusedLinearJSD
        loss_fn = LigerFusedLinearJSD(jsd_beta=spec["beta"])

        def step():
            loss_fn(inputs["hidden"], inputs["weight"], inputs["teacher_hidden"], inputs["teacher_weight"],
                    None).backward()   # shift_labels: none, every row counts
        return step, leaves
    from liger_kernel.transformers import LigerJSD
    loss_fn = LigerJSD(beta=spec["beta"])

    def step():
        log_s = torch.log_softmax(inputs["student"].float(), -1)
        log_t = torch.log_softmax(inputs["teacher"].float(), -1)
        loss_fn(log_s, log_t).backward()
    return step, leaves


def _worker(spec: dict) -> dict:
    import torch
    device = torch.device(spec["device"])
    if spec.get("fused_blocks") and device.type == "cuda":   # only opd rows carry it
        from opd.kernels import triton_ops
        bn, bv, bh, warps, stages = (int(v) for v in spec["fused_blocks"].split(","))
        triton_ops.FUSED_CONFIG = dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_H=bh, num_warps=warps, num_stages=stages)
    inputs = _inputs(spec, torch, device)
    step, leaves = _step_fn(spec, inputs, torch)
    cuda = device.type == "cuda"
    memory = PeakMemory(torch, device)
    times = []
    if spec.get("warmup"):   # quick shapes, or CUDA (Triton compiles on the first call)
        step()
    for _ in range(max(1, spec["repeats"])):
        for t in leaves:
            t.grad = None
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return _row(spec, peak=memory.extra(), times=times)


if __name__ == "__main__":
    sys.exit(standalone(sys.modules[__name__]))
