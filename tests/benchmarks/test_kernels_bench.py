"""Smoke test of `opd bench kernels`: one tiny case per kind, in process (no timing asserts),
and its Liger side-by-side checked against our reference under Triton's interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from opd.benchmarks.kernels import _spec, _worker


@pytest.mark.parametrize("case,provider", [("kl_topk", "opd"), ("fused_kl_full", "opd"), ("jsd_full", "reference")])
def test_bench_worker_row(case, provider):
    spec = dict(_spec(case, quick=True), provider=provider, dtype="float32", repeats=1, device="cpu")
    row = _worker(spec)
    assert row["error"] is None and row["runs"] == 1
    assert row["impl"] == provider and row["N"] == 64 and row["V"] == 4096
    assert row["divergence"] == ("jsd" if case == "jsd_full" else "forward_kl")
    assert row["median_ms"] > 0 and row["peak_extra_bytes"] >= 0


@pytest.fixture(scope="module")
def liger_results():
    pytest.importorskip("liger_kernel")   # installed by scripts/setup_env.sh
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "liger_cases.py")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {(r["fused"], r["beta"]): r for r in rows}


@pytest.mark.parametrize("fused", [False, True], ids=["jsd", "fused_linear_jsd"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_liger_side_by_side_computes_our_divergence(liger_results, fused, beta):
    # The bench compares Liger at our beta: same divergence (0 forward KL, 1 reverse KL), same
    # mean over rows. A wrong class name or a beta mapping off by a convention fails here.
    r = liger_results[(fused, beta)]
    assert r["scale"] > 1e-4 and r["max_abs_diff"] < 1e-5 * max(1.0, r["scale"]) + 1e-7, r


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_plain_provider_computes_our_divergence(beta):
    # The plain loss (as TRL's GKDTrainer writes it) must be the same divergence as the
    # reference, or its time and memory would be for another computation.
    import torch

    from opd.benchmarks.kernels import _inputs, _step_fn

    grads = {}
    for provider in ("reference", "plain"):
        spec = dict(_spec("kl_full", quick=True), beta=beta, provider=provider, dtype="float32")
        inputs = _inputs(spec, torch, "cpu")
        step, leaves = _step_fn(spec, inputs, torch)
        step()
        grads[provider] = leaves[0].grad
    assert grads["plain"].abs().max() > 1e-6
    torch.testing.assert_close(grads["plain"], grads["reference"], atol=1e-6, rtol=1e-5)
    with pytest.raises(SystemExit, match="neither fused nor top-k"):
        _step_fn(dict(_spec("kl_topk", quick=True), provider="plain", dtype="float32"), {"student": torch.zeros(1)},
                 torch)


def test_the_plain_provider_is_listed_as_not_run_where_it_does_not_apply(tmp_path):
    # A fused or top-k case has no plain loss: its row says so rather than "exit 1".
    import argparse

    from opd.benchmarks.kernels import PLAIN_ONLY, add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "k.json"
    run(parser.parse_args(["--cases", "fused_kl_full", "kl_topk", "--providers", "plain", "--quick",
                           "--json", str(out)]))
    rows = json.loads(out.read_text())
    assert [(r["case"], r["error"]) for r in rows] == [("fused_kl_full", PLAIN_ONLY), ("kl_topk", PLAIN_ONLY)]
