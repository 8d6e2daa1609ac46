"""Smoke test of `opd bench kernels`: one tiny case per kind, in process (no timing asserts)."""

from __future__ import annotations

import pytest

from opd.bench.kernels import _spec, _worker


@pytest.mark.parametrize("case,provider", [("kl_topk", "opd"), ("fused_kl_full", "opd"), ("jsd_full", "reference")])
def test_bench_worker_row(case, provider):
    spec = dict(_spec(case, quick=True), provider=provider, dtype="float32", repeats=1, device="cpu")
    row = _worker(spec)
    assert row["error"] is None and row["runs"] == 1
    assert row["impl"] == provider and row["N"] == 64 and row["V"] == 4096
    assert row["divergence"] == ("jsd" if case == "jsd_full" else "forward_kl")
    assert row["median_ms"] > 0 and row["peak_extra_bytes"] >= 0
