"""opd rl with `agent:`: multi-turn trajectories train on the policy's own tokens only.

The batch's mask is the rollout's (observations 0, their logprobs unused), the loss's
normalizers count assistant tokens, per-call shaping joins the trajectory's reward, and
`opd rl` runs end to end with the calculator tool (hf and vLLM engines), its metrics and card
saying what the trajectories did.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from opd.config import ConfigError, from_dict
from opd.rl.config import RLConfig
from opd.rollout.base import Rollout, RolloutEngine

CALL_OK = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*13"}}</tool_call>'
CALL_BAD = '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'   # the tool raises


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    from opd.tiny.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("chat") / "model", chat=True, seed=0)


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)   # the box is shared; one thread is faster than contending for two
    yield
    torch.set_num_threads(n)


def write_data(tmp_path) -> str:
    rows = [{"prompt": f"What is 12*{13 + i}?", "answer": str(12 * (13 + i))} for i in range(3)]
    rows.append({"messages": [{"role": "system", "content": "Be exact."},
                              {"role": "user", "content": "What is 12*13?"}], "answer": "156"})
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def config(tmp_path, model_dir, **over) -> RLConfig:
    cfg = {"model": {"path": str(model_dir)},
           "data": {"train": write_data(tmp_path)},
           "rollout": {"prompts_per_step": 2, "samples_per_prompt": 4, "max_new_tokens": 90, "temperature": 1.0},
           "algorithm": {"epochs": 1},
           "rewards": [{"name": "math"}],
           "optim": {"lr": 1e-3},
           "agent": {"tools": [{"function": "calculator"}], "max_turns": 2, "max_tokens": 240, "workers": 2},
           "run": {"steps": 1, "checkpoint_every": 0, "out_dir": str(tmp_path / "run"), "seed": 0}}
    for key, value in over.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    return from_dict(cfg, RLConfig)


def two_turns(prompt: list[int], first: list[int], observation: list[int], second: list[int],
              logprobs: list[float] | None = None) -> Rollout:
    mask = [1] * len(first) + [0] * len(observation) + [1] * len(second)
    lps = logprobs or [-0.5] * len(mask)
    return Rollout(prompt_ids=prompt, response_ids=first + observation + second, logprobs=lps,
                   finish_reason="eos", mask=mask, meta={"turns": 2})


# ---- the batch -------------------------------------------------------------------------------

def test_collate_masks_the_observation_and_drops_its_logprobs():
    from opd.rl.batch import collate

    # logprobs at the observation: NaN and a huge value, what a bug upstream could leave there
    traj = two_turns([1, 2, 3], [10, 11, 12], [20, 21], [30, 31],
                     logprobs=[-0.1, -0.2, -0.3, float("nan"), 1e4, -0.4, -0.5])
    single = Rollout(prompt_ids=[5, 6], response_ids=[40, 41, 42], logprobs=[-1.0, -2.0, -3.0], finish_reason="eos")
    batch = collate([traj, single], pad_id=0)
    p = batch.packed
    # the rows are the sampled tokens: the observation (20, 21) is none of them
    assert batch.lengths == [5, 3]
    assert p.targets_N.tolist() == [10, 11, 12, 30, 31, 40, 41, 42]
    assert batch.old_logprobs_N.tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5, -1.0, -2.0, -3.0])
    # the observation is context: in the input, attended to, in the positions' count
    assert p.input_ids_B_L[0].tolist() == [1, 2, 3, 10, 11, 12, 20, 21, 30, 31]
    assert p.attention_B_L[0].tolist() == [1] * 10
    assert p.row_pos_N[:5].tolist() == [2, 3, 4, 7, 8]

    from opd.rl import grpo   # ratio and loss stay finite however bad the observation's logprob was
    lp = torch.zeros_like(batch.old_logprobs_N)
    loss, _ = grpo.clipped_surrogate(lp, batch.old_logprobs_N, batch.per_row(torch.tensor([1.0, -1.0])))
    assert math.isfinite(float(grpo.aggregate(loss, batch.lengths, "token_mean")))


def test_the_teachers_discount_skips_observations():
    from opd.rl.batch import collate
    from opd.spine.objective import discounted

    # a trajectory's rows are its sampled tokens: the observation neither adds a term nor takes
    # a discount step, and the discount stops at the sequence's end
    traj = two_turns([1, 2], [10, 11], [20, 21], [30])
    single = Rollout(prompt_ids=[5], response_ids=[40, 41, 42], logprobs=[0.0] * 3, finish_reason="eos")
    batch = collate([traj, single], pad_id=0)
    x = torch.tensor([1.0, 2.0, 3.0, 1.0, 2.0, 3.0])
    out = discounted(x, batch.packed.row_offsets, 0.5)
    assert out.tolist() == pytest.approx([1 + 0.5 * 2 + 0.25 * 3, 2 + 0.5 * 3, 3, 1 + 0.5 * 2 + 0.25 * 3, 2 + 1.5, 3])


# ---- the loss's normalizers --------------------------------------------------------------------

@pytest.mark.parametrize("aggregation", ["token_mean", "dr_grpo"])
def test_the_loss_normalizer_counts_assistant_tokens_only(tmp_path, chat_model_dir, one_thread, aggregation):
    from opd.data import Sample
    from opd.rl import agentic
    from opd.rl.batch import collate
    from opd.rl.logprobs import token_logprobs_and_entropy
    from opd.rl.trainer import GRPOTrainer

    trainer = GRPOTrainer(config(tmp_path, chat_model_dir, algorithm={"loss_aggregation": aggregation},
                                 optim={"lr": 0.0}))
    prompt = trainer.encode(Sample(prompt="What is 12*13?"))   # rendered with the tools' schemas
    ids = trainer.tokenizer("abcdefgh", add_special_tokens=False)["input_ids"]
    # 5 sampled tokens around a 12-token observation, and a single turn of 3
    a = two_turns(prompt, ids[:3], ids[:8] + ids[:4], ids[3:5])
    b = Rollout(prompt_ids=prompt, response_ids=ids[5:8], logprobs=[0.0] * 3, finish_reason="eos")
    batch = collate([a, b], trainer.pad_id)
    with torch.no_grad():   # the policy's own logprobs: ratio 1, so each token's loss is -advantage
        batch.old_logprobs_N = token_logprobs_and_entropy(trainer.model, batch.packed, with_entropy=False)[0].cpu()
    adv = torch.tensor([1.0, -0.5])
    upd = trainer.update(batch, adv, None)
    signed = 1.0 * 5 - 0.5 * 3
    if aggregation == "token_mean":
        expected, with_observations = -signed / 8, -(1.0 * 17 - 0.5 * 3) / 20
    else:   # a trajectory samples at most min(max_tokens 240, 2 turns x 90) = 180 tokens
        assert agentic.sampled_budget(trainer.cfg) == 180
        expected, with_observations = -signed / (2 * 180), -(1.0 * 17 - 0.5 * 3) / (2 * 90)
    assert upd["loss/pg"] == pytest.approx(expected, abs=1e-5)
    assert abs(upd["loss/pg"] - with_observations) > 1e-2
    assert upd["ratio/mean"] == pytest.approx(1.0, abs=1e-5)


# ---- rewards -------------------------------------------------------------------------------------

def test_shaping_adds_per_valid_and_failed_call(tmp_path, chat_model_dir):
    from opd.rl import agentic

    cfg = config(tmp_path, chat_model_dir, agent_shaping={"valid_call": 0.1, "failed_call": -0.25, "turn_limit": -1.0})
    metas = [{"turns": 3, "tool_calls": 2, "tool_failures": 0, "turn_limit": False},
             {"turns": 3, "tool_calls": 3, "tool_failures": 2, "turn_limit": True},
             {"turns": 1, "tool_calls": 0, "tool_failures": 0, "turn_limit": False}]
    rollouts = [Rollout(prompt_ids=[1], response_ids=[2], logprobs=[0.0], finish_reason="eos", meta=m) for m in metas]
    total, parts = agentic.shaped(cfg, ([1.0, 0.0, 0.5], {"math": [1.0, 0.0, 0.5]}), rollouts)
    extra = [0.2, 0.1 - 0.5 - 1.0, 0.0]
    assert parts["agent_shaping"] == pytest.approx(extra)
    assert parts["math"] == [1.0, 0.0, 0.5]
    assert total == pytest.approx([1.2, -1.4, 0.5])
    # without the section the rewards are what the functions gave
    assert agentic.shaped(config(tmp_path, chat_model_dir), ([1.0], {"math": [1.0]}), rollouts[:1]) == \
        ([1.0], {"math": [1.0]})


# ---- what cannot combine ---------------------------------------------------------------------------

@pytest.mark.parametrize("over, error", [
    ({"agent": {"tools": []}}, "agent.tools is empty"),
    ({"cluster": {"mode": "ray"}}, "agent with cluster.mode ray is not supported"),
    ({"cluster": {"student": {"num_workers": 2}}}, "agent with cluster.student.num_workers > 1"),
    ({"agent": None, "agent_shaping": {"valid_call": 0.1}}, "agent_shaping .* needs `agent`"),
    ({"agent_shaping": {"failed_call": float("inf")}}, "key 'agent_shaping.failed_call' must be a finite number"),
    ({"rollout": {"engine": "vllm", "vllm_max_model_len": 240}}, "agent.max_tokens 240 leaves no room for a prompt"),   # the loader's finite check
])
def test_what_agent_cannot_combine_with_is_refused(tmp_path, chat_model_dir, over, error):
    with pytest.raises(ConfigError, match=error):
        config(tmp_path, chat_model_dir, **over)


def test_a_tokenizer_without_chat_template_or_a_bad_tool_is_refused_before_a_rollout(tmp_path, tiny_model_dir,
                                                                                     chat_model_dir):
    from opd.rl.trainer import GRPOTrainer

    with pytest.raises(ConfigError, match="has no chat template"):
        GRPOTrainer(config(tmp_path, tiny_model_dir))
    (tmp_path / "tools.py").write_text("def nodoc(x):\n    return x\n")
    with pytest.raises(ConfigError, match="agent.tools: .*nodoc"):
        GRPOTrainer(config(tmp_path, chat_model_dir, agent={"tools": [{"function": "tools.py:nodoc"}]}),
                    config_dir=tmp_path, overwrite=True)


# ---- end to end ---------------------------------------------------------------------------------------

class ToolCalling(RolloutEngine):
    """The real engine, with two samples of each group calling the calculator: a random tiny
    model does not. In a group's first turn (n > 1) sample 0 calls 12*13 and sample 1 divides by
    zero (the tool fails); sample 0 calls again in its second turn (max_turns 2 cuts it there).
    The forced tokens carry the policy's own log-probs (temperature 1: what sampling them gives),
    so the importance ratio stays 1."""

    def __init__(self, engine, model, tokenizer):
        self.engine, self.model, self.tok = engine, model, tokenizer

    def generate(self, prompts, params):
        from opd.rl.batch import collate
        from opd.rl.logprobs import token_logprobs_and_entropy

        outs = self.engine.generate(prompts, params)
        for i, r in enumerate(outs):
            seen = self.tok.decode(r.prompt_ids)
            call = (CALL_OK, CALL_BAD)[i % params.n] if params.n > 1 and i % params.n < 2 else \
                CALL_OK if params.n == 1 and CALL_OK in seen else None
            if call is None:
                continue
            ids = self.tok(call, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            assert len(ids) <= params.max_new_tokens
            forced = Rollout(prompt_ids=r.prompt_ids, response_ids=ids, logprobs=[0.0] * len(ids), finish_reason="eos")
            with torch.no_grad():
                lp = token_logprobs_and_entropy(self.model, collate([forced], self.tok.pad_token_id).packed,
                                                with_entropy=False)[0]
            outs[i] = dataclasses.replace(r, response_ids=ids, logprobs=lp.tolist(), finish_reason="eos",
                                          topk_ids=None)
        return outs

    def sync_weights(self, model):
        self.engine.sync_weights(model)

    def close(self):
        self.engine.close()


def write_yaml(tmp_path, model_dir, engine: str, **extra) -> str:
    import yaml

    data = write_data(tmp_path)
    cfg = {"model": {"path": str(model_dir)},
           "rollout": {"engine": engine, "prompts_per_step": 2, "samples_per_prompt": 4, "max_new_tokens": 90,
                       "temperature": 1.0,
                       **({"vllm_max_model_len": 512} if engine == "vllm" else {})},
           "data": {"train": data, "eval": data, "eval_prompts": 2},
           "algorithm": {"epochs": 1, "kl_beta": 0.01},
           "rewards": [{"name": "math"}],
           "agent": {"tools": [{"function": "calculator"}], "max_turns": 2, "max_tokens": 240, "workers": 2},
           "agent_shaping": {"valid_call": 0.5, "failed_call": -0.25, "turn_limit": -1.0},
           "optim": {"lr": 1e-3},
           "run": {"steps": 2, "checkpoint_every": 1, "out_dir": "run", "seed": 0}, **extra}
    path = tmp_path / "agentic_rl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def run_agentic(tmp_path, model_dir, engine: str, steps: int | None = None, resume: bool = False):
    from opd.rl.train import load_config
    from opd.rl.trainer import GRPOTrainer

    path = write_yaml(tmp_path, model_dir, engine)
    trainer = GRPOTrainer(load_config(path, steps=steps), config_dir=tmp_path, resume=resume)
    trainer.engine.engine = ToolCalling(trainer.engine.engine, trainer.model, trainer.tokenizer)
    trainer.train()
    out = tmp_path / "run"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], \
        json.loads((out / "card.json").read_text())


def check_trajectories(rows: list[dict], card: dict, steps: int) -> None:
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        # per group: sample 0 calls (runs), calls again and is cut by max_turns; sample 1's call
        # fails; samples 2 and 3 answer at once
        assert r["agent/turns"] == pytest.approx(1.5)
        assert r["agent/tool_calls"] == pytest.approx(0.5)
        assert r["agent/tool_failure_share"] == pytest.approx(0.5)
        assert r["agent/turn_limit_rate"] == pytest.approx(0.25)
        assert r["agent/observation_tokens"] > 0
        # a trajectory's tokens are its sampled ones and its observations
        assert r["length/mean"] - r["length/sampled_mean"] == pytest.approx(r["agent/observation_tokens"])
        assert r["reward/agent_shaping"] == pytest.approx((0.5 - 1.0 - 0.25) / 4)
        assert r["ratio/mean"] == pytest.approx(1.0, abs=2e-3)
        assert math.isfinite(r["loss"]) and math.isfinite(r["kl"])
    assert "eval/agent/turns" in rows[-1] and "eval/reward" in rows[-1]
    agent = card["agent"]
    assert agent["tools"] == ["calculator"] and agent["max_turns"] == 2
    assert agent["max_tokens (a trajectory after its prompt)"] == 240
    assert agent["trajectories"] == steps * 8
    assert agent["turns per trajectory"] == pytest.approx(1.5)
    assert agent["tool calls per trajectory"] == pytest.approx(0.5)
    assert agent["tool failure share"] == pytest.approx(0.5)
    assert agent["turn-limit hit rate"] == pytest.approx(0.25)
    masked = sum(r["agent/observation_tokens"] for r in rows) * 8
    assert agent["observation tokens masked"].startswith(f"{round(masked)} (")
    assert agent["shaping"] == {"valid_call": 0.5, "failed_call": -0.25, "turn_limit": -1.0}


def test_opd_rl_with_the_calculator_end_to_end(tmp_path, chat_model_dir, one_thread):
    from opd.checkpoint import CheckpointError, latest_checkpoint
    from opd.rl.train import load_config
    from opd.rl.trainer import GRPOTrainer

    rows, card = run_agentic(tmp_path, chat_model_dir, "hf")
    check_trajectories(rows, card, 2)
    md = (tmp_path / "run" / "card.md").read_text()
    for fact in ("calculator", "turn-limit hit rate", "observation tokens masked", "tool failure share"):
        assert fact in md, fact
    state = json.loads((latest_checkpoint(tmp_path / "run" / "checkpoints") / "state.json").read_text())
    assert state["agent"][0] == 16   # the run's trajectories so far, for the card after a resume
    # a resume keeps the agent's objective (tools, limits, shaping)
    with pytest.raises(CheckpointError, match=r"agent\.max_turns: 2 -> 3"):
        GRPOTrainer(dataclasses.replace(cfg := load_config(write_yaml(tmp_path, chat_model_dir, "hf"), steps=3),
                                        agent=dataclasses.replace(cfg.agent, max_turns=3)), resume=True)
    # --resume: the card's totals cover the steps before it
    rows, card = run_agentic(tmp_path, chat_model_dir, "hf", steps=3, resume=True)
    check_trajectories(rows, card, 3)


TRAJECTORY_REWARD = """
def used_tools(sample, text, trajectory):
    # the whole trajectory, not its final turn: a calculator call whose result the model read
    calls = [c for c in trajectory.tool_calls if c.name == "calculator"]
    return len(calls) + 10 * any("156" in o for o in trajectory.observations)
