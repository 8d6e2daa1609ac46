"""Prompt data sets: JSONL files with one sample per line.

Each line is an object with `prompt` (a string, rendered as one user turn) or `messages` (a
conversation in the shape of Hugging Face chat datasets: system / user / assistant / tool
messages, rendered with the tokenizer's chat template); optional `domain`, `answer` (for math
verifiers), `tests` (unit tests for code verifiers), `response` (a reference response for
SFT data) and anything else (kept in `meta`). A conversation that ends with an assistant
message and has no `response` gives that message as the response (SFT's target); what is
left must end with a user or tool message, the turn the model answers. A malformed line is
reported with its line number; the caller chooses to stop or to skip (and count) it.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class Sample:
    prompt: str
    domain: str | None = None
    answer: str | None = None
    tests: str | None = None
    response: str | None = None
    # Code tests no reward sees: held out to catch a policy that fits its visible `tests` (reward
    # hacking); `opd validate` and `opd rl`'s evaluation report them beside the visible ones.
    hidden_tests: str | None = None
    meta: dict = field(default_factory=dict, hash=False, compare=False)
    # A `messages` row: the conversation up to the model's turn; `prompt` is then its last
    # user message (what routing rules, classifiers and context templates read).
    messages: list[dict] | None = field(default=None, hash=False, compare=False)

    @property
    def chat(self) -> str | list[dict]:
        """What `encode_prompt` renders: the conversation, or the prompt as one user turn."""
        return self.messages if self.messages is not None else self.prompt


@dataclass
class LoadReport:
    path: str
    loaded: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)  # "path:line: why", the first few


_KNOWN = {"prompt", "domain", "answer", "tests", "response", "hidden_tests"}
ROLES = ("system", "user", "assistant", "tool")


def _conversation(obj: dict, where: str) -> None:
    """Check a `messages` row and set its `prompt` (the last user message) and, from a final
    assistant message, its `response`, in place."""
    msgs = obj["messages"]
    if "prompt" in obj:
        raise DataError(f"{where}: give `prompt` or `messages`, not both")
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: 'messages' must be a non-empty list of messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise DataError(f"{where}: messages[{i}] needs a role among {list(ROLES)}")
        content = m.get("content")
        if not isinstance(content, str) and not (m["role"] == "assistant" and content is None and m.get("tool_calls")):
            raise DataError(f"{where}: messages[{i}] ({m['role']}) needs a string 'content'")
    if msgs[-1]["role"] == "assistant" and obj.get("response") is None:
        if not isinstance(msgs[-1].get("content"), str):
            raise DataError(f"{where}: the final assistant message is the response and needs a string 'content'")
        obj["response"], msgs = msgs[-1]["content"], msgs[:-1]
    if not msgs or msgs[-1]["role"] not in ("user", "tool"):
        raise DataError(f"{where}: the conversation must end with a user or tool message (the model answers next)")
    users = [m["content"] for m in msgs if m["role"] == "user"]
    if not users:
        raise DataError(f"{where}: the conversation has no user message")
    obj["messages"], obj["prompt"] = msgs, users[-1]


def _parse(line: str, where: str) -> Sample:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        _conversation(obj, where)
    if not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
        raise DataError(f"{where}: missing or empty string field 'prompt'")
    for key in ("domain", "answer", "tests", "response", "hidden_tests"):
        if key in obj and obj[key] is not None and not isinstance(obj[key], str):
            if key == "answer" and isinstance(obj[key], (int, float)):
                obj[key] = str(obj[key])
                continue
            raise DataError(f"{where}: field '{key}' must be a string, got {type(obj[key]).__name__}")
    return Sample(**{k: obj.get(k) for k in _KNOWN}, messages=obj.get("messages"),
                  meta={k: v for k, v in obj.items() if k not in _KNOWN and k != "messages"})


def load_jsonl(path: str | Path, *, on_error: Literal["stop", "skip"] = "stop",
               default_domain: str | None = None) -> tuple[list[Sample], LoadReport]:
    """Read a JSONL file. on_error="stop" raises DataError naming the line; "skip" counts it."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: data file not found")
    report = LoadReport(path=str(p))
    samples = []
    with p.open("rb") as f:   # bytes: a line that is not UTF-8 is that line's error, not the file's
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{p}:{lineno}: not UTF-8 ({e.reason} at byte {e.start})") from None
                s = _parse(line, f"{p}:{lineno}")
            except DataError as e:
                if on_error == "stop":
                    raise
                report.skipped += 1
                if len(report.errors) < 20:
                    report.errors.append(str(e))
                continue
            if s.domain is None and default_domain is not None:
                s = dataclasses.replace(s, domain=default_domain)
            samples.append(s)
    report.loaded = len(samples)
    if not samples:
        raise DataError(f"{p}: no usable samples ({report.skipped} malformed lines)")
    return samples, report


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    """One JSON object per line (parents made); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return p


class Cycler:
    """Endless shuffled passes over a list, with a position that checkpoints can save.

    state() / load_state() make a resumed run draw exactly the samples the uninterrupted
    run would have drawn.
    """

    def __init__(self, items: list, seed: int):
        self.items = items
        self.seed = seed
        self.epoch = 0
        self.pos = 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        order = list(range(len(self.items)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next(self):
        if self.pos >= len(self._order):
            self.epoch += 1
            self.pos = 0
            self._order = self._shuffle()
        item = self.items[self._order[self.pos]]
        self.pos += 1
        return item

    def take(self, n: int) -> list:
        return [self.next() for _ in range(n)]

    def __iter__(self) -> Iterator:
        while True:
            yield self.next()

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._shuffle()


def encode_prompt(tokenizer, prompt: str | list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of a prompt (one user turn) or a conversation (`Sample.chat`), ending where the
    model's turn begins; the chat template is applied when the tokenizer has one, with `tools`
    (JSON schemas, opd.agent.tools) as the template expects them."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return [int(i) for i in ids]
    if not isinstance(prompt, str) or tools:
        raise DataError("a `messages` row or tools need a tokenizer with a chat template (this one has none)")
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
