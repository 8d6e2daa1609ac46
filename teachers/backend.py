"""What a teacher backend must do, independent of the transport.

The server (teachers/server.py) validates SCORE messages into `ScoreRequest`s, groups
them up to a token budget and hands them to a backend. A backend holds one frozen model
and answers in torch tensors on the CPU; the server puts them on the wire.

Two backends implement this: `HFBackend` (transformers, exact in every mode) and
`VLLMBackend` (vLLM; top-k at temperature 1 only, anything else is UNSUPPORTED rather
than approximated).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import torch

# The smallest tail a top-k answer reports: fp32's resolution below 1, log 2^-24 (-16.64 nats).
# A tail under it is below what the teacher's fp32 log-softmax resolves; see
# tail_logmass_from_topk. The loss reads a tail of -inf as the same value (opd.kernels
# TAIL_LOGMASS_FLOOR, kept equal by tests/teachers/test_backend.py): the teacher side does
# not import the loss package.
TAIL_LOGMASS_FLOOR = math.log(2.0 ** -24)


@dataclass(frozen=True)
class ScoreRequest:
    """One validated SCORE request. Row convention: see teachers/protocol.py.

    A SCORE with teacher context arrives here already composed: `ids`, `offsets` and
    `response_starts` describe the sequences the teacher scores (its prompt + the student's
    response), so a backend never sees the context as such, and the rows are the student's.
    A row mask arrives as `kept_rows`: the rows to answer, per sequence (`kept`)."""
    request_id: int
    mode: str                   # "topk" | "full" | "prefill"
    ids: torch.Tensor           # int64 [T], all sequences concatenated
    offsets: tuple[int, ...]    # [B + 1] into ids
    response_starts: tuple[int, ...]  # [B], 1 <= s_b <= len_b
    k: int                      # topk mode
    temperature: float
    dtype: str                  # full mode: "float32" | "bfloat16" | "float16"
    chunk_rows: int             # full mode
    vocab_limit: int = 0        # > 0: the distribution over the first vocab_limit columns (a student
                                # whose LM head has fewer padding rows than the teacher's)
    candidates: torch.Tensor | None = None   # int64 [R, k]: the ids to answer per row (support
                                             # "given"), distinct within a row; None: the teacher's top k
    kept_rows: tuple[torch.Tensor, ...] | None = None   # per sequence b, int64 [R_b], rising: the rows i
                                                        # (token s_b + i) to answer; None: all len_b - s_b

    @property
    def num_sequences(self) -> int:
        return len(self.response_starts)

    @property
    def num_tokens(self) -> int:
        return int(self.ids.numel())

    def row_offsets(self) -> list[int]:
        """[B + 1]: sequence b's answer rows are row_offsets[b]:row_offsets[b+1]."""
        out = [0]
        for b, s in enumerate(self.response_starts):
            out.append(out[-1] + ((self.offsets[b + 1] - self.offsets[b]) - s if self.kept_rows is None
                                  else len(self.kept_rows[b])))
        return out

    def kept(self, b: int):
        """Which of sequence b's len_b - s_b response rows to answer, as an index into them:
        all (a slice, no copy) or the row mask's (int64 [R_b]). `seq[s_b:][kept(b)]` are their tokens."""
        return slice(None) if self.kept_rows is None else self.kept_rows[b]

    def sequence(self, b: int) -> torch.Tensor:
        return self.ids[self.offsets[b]:self.offsets[b + 1]]


