"""What `TeacherClient` hands back and raises: `TopKResult` (one top-k answer for a whole
batch), `FullChunk` (one chunk of a full-vocabulary stream), `SampleResult` (a teacher's
responses) and `TeacherError`.
Importable from opd.teachers.client (and opd.teachers) as before."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from opd.teachers.protocol import Done, ErrorCode

if TYPE_CHECKING:
    import torch


class TeacherError(Exception):
    """A request that failed for good. `code` is an ErrorCode value or TIMEOUT / FINGERPRINT_CHANGED / CLOSED."""

    def __init__(self, code: str, message: str):
        self.code = code.value if isinstance(code, ErrorCode) else str(code)
        super().__init__(f"{self.code}: {message}")
        self.message = message


@dataclass
class TopKResult:
    """R rows over all sequences; rows of sequence b are row_offsets[b]:row_offsets[b+1]."""
    ids: "torch.Tensor"            # int32 [R, k]
    logprobs: "torch.Tensor"       # fp32 [R, k]
    tail_logmass: "torch.Tensor"   # fp32 [R]
    token_logprob: "torch.Tensor"  # fp32 [R]
    lse: "torch.Tensor"            # fp32 [R]
    row_offsets: list[int]
    stats: Done | None = None


@dataclass
class SampleResult:
    """A SAMPLE's answer: B * n responses, response j of prompt b at b * n + j."""
    responses: list[list[int]]     # token ids, each ending after its stop id (kept) or at max_new_tokens
    finish: list[str]              # "stop" | "length"
    stats: Done | None = None


class FullChunk(NamedTuple):
    row_start: int
    logits: "torch.Tensor"         # [rows, V] in the requested dtype, temperature not applied
    lse: "torch.Tensor"            # fp32 [rows], logsumexp(logits / T)
    token_logprob: "torch.Tensor"  # fp32 [rows]
