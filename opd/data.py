"""Prompt data sets: JSONL files with one sample per line.

Each line is an object with at least `prompt`; optional `domain`, `answer` (for math
verifiers), `tests` (unit tests for code verifiers), `response` (a reference response for
SFT data) and anything else (kept in `meta`). A malformed line is reported with its line
number; the caller chooses to stop or to skip (and count) it.
"""

from __future__ import annotations

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
    meta: dict = field(default_factory=dict, hash=False, compare=False)


@dataclass
class LoadReport:
    path: str
    loaded: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)  # "path:line: why", the first few


_KNOWN = {"prompt", "domain", "answer", "tests", "response"}


def _parse(line: str, where: str) -> Sample:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
        raise DataError(f"{where}: missing or empty string field 'prompt'")
    for key in ("domain", "answer", "tests", "response"):
        if key in obj and obj[key] is not None and not isinstance(obj[key], str):
            if key == "answer" and isinstance(obj[key], (int, float)):
                obj[key] = str(obj[key])
                continue
            raise DataError(f"{where}: field '{key}' must be a string, got {type(obj[key]).__name__}")
    return Sample(**{k: obj.get(k) for k in _KNOWN}, meta={k: v for k, v in obj.items() if k not in _KNOWN})


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
                s = Sample(prompt=s.prompt, domain=default_domain, answer=s.answer, tests=s.tests,
                           response=s.response, meta=s.meta)
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


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a prompt; the chat template is applied when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return [int(i) for i in ids]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
