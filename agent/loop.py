"""Multi-turn rollouts: the model calls tools, reads their answers, and goes on.

`AgentEngine` wraps a rollout engine (hf or vLLM) and is one itself, so the loops that sample
(opd train, opd rl) are unchanged by it. One `generate`:

    turn 1      every prompt's n samples in one call of the engine (a GRPO group drawn together)
    then        parse each turn's tool calls (opd.agent.calls); a turn without one is the final
                answer; execute all the batch's calls at once (opd.agent.tools, in the sandbox);
                append each trajectory's observation tokens (opd.agent.chat) and sample the next
                turn of every trajectory still going, in one call of the engine (it batches them)
    until       a final answer, agent.max_turns (a call in the last turn is not executed:
                meta["turn_limit"]), a turn cut by rollout.max_new_tokens, or agent.max_tokens
                (the trajectory's budget after its prompt: meta["budget"])

The result is one Rollout per trajectory: `response_ids` every token after the prompt, `mask`
1 on what the model sampled (its turns) and 0 on what it read (observations, the template
around them), log-probs 0.0 and top-k rows [] where it did not sample. Each later turn
prefills the whole trajectory again (vLLM's prefix cache makes that cheap; the hf engine
recomputes it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from opd.agent.calls import parse_calls
from opd.agent.chat import observation_ids
from opd.agent.config import AgentConfig
from opd.agent import totals
from opd.agent.tools import Toolbox, build_toolbox
from opd.rollout.base import Rollout, RolloutEngine, SamplingParams, prompt_seed


@dataclass
class _Trajectory:
    prompt_index: int
    prompt: list[int]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    topk: list[list[int]] = field(default_factory=list)
    turns: int = 0
    calls: int = 0
    failures: int = 0
    observed: int = 0
    stopped: bool = False        # its last turn ended with a stop token
    done: bool = False
    turn_limit: bool = False
    budget: bool = False

    def add_turn(self, ro: Rollout, room: int, stops: set[int]) -> list[int]:
        """Append one sampled turn, cut to `room` tokens; returns its ids."""
        ids = ro.response_ids[:room]
        self.response += ids
        self.logprobs += ro.logprobs[:room]
        self.mask += [1] * len(ids)
        self.topk += (ro.topk_ids or [[]] * len(ids))[:room]
        self.turns += 1
        self.stopped = bool(ids) and ids[-1] in stops
        self.budget = not self.stopped and len(ids) >= room   # the trajectory's budget, not the turn's, cut it
        if not self.stopped or self.budget:
            self.done = True   # cut by a length: nothing sensible follows
        return ids

    def add_observation(self, ids: list[int]) -> None:
        self.response += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.topk += [[] for _ in ids]
        self.observed += len(ids)

    def rollout(self, topk: bool) -> Rollout:
        meta = {"turns": self.turns, "tool_calls": self.calls, "tool_failures": self.failures,
                "turn_limit": self.turn_limit, "observation_tokens": self.observed, "budget": self.budget}
        return Rollout(prompt_ids=self.prompt, response_ids=self.response, logprobs=self.logprobs,
                       finish_reason="eos" if self.stopped else "length", prompt_index=self.prompt_index,
                       meta=meta, topk_ids=self.topk if topk else None, mask=self.mask)


class AgentEngine(RolloutEngine):
    def __init__(self, engine: RolloutEngine, tokenizer, toolbox: Toolbox, cfg: AgentConfig, stop_ids: set[int]):
        """engine: the hf or vLLM engine that samples each turn; stop_ids: the tokens that end a
        turn (the engine stops on them too: opd.rollout.base.eos_ids)."""
        self.engine, self.tokenizer, self.toolbox, self.cfg = engine, tokenizer, toolbox, cfg
        self.stops = set(stop_ids)

    def sync_weights(self, model) -> None:
        self.engine.sync_weights(model)

    def close(self) -> None:
        self.engine.close()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        cfg, stops = self.cfg, self.stops | set(params.stop_token_ids)
        trajs = [_Trajectory(i, list(p)) for i, p in enumerate(prompts) for _ in range(params.n)]
        first = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, cfg.max_tokens))
        last = {id(t): t.add_turn(ro, cfg.max_tokens, stops)       # each trajectory's latest turn
                for t, ro in zip(trajs, self.engine.generate(prompts, first))}
        for turn in range(2, cfg.max_turns + 2):
            going = [t for t in trajs if not t.done]
            asked = self._act(going, last, final=turn > cfg.max_turns)
            if not asked:
                break
            room = [cfg.max_tokens - len(t.response) for t in asked]
            later = dataclasses.replace(params, n=1, share=None, max_new_tokens=min(params.max_new_tokens, max(room)),
                                        seed=None if params.seed is None else prompt_seed(params.seed, -turn))
            outs = self.engine.generate([t.prompt + t.response for t in asked], later)
            last = {id(t): t.add_turn(ro, r, stops) for t, ro, r in zip(asked, outs, room)}
        return [t.rollout(params.topk > 0) for t in trajs]

    def _act(self, going: list[_Trajectory], last: dict[int, list[int]], final: bool) -> list[_Trajectory]:
        """Execute the calls of each trajectory's last turn and append what it reads; the
        trajectories that go on to another turn."""
        calls = {id(t): parse_calls(self.tokenizer.decode(last[id(t)], skip_special_tokens=True)) for t in going}
        acting = []
        for t in going:
            if not calls[id(t)]:
                t.done = True          # a final answer
            elif final:
                t.done = t.turn_limit = True
            else:
                acting.append(t)
        flat = [(t, c) for t in acting for c in calls[id(t)]]
        runnable = [(c.name, c.arguments) for _, c in flat if c.error is None]
        outcomes = iter(self.toolbox.call_many(runnable) if runnable else [])
        results: dict[int, list[str]] = {id(t): [] for t in acting}
        for t, c in flat:
            ok, text = (False, c.error) if c.error is not None else _unpack(next(outcomes))
            t.calls += 1
            t.failures += not ok
            results[id(t)].append(text)
        going_on = []
        for t in acting:
            stop_text = self.tokenizer.decode(t.response[-1:], skip_special_tokens=False)
            obs = observation_ids(self.tokenizer, results[id(t)], stop_text, self.toolbox.schemas())
            if len(t.response) + len(obs) >= self.cfg.max_tokens:   # no room left for the answer
                t.done = t.budget = True
                continue
            t.add_observation(obs)
            going_on.append(t)
        return going_on


def _unpack(outcome) -> tuple[bool, str]:
    return bool(outcome.ok), str(outcome.text)


def build_agent(cfg: AgentConfig, engine: RolloutEngine, tokenizer, stop_ids: set[int],
                base_dir: str | Path = ".") -> AgentEngine:
    """`engine` made multi-turn with the tools of `cfg` (resolved relative to base_dir)."""
    return AgentEngine(engine, tokenizer, build_toolbox(cfg, base_dir), cfg, stop_ids)


def trajectory_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """Means over a batch's trajectories: turns, tool calls, the share of calls that failed,
    observation tokens (masked: neither trained nor scored), and how often max_turns cut one."""
    return totals.metrics(totals.sums(rollouts))
