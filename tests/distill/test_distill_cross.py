"""`opd train` with a cross-tokenizer teacher (`tokenizer: cross`) against a real `opd serve-teacher`.

The student is the tiny byte-level model (a token per byte); the teacher a tiny model of its
own with a BPE tokenizer learned here from the prompts (merges such as " what" are one token),
so the two share texts, not ids. The run must lower the held-out cross-tokenizer divergence
(the three parts' rows, opd.distill.cross), report each part, and say so in the card; a
teacher whose tokenizer is not the one named by cross.tokenizer_path is refused at the handshake.
"""

import json

import pytest

from opd.config import from_dict
from opd.data import Sample, encode_prompt, write_jsonl
from opd.distill.context import teacher_inputs, teacher_prompts
from opd.distill.config import TrainConfig
from opd.distill.trainer import Trainer, TrainError
from opd.metrics import read_metrics
from opd.routing.config import TeacherSpec
from opd.tiny import build_tokenizer
from opd.tiny.cross import build_bpe_tokenizer, build_cross_teacher

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    from opd.teachers.launch import start_server_process

    root = tmp_path_factory.mktemp("opd_train_cross")
    prompts = [f"q{i}: what is {i} plus {i}?" for i in range(16)]
    write_jsonl(root / "train.jsonl", [{"prompt": p} for p in prompts])
    write_jsonl(root / "eval.jsonl", [{"prompt": f"q{i}: what is {i} plus {i}?"} for i in range(100, 108)])
    teacher = build_cross_teacher(root / "teacher", prompts * 4 + ["the answer is 12", "it is 4"],
                                  vocab_size=320, init_std=0.2)
    server = start_server_process(["--model", str(teacher), "--max-k", "16", "--name", "t"])
    try:
        yield {"root": root, "student": tiny_model_dir, "teacher": teacher, "address": server.address,
               "server": server}
    finally:
        server.stop()


def _cfg(s, name, *, steps=24, lr=3e-3, tokenizer_path=None, weights=(1.0, 1.0, 1.0)):
    return from_dict({
        "student": {"path": str(s["student"])},
        "merge": {"teachers": [{"name": "t", "address": s["address"], "mode": "topk", "k": 8, "tokenizer": "cross",
                                "cross": {"tokenizer_path": str(tokenizer_path or s["teacher"]),
                                          **dict(zip(("exact", "uld", "span"), weights))}}],
                  "datasets": [{"domain": "gen", "path": str(s["root"] / "train.jsonl"),
                                "eval_path": str(s["root"] / "eval.jsonl")}]},
        "rollout": {"prompts_per_step": 8, "max_new_tokens": 12},
        "optim": {"lr": lr, "micro_batch_size": 8},
        "teacher_client": {"connect_timeout_s": 5.0},
        "run": {"steps": steps, "out_dir": str(s["root"] / name), "progress": False, "tensorboard": False},
    }, TrainConfig)


@pytest.mark.parametrize("weights,floor,factor", [((1.0, 1.0, 1.0), 0.5, 0.6), ((1.0, 1.0, 0.0), 0.2, 0.8)],
                         ids=["three_parts", "distribution_parts"])
