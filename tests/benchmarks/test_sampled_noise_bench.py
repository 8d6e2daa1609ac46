"""`opd bench sampled-noise`: its row on tiny models (the statistics themselves are held to
their expectation by tests/distill/test_sampled_gradient.py)."""

import json

from opd.benchmarks import SUBJECTS
from opd.benchmarks.sampled_noise import main
from opd.data import write_jsonl
from opd.tiny import lm_head_teacher


def test_a_row_on_tiny_models(tmp_path, tiny_model_dir):
    teacher = lm_head_teacher(tiny_model_dir, tmp_path / "teacher")
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{i}:"} for i in range(40)])
    out = tmp_path / "row.json"
    assert main(["--student", str(tiny_model_dir), "--teacher", str(teacher), "--prompts", str(tmp_path / "p.jsonl"),
                 "--batches", "3", "--prompts-per-step", "4", "--max-new-tokens", "6", "--json", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["batches"] == 3 and row["ratio"] > 0 and -1 <= row["cosine_per_batch"] <= 1
    assert row["squared_snr_sampled"] > 0 and row["squared_snr_exact"] > 0
    assert SUBJECTS["sampled-noise"][0] == "opd.benchmarks.sampled_noise"
