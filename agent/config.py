"""The `agent:` section of `opd train` and `opd rl`: which tools a model may call, and the limits
of a multi-turn trajectory. Leaving the section out keeps single-turn rollouts."""

from __future__ import annotations

from dataclasses import dataclass

from opd.config import field


@dataclass(frozen=True)
class ToolSpec:
    function: str = field(help="'module:function', 'FILE.py:function' (relative to the config), or a built-in: "
                               "calculator, python")
    name: str | None = field(None, help="the name the model calls it by (default: the function's own name)")


@dataclass(frozen=True)
class AgentConfig:
    tools: list[ToolSpec] = field(default_factory=list, help="functions the model may call; each one's JSON schema "
                                  "comes from its signature and docstring and goes to the chat template")
    max_turns: int = field(4, help="assistant turns per trajectory; a call in the last one is not executed "
                                   "(counted in agent/turn_limit)", min=1)
    max_tokens: int = field(512, help="token budget of a trajectory after its prompt: every assistant turn "
                                      "and tool observation; rollout.max_new_tokens limits each turn", min=1)
    timeout_s: float = field(5.0, help="wall-clock limit of one tool call (the call then answers an error)",
                             min=0.1)
    memory_mb: int = field(512, help="address-space limit of a tool call's process, MiB", min=16)
    max_output_chars: int = field(2000, help="a tool's answer past this many characters is cut (and says so)",
                                  min=16)
    workers: int = field(4, help="tool calls executed at once", min=1)

    def max_sampled(self, max_new_tokens: int) -> int:
        """The most tokens one trajectory samples: its turns' limits, within the budget its
        observations share (what bounds its rows, as max_new_tokens bounds one response's)."""
        return min(self.max_tokens, self.max_turns * max_new_tokens)

    def __post_init__(self):
        names = [t.name or t.function.rsplit(":", 1)[-1] for t in self.tools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"agent.tools: two tools are called {dup}; give one a `name`")
