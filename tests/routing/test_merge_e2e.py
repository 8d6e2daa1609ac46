"""End to end: two real teacher servers on tiny models that differ, one per domain; a
student trained with a merge config gets closer to each teacher on that teacher's domain."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import pytest
import yaml


def _eval_rows(out_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "eval/kl/math" in r or "eval/kl/code" in r]


@pytest.mark.timeout(600)
def test_student_kl_to_each_teacher_falls_on_its_own_domain(tmp_path, tiny_model_dir):
    from opd.cli import main
    from opd.tiny.data import write_demo_data
    from opd.teachers.launch import start_server_process
    from opd.tiny import perturb_model

    # two different teachers: independent perturbations of the student's start point
    math_teacher = perturb_model(tiny_model_dir, tmp_path / "math_teacher", scale=3.0, seed=1)
    code_teacher = perturb_model(tiny_model_dir, tmp_path / "code_teacher", scale=3.0, seed=2)
    data = write_demo_data(tmp_path / "data", n_train=64, n_eval=8, seed=0, domains=("math", "code"))
    with ExitStack() as stack:
        math_srv = stack.enter_context(start_server_process(["--model", math_teacher, "--name", "math",
                                                             "--max-k", "16"]))
        code_srv = stack.enter_context(start_server_process(["--model", code_teacher, "--name", "code",
                                                             "--max-k", "16"]))
        cfg = {
            "student": {"path": str(tiny_model_dir)},
            "merge": {
                "teachers": [
                    {"name": "math", "address": math_srv.address, "domains": ["math"], "k": 16, "beta": 0.0},
                    {"name": "code", "address": code_srv.address, "domains": ["code"], "k": 16, "beta": 0.0},
                ],
                "datasets": [{"domain": d, "path": str(p["train"]), "eval_path": str(p["eval"]), "ratio": 0.5}
                             for d, p in data.items()],
                "routing": {"rules": [{"kind": "domain_field"},
                                      {"kind": "keywords", "teacher": "code", "keywords": ["def"]},
                                      {"kind": "fallback", "teacher": "math"}]},
                "normalize": "running_mean",
            },
            "rollout": {"prompts_per_step": 8, "max_new_tokens": 12, "temperature": 1.0},
            "optim": {"lr": 3.0e-3, "micro_batch_size": 8},
            "run": {"steps": 12, "out_dir": str(tmp_path / "run"), "eval_prompts": 16, "progress": False,
                    "tensorboard": False, "seed": 0},
        }
        path = tmp_path / "merge.yaml"
        path.write_text(yaml.safe_dump(cfg))
        assert main(["train", str(path)]) == 0

    evals = _eval_rows(tmp_path / "run")
    first, last = evals[0], evals[-1]
    print({d: (round(first[f"eval/kl/{d}"], 4), round(last[f"eval/kl/{d}"], 4)) for d in ("math", "code")})
    for d in ("math", "code"):
        assert last[f"eval/kl/{d}"] < 0.8 * first[f"eval/kl/{d}"], (d, first, last)
    card = (tmp_path / "run" / "card.md").read_text()
    assert "math" in card and "code" in card
