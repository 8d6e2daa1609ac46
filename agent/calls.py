"""Tool calls in a turn's text, in the Hermes / Qwen format the chat templates use:

    <tool_call>{"name": "calculator", "arguments": {"expression": "12*13"}}</tool_call>

A turn may hold several. One that cannot be read (not JSON, no name, arguments that are not
an object, no closing tag) is still a call: a failed one, whose error the model reads back as
its tool message, so that a malformed call teaches the model something and never stops a run.
A turn without `<tool_call>` is the trajectory's final answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class Call:
    name: str | None          # None when the call could not be read
    arguments: dict | None
    error: str | None = None  # why it could not be read (the tool message the model gets)


def parse_calls(text: str) -> list[Call]:
    """The calls of one assistant turn, in order ([]: a final answer)."""
    calls = [_read(body) for body in _CALL.findall(text)]
    if text.count(OPEN) > len(calls):   # an opened call never closed (cut by the turn's length, or sloppy)
        calls.append(Call(None, None, f"error: a {OPEN} without its {CLOSE}"))
    return calls


def _read(body: str) -> Call:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return Call(None, None, f"error: the tool call is not JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Call(None, None, 'error: a tool call is {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):   # some models write the arguments as a JSON string (OpenAI's wire form)
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return Call(obj["name"], None, "error: the arguments of a tool call must be a JSON object")
    return Call(obj["name"], args)
