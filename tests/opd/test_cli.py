"""opd.cli: a user's mistake is one line on stderr; a bug keeps its traceback; Ctrl-C is a line too."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from opd.cli import main


def test_a_users_mistake_is_one_line_not_a_traceback(tmp_path, capsys):
    # Each of these printed a traceback before (ConfigError, FileExistsError escaped run()).
    assert main(["route", "explain", "--config", str(tmp_path / "missing.yaml"), "--data", "x.jsonl"]) == 1
    assert capsys.readouterr().err == f"opd route: error: {tmp_path / 'missing.yaml'}: config file not found\n"
    assert main(["keys", "generate", "--out", str(tmp_path), "--name", "a"]) == 0
    capsys.readouterr()
    assert main(["keys", "generate", "--out", str(tmp_path), "--name", "a"]) == 1
    assert capsys.readouterr().err.startswith("opd keys: error: ")


def test_a_bug_keeps_its_traceback_and_ctrl_c_is_a_line(monkeypatch, capsys):
    import opd.routing.cli

    def bug(args):
        raise KeyError("an internal mistake")

    monkeypatch.setattr(opd.routing.cli, "run", bug)
    with pytest.raises(KeyError, match="an internal mistake"):
        main(["route", "explain", "--config", "c.yaml", "--data", "x.jsonl"])

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(opd.routing.cli, "run", interrupted)
    assert main(["route", "explain", "--config", "c.yaml", "--data", "x.jsonl"]) == 130
    assert capsys.readouterr().err == "opd route: interrupted\n"
    monkeypatch.setenv("OPD_TRACEBACK", "1")
    monkeypatch.setattr(opd.routing.cli, "run", lambda args: open("/no/such/file"))
    with pytest.raises(FileNotFoundError):
        main(["route", "explain", "--config", "c.yaml", "--data", "x.jsonl"])


def test_probe_refuses_a_timeout_or_temperature_it_cannot_use(capsys):
    # --timeout-s -1 was accepted, and every teacher answer then failed TIMEOUT.
    base = ["probe", "--student", "s", "--teacher", "tcp://127.0.0.1:1", "--prompts", "p.jsonl"]
    for option, value, expect in [("--timeout-s", "-1", "must be a finite number above 0, got -1"),
                                  ("--timeout-s", "0", "must be a finite number above 0, got 0"),
                                  ("--timeout-s", "inf", "must be a finite number above 0, got inf"),
                                  ("--temperature", "-0.5", "must be a finite number of at least 0 (0: greedy), "
                                                            "got -0.5"),
                                  ("--temperature", "nan", "must be a finite number of at least 0 (0: greedy), "
                                                           "got nan")]:
        with pytest.raises(SystemExit) as e:
            main([*base, option, value])
        assert e.value.code == 2
        assert f"argument {option}: {expect}" in capsys.readouterr().err


def test_probe_says_when_it_lowers_k_and_reports_its_settings(tiny_model_dir, tiny_teacher_dir, tmp_path, capsys):
    # A --k above the teacher's max_k was capped silently, and the report left out the settings
    # its numbers depend on (the k used, the student's temperature, seed and length).
    import json

    from opd.data import write_jsonl
    from opd.teachers.hf_backend import HFBackend
    from opd.teachers.server import serving_in_thread

    write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}: what is {i}+{i}?"} for i in range(3)])
    backend = HFBackend(tiny_teacher_dir, name="t", max_k=4)
    try:
        with serving_in_thread(backend) as server:
            assert main(["probe", "--student", str(tiny_model_dir), "--teacher", server.address, "--prompts",
                         str(tmp_path / "p.jsonl"), "--num-prompts", "2", "--k", "8", "--max-new-tokens", "3",
                         "--temperature", "0.7", "--seed", "5", "--json", str(tmp_path / "r.json")]) == 0
    finally:
        backend.close()
    captured = capsys.readouterr()
    assert f"note: the teacher at {server.address} answers top-k for k up to 4 (its --max-k): k 8 lowered to 4" \
        in captured.err
    shown = dict(line.split(None, 1) for line in captured.out.splitlines())
    assert {key: shown[key] for key in ("student_temperature", "seed", "max_new_tokens", "teacher_temperature",
                                        "k_requested", "k")} == {
        "student_temperature": "0.7", "seed": "5", "max_new_tokens": "3", "teacher_temperature": "1",
        "k_requested": "8", "k": "4"}
    report = json.loads((tmp_path / "r.json").read_text())
    assert {key: report[key] for key in ("student_temperature", "seed", "max_new_tokens", "teacher_temperature",
                                         "k_requested", "k")} == {
        "student_temperature": 0.7, "seed": 5, "max_new_tokens": 3, "teacher_temperature": 1.0,
        "k_requested": 8, "k": 4}
    assert report["responses"] == 2 and 0 < report["topk_overlap"] <= 1


def test_help_and_a_refused_config_of_the_training_commands_import_no_torch(tmp_path):
    # `opd rl --help` took 7 s when the trainers were imported at the top of the CLI modules
    # (`opd validate --help` 5.3 s, until its engines and GRPOTrainer were imported where used).
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_key: 1\n")
    probe = textwrap.dedent("""
        import contextlib, io, sys
        from opd.cli import main
        for argv in (["sft", "--help"], ["train", "--help"], ["rl", "--help"], ["validate", "--help"],
                     ["sft", sys.argv[1]], ["train", sys.argv[1]], ["rl", sys.argv[1]], ["validate", sys.argv[1]]):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                try:
                    code = main(argv)
                except SystemExit as e:   # --help
                    code = e.code
            print(argv[0], code)
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", probe, str(bad)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["sft", "0", "train", "0", "rl", "0", "validate", "0",
                                  "sft", "2", "train", "2", "rl", "2", "validate", "2", "False"], out.stdout
