"""`opd bench all` writes summary.md from the three benchmarks' JSON files."""

from __future__ import annotations

import json

from opd.benchmarks.all import summary


def test_summary_tables_from_json(tmp_path):
    step = {"system": "opd-topk", "tokens_per_s": 3948.0, "step_s": 0.059, "peak_rss_trainer": 472 << 20,
            "peak_rss_teacher": 439 << 20, "peak_pss_total": 715 << 20, "tokens_per_s_vs_trl": 1.51,
            "phases_s": {"rollout": 0.035, "teacher_wait": 0.01, "loss_backward_optim": 0.014}}
    transport = {"transport": "tcp", "mode": "topk", "k": 64, "vocab": None, "dtype": "float32",
                 "positions_per_request": 16384, "positions_per_s": 4.97e6, "bytes_per_position": 524,
                 "ratio_to_ceiling": 0.59, "ratio_to_http": 1499.0, "curve_cost": 0.72,
                 "cpu_us_per_position": 0.3312, "ceiling_cpu_us_per_position": 0.2204,
                 "reqresp_ratio_to_ceiling": 0.884, "work_ratio_to_ceiling": 0.706,
                 "ratio_to_ceiling_rounds": [0.62, 0.59, 1.304]}
    (tmp_path / "step.json").write_text(json.dumps({"rows": [step]}))
    (tmp_path / "step_v152064.json").write_text(json.dumps({"rows": [dict(step, tokens_per_s_vs_trl=1.78,
                                                                          teacher_launch="fork")]}))
    older = {k: v for k, v in transport.items()                    # written before CPU, per-round ratios and the
             if "cpu" not in k and "reqresp" not in k and "work" not in k and "rounds" not in k}  # references
    (tmp_path / "transport.json").write_text(json.dumps({"rows": [transport, dict(older, k=8)]}))
    text = summary(tmp_path, {"transport": 200.0, "step": 70.0}, quick=False)
    assert "| tcp | top-64 | 16384 | 4970000 | 524 | 59% (59-130%) | 88% / 71% | 0.331 / 0.22 | 1499x | 72% |" in text
    assert "| tcp | top-8 | 16384 | 4970000 | 524 | 59% (-) | - | - | 1499x | 72% |" in text
    assert "| opd-topk | 3948 | 0.059 | 472 | 439 | 715 | 1.51 | rollout 0.035, teacher_wait 0.010, " in text
    assert "## The same step, vocabulary padded to 152,064" in text and "| 1.78 |" in text
    assert "| opd-topk (teacher: fork) | 3948 |" in text
    assert "## Kernels" not in text                      # no kernels.json: no table
    assert "Wall time per benchmark: transport 200 s, step 70 s" in text


def test_summary_says_why_a_kernel_row_was_not_run(tmp_path):
    from opd.benchmarks.kernels import LIGER_ON_CPU

    row = {"case": "kl_full", "impl": "liger", "divergence": "forward_kl", "teacher": "full", "N": 2048,
           "V": 152064, "H": 0, "dtype": "float32", "peak_extra_bytes": None, "median_ms": None, "error": LIGER_ON_CPU}
    (tmp_path / "kernels.json").write_text(json.dumps([row, dict(row, impl="opd", median_ms=4697.44, error=None,
                                                                 peak_extra_bytes=1211 << 20)]))
    text = summary(tmp_path, {}, quick=False)
    assert f"| liger | kl_full (forward_kl) | full | 2048 | 152064 | - | float32 | - | {LIGER_ON_CPU} |" in text
    assert "| opd | kl_full (forward_kl) | full | 2048 | 152064 | - | float32 | 1211 | 4697.4 |" in text


def test_every_bench_option_says_what_it_is_and_its_default_once(capsys):
    # --providers/--dtype, --transports/--dtypes and --warmup/--systems had no help, so --help
    # showed neither what they do nor their default; --vocab said its default twice.
    import argparse

    import pytest

    from opd.benchmarks import SUBJECTS
    from opd.cli import build_parser, main

    parser = build_parser("bench")
    bench = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    subjects = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(subjects) == set(SUBJECTS)
    undocumented = [(name, a.option_strings[0]) for name, p in subjects.items() for a in p._actions
                    if a.option_strings and a.help is None]
    assert undocumented == []
    for name, expect in [("kernels", "--providers {reference,plain,opd,liger} [{reference,plain,opd,liger} ...] "
                                     "implementations"),
                         ("kernels", "dtype of the student's logits"),
                         ("transport", "--transports {tcp,ipc} [{tcp,ipc} ...] ZeroMQ transports measured"),
                         ("transport", "dtypes of the full-mode logits sent"),
                         ("step", "--warmup WARMUP first steps of each run left out of the timings (unset: tiny 5, "
                                  "small-real 1) (default: None)"),
                         ("step", "systems timed: opd-full"),
                         ("step", "--vocab VOCAB tiny: pad both models' vocabulary to this many rows; None: the "
                                  "byte tokenizer's 260 (default: None) ")]:
        with pytest.raises(SystemExit):
            main(["bench", name, "--help"])
        text = " ".join(capsys.readouterr().out.split()) + " "
        assert expect in text, (name, expect)
        assert text.count("(default:") == sum(1 for a in subjects[name]._actions
                                              if a.option_strings and a.help not in (None, argparse.SUPPRESS)
                                              and a.dest != "help")
