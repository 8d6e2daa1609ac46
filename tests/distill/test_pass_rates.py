"""Teacher weights from the verifier during a run (`merge.routing.refresh_every`).

First the arithmetic, with scripted teachers (each answers one fixed text; the verifier knows
which is right): pooled pass rates, the weights the router gives them, the routes that follow,
the held-out cursor, and the state a checkpoint keeps. Then `opd train` end to end with two
real teachers served in this process, answering through protocol 2.7.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from opd.config import from_dict
from opd.data import Sample, write_jsonl
from opd.distill.config import TrainConfig
from opd.distill.pass_rates import PassRates
from opd.errors import TrainError
from opd.metrics import read_metrics
from opd.routing.config import MergeConfig, RouterConfig
from opd.routing.router import Router
from opd.spine.dist import World
from opd.teachers.results import SampleResult


def merge(**routing) -> MergeConfig:
    return from_dict({"teachers": [{"name": "a", "address": "tcp://x:1", "domains": ["math"]},
                                   {"name": "b", "address": "tcp://x:2", "domains": ["math"]},
                                   {"name": "c", "address": "tcp://x:3", "domains": ["code"]}],
                      "datasets": [{"domain": "math", "path": "m.jsonl"}, {"domain": "code", "path": "c.jsonl"}],
                      "routing": {"rules": [{"kind": "domain_field"}], "weighting": "pass_rate", **routing}},
                     MergeConfig)


class Scripted:
    """Teachers `a` and `b` answer every prompt with their own letter; `right[t]` of each of
    their answers, in turn, are marked correct by the verifier below."""

    def __init__(self, right: dict[str, list[bool]]):
        self.right, self.asked = right, []
        self.specs = {t: SimpleNamespace(name=t, context=None) for t in "abc"}

    def sample(self, teacher, prompts, **kw):
        self.asked.append((teacher, len(prompts), kw["seed"]))
        f = Future()
        f.set_result(SampleResult([[ord(teacher)] for _ in prompts], ["length"] * len(prompts)))
        return f

    def verify(self, samples, texts):
        return [1.0 if self.right[t].pop(0) else 0.0 for t in texts]


def trainer(cfg: MergeConfig, teachers: Scripted, held_out):
    router = Router(cfg.routing, cfg.teachers)
    samples = [Sample(prompt=f"p{i}", domain="math") for i in range(3)]
    prompts = SimpleNamespace(routes={id(s): router.route(s) for s in samples}, eval_routes=[], held_out=held_out)
    tr = SimpleNamespace(cfg=SimpleNamespace(run=SimpleNamespace(seed=0),
                                             rollout=SimpleNamespace(max_new_tokens=4, temperature=1.0, top_p=1.0)),
                         teachers=teachers, tok=SimpleNamespace(decode=lambda ids, **_: "".join(map(chr, ids))),
                         tools=None, encode=lambda s: [1, 2], verify=teachers.verify, stop_ids=[0],
                         world=World(), prompts=prompts)
    return tr, router, samples


def test_pooled_pass_rates_weigh_the_routes_and_a_checkpoint_keeps_them():
    cfg = merge(refresh_every=5, refresh_prompts=4)
    held_out = {"math": [Sample(prompt=f"h{i}", domain="math") for i in range(6)],
                "code": [Sample(prompt="c", domain="code")]}   # one teacher: nothing to weigh
    script = Scripted({"a": [True, True, True, False] + [True, False, False, False],
                       "b": [True, False, False, False] + [True, True, True, True]})
    tr, router, samples = trainer(cfg, script, held_out)
    rates = PassRates(cfg.routing, router, held_out)
    assert rates.domains == {"math": ["a", "b"]} and [rates.due(s) for s in (0, 3, 5, 10)] == [True, False, True, True]

    row = rates.refresh(0, tr)
    assert row == {"routing/pass_rate/math/a": 0.75, "routing/pass_rate/math/b": 0.25,
                   "routing/weight/math/a": 0.75, "routing/weight/math/b": 0.25}
    assert {tuple(r.weights.items()) for r in tr.prompts.routes.values()} == {(("a", 0.75), ("b", 0.25))}
    assert [a[:2] for a in script.asked] == [("a", 4), ("b", 4)] and rates.cursor == {"math": 4}

    row = rates.refresh(5, tr)   # 4 more answers each, pooled: a 4 of 8, b 5 of 8
    assert row["routing/pass_rate/math/a"] == 0.5 and row["routing/pass_rate/math/b"] == 0.625
    assert row["routing/weight/math/b"] == pytest.approx(0.625 / 1.125)
    assert rates.cursor == {"math": 2}   # 6 held-out prompts, drawn in turn
    assert script.asked[2][2] != script.asked[0][2]   # another seed each refresh
    assert rates.card() == ["step 0: math: a 0.75 (pass 0.75 of 4), b 0.25 (pass 0.25 of 4)",
                            "step 5: math: a 0.44 (pass 0.50 of 8), b 0.56 (pass 0.62 of 8)"]

    # A resumed run starts from the saved counts: the same weights, the same routes.
    tr2, router2, _ = trainer(cfg, Scripted({}), held_out)
    again = PassRates(cfg.routing, router2, held_out)
    again.load_state(json.loads(json.dumps(rates.state())))
    again.apply(None)
    again.reroute(tr2.prompts)
    assert router2.domain_weights("math") == router.domain_weights("math") and again.history == rates.history
    assert [r.weights for r in tr2.prompts.routes.values()] == [r.weights for r in tr.prompts.routes.values()]


def test_a_teacher_no_answer_of_which_passes_gets_no_samples():
    cfg = merge(refresh_every=1, refresh_prompts=2)
    held_out = {"math": [Sample(prompt=f"h{i}", domain="math") for i in range(2)]}
    tr, router, _ = trainer(cfg, Scripted({"a": [True, False], "b": [False, False]}), held_out)
    PassRates(cfg.routing, router, held_out).refresh(0, tr)
    assert {tuple(r.weights.items()) for r in tr.prompts.routes.values()} == {(("a", 1.0),)}


def test_refresh_needs_pass_rate_weighting_and_a_domain_with_two_teachers_held_out():
    with pytest.raises(ValueError, match="weighting: pass_rate"):
        from_dict({"teachers": [{"name": "a", "address": "tcp://x:1"}], "datasets": [{"domain": "m", "path": "p"}],
                   "routing": {"refresh_every": 2}}, MergeConfig)
    cfg = merge(refresh_every=2)
    with pytest.raises(TrainError, match="no domain has both"):
        PassRates(cfg.routing, Router(cfg.routing, cfg.teachers), {"code": [Sample(prompt="c", domain="code")]})
    assert RouterConfig().refresh_every == 0


def test_opd_train_measures_its_teachers_before_the_first_step_and_every_n_after(tmp_path, tiny_model_dir):
    from opd.distill.trainer import Trainer
    from opd.teachers.hf_backend import HFBackend
    from opd.teachers.server import serving_in_thread
    from opd.tiny import lm_head_teacher

    other = lm_head_teacher(tiny_model_dir, tmp_path / "teacher")
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"q{i}: what is {i}+{i}?"} for i in range(8)])
    write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"what is {i}+{i}?", "answer": str(2 * i)} for i in range(6)])
    with serving_in_thread(HFBackend(tiny_model_dir, name="same", max_k=8)) as s1, \
            serving_in_thread(HFBackend(other, name="other", max_k=8)) as s2:
        cfg = from_dict({
            "student": {"path": str(tiny_model_dir)},
            "merge": {"teachers": [{"name": "same", "address": s1.address, "k": 8, "domains": ["gen"]},
                                   {"name": "other", "address": s2.address, "k": 8, "domains": ["gen"]}],
                      "datasets": [{"domain": "gen", "path": str(tmp_path / "train.jsonl"),
                                    "eval_path": str(tmp_path / "eval.jsonl")}],
                      "routing": {"rules": [{"kind": "domain_field"}], "weighting": "pass_rate",
                                  "refresh_every": 2, "refresh_prompts": 4}},
            "rollout": {"prompts_per_step": 2, "max_new_tokens": 6},
            "optim": {"lr": 1e-3},
            "run": {"steps": 5, "out_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False,
                    "eval_every": 0}}, TrainConfig)
        tr = Trainer(cfg)
        # The tiny teachers answer no sum right: a scripted verifier passes answers of even length.
        tr.verify = lambda samples, texts: [float(len(t) % 2 == 0) for t in texts]
        tr.run()
    history = tr.pass_rates.history
    assert [h["step"] for h in history] == [0, 2, 4]
    assert [h["answered"]["gen"] for h in history] == [{"same": n, "other": n} for n in (4, 8, 12)]
    last = history[-1]
    rates = last["pass_rates"]["gen"]
    total = sum(rates.values())   # the weights are the pooled rates, normalised
    assert last["weights"]["gen"] == pytest.approx({t: r / total for t, r in rates.items()})
    logged = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "routing/weight/gen/same" in r]
    assert [r["step"] for r in logged] == [0, 2, 4]
    assert logged[-1]["routing/weight/gen/other"] == pytest.approx(last["weights"]["gen"]["other"])
    card = json.loads((tmp_path / "run" / "card.json").read_text())["data"]
    assert len(card["teacher_weights_over_time"]) == 3 and "every 2 steps" in card["teacher_weighting"]
