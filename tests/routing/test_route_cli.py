"""The example merge configs against demo-shaped data, and `opd route fit | explain`."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from routing_prompts import labelled_prompts

from opd.cli import main
from opd.data import Sample, write_jsonl
from opd.routing import (MixtureSampler, Router, load_datasets, load_merge_config, mixture_ratios)

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ["merge_math_code.yaml", "merge_math_code_general.yaml"]


@pytest.fixture(scope="module")
def demo_tree(tmp_path_factory):
    """configs/ copied next to runs/demo/data/ with the demo's data generator, as `make demo` lays it out."""
    from opd.tiny.data import write_demo_data

    root = tmp_path_factory.mktemp("repo")
    shutil.copytree(REPO / "configs", root / "configs")
    write_demo_data(root / "runs" / "demo" / "data", n_train=60, n_eval=20, seed=0)
    return root


@pytest.mark.parametrize("name", CONFIGS)
def test_example_configs_load_and_route_demo_data(demo_tree, name):
    from opd.distill.config import load_train_config

    path = demo_tree / "configs" / name
    train = load_train_config(path)               # valid as an `opd train` config
    cfg = load_merge_config(path)                 # and its merge section on its own
    assert [Path(d.path).resolve() for d in cfg.datasets] == [Path(d.path).resolve() for d in train.merge.datasets]
    assert cfg.teachers == train.merge.teachers and cfg.routing == train.merge.routing
    data = load_datasets(cfg)
    assert set(data) == {d.domain for d in cfg.datasets} and all(len(v) == 60 for v in data.values())
    router = Router(cfg.routing, cfg.teachers, base_dir=path.parent)
    for domain, samples in data.items():
        for s in samples:
            r = router.route(s)
            assert (r.teacher, r.rule) == (domain, "domain_field")
            # without the domain field the pattern/keyword rules still find the right teacher
            bare = router.route(Sample(prompt=s.prompt))
            expected = domain if domain in ("math", "code") else cfg.routing.rules[-1].teacher
            assert bare.teacher == expected, (s.prompt, bare)
    sampler = MixtureSampler(data, mixture_ratios(cfg), seed=0)
    batch = sampler.sample(10)
    assert len(batch) == 10
    if cfg.sft is not None:
        assert Path(cfg.sft.path).is_file() and cfg.normalize == "running_mean"


