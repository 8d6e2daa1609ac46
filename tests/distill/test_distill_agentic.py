"""`opd train` with `agent:`, end to end: a tiny chat student taught to call the built-in
calculator samples two-turn trajectories (call, observation, answer); its teachers are sent
each trajectory with the row mask of its own kept tokens and answer those rows alone, which
are the rows trained; the metrics and the card say what the trajectories did."""

import json
from dataclasses import replace

import pytest
import torch

from opd.agent.config import AgentConfig, ToolSpec
from opd.agent.loop import trajectory_metrics
from opd.agent.tools import build_toolbox
from opd.checkpoint import CheckpointError
from opd.config import from_dict
from opd.data import encode_prompt, write_jsonl
from opd.distill import agentic
from opd.distill.config import TrainConfig
from opd.teachers.session import TeacherSet
from opd.distill.trainer import Trainer, TrainError
from opd.metrics import read_metrics
from opd.spine.rows import trim_turns
from opd.tiny import build_tokenizer

pytestmark = pytest.mark.timeout(400)

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
CONTEXT = "{prompt} The answer is {answer}."
PROMPTS = {"a": range(0, 4), "b": range(50, 54)}   # domain -> the i of its "i+i=" prompts (first 3: train)


def _rows(domain):
    return [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "domain": domain} for i in PROMPTS[domain]]


