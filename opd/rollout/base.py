"""One interface for sampling the student: transformers `generate` (reference) or vLLM.

Both engines return, per sample, the prompt ids, the response ids, the student's
log-probability of each sampled token and why it stopped. The log-probabilities are the
model's raw ones, log_softmax(logits) at temperature 1 and before top-p, i.e. what a
transformers forward pass of the same weights gives. GRPO's importance ratio and the
sampled-token reverse KL both need exactly that quantity.
"""

from __future__ import annotations

import abc
import hashlib
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["eos", "length"]


def eos_ids(tokenizer, generation_config=None) -> set[int]:
    """Every token that ends a response: the tokenizer's EOS and those of the model's generation
    config (an int or a list: Qwen2.5-Instruct lists <|im_end|> and <|endoftext|>, Llama 3
    three ids). vLLM stops on all of them; so must the HF engine, and trimming must cut there."""
    ids = {tokenizer.eos_token_id}
    extra = getattr(generation_config, "eos_token_id", None)
    ids.update(extra if isinstance(extra, (list, tuple)) else [extra])
    return {int(i) for i in ids if i is not None}


def prompt_seed(seed: int, i: int) -> int:
    """The seed of part i (a prompt; a worker's shard) of a batch sampled with `seed`. vLLM
    seeds sample j of a request with seed + j: one seed for every prompt gave sample j of each
    the same random stream (a prompt twice in a batch got the same samples), and the trainers'
    step seeds (base + step) made step t + 1 reuse step t's streams. A hash of (seed, i) keeps
    every stream apart."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest(), "little") >> 2


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    n: int = 1                              # samples per prompt (a GRPO group)
    stop_token_ids: tuple[int, ...] = ()    # besides the EOS ids (`eos_ids`)
    seed: int | None = None
    # (first row, rows of the whole batch) when this call samples one rank's share of a bigger
    # batch: the hf engine then draws what the whole batch would have drawn (exactly so when
    # the whole batch fits one of its batches), so a run samples the same on any number of ranks.
    share: tuple[int, int] | None = None
    # > 0: also return each response position's `topk` most likely ids under the raw logits
    # (temperature 1, before top-p), most likely first: the support of a student_topk teacher.
    topk: int = 0


@dataclass
class Rollout:
    prompt_ids: list[int]
    response_ids: list[int]                 # includes the stop token when one was sampled
    logprobs: list[float]                   # [len(response_ids)] raw student log-probs
    finish_reason: FinishReason
    prompt_index: int = 0                   # which prompt of the batch it answers
    meta: dict = field(default_factory=dict)
    topk_ids: list[list[int]] | None = None  # [len(response_ids), k] with SamplingParams.topk = k
    # Multi-turn (opd.agent): [len(response_ids)], 1 on the tokens the model sampled (its turns),
    # 0 on the context it did not write (tool observations, the chat template between turns;
    # their logprobs are 0.0 and topk_ids rows []). None: a single turn, every token sampled.
    mask: list[int] | None = None

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def sampled(self, n: int | None = None) -> list[bool]:
        """Per response token (the first n), whether the model sampled it: what is trained and
        what the teachers score."""
        n = len(self.response_ids) if n is None else n
        return [True] * n if self.mask is None else [bool(m) for m in self.mask[:n]]

    def last_turn(self) -> tuple[int, int]:
        """[a, b): the response tokens of the model's last turn (the whole response for one turn)."""
        if self.mask is None:
            return 0, len(self.response_ids)
        b = max((i + 1 for i, m in enumerate(self.mask) if m), default=0)
        a = b
        while a > 0 and self.mask[a - 1]:
            a -= 1
        return a, b

    def text(self, tokenizer) -> str:
        """The answer as the verifiers read it: the last turn decoded, its stop token dropped."""
        a, b = self.last_turn()
        ids = self.response_ids[a:b]
        if self.finish_reason == "eos" and b == len(self.response_ids):
            ids = ids[:-1]
        return tokenizer.decode(ids, skip_special_tokens=True)


class RolloutEngine(abc.ABC):
    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        """n samples per prompt, grouped by prompt: result[i * n + j] answers prompts[i]."""

    @abc.abstractmethod
    def sync_weights(self, model) -> None:
        """Make the next `generate` sample from `model`'s current weights (on-policy)."""

    def close(self) -> None:
        pass
