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


def test_per_position_forms_are_unbiased_but_the_clipped_one(tmp_path, tiny_model_dir):
    """`--positions`: each form's expected logit gradient, taken exactly over the student's
    distribution, is the reverse KL's (a wrong sign or a missing term in the exact entropy
    half would show as a bias of the signal's order); clipping is the biased one."""
    from argparse import Namespace

    from opd.benchmarks.sampled_noise import per_position

    teacher = lm_head_teacher(tiny_model_dir, tmp_path / "teacher")
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{i}:"} for i in range(10)])
    row = per_position(Namespace(student=str(tiny_model_dir), teacher=str(teacher), prompts=str(tmp_path / "p.jsonl"),
                                 positions=20, max_new_tokens=4))
    assert row["positions"] == 20 and row["mean_kl"] > 0
    for form in ("plain", "batch_mean_baseline", "exact_kl_baseline", "entropy_exact",
                 "entropy_exact_batch_mean_baseline"):
        assert row[form]["squared_bias_over_signal"] < 1e-8, (form, row[form])
        assert row[form]["squared_snr"] > 0
    assert row["clipped_2"]["squared_bias_over_signal"] > 1e-6
