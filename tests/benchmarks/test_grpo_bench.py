"""Smoke test of `opd bench grpo`: both paths at --quick shapes, and that they compute the same
log-probs, entropies and gradients (else the comparison would time two different things)."""

from __future__ import annotations

import json

import pytest
import torch

from opd.benchmarks import SUBJECTS
from opd.benchmarks.grpo import CASES, QUICK, _inputs, _step_fn, _worker


def _spec(case: str) -> dict:
    return dict(QUICK, case=case, dtype="float32", repeats=1, device="cpu")


@pytest.mark.parametrize("case", CASES)
def test_bench_worker_row(case):
    row = _worker(_spec(case))
    assert row["error"] is None and row["runs"] == 1 and row["case"] == case
    assert (row["B"], row["T"], row["V"], row["H"]) == (QUICK["B"], QUICK["T"], QUICK["V"], QUICK["H"])
    assert row["N"] == QUICK["B"] * QUICK["T"]
    assert set(row["phases_s"]) == {"forward", "backward", "entropy"}
    assert row["median_s"] > 0 and row["peak_extra_bytes"] >= 0


def test_before_and_after_compute_the_same_gradients():
    grads = {}
    for case in CASES:
        inputs = _inputs(_spec(case), torch, torch.device("cpu"))
        step, leaves = _step_fn(_spec(case), inputs, torch)
        step()
        grads[case] = [t.grad for t in leaves]
    for before, after in zip(grads["before"], grads["after"]):
        assert before.abs().max() > 0
        torch.testing.assert_close(after, before, atol=1e-6, rtol=1e-4)


def test_opd_bench_grpo_quick_writes_its_rows(tmp_path):
    # through the CLI, one subprocess per case, as `opd bench grpo` runs it
    from opd.cli import main

    assert "grpo" in SUBJECTS
    out = tmp_path / "grpo.json"
    assert main(["bench", "grpo", "--quick", "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["case"] for r in rows] == list(CASES)
    assert all(r["error"] is None and r["peak_extra_bytes"] is not None for r in rows), rows
