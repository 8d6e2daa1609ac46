"""The config of `opd generate`: frozen structs loaded from YAML (unknown keys refused)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from opd.config import check_device, field


@dataclass(frozen=True)
class TeacherSource:
    engine: Literal["hf", "vllm", "served", "http"] = field(
        "hf", help="hf: transformers on this machine; vllm: a vLLM engine on this machine; served: an `opd "
                   "serve-teacher` server (its SAMPLE message), the same teacher a run distills from; http: an "
                   "OpenAI-compatible endpoint (/v1/chat/completions), a text-only teacher")
    model: str | None = field(None, help="hf / vllm: local model directory (relative to the config file); served: "
                                         "a directory with the served model's tokenizer, which renders the prompts "
                                         "(checked against the server's tokenizer fingerprint)")
    address: str | None = field(None, help="served: the teacher server, e.g. tcp://127.0.0.1:5601")
    url: str | None = field(None, help="http: the endpoint's base URL, e.g. http://127.0.0.1:8000/v1")
    api_model: str | None = field(None, help="http: the model name the endpoint serves (its `model` field)")
    api_key_env: str | None = field(None, help="http: environment variable holding the API key (sent as a "
                                               "Bearer token; none: no key)")
    timeout_s: float = field(120.0, help="http, served: seconds to wait for one answer", min=1.0)
    device: str = field("auto", help="hf: torch device (auto: cuda when available)")
    dtype: Literal["float32", "bfloat16", "float16"] = field("float32", help="hf / vllm: weights' dtype")
    vllm_max_model_len: int = field(2048, help="vllm: longest prompt + response it holds", min=16)

    def __post_init__(self):
        if self.engine in ("hf", "vllm") and not self.model:
            raise ValueError(f"teacher.engine {self.engine} samples a local model: set teacher.model (a model "
                             f"directory)")
        if self.engine == "served" and not (self.address and self.model):
            raise ValueError("teacher.engine served needs teacher.address (the `opd serve-teacher` server) and "
                             "teacher.model (a directory with its tokenizer, to render the prompts)")
        if self.engine != "served" and self.address:
            raise ValueError(f"teacher.address is for engine served, not {self.engine}")
        if self.engine == "http" and not (self.url and self.api_model):
            raise ValueError("teacher.engine http needs teacher.url (e.g. http://127.0.0.1:8000/v1) and "
                             "teacher.api_model (the name the endpoint serves)")
        if self.engine != "http" and (self.url or self.api_model):
            raise ValueError(f"teacher.url and teacher.api_model are for engine http, not {self.engine}")
        check_device(self.device, auto=True)


@dataclass(frozen=True)
class Sampling:
    n: int = field(4, help="responses per prompt", min=1)
    temperature: float = field(1.0, help="sampling temperature (0: greedy, then n = 1 makes sense)", min=0.0)
    top_p: float = field(1.0, help="nucleus sampling threshold", min=0.0, max=1.0)
    max_new_tokens: int = field(256, help="length limit of a response", min=1)
    seed: int = field(0, help="sampling seed (hf, vllm; sent to an http endpoint, which may ignore it)")
    batch_size: int = field(32, help="prompts sent together (hf: sequences decoded together are this x n)", min=1)


@dataclass(frozen=True)
class Filter:
    keep: Literal["all", "correct"] = field(
        "correct", help="correct: keep the responses the domain verifier scores 1 (math by `answer`, code by "
                        "`tests`): rejection sampling; a prompt with neither is kept unverified and counted; "
                        "all: keep every response (scores still reported)")
    dedup: bool = field(True, help="drop a response identical (whitespace aside) to one kept for the same prompt")
    max_per_prompt: int | None = field(None, help="keep at most this many responses per prompt (first sampled "
                                                  "first); null: all that pass", min=1)


@dataclass(frozen=True)
class GenerateConfig:
    teacher: TeacherSource = field(help="who answers: a local model (hf, vllm) or an OpenAI-compatible endpoint")
    prompts: str = field(help="JSONL of `prompt` or `messages` rows, with `domain`, and `answer` (math) or "
                              "`tests` (code) to verify by (relative to the config file)")
    out: str = field(help="output JSONL (relative to the config file); its card is OUT.card.md and .card.json")
    format: Literal["sft", "messages"] = field(
        "sft", help="sft: prompt/response rows (a `messages` prompt stays a conversation with the response as "
                    "its final assistant message); messages: every row a conversation. `opd sft` reads both")
    sampling: Sampling = field(default_factory=Sampling, help="how many responses and how they are sampled")
    filter: Filter = field(default_factory=Filter, help="what is kept")
    max_prompts: int | None = field(None, help="only the first N prompts of the file", min=1)
    code_workers: int = field(2, help="code verifier sandboxes run at once", min=1)
