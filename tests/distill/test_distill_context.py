"""`opd train` with what a teacher sees and where it looks (protocol 2.4), end to end: a `self`
teacher (the student's start, served by the run itself) that sees the reference answer in its
own prompt, beside a teacher that answers at the student's own top k."""

import json
from dataclasses import replace

import pytest
import torch

from opd.config import from_dict
from opd.data import encode_prompt, write_jsonl
from opd.distill.config import TrainConfig
from opd.teachers.session import TeacherSet
from opd.distill.trainer import Trainer, TrainError
from opd.metrics import read_metrics
from opd.tiny import lm_head_teacher

pytestmark = pytest.mark.timeout(300)

CONTEXT = "{prompt} The answer is {answer}."


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    from opd.teachers.launch import start_server_process

    root = tmp_path_factory.mktemp("opd_context")
    teacher = lm_head_teacher(tiny_model_dir, root / "teacher")
    for name, first in (("a", 0), ("b", 50)):
        write_jsonl(root / f"{name}.jsonl", [{"prompt": f"{i}+{i}=", "answer": str(2 * i)}
                                             for i in range(first, first + 12)])
        write_jsonl(root / f"{name}_eval.jsonl", [{"prompt": f"{i}+{i}=", "answer": str(2 * i)}
                                                  for i in range(first + 20, first + 24)])
    server = start_server_process(["--model", str(teacher), "--max-k", "16", "--name", "other"])
    try:
        yield {"root": root, "student": tiny_model_dir, "address": server.address}
    finally:
        server.stop()


def _cfg(s, name, steps=3, **merge_teacher):
    return from_dict({
        "student": {"path": str(s["student"])},
        "merge": {"teachers": [{"name": "self", "address": "tcp://127.0.0.1:*", "domains": ["a"], "k": 8,
                                "context": CONTEXT, **merge_teacher},
                               {"name": "other", "address": s["address"], "domains": ["b"], "mode": "student_topk",
                                "k": 6}],
                  "datasets": [{"domain": d, "path": str(s["root"] / f"{d}.jsonl"),
                                "eval_path": str(s["root"] / f"{d}_eval.jsonl")} for d in ("a", "b")],
                  "routing": {"rules": [{"kind": "domain_field"}]}},
        "cluster": {"mode": "fork", "teachers": [{"name": "self", "model": "self", "serve_args": ["--max-k", "16"]}]},
        "rollout": {"prompts_per_step": 4, "max_new_tokens": 8},
        "optim": {"lr": 3e-3, "micro_batch_size": 4},
        "teacher_client": {"connect_timeout_s": 5.0},
        "run": {"steps": steps, "eval_every": steps, "eval_prompts": 4, "out_dir": str(s["root"] / name),
                "progress": False, "tensorboard": False},
    }, TrainConfig)


def test_a_self_teacher_with_context_and_a_student_topk_teacher_train_end_to_end(setup, monkeypatch):
    sent, answered = [], []
    request = TeacherSet.request

    def spy(self, teacher, sequences, starts, contexts=None, candidates=None):
        fut = request(self, teacher, sequences, starts, contexts, candidates)
        sent.append((teacher, sequences, starts, contexts, candidates))
        answered.append(fut)
        return fut

    monkeypatch.setattr(TeacherSet, "request", spy)
    trainer = Trainer(_cfg(setup, "both"))
    assert trainer.cfg.cluster.teachers[0].model == str(setup["student"])   # `model: self`
    trainer.run()
    tok = trainer.tok
    seen = {t for t, *_ in sent}
    assert seen == {"self", "other"}
    for (teacher, sequences, starts, contexts, candidates), fut in zip(sent, answered):
        if teacher == "self":   # its own prompt: the sample's, with its answer, through the chat template
            assert candidates is None and len(contexts) == len(sequences)
            for seq, st, ctx in zip(sequences, starts, contexts):
                prompt = tok.decode(seq[:st])
                i = int(prompt.split("+")[0])
                assert ctx == encode_prompt(tok, CONTEXT.format(prompt=f"{i}+{i}=", answer=2 * i))
        else:                   # the student's own top 6 at each response token; answered there
            rows = sum(len(s) - st for s, st in zip(sequences, starts))
            assert contexts is None and candidates.shape == (rows, 6) and candidates.dtype == torch.int32
            assert torch.equal(fut.result().topk.ids, candidates)
    # The first batch was sampled by the start's weights: its candidates are their top 6.
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(str(setup["student"]), dtype=torch.float32).eval()
    _, sequences, starts, _, candidates = next(x for x in sent if x[0] == "other")
    with torch.no_grad():
        want = torch.cat([start(torch.tensor([q])).logits[0, st - 1:len(q) - 1].topk(6, -1).indices
                          for q, st in zip(sequences, starts)])
    assert torch.equal(candidates.long(), want)
    rows = read_metrics(setup["root"] / "both" / "metrics.jsonl")
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 3 and all(r["loss"] == r["loss"] and r["loss"] >= 0 for r in steps)
    assert any("eval/kl" in r for r in rows)
    card = json.loads((setup["root"] / "both" / "card.json").read_text())
    me, other = card["teacher self"], card["teacher other"]
    assert me["self"].startswith("a frozen copy of the student's start") and CONTEXT in me["sees"]
    assert "student's own top k" in other["scoring"] and "self" not in other


def test_a_context_field_the_samples_lack_is_refused_at_load(setup):
    cfg = _cfg(setup, "missing")   # only the served teacher, given a context its samples cannot fill
    other = cfg.merge.teachers[1]
    cfg = replace(cfg, cluster=replace(cfg.cluster, mode="local", teachers=[]), merge=replace(
        cfg.merge, routing=replace(cfg.merge.routing, rules=[]),
        teachers=[replace(other, domains=[], context="{prompt} Solution: {solution}")]))
    with pytest.raises(TrainError, match=r"needs the field 'solution'.*has \['answer', 'domain', 'prompt'\]"):
        Trainer(cfg).run()


def test_context_templates_are_checked_when_the_config_loads(setup):
    with pytest.raises(ValueError, match="no template"):
        _cfg(setup, "bad", context="{prompt} {")
    with pytest.raises(ValueError, match="plain field names"):
        _cfg(setup, "bad", context="{answer[0]}")


def test_the_example_config_loads_with_its_self_teacher_resolved():
    from pathlib import Path

    from opd.distill.config import load_train_config

    path = Path(__file__).resolve().parents[2] / "configs" / "merge_self_distill.yaml"
    cfg = load_train_config(path)
    modes = {t.name: (t.mode, t.context) for t in cfg.merge.teachers}
    assert modes == {"math": ("student_topk", None), "self": ("topk", "# a solution: {response}\n{prompt}")}
    assert cfg.cluster.teachers[0].model == cfg.student.path == str(path.parent / "../runs/demo/student")
