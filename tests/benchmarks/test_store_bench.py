"""Smoke tests of `opd bench store` and `store-quality`: the stores are written, every arm trains."""

from __future__ import annotations

import argparse
import json

from opd.benchmarks import SUBJECTS
from opd.benchmarks import store, store_quality


def test_bench_store_small(tmp_path):
    assert "store" in SUBJECTS
    parser = argparse.ArgumentParser()
    store.add_arguments(parser)
    out = tmp_path / "s.json"
    args = ["--prompts", "2", "--n", "2", "--max-new-tokens", "6", "--batch", "2", "--steps", "2", "--k", "8",
            "--out", str(tmp_path / "work"), "--json", str(out)]
    assert store.run(parser.parse_args(args)) == 0
    r = json.loads(out.read_text())
    assert r["store"]["sequences"] == 4 and r["store"]["answer_bytes_per_token"] == 8 * 4 + 8   # uint16 ids
    assert r["store"]["bytes_per_token_on_disk"] > r["store"]["answer_bytes_per_token"]
    assert set(r["arms"]) == {"replay (store)", "live teacher, stored sequences", "live teacher, on-policy"}
    assert all(a["steps_per_s"] > 0 for a in r["arms"].values())


def test_bench_store_quality_small(tmp_path):
    assert "store-quality" in SUBJECTS
    parser = argparse.ArgumentParser()
    store_quality.add_arguments(parser)
    out = tmp_path / "q.json"
    args = ["--steps", "2", "--batch", "2", "--prompts", "4", "--n", "1", "--max-new-tokens", "6",
            "--out", str(tmp_path / "work"), "--json", str(out)]
    assert store_quality.run(parser.parse_args(args)) == 0
    arms = json.loads(out.read_text())["arms"]
    assert set(arms) == {"start", "on-policy", "replay, student", "replay, teacher"}
    assert all(a["forward_kl_topk"] > 0 and a["wall_s"] >= 0 for a in arms.values())
