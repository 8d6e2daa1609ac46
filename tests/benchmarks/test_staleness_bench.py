"""Smoke test of `opd bench staleness`: every schedule runs, and each keeps its staleness bound."""

from __future__ import annotations

import argparse
import json

import pytest

from opd.benchmarks import SUBJECTS
from opd.benchmarks import staleness


@pytest.mark.slow
def test_bench_staleness_quick(tmp_path):
    assert "staleness" in SUBJECTS
    parser = argparse.ArgumentParser()
    staleness.add_arguments(parser)
    out = tmp_path / "s.json"
    assert staleness.run(parser.parse_args(["--quick", "--json", str(out)])) == 0
    rows = {r["schedule"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(staleness.SCHEDULES)
    assert rows["on-policy"]["staleness_max"] == 0 and rows["ahead K=0"]["staleness_max"] == 0
    assert rows["pipeline"]["staleness_max"] <= 1 and rows["ahead K=2"]["staleness_max"] <= 2
    assert all(r["steps_per_s"] > 0 for r in rows.values())