def test_cross_tokenizer_heldout_divergence_falls(setup, weights, floor, factor):
    steps = 24
    name = "cross" if weights[2] else "cross_dist"
    result = Trainer(_cfg(setup, name, steps=steps, weights=weights)).run()
    first, last = result["evals"][0]["eval/kl"], result["evals"][-1]["eval/kl"]
    print(f"held-out cross-tokenizer divergence {weights}: {first:.3f} -> {last:.3f}")
    assert first > floor, first                     # the teacher really differs
    assert last <= factor * first, (first, last)
    if not weights[2]:
        return
    rows = [r for r in read_metrics(setup["root"] / name / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    parts = {p: rows[-1][f"signal/cross/t/{p}"] for p in ("exact", "uld", "span")}
    assert all(v > 0 for v in parts.values()), parts
    card = json.loads((setup["root"] / "cross" / "card.json").read_text())
    facts = card["teacher t"]
    assert facts["tokenizer"].startswith("cross-tokenizer")
    assert facts["tokenizer_fingerprint"] == setup["server"].tokenizer_fingerprint
    assert rows[-1]["signal/cross/t/unaligned"] == 0   # byte-level text the BPE gives back unchanged
    assert facts["responses_not_retokenized_exactly"].startswith("0.0% of ")
    shares = {p: v["share"] for p, v in facts["cross_parts"].items()}
    assert sorted(shares) == ["exact", "span", "uld"] and sum(shares.values()) == pytest.approx(1.0)


def test_cross_tokenizer_other_tokenizer_refused(setup):
    # cross.tokenizer_path names the student's byte tokenizer, the server reads its BPE one
    with pytest.raises(TrainError, match="cross.tokenizer_path's"):
        Trainer(_cfg(setup, "refused", steps=1, tokenizer_path=setup["student"])).run()


def test_cross_config_checks():
    with pytest.raises(ValueError, match="mode topk"):
        TeacherSpec(name="t", address="tcp://127.0.0.1:1", mode="full", tokenizer="cross")
    base = {"student": {"path": "s"}, "merge": {"teachers": [{"name": "t", "address": "tcp://127.0.0.1:1",
                                                             "tokenizer": "cross"}],
                                               "datasets": [{"domain": "gen", "path": "p.jsonl"}]}}
    with pytest.raises(ValueError, match="cross.tokenizer_path"):
        from_dict(base, TrainConfig)
    # a forked teacher's model is its tokenizer by default
    cfg = from_dict({**base, "cluster": {"mode": "fork", "teachers": [{"name": "t", "model": "/m/teacher"}]}},
                    TrainConfig)
    assert cfg.merge.teachers[0].cross.tokenizer_path == "/m/teacher"
    with pytest.raises(ValueError, match="fused_linear"):
        from_dict({**base, "merge": {**base["merge"], "teachers": [{**base["merge"]["teachers"][0],
                                                                    "cross": {"tokenizer_path": "/t"}}]},
                   "loss": {"fused_linear": True}}, TrainConfig)


def test_cross_teacher_reads_its_own_chat_template(tmp_path):
    # the teacher's prompt is the sample's chat in the teacher's template and tokens, a context
    # teacher's its context likewise; a same-tokenizer teacher keeps the student's prompt ids
    student = build_tokenizer(tmp_path / "s", chat=True)
    teacher = build_bpe_tokenizer(tmp_path / "t", merges=[("Ġ", "w"), ("h", "a")], chat=True)
    samples = [Sample(prompt="what is 2 plus 2?", answer="4")]
    cross = TeacherSpec(name="t", address="tcp://127.0.0.1:1", tokenizer="cross")
    ctx = teacher_inputs(cross, teacher, samples, [], [0])["contexts"]
    assert ctx == [encode_prompt(teacher, samples[0].chat)]
    assert teacher.decode(ctx[0]) == "<|im_start|>user\nwhat is 2 plus 2?<|im_end|>\n<|im_start|>assistant\n"
    assert ctx[0] != encode_prompt(student, samples[0].chat)   # other ids for the same text
    hinted = TeacherSpec(name="t", address="tcp://127.0.0.1:1", tokenizer="cross", context="{prompt} ({answer})")
    assert teacher.decode(teacher_inputs(hinted, teacher, samples, [], [0])["contexts"][0]).startswith(
        "<|im_start|>user\nwhat is 2 plus 2? (4)")
    same = TeacherSpec(name="t", address="tcp://127.0.0.1:1")
    assert teacher_inputs(same, student, samples, [], [0]) == {}
    assert teacher_prompts(same, student, samples, [[1, 2]]) == [[1, 2]]