def _teach_the_call(path):
    """A tiny chat model fitted to answer every prompt with CALL and, after the tool's "2", with "2"."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.spine.rows import sft_loss
    from opd.tiny import build_tiny_model

    build_tiny_model(path, chat=True, seed=0)
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    tools = build_toolbox(AgentConfig(tools=[ToolSpec("calculator")]), ".").schemas()
    pairs = []
    for row in _rows("a") + _rows("b"):
        user = {"role": "user", "content": row["prompt"]}
        called = [user, {"role": "assistant", "content": CALL}, {"role": "tool", "content": "2"}]
        for msgs, answer in (([user], CALL), (called, "2")):
            pairs.append((encode_prompt(tok, msgs, tools=tools),
                          tok(answer + tok.eos_token, add_special_tokens=False)["input_ids"]))
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(600):
        loss = sft_loss(model, [p for p, _ in pairs], [r for _, r in pairs], tok.pad_token_id)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if loss.item() < 5e-4:
            break
    assert loss.item() < 5e-2
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from opd.teachers.launch import start_server_process
    from opd.tiny import perturb_model

    root = tmp_path_factory.mktemp("opd_agentic")
    student = _teach_the_call(root / "student")
    teacher = perturb_model(student, root / "teacher", scale=0.3, seed=2)
    for d in PROMPTS:
        rows = _rows(d)
        write_jsonl(root / f"{d}.jsonl", rows[:3])
        write_jsonl(root / f"{d}_eval.jsonl", rows[3:])
    server = start_server_process(["--model", str(teacher), "--max-k", "16", "--name", "t"])
    try:
        yield {"root": root, "student": student, "address": server.address}
    finally:
        server.stop()


def _cfg(s, name, **rollout):
    """Two teachers of one server: `plain` at the student's top 4 (domain a), `ctx` seeing the
    answer in its own prompt (domain b)."""
    return from_dict({
        "student": {"path": str(s["student"])},
        "merge": {"teachers": [{"name": "plain", "address": s["address"], "domains": ["a"], "mode": "student_topk",
                                "k": 4},
                               {"name": "ctx", "address": s["address"], "domains": ["b"], "k": 8, "context": CONTEXT}],
                  "datasets": [{"domain": d, "path": str(s["root"] / f"{d}.jsonl"),
                                "eval_path": str(s["root"] / f"{d}_eval.jsonl")} for d in PROMPTS],
                  "routing": {"rules": [{"kind": "domain_field"}]}},
        "agent": {"tools": [{"function": "calculator"}], "max_turns": 3, "max_tokens": 128},
        "rollout": {"prompts_per_step": 4, "max_new_tokens": 96, **rollout},
        "optim": {"lr": 1e-4, "micro_batch_size": 4},
        "teacher_client": {"connect_timeout_s": 5.0},
        "run": {"steps": 2, "eval_every": 2, "eval_prompts": 2, "checkpoint_every": 2,
                "out_dir": str(s["root"] / name), "progress": False, "tensorboard": False},
    }, TrainConfig)


class Recording(Trainer):
    """Keeps every batch it sends (training batches and evaluations) in `sent`."""

    def _submit(self, batch):
        self.__dict__.setdefault("sent", []).append(batch)
        return super()._submit(batch)


def _train_and_check(setup, name, monkeypatch, **rollout):
    requests = []
    request = TeacherSet.request

    def spy(self, teacher, sequences, starts, contexts=None, candidates=None, rows=None):
        fut = request(self, teacher, sequences, starts, contexts, candidates, rows)
        requests.append((teacher, sequences, starts, contexts, candidates, rows, fut))
        return fut

    monkeypatch.setattr(TeacherSet, "request", spy)
    trainer = Recording(_cfg(setup, name, **rollout))
    trainer.run()
    tok, out = trainer.tok, setup["root"] / name
    tools = build_toolbox(trainer.cfg.agent, ".").schemas()
    # Each batch's requests, in the order _submit made them (one per teacher routed to).
    calls = iter(requests)
    trained = {}   # batch index -> rows the teachers answered
    for batch in trainer.sent:
        for t, seqs in batch.members.items():
            teacher, sequences, starts, contexts, candidates, rows, fut = next(calls)
            assert teacher == t
            ros = [batch.rollouts[s] for s in seqs]
            cut = [trim_turns(ro, trainer.trim) for ro in ros]
            assert sequences == [ro.prompt_ids + ro.response_ids[:k] for ro, (k, _) in zip(ros, cut)]
            assert starts == [len(ro.prompt_ids) for ro in ros]
            # the row mask sent: the rollout's own mask, cut per turn after its end-of-turn token
            assert rows == [m for _, m in cut]
            for ro, (k, m) in zip(ros, cut):
                assert m == [bool(x) for x in ro.mask[:k]]          # trim eos: turns end at their EOS
            n_rows = sum(map(sum, rows))
            answer = fut.result()
            assert answer.row_offsets[-1] == n_rows                 # the answer holds the masked rows alone
            if t == "plain":   # student_topk: candidates at those rows only
                assert candidates.shape == (n_rows, 4) and contexts is None
            else:              # its own prompt, rendered with the tools as the student's is
                assert candidates is None
                for ctx, ro in zip(contexts, ros):
                    sample = batch.samples[ro.prompt_index]
                    assert ctx == encode_prompt(tok, CONTEXT.format(prompt=sample.prompt, answer=sample.answer),
                                                tools=tools)
            if batch.index >= 0:
                trained[batch.index] = trained.get(batch.index, 0) + n_rows
    # The trajectories called the tool and read its answer: observations masked out of the rows.
    rollouts = [ro for b in trainer.sent if b.index >= 0 for ro in b.rollouts]
    assert sum(ro.meta["tool_calls"] for ro in rollouts) >= 4
    assert any(0 in ro.mask and ro.mask[-1] == 1 for ro in rollouts)   # call, observation, answer
    steps = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    batches = {b.index: b for b in trainer.sent if b.index >= 0}
    for r in steps:   # step i trains batch i - 1 (pipelined, one batch a step): its rows, its trajectories
        batch = batches[r["step"] - 1]
        assert r["tokens"] == trained[batch.index] == sum(batch.rows(s) for s in range(len(batch.rollouts)))
        want = trajectory_metrics(batch.rollouts)
        assert set(want) <= set(r) and all(r[k] == pytest.approx(v) for k, v in want.items())
        assert r["masked_tokens"] == sum(ro.mask.count(0) for ro in batch.rollouts) > 0
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval/kl" in r]
    assert len(evals) == 2 and all("eval/agent/turns" in r for r in evals)
    card = json.loads((out / "card.json").read_text())["agent"]
    assert card["tools"] == ["calculator"] and card["max_turns"] == 3
    assert card["max_tokens (a trajectory after its prompt)"] == 128
    trained_ros = [ro for i in (0, 1) for ro in batches[i].rollouts]
    run = trajectory_metrics(trained_ros)
    assert card["trajectories"] == len(trained_ros) == 8
    assert card["turns per trajectory"] == pytest.approx(run["agent/turns"])
    assert card["tool calls per trajectory"] == pytest.approx(run["agent/tool_calls"])
    assert card["tool failure share"] == pytest.approx(run["agent/tool_failure_share"])
    assert card["turn-limit hit rate"] == pytest.approx(run["agent/turn_limit_rate"])
    masked = sum(ro.mask.count(0) for ro in trained_ros)
    assert card["observation tokens masked"].startswith(f"{masked} (")
    # the checkpoint keeps the run's trajectory sums (a resumed run's card covers every step)
    state = json.loads(next(out.glob("checkpoints/*/state.json")).read_text())
    assert state["agent"] == agentic.sums(trained_ros)
    return trainer


def test_agentic_trajectories_train_on_their_own_tokens_end_to_end(setup, monkeypatch):
    trainer = _train_and_check(setup, "hf", monkeypatch)
    # agent.* defines the trajectories trained on: a resume under other limits is refused
    cfg = replace(trainer.cfg, agent=replace(trainer.cfg.agent, max_turns=2))
    with pytest.raises(CheckpointError, match=r"agent.max_turns: 3 -> 2"):
        Trainer(cfg, resume=True).run()


@pytest.mark.vllm   # ~30 s: in make test, since the done-when names this run
@pytest.mark.timeout(600)
def test_agentic_trajectories_sampled_by_vllm(setup, monkeypatch):
    pytest.importorskip("vllm")
    _train_and_check(setup, "vllm", monkeypatch, engine="vllm", vllm_max_model_len=256)


def test_what_agent_cannot_run_with_is_refused(setup):
    cfg = _cfg(setup, "refused")
    with pytest.raises(ValueError, match="agent.tools is empty"):
        replace(cfg, agent=AgentConfig(tools=[]))
    with pytest.raises(ValueError, match="num_workers > 1 is not supported"):
        replace(cfg, cluster=replace(cfg.cluster, student=replace(cfg.cluster.student, num_workers=2)),
                rollout=replace(cfg.rollout, prompts_per_step=4))
    with pytest.raises(ValueError, match="agent.max_tokens 128 leaves no room for a prompt in rollout.vllm_max"):
        replace(cfg, rollout=replace(cfg.rollout, engine="vllm", vllm_max_model_len=128))
    # prompts must leave room for the whole trajectory (agent.max_tokens), not one turn
    long = replace(cfg, agent=replace(cfg.agent, max_tokens=500))
    with pytest.raises(TrainError, match=r"leave no room for agent.max_tokens \(500\)"):
        Trainer(long).run()


def test_a_tokenizer_without_a_chat_template_or_a_tool_that_cannot_be_built_is_refused(tiny_model_dir, tmp_path):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    cfg = SimpleNamespace(agent=AgentConfig(tools=[ToolSpec("calculator")]), student=SimpleNamespace(
        path=str(tiny_model_dir)))
    with pytest.raises(TrainError, match="has no chat template"):
        agentic.schemas(cfg, AutoTokenizer.from_pretrained(tiny_model_dir), ".")
    with pytest.raises(TrainError, match="no_such_tool"):   # a tool that cannot be built: before the first step
        agentic.schemas(SimpleNamespace(agent=AgentConfig(tools=[ToolSpec("opd.data:no_such_tool")]),
                                        student=cfg.student), build_tokenizer(tmp_path, chat=True), ".")
    assert agentic.schemas(SimpleNamespace(agent=None, student=cfg.student), None, ".") is None
