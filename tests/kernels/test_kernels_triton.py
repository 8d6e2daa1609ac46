"""Triton kernels (impl="triton") vs the naive reference, on CPU through the interpreter.

All cases run in one subprocess with TRITON_INTERPRET=1 (kernels_triton_cases.py), so the
variable never reaches other tests; each case is then asserted here on its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from kernels_cases import EDGE_CHECKS, TRITON_CASES  # noqa: E402

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "kernels_triton_cases.py")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {row["case"]: row for row in rows}


@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: c.name())
def test_triton_matches_reference(results, case):
    row = results[case.name()]
    assert row["ok"], row


@pytest.mark.parametrize("edge", EDGE_CHECKS, ids=lambda f: f.__name__)
def test_triton_edge_cases(results, edge):
    row = results[f"{edge.__name__}-triton"]
    assert row["ok"], row