@dataclass(frozen=True)
class SampleRequest:
    """One validated SAMPLE request: B prompts, n responses each."""
    request_id: int
    ids: torch.Tensor           # int64 [T], the prompts concatenated
    offsets: tuple[int, ...]    # [B + 1] into ids
    n: int
    max_new_tokens: int
    temperature: float          # 0: greedy
    top_p: float
    seed: int
    stop_ids: tuple[int, ...]   # (): the backend's own EOS ids
    mode: str = "sample"

    @property
    def num_sequences(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        """What it may hold in the server's in-flight budget: its prompts and every response at full length."""
        return int(self.ids.numel()) + self.num_sequences * self.n * self.max_new_tokens

    def row_offsets(self) -> list[int]:
        return [0] * len(self.offsets)   # a SAMPLE answers no rows

    def sequence(self, b: int) -> torch.Tensor:
        return self.ids[self.offsets[b]:self.offsets[b + 1]]


class SampleAnswer(NamedTuple):
    """The B * n responses of one SAMPLE request, response j of prompt b at b * n + j."""
    responses: list[list[int]]   # token ids, each ending after its first stop id or at max_new_tokens
    finish: list[str]            # "stop" | "length"


def cut_at_stop(ids: list[int], stop_ids, max_new_tokens: int) -> tuple[list[int], str]:
    """A generated row as a response: through its first stop id (kept), else its first
    max_new_tokens ids (what an engine padded a finished row with is dropped)."""
    stops = set(stop_ids)
    for i, t in enumerate(ids[:max_new_tokens]):
        if t in stops:
            return ids[:i + 1], "stop"
    return ids[:max_new_tokens], "length"


class TopKAnswer(NamedTuple):
    """All rows of one request (R rows). fp32 except ids."""
    ids: torch.Tensor            # int32 [R, k]
    logprobs: torch.Tensor       # fp32 [R, k]
    tail_logmass: torch.Tensor   # fp32 [R]
    token_logprob: torch.Tensor  # fp32 [R]
    lse: torch.Tensor            # fp32 [R]  logsumexp(logits / T)


class FullChunkAnswer(NamedTuple):
    row_start: int               # global row index of the first row
    logits: torch.Tensor         # [rows, V] in the requested dtype, temperature NOT applied
    lse: torch.Tensor            # fp32 [rows]  logsumexp(logits / T)
    token_logprob: torch.Tensor  # fp32 [rows]


class TeacherBackend(abc.ABC):
    """A frozen model that scores sequences. Not thread-safe: the server calls it from one thread."""

    name: str                    # "hf" | "vllm"
    model_id: str
    model_fingerprint: str
    tokenizer_fingerprint: str
    vocab_size: int              # size of the answer's vocabulary axis
    max_positions: int           # longest sequence the model accepts
    max_k: int
    modes: tuple[str, ...]
    dtypes: tuple[str, ...]      # full-mode logit dtypes
    supports_temperature: bool = True
    exact_lse: bool = True       # False: answers carry NaN in `lse`
    prompt_cache_tokens: int = 0  # > 0: sequences announced by a "prefill" SCORE are kept, this many tokens

    def unsupported(self, req: ScoreRequest) -> str | None:
        """None when this backend answers `req` exactly; else why not and which backend can."""
        return None

    @abc.abstractmethod
    def score_topk(self, reqs: list[ScoreRequest]) -> list[TopKAnswer]:
        """Answer several top-k requests, ideally in one batched forward pass."""

    def prefill(self, reqs: list[ScoreRequest]) -> list[int]:
        """Keep these requests' sequences (prompts, or prompt + the response so far from s_b) for
        the SCOREs that will follow (mode "prefill"); per request, the tokens held.
        A backend without a prompt cache holds none: the later SCOREs compute them as any other."""
        return [0] * len(reqs)

    @abc.abstractmethod
    def score_full(self, req: ScoreRequest) -> Iterator[FullChunkAnswer]:
        """Stream one full-vocabulary request in chunks of `req.chunk_rows` rows."""

    def sample(self, reqs: list[SampleRequest]) -> list[SampleAnswer]:
        """Generate the responses of several SAMPLE requests (served where `modes`
        lists "sample")."""
        raise NotImplementedError(f"the {self.name} backend does not sample")

    def close(self) -> None:
        pass


def tail_logmass_from_topk(topk_logprobs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log(1 - sum_j exp(lp_j)) per row, stably, for backends that only see the top k.

    With s = logsumexp(lp) <= 0 the tail is log(-expm1(s)); -expm1 keeps precision when
    the top k hold almost all the mass. A top k that spans the vocabulary has no tail (-inf).
    Otherwise a tail under TAIL_LOGMASS_FLOOR (2**-24, half an ulp of 1) is below what the teacher's fp32 log-softmax
    resolves (a peaked teacher's top token comes back as log-prob 0 and the formula gives
    log 0): it lies somewhere in [0, 2**-24] and is reported as 2**-24, its upper bound.
    -inf there made reverse KL infinite, S·(log S - log T) with T = 0, and its gradient NaN,
    for a tail that is only too small for fp32.
    """
    s = torch.logsumexp(topk_logprobs.float(), dim=-1).clamp(max=0.0)
    tail = torch.log(-torch.expm1(s))
    if topk_logprobs.shape[-1] >= vocab_size:
        return torch.full_like(tail, -math.inf)
    return tail.clamp(min=TAIL_LOGMASS_FLOOR)
