"""Bad input beyond the server fuzz: config files and data files.

A bad config (unknown key, wrong type, out-of-range value, missing file, broken YAML) gets
one message naming the file (with its line), the key and what was expected, exit code 2,
and nothing starts (no run directory). A malformed JSONL line is reported with its line
number; `stop` raises, `skip` counts it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from opd.cli import main
from opd.data import DataError, load_jsonl

pytestmark = pytest.mark.timeout(120)


def base_train(tmp_path) -> dict:
    return {"student": {"path": str(tmp_path / "student")},
            "merge": {"teachers": [{"name": "t", "address": "tcp://127.0.0.1:1", "mode": "topk", "k": 8}],
                      "datasets": [{"domain": "gen", "path": str(tmp_path / "train.jsonl")}]},
            "run": {"steps": 2, "out_dir": str(tmp_path / "run")}}


def base_rl(tmp_path) -> dict:
    return {"model": {"path": str(tmp_path / "student")},
            "data": {"train": str(tmp_path / "train.jsonl")},
            "rewards": [{"name": "math", "weight": 1.0}],
            "run": {"steps": 2, "out_dir": str(tmp_path / "run")}}


# (what is wrong, edit of the config dict, words the message must hold)
TRAIN_CASES = [
    ("unknown key", lambda d: d["run"].update(stepz=3), ["unknown key", "stepz"]),
    ("wrong type", lambda d: d["run"].update(steps="many"), ["run.steps", "int", "many"]),
    ("out of range", lambda d: d["optim"].update(lr=-1.0) if "optim" in d else d.update(optim={"lr": -1.0}),
     ["optim.lr", ">= 0.0", "-1.0"]),
    ("bad choice", lambda d: d["merge"]["teachers"][0].update(mode="fancy"), ["mode", "'topk'", "fancy"]),
    ("missing required", lambda d: d["student"].pop("path"), ["missing required", "path"]),
    ("nested unknown", lambda d: d["merge"]["teachers"][0].update(kk=8), ["unknown key", "kk"]),
]
RL_CASES = [
    ("unknown key", lambda d: d["run"].update(stepz=3), ["unknown key", "stepz"]),
    ("wrong type", lambda d: d["run"].update(steps=[1, 2]), ["steps", "int"]),
    ("out of range", lambda d: d["run"].update(steps=0), ["steps", ">= 1", "0"]),
]


def check_refused(capsys, tmp_path, argv, words, config_path):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err                             # one message (YAML's may span lines)
    assert str(config_path) in err.strip().splitlines()[0], err
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "run").exists()                          # nothing started
    return err


@pytest.mark.parametrize("what,edit,words", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_train_config_refused(tmp_path, capsys, what, edit, words):
    d = base_train(tmp_path)
    edit(d)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    err = check_refused(capsys, tmp_path, ["train", str(path)], words, path)
    assert f"{path}:" in err                                        # with a line number


@pytest.mark.parametrize("what,edit,words", RL_CASES, ids=[c[0] for c in RL_CASES])
def test_rl_config_refused(tmp_path, capsys, what, edit, words):
    d = base_rl(tmp_path)
    edit(d)
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    check_refused(capsys, tmp_path, ["rl", str(path)], words, path)


@pytest.mark.parametrize("command", ["train", "rl"])
def test_missing_and_broken_config_files(tmp_path, capsys, command):
    missing = tmp_path / "nope.yaml"
    check_refused(capsys, tmp_path, [command, str(missing)], ["not found"], missing)
    broken = tmp_path / "broken.yaml"
    broken.write_text("run: {steps: 2\nstudent: [\n")
    check_refused(capsys, tmp_path, [command, str(broken)], ["not valid YAML"], broken)


def test_cli_process_refuses_a_bad_config_before_loading_anything(tmp_path):
    d = base_train(tmp_path)
    d["rollout"] = {"temperature": "hot"}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    out = subprocess.run([sys.executable, "-m", "opd.cli", "train", str(path)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 2
    assert "rollout.temperature" in out.stderr and "hot" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()


def test_malformed_jsonl_lines_named_stop_or_skip(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "ok 1"}\n'
                    '{"prompt": "broken\n'                 # line 2: not JSON
                    '\n'
                    '["a list"]\n'                          # line 4: not an object
                    '{"answer": "4"}\n'                     # line 5: no prompt
                    '{"prompt": "x", "domain": 3}\n'        # line 6: wrong type
                    '{"prompt": "ok 2", "answer": 4}\n')
    with pytest.raises(DataError) as e:
        load_jsonl(path, on_error="stop")
    assert f"{path}:2:" in str(e.value) and "not valid JSON" in str(e.value)
    samples, report = load_jsonl(path, on_error="skip")
    assert [s.prompt for s in samples] == ["ok 1", "ok 2"] and samples[1].answer == "4"
    assert report.loaded == 2 and report.skipped == 4
    assert [err.split(": ")[0] for err in report.errors] == [f"{path}:{n}" for n in (2, 4, 5, 6)]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("not json\n")
    with pytest.raises(DataError, match="no usable samples"):
        load_jsonl(empty, on_error="skip")
    with pytest.raises(DataError, match="not found"):
        load_jsonl(tmp_path / "absent.jsonl")
    latin = tmp_path / "latin1.jsonl"   # one line in Latin-1: that line's error, like any other
    latin.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n{"prompt": "ok 2"}\n')
    with pytest.raises(DataError, match=f"{latin}:2: not UTF-8"):
        load_jsonl(latin)
    samples, report = load_jsonl(latin, on_error="skip")
    assert [s.prompt for s in samples] == ["ok", "ok 2"] and report.skipped == 1
