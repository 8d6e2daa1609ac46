"""Smoke test of `opd bench self-distill`: `--quick` warms up a base, runs both arms (the forked
`self` teacher with the answer in its context, and SFT on the answers) and writes a table with
every arm and accuracies in [0, 1]. The numbers of a quick run mean nothing."""

from __future__ import annotations

import argparse
import json

import pytest

from opd.benchmarks import SUBJECTS
from opd.benchmarks import self_distill


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_self_distill_quick(tmp_path):
    assert SUBJECTS["self-distill"][0] == "opd.benchmarks.self_distill"
    parser = argparse.ArgumentParser()
    self_distill.add_arguments(parser)
    args = parser.parse_args(["--quick", "--out", str(tmp_path / "out")])
    assert self_distill.run(args) == 0
    report = json.loads((tmp_path / "out" / "self_distill.json").read_text())
    rows = {r["arm"]: r for r in report["rows"]}
    assert set(rows) == {"base", "teacher", *self_distill.ARMS}
    for arm in self_distill.ARMS:
        assert rows[arm]["seeds"] == 1 and not rows[arm]["failed"]
        accs = [a["acc"] for a in rows[arm]["at"].values()] + rows[arm]["per_seed"] + [rows[arm]["hint_acc"]]
        assert len(rows[arm]["at"]) == len(report["plan"]["eval_at"]) and all(0.0 <= a <= 1.0 for a in accs)
    assert 0.0 <= rows["base"]["acc"] <= 1.0 and 0.0 <= rows["teacher"]["acc"] <= 1.0
    # The self-distillation run's teacher was the base itself, shown the context.
    card = (tmp_path / "out" / "runs" / "seed0" / "self_distill" / "train" / "card.md").read_text()
    assert "a frozen copy of the student's start" in card and self_distill.CONTEXT in card
    text = (tmp_path / "out" / "self_distill.md").read_text()
    assert all(self_distill.LABELS[a] in text for a in rows)
    assert len({line.count("|") for line in text.splitlines() if line.startswith("|")}) == 1
