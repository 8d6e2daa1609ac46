"""`opd train` against a CURVE teacher: keys from `opd keys generate`, the client key pair from
`teacher_client.curve_secret_key`, the server's public key from `merge.teachers[].curve_server_key`."""

from __future__ import annotations

import pytest
import yaml

from opd.cli import main
from opd.data import write_jsonl
from opd.metrics import read_metrics

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def curve_world(tmp_path_factory, tiny_model_dir, tiny_teacher_dir):
    from opd.teachers.launch import start_server_process

    root = tmp_path_factory.mktemp("opd_train_curve")
    assert main(["keys", "generate", "--out", str(root / "server_keys"), "--name", "server"]) == 0
    assert main(["keys", "generate", "--out", str(root / "clients"), "--name", "trainer"]) == 0
    assert main(["keys", "generate", "--out", str(root / "others"), "--name", "intruder"]) == 0
    write_jsonl(root / "train.jsonl", [{"prompt": f"q{i}: what is {i}+{i}?"} for i in range(8)])
    server = start_server_process(["--model", str(tiny_teacher_dir), "--max-k", "16", "--name", "t",
                                   "--curve-secret-key", str(root / "server_keys" / "server.key_secret"),
                                   "--curve-allow", str(root / "clients")])
    try:
        yield {"root": root, "student": tiny_model_dir, "server": server}
    finally:
        server.stop()


def write_config(w, name: str, client_key: str | None) -> str:
    d = {
        "student": {"path": str(w["student"])},
        "merge": {"teachers": [{"name": "t", "address": w["server"].address, "k": 8,
                                "curve_server_key": "server_keys/server.key"}],     # relative to the config
                  "datasets": [{"domain": "gen", "path": "train.jsonl"}]},
        "rollout": {"prompts_per_step": 2, "max_new_tokens": 6},
        "teacher_client": {"connect_timeout_s": 1.0, **({"curve_secret_key": client_key} if client_key else {})},
        "run": {"steps": 2, "out_dir": name, "progress": False, "tensorboard": False, "eval_prompts": 1},
    }
    path = w["root"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(d))
    return str(path)


def test_train_with_an_allowed_client_key(curve_world):
    assert main(["train", write_config(curve_world, "allowed", "clients/trainer.key_secret")]) == 0
    rows = [r for r in read_metrics(curve_world["root"] / "allowed" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]


def test_missing_or_unlisted_client_key_is_refused_before_compute(curve_world, capsys):
    root = curve_world["root"]
    assert main(["train", write_config(curve_world, "no_key", None)]) == 1
    err = capsys.readouterr().err
    assert "teacher_client.curve_secret_key is not set" in err and "Traceback" not in err, err
    assert main(["train", write_config(curve_world, "public_only", "clients/trainer.key")]) == 1
    assert "holds no secret key" in capsys.readouterr().err
    # A valid key pair the server does not admit: the server never answers, so the check times out.
    assert main(["train", write_config(curve_world, "intruder", "others/intruder.key_secret")]) == 1
    err = capsys.readouterr().err
    assert "is unreachable" in err and "--curve-allow" in err, err
    for name in ("no_key", "public_only", "intruder"):
        assert not (root / name / "metrics.jsonl").exists()