"""


def test_a_reward_reads_the_whole_trajectory_its_tool_calls_and_their_results(tmp_path, chat_model_dir, one_thread):
    from opd.rl.train import load_config
    from opd.rl.trainer import GRPOTrainer

    (tmp_path / "traj.py").write_text(TRAJECTORY_REWARD)
    path = write_yaml(tmp_path, chat_model_dir, "hf", rewards=[{"name": "python", "path": "traj.py:used_tools"}],
                      agent_shaping={"valid_call": 0.0, "failed_call": 0.0, "turn_limit": 0.0})
    trainer = GRPOTrainer(load_config(path, steps=1), config_dir=tmp_path)
    trainer.engine.engine = ToolCalling(trainer.engine.engine, trainer.model, trainer.tokenizer)
    trainer.train()
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    # per group: sample 0 calls 12*13, reads 156 and calls again (cut by max_turns): 2 + 10; sample
    # 1's call fails (1/0): 1; samples 2 and 3 answer without a call: 0. The final turns alone
    # would give 1, 0, 0, 0.
    assert row["reward/python:used_tools"] == pytest.approx((12 + 1 + 0 + 0) / 4)


def test_a_trajectory_is_the_turns_the_observations_between_them_and_each_turns_calls(chat_model_dir):
    from opd.agent.trajectory import trajectory
    from opd.spine.model import load_tokenizer

    tok = load_tokenizer(chat_model_dir)
    turn1, seen, turn2 = (tok(t, add_special_tokens=False)["input_ids"] for t in (CALL_OK, "result: 156", "The answer is 156"))
    ro = Rollout(prompt_ids=[1], response_ids=turn1 + seen + turn2, logprobs=[0.0] * 99, finish_reason="eos",
                 mask=[1] * len(turn1) + [0] * len(seen) + [1] * len(turn2), meta={"turns": 2})
    t = trajectory(ro, tok)
    assert t.turns == [CALL_OK, "The answer is 156"] and t.observations == ["result: 156"]
    assert [c.name for c in t.tool_calls] == ["calculator"] and t.calls[1] == []
    assert t.tool_calls[0].arguments == {"expression": "12*13"} and t.meta == {"turns": 2}
    one = trajectory(Rollout([1], turn2, [0.0] * len(turn2), "eos"), tok)   # one turn, no mask
    assert one.turns == ["The answer is 156"] and one.observations == [] and one.calls == [[]]


@pytest.mark.vllm   # ~30 s: in make test, since the issue's done-when names this run
def test_opd_rl_with_the_calculator_on_the_vllm_engine(tmp_path, chat_model_dir, one_thread):
    pytest.importorskip("vllm")
    rows, card = run_agentic(tmp_path, chat_model_dir, "vllm")
    check_trajectories(rows, card, 2)
    assert card["sampling"]["engine"] == "vllm"


def test_validate_answers_as_an_agent(tmp_path, chat_model_dir, one_thread):
    from opd.rl.validate import ValidateConfig, validate

    cfg = from_dict({"models": [{"name": "chat", "path": str(chat_model_dir)}],
                     "sets": [{"domain": "math", "path": write_data(tmp_path), "limit": 2}],
                     "samples": 2, "k": [1], "max_new_tokens": 8, "out_dir": str(tmp_path / "val"),
                     "agent": {"tools": [{"function": "calculator"}], "max_turns": 2, "max_tokens": 64}},
                    ValidateConfig)
    result = validate(cfg)
    res = result["results"]["chat"]["math"]
    assert res["agent/turns"] >= 1.0 and "agent/tool_calls" in res
    assert res["checks"]["rows"]["turn_limit"]["of"] == 4   # 2 prompts x 2 samples: the agent's exit checks
    assert "agent/turns" in (tmp_path / "val" / "report.md").read_text()


def test_the_example_config_loads():
    from pathlib import Path

    from opd.rl.train import load_config

    root = Path(__file__).resolve().parents[2] / "configs"
    cfg = load_config(str(root / "agentic_rl.yaml"))
    assert [t.function for t in cfg.agent.tools] == ["calculator"] and cfg.agent_shaping is not None
    data = root.parent / "runs" / "demo" / "agentic" / "data"
    assert Path(cfg.data.train).resolve() == (data / "train.jsonl").resolve()


def test_a_teacher_answers_only_the_sampled_tokens(tmp_path, chat_model_dir, one_thread, monkeypatch):
    """With the start policy as the teacher, its log-probs at the rows it answered are the
    rollout's own at the sampled positions: the rows (protocol 2.5 masks) land where they belong."""
    from opd.rl import teachers as rl_teachers
    from opd.rl.train import load_config
    from opd.rl.trainer import GRPOTrainer
    from opd.teachers.launch import start_server_process

    server = start_server_process(["--model", str(chat_model_dir), "--max-k", "16", "--name", "t"])
    try:
        seen = []
        terms = rl_teachers.terms
        monkeypatch.setattr(rl_teachers, "terms", lambda *a: seen.append((a[3], terms(*a))) or seen[-1][1])
        teacher = {"name": "t", "address": server.address, "mode": "sampled", "k": 8, "weight": 0.5, "gamma": 0.9}
        cfg = load_config(write_yaml(tmp_path, chat_model_dir, "hf", teachers=[teacher],
                                     teacher_client={"connect_timeout_s": 10.0}), steps=1)
        trainer = GRPOTrainer(cfg, config_dir=tmp_path)
        trainer.engine.engine = ToolCalling(trainer.engine.engine, trainer.model, trainer.tokenizer)
        trainer.train()
    finally:
        server.stop()
    (batch, (term,)), = seen
    # observations between turns: in the sequences, not among the rows
    o, pos = batch.packed.row_offsets, batch.packed.row_pos_N
    spans = [int(pos[o[b + 1] - 1] - pos[o[b]]) + 1 for b in range(len(o) - 1) if o[b + 1] > o[b]]
    assert sum(spans) > o[-1]
    assert int(term.on_B.sum()) == 8
    assert torch.allclose(term.lp_N, batch.old_logprobs_N, atol=1e-4)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["signal/teacher"] < 1e-3 < row["signal/reward"]   # the start policy agrees with itself


def test_the_example_validate_config_loads_as_an_agent():
    from pathlib import Path

    from opd.config import load_yaml
    from opd.rl.validate import ValidateConfig

    root = Path(__file__).resolve().parents[2] / "configs"
    cfg = load_yaml(root / "agentic_validate.yaml", ValidateConfig)
    assert [t.function for t in cfg.agent.tools] == ["calculator"] and cfg.agent.max_turns == 3
    assert {m.role for m in cfg.models} == {"base", "student", "teacher"}
