"""The multi-turn loop: tool calls parsed, observations as the chat template renders them, and
trajectories whose masks say exactly which tokens the model sampled."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from opd.agent.calls import parse_calls
from opd.agent.chat import ChatTemplateError, observation_ids
from opd.agent.config import AgentConfig
from opd.agent.loop import AgentEngine, trajectory_metrics
from opd.rollout.base import Rollout, RolloutEngine, SamplingParams
from opd.tiny.models import build_tiny_model

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*13"}}</tool_call>'
SCHEMA = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object", "properties": {"expression": {
                                               "type": "string", "description": "the expression"}},
                                               "required": ["expression"]}}}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = build_tiny_model(tmp_path_factory.mktemp("chat"), chat=True, seed=3)
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@dataclass
class Outcome:
    ok: bool
    text: str


class FakeTools:
    """A calculator that answers eval of its expression, or fails on 'boom'."""
    def __init__(self):
        self.seen = []

    def schemas(self):
        return [SCHEMA]

    def call_many(self, calls):
        self.seen.append(list(calls))
        return [Outcome(False, "error: boom") if a.get("expression") == "boom" else Outcome(True, str(eval(a["expression"])))
                for _, a in calls]


class ScriptedEngine(RolloutEngine):
    """Answers each generate call with the next turn texts of a script, one per prompt row."""
    def __init__(self, tok, script: list[list[str]]):
        self.tok, self.script, self.prompts, self.params = tok, list(script), [], []

    def generate(self, prompts, params):
        self.prompts.append([list(p) for p in prompts])
        self.params.append(params)
        texts = self.script.pop(0)
        out = []
        for i, p in enumerate(prompts):
            for j in range(params.n):
                text = texts[i * params.n + j]
                ids = self.tok(text, add_special_tokens=False)["input_ids"]
                ids = ids[:params.max_new_tokens]
                out.append(Rollout(list(p), ids, [-0.5] * len(ids), "eos" if ids and ids[-1] == self.tok.eos_token_id
                                   else "length", prompt_index=i))
        return out

    def sync_weights(self, model):
        pass


def test_parse_calls_reads_hermes_calls_and_turns_bad_ones_into_errors():
    assert parse_calls("The answer is 5.") == []
    (c,) = parse_calls("let me compute " + CALL)
    assert (c.name, c.arguments, c.error) == ("calculator", {"expression": "12*13"}, None)
    assert parse_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[0].arguments == {"x": 1}
    bad = parse_calls("<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
                      '<tool_call>{"name": "f", "arguments": 3}</tool_call><tool_call>{"name": "f"')
    assert [c.name for c in bad] == [None, None, "f", None] and all(c.error.startswith("error: ") for c in bad)


def test_observation_tokens_are_what_the_template_renders_for_the_whole_conversation(chat_model):
    _, tok = chat_model
    user = [{"role": "user", "content": "12*13="}]
    prompt = tok.apply_chat_template(user, tools=[SCHEMA], add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    turn = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    obs = observation_ids(tok, ["156"], tok.decode([tok.eos_token_id]), [SCHEMA])
    whole = tok.apply_chat_template(user + [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "156"}],
                                    tools=[SCHEMA], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(prompt) + turn + obs == list(whole)
    assert tok.decode(obs) == "\n<|im_start|>tool\n156<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_the_start_of_a_conversation_is_refused(chat_model):
    _, tok = chat_model
    tok = type(tok).from_pretrained(tok.name_or_path)
    tok.chat_template = "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ChatTemplateError):
        observation_ids(tok, ["1"], "", None)


def test_two_turn_trajectory_masks_meta_and_what_the_second_turn_was_given(chat_model):
    _, tok = chat_model
    eos = tok.decode([tok.eos_token_id])
    # 2 prompts x n=2: a call then an answer; an answer at once; a malformed call then an answer;
    # a failing call then an answer.
    script = [[CALL + eos, "156" + eos, "<tool_call>{oops}</tool_call>" + eos,
               CALL.replace("12*13", "boom") + eos],
              ["The answer is 156" + eos, "I could not" + eos, "sorry" + eos]]
    engine = ScriptedEngine(tok, script)
    agent = AgentEngine(engine, tok, FakeTools(), AgentConfig(max_turns=3, max_tokens=400), {tok.eos_token_id})
    prompts = [tok("A", add_special_tokens=False)["input_ids"], tok("B", add_special_tokens=False)["input_ids"]]
    out = agent.generate(prompts, SamplingParams(n=2, max_new_tokens=120, seed=1))
    assert [r.prompt_index for r in out] == [0, 0, 1, 1]
    call_ids = tok(CALL + eos, add_special_tokens=False)["input_ids"]
    obs = observation_ids(tok, ["156"], eos, [SCHEMA])
    answer = tok("The answer is 156" + eos, add_special_tokens=False)["input_ids"]
    r = out[0]
    assert r.response_ids == call_ids + obs + answer
    assert r.mask == [1] * len(call_ids) + [0] * len(obs) + [1] * len(answer)
    assert r.logprobs == [-0.5] * len(call_ids) + [0.0] * len(obs) + [-0.5] * len(answer)
    assert r.meta == {"turns": 2, "tool_calls": 1, "tool_failures": 0, "turn_limit": False,
                      "observation_tokens": len(obs), "budget": False}
    assert r.text(tok) == "The answer is 156" and r.finish_reason == "eos"
    assert out[1].mask == [1] * len(out[1].response_ids) and out[1].meta["turns"] == 1
    assert [o.meta["tool_failures"] for o in out[2:]] == [1, 1]   # malformed, and a tool that failed
    assert "error: the tool call is not JSON" in tok.decode(out[2].response_ids)
    assert "error: boom" in tok.decode(out[3].response_ids)
    # The second turn: every trajectory still going, one sample each, its whole context as the prompt.
    assert engine.prompts[1] == [prompts[0] + call_ids + obs, *(p for p in (
        prompts[1] + out[2].response_ids[:out[2].mask.index(1, out[2].mask.index(0))],
        prompts[1] + out[3].response_ids[:out[3].mask.index(1, out[3].mask.index(0))]))]
    assert engine.params[1].n == 1 and engine.params[1].seed != engine.params[0].seed
    m = trajectory_metrics(out)
    assert m == {"agent/turns": 7 / 4, "agent/tool_calls": 3 / 4, "agent/tool_failure_share": 2 / 3,
                 "agent/observation_tokens": sum(o.meta["observation_tokens"] for o in out) / 4,
                 "agent/turn_limit_rate": 0.0}


def test_turn_limit_and_budget_end_a_trajectory(chat_model):
    _, tok = chat_model
    eos = tok.decode([tok.eos_token_id])
    engine = ScriptedEngine(tok, [[CALL + eos, CALL + eos]])
    agent = AgentEngine(engine, tok, FakeTools(), AgentConfig(max_turns=1, max_tokens=400), {tok.eos_token_id})
    (r1, r2) = agent.generate([[5], [6]], SamplingParams(max_new_tokens=120))
    assert r1.meta["turn_limit"] and r1.meta["tool_calls"] == 0 and r1.mask == [1] * len(r1.response_ids)
    assert len(engine.prompts) == 1   # the call in the last turn is not executed
    call = tok(CALL + eos, add_special_tokens=False)["input_ids"]
    # A budget that the observation would leave no room in: it ends there, nothing appended.
    agent = AgentEngine(ScriptedEngine(tok, [[CALL + eos]]), tok, FakeTools(), AgentConfig(max_tokens=len(call) + 5),
                        {tok.eos_token_id})
    (r,) = agent.generate([[5]], SamplingParams(max_new_tokens=120))
    assert r.meta["budget"] and r.response_ids == call
    # A turn the budget cuts: finish length, cut to the budget.
    agent = AgentEngine(ScriptedEngine(tok, [[CALL + eos]]), tok, FakeTools(), AgentConfig(max_tokens=10),
                        {tok.eos_token_id})
    (r,) = agent.generate([[5]], SamplingParams(max_new_tokens=120))
    assert r.meta["budget"] and len(r.response_ids) == 10 and r.finish_reason == "length"


def test_real_engine_trajectory_log_probs_are_a_forward_of_the_whole_trajectory(chat_model):
    """With the hf engine: the sampled turns' log-probs are those of one forward over prompt +
    trajectory (observations included as context), and the observations are the template's."""
    from opd.rollout.hf import HFRolloutEngine
    model, tok = chat_model
    eos = tok.decode([tok.eos_token_id])

    class Forced(HFRolloutEngine):
        """Samples its first turn, then appends a fixed call so the trajectory goes on."""
        calls = 0

        def generate(self, prompts, params):
            out = super().generate(prompts, params)
            Forced.calls += 1
            if Forced.calls == 1:
                for r in out:
                    ids = tok(CALL + eos, add_special_tokens=False)["input_ids"]
                    r.response_ids, r.logprobs = ids, _logprobs(model, r.prompt_ids, ids)
            return out

    agent = AgentEngine(Forced(model, tok), tok, FakeTools(), AgentConfig(max_turns=2, max_tokens=300),
                        {tok.eos_token_id})
    prompt = tok.apply_chat_template([{"role": "user", "content": "12*13="}], tools=[SCHEMA],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    (r,) = agent.generate([list(prompt)], SamplingParams(max_new_tokens=12, seed=0))
    assert r.meta["turns"] == 2 and 0 in r.mask
    lp = _logprobs(model, r.prompt_ids, r.response_ids)
    sampled = [i for i, m in enumerate(r.mask) if m]
    torch.testing.assert_close(torch.tensor([r.logprobs[i] for i in sampled]), torch.tensor([lp[i] for i in sampled]),
                               atol=1e-4, rtol=0)


def _logprobs(model, prompt, response):
    with torch.no_grad():
        ids = torch.tensor([prompt + response])
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None]).squeeze(1).tolist()