def test_route_fit_then_explain(tmp_path, capsys):
    rows = [{"prompt": x, "domain": y} for x, y in labelled_prompts(60, seed=5)]
    write_jsonl(tmp_path / "labelled.jsonl", rows)
    out = tmp_path / "cfg" / "router.json"
    assert main(["route", "fit", "--data", str(tmp_path / "labelled.jsonl"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    acc = float(re.search(r"held-out accuracy: ([0-9.]+)", printed).group(1))
    assert acc > 0.9 and out.is_file()
    assert json.loads(out.read_text())["meta"]["held_out_accuracy"] == pytest.approx(acc)

    # Mistakes are one line each, and a failed write leaves no stray file (all were tracebacks).
    fit_args = ["route", "fit", "--data", str(tmp_path / "labelled.jsonl"), "--out"]
    assert main([*fit_args, str(tmp_path / "r.json"), "--holdout", "1.0"]) == 2
    assert "--holdout is the held-out share, 0 <= h < 1; got 1.0" in capsys.readouterr().err
    assert main([*fit_args, str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    write_jsonl(tmp_path / "one.jsonl", [r for r in rows if r["domain"] == "math"])
    assert main(["route", "fit", "--data", str(tmp_path / "one.jsonl"), "--out", str(tmp_path / "r.json")]) == 2
    assert "need at least two labels to route between" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.tmp")) and not (tmp_path / "r.json").exists()

    # a plain merge file (MergeConfig at the top level) whose classifier path is relative to it
    (tmp_path / "cfg" / "merge.yaml").write_text(
        "teachers:\n"
        "  - {name: math, address: 'tcp://127.0.0.1:5601', domains: [math]}\n"
        "  - {name: code, address: 'tcp://127.0.0.1:5602', domains: [code]}\n"
        "  - {name: general, address: 'tcp://127.0.0.1:5603', domains: [general]}\n"
        "datasets:\n  - {domain: math, path: math.jsonl}\n"
        "routing:\n  rules:\n    - {kind: domain_field}\n"
        "    - {kind: classifier, path: router.json, min_confidence: 0.5}\n"
        "    - {kind: fallback, teacher: general}\n")
    write_jsonl(tmp_path / "cfg" / "prompts.jsonl", [
        {"prompt": "Compute 17*3.", "domain": "math"},
        {"prompt": "Implement is_prime in Python with a loop."},
        {"prompt": "Write a short poem about tea."}])
    write_jsonl(tmp_path / "cfg" / "math.jsonl", [{"prompt": "Compute 2+2."}])
    assert load_merge_config(tmp_path / "cfg" / "merge.yaml").routing.rules[1].path == str(out)
    code = main(["route", "explain", "--config", str(tmp_path / "cfg" / "merge.yaml"),
                 "--data", str(tmp_path / "cfg" / "prompts.jsonl")])
    printed = capsys.readouterr().out
    assert code == 0
    lines = printed.splitlines()
    assert "math" in lines[0] and "domain 'math' -> teacher math" in lines[0]
    assert re.search(r"code\s+classifier .*classifier p=0\.\d\d for code -> teacher code", lines[1])
    assert re.search(r"general\s+classifier", lines[2])
    assert "by rule:    classifier 2, domain_field 1" in printed
    assert "domain default: none (" in printed     # prompts.jsonl is no data set of the config


def test_route_explain_gives_rows_the_domain_opd_train_gives(tmp_path, capsys):
    # `opd train` loads each data set (and eval set) with its `domain` as the default of rows
    # without one; explain did not, and showed the fallback teacher for rows that training sends
    # to the domain's teacher.
    from opd.routing.merge import load_datasets

    (tmp_path / "merge.yaml").write_text(
        "teachers:\n"
        "  - {name: tmath, address: 'tcp://127.0.0.1:5601', domains: [math]}\n"
        "  - {name: tcode, address: 'tcp://127.0.0.1:5602', domains: [code]}\n"
        "datasets:\n"
        "  - {domain: code, path: data/code.jsonl, eval_path: data/code_eval.jsonl}\n"
        "  - {domain: math, path: data/math.jsonl}\n"
        "routing:\n  rules: [{kind: domain_field}, {kind: fallback, teacher: tmath}]\n")
    write_jsonl(tmp_path / "data" / "code.jsonl", [{"prompt": "f(x): square x"}, {"prompt": "1+1=", "domain": "math"},
                                                   {"prompt": "f(x): times 5"}])
    write_jsonl(tmp_path / "data" / "code_eval.jsonl", [{"prompt": "f(x): add 1"}])
    write_jsonl(tmp_path / "data" / "math.jsonl", [{"prompt": "2+2="}])
    write_jsonl(tmp_path / "other.jsonl", [{"prompt": "f(x): square x"}])
    config = ["route", "explain", "--config", str(tmp_path / "merge.yaml"), "--json", "--data"]

    def explain(data, *extra):
        code = main([*config, str(data), *extra])
        captured = capsys.readouterr()
        rows = [json.loads(line) for line in captured.out.splitlines()]
        return code, [(r["teacher"], r["rule"]) for r in rows], captured.err

    # The data set's file, named another way than in the config: its rows go where training sends them.
    code, routes, err = explain(tmp_path / "data" / ".." / "data" / "code.jsonl")
    assert code == 0 and routes == [("tcode", "domain_field"), ("tmath", "domain_field"), ("tcode", "domain_field")]
    assert "domain default: 'code' for rows without `domain` (" in err and "the config's datasets[0].path" in err
    cfg = load_merge_config(tmp_path / "merge.yaml")
    router = Router(cfg.routing, cfg.teachers, base_dir=tmp_path)
    assert [(r.teacher, r.rule) for r in map(router.route, load_datasets(cfg)["code"])] == routes
    code, routes, err = explain(tmp_path / "data" / "code_eval.jsonl")
    assert routes == [("tcode", "domain_field")] and "datasets[0].eval_path" in err
    # A file of no data set keeps no domain (the fallback decides), unless --domain gives one.
    code, routes, err = explain(tmp_path / "other.jsonl")
    assert code == 0 and routes == [("tmath", "fallback")] and "domain default: none (" in err
    code, routes, err = explain(tmp_path / "other.jsonl", "--domain", "code")
    assert routes == [("tcode", "domain_field")]
    assert "domain default: 'code' for rows without `domain` (--domain)" in err
    code, routes, err = explain(tmp_path / "data" / "code.jsonl", "--domain", "math")   # --domain wins
    assert routes == [("tmath", "domain_field"), ("tmath", "domain_field"), ("tmath", "domain_field")]
    # A file that is the set of two domains is routed once per set by training: pick one.
    (tmp_path / "merge.yaml").write_text((tmp_path / "merge.yaml").read_text().replace("data/math.jsonl",
                                                                                       "data/code.jsonl"))
    code, routes, err = explain(tmp_path / "data" / "code.jsonl")
    assert code == 2 and routes == []
    assert "datasets[0].path (domain 'code'), datasets[1].path (domain 'math')" in err and "--domain" in err


def test_route_fit_and_explain_refuse_non_positive_counts(tmp_path, capsys):
    # `--epochs -3 --max-features 0` wrote a classifier with no features that gives every prompt
    # the priors, and exited 0.
    from opd.routing.classifier import fit

    rows = [{"prompt": x, "domain": y} for x, y in labelled_prompts(20, seed=5)]
    write_jsonl(tmp_path / "labelled.jsonl", rows)
    fit_args = ["route", "fit", "--data", str(tmp_path / "labelled.jsonl"), "--out", str(tmp_path / "r.json")]
    for option, value in [("--epochs", "-3"), ("--epochs", "0"), ("--max-features", "0")]:
        with pytest.raises(SystemExit) as e:
            main([*fit_args, option, value])
        assert e.value.code == 2
        assert f"argument {option}: must be at least 1, got {value}" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
    with pytest.raises(ValueError, match="need epochs >= 1 and max_features >= 1, got epochs 0"):
        fit(["a", "b"], ["x", "y"], epochs=0)
    with pytest.raises(ValueError, match="max_features 0"):
        fit(["a", "b"], ["x", "y"], max_features=0)
    assert len(fit(["ab", "cd"], ["x", "y"], epochs=1, max_features=2).vocab) == 2
    with pytest.raises(SystemExit) as e:
        main(["route", "explain", "--config", "c.yaml", "--data", "d.jsonl", "--limit", "-1"])
    assert e.value.code == 2 and "argument --limit: must be at least 0 (0: no limit), got -1" in capsys.readouterr().err


def test_route_actions_have_descriptions(capsys):
    for action, expect in [("fit", "fit the text classifier on a labelled prompt file (prompt + domain): holds out"),
                           ("explain", "print the route and reason of every sample of a file as `opd train` routes")]:
        with pytest.raises(SystemExit):
            main(["route", action, "--help"])
        assert expect in " ".join(capsys.readouterr().out.split())
