"""Turn a decoded SCORE message into a `ScoreRequest`, or say exactly what is wrong with it.

Every check here runs before the request reaches the backend, so a bad request costs the
server one ERROR answer and nothing else. Each failure names its ErrorCode:
BAD_TOKEN (id < 0 or >= vocab), TOO_LONG (sequence or request over a limit), BAD_K,
MALFORMED (tensors missing, wrong dtype or shape, offsets inconsistent, a row mask not 0/1), BAD_REQUEST
(temperature, response starts, dtype, chunking), UNSUPPORTED (the backend cannot answer
it exactly).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from opd.teachers.backend import SampleRequest, ScoreRequest, TeacherBackend
from opd.teachers.protocol import LOGIT_DTYPES, MAX_CHUNK_BYTES, ErrorCode, ProtocolError, Sample, Score

MAX_WINDOW = 64               # CHUNKs a client may ask to receive before its first CREDIT
MAX_SAMPLES = 64              # responses per prompt a SAMPLE may ask for


def score_request(msg: Score, arrays: list[np.ndarray], backend: TeacherBackend,
                  max_tokens_per_request: int) -> ScoreRequest:
    rid = msg.request_id

    def fail(code: ErrorCode, text: str):
        raise ProtocolError(code, text, rid)

    if rid < 0:
        fail(ErrorCode.BAD_REQUEST, f"request_id must be >= 0 (-1 marks unreadable ids), got {rid}")

    # Frames: ids int32 [T], offsets int32 [B + 1], then context, row mask and candidates when asked.
    names = msg.tensor_names()
    if len(arrays) != len(names):
        fail(ErrorCode.MALFORMED, f"this SCORE carries {len(names)} tensors ({', '.join(names)}), got {len(arrays)}")
    tensors = dict(zip(names, arrays))
    ids, offsets = tensors["ids"], tensors["offsets"]
    starts = msg.response_starts
    B = len(starts)
    if B < 1:
        fail(ErrorCode.MALFORMED, "a SCORE needs at least one sequence (response_starts is empty)")
    offs, lengths = _ragged(ids, offsets, B, "ids", fail)
    # Response starts: 1 <= s_b <= len_b (s_b == len_b means no rows for that sequence).
    for b, (s, n) in enumerate(zip(starts, lengths)):
        if not 1 <= s <= n:
            fail(ErrorCode.BAD_REQUEST, f"response_starts[{b}] = {s} must lie in [1, {n}] (sequence length)")
    if msg.mode == "prefill" and (msg.context or msg.rows or msg.support != "teacher"):
        fail(ErrorCode.BAD_REQUEST, "a prefill SCORE carries the teacher's own sequences only (a context "
                                    "teacher's context + the response so far): no context, row mask or candidates")
    if msg.context:   # the teacher's input: c_b + the response (c_b empty: the sequence's own prompt)
        ctx, ctx_offs_arr = tensors["context_ids"], tensors["context_offsets"]
        ctx_offs, ctx_lengths = _ragged(ctx, ctx_offs_arr, B, "context_ids", fail)
        new_starts = [c or s for c, s in zip(ctx_lengths, starts)]
        lengths = [s + (n - s0) for s, n, s0 in zip(new_starts, lengths, starts)]
    # Sizes (of what the teacher scores: with a context, its own prompts), before any copy.
    total = sum(lengths)
    if total > max_tokens_per_request:
        fail(ErrorCode.TOO_LONG, f"request has {total} tokens" + (" with its teacher contexts" if msg.context else "")
                                 + f", max_tokens_per_request is {max_tokens_per_request}")
    longest = max(lengths)
    if longest > backend.max_positions:
        fail(ErrorCode.TOO_LONG, f"a sequence has {longest} tokens" + (" with its teacher context" if msg.context else "")
                                 + f", the model takes at most {backend.max_positions}")

    if msg.context:   # one array of the teacher's sequences: c_b (or the prompt) + the response
        parts = []
        for b in range(B):
            a, s, e = offs[b], starts[b], offs[b + 1]
            parts += [ctx[ctx_offs[b]:ctx_offs[b + 1]] if ctx_lengths[b] else ids[a:a + s], ids[a + s:e]]
        ids, starts, offs = np.concatenate(parts), new_starts, [0, *np.cumsum(lengths).tolist()]

    # Token ids, in one pass: read as uint32 a negative id is >= 2**31, above any vocabulary.
    vocab = msg.vocab_limit if 0 < msg.vocab_limit <= backend.vocab_size else backend.vocab_size
    if len(ids) and int(ids.view(np.uint32).max()) >= vocab:
        fail(ErrorCode.BAD_TOKEN, "token ids" + (" (context included)" if msg.context else "")
                                  + f" must lie in [0, {vocab}); got min {int(ids.min())}, max {int(ids.max())}")

    # Response rows per sequence (a context leaves them as they are), or those the mask keeps.
    counts, kept_rows = [n - s for s, n in zip(starts, lengths)], None
    if msg.rows:
        kept_rows, counts = _row_mask(tensors["row_mask"], counts, fail)

    candidates = None
    if msg.support == "given":
        cand, rows = tensors["candidates"], sum(counts)
        if msg.mode != "topk":
            fail(ErrorCode.BAD_REQUEST, "support 'given' answers top-k requests only")
        if cand.dtype != np.dtype("<i4") or cand.shape != (rows, msg.k):
            fail(ErrorCode.MALFORMED, f"candidates must be int32 [rows, k] = [{rows}, {msg.k}]"
                                      + (" (rows: the row mask's ones)" if msg.rows else "")
                                      + f", got {cand.dtype} {list(cand.shape)}")
        if cand.size and int(cand.view(np.uint32).max()) >= vocab:
            fail(ErrorCode.BAD_TOKEN, f"candidate ids must lie in [0, {vocab}); "
                                      f"got min {int(cand.min())}, max {int(cand.max())}")
        ordered = np.sort(cand, axis=1)
        if cand.size and (ordered[:, 1:] == ordered[:, :-1]).any():
            fail(ErrorCode.BAD_REQUEST, "candidate ids must be distinct within a row (the tail is the rest)")
        candidates = torch.from_numpy(cand.astype(np.int64))

    # A temperature fp32 cannot divide by (subnormal, 0) answered with NaN rows.
    if not (math.isfinite(msg.temperature) and msg.temperature >= 1e-6):
        fail(ErrorCode.BAD_REQUEST, f"temperature must be finite and >= 1e-6, got {msg.temperature}")
    if not 0 <= msg.vocab_limit <= backend.vocab_size:
        fail(ErrorCode.BAD_REQUEST, f"vocab_limit = {msg.vocab_limit} must lie in [0, {backend.vocab_size}] "
                                    f"(0: the whole vocabulary)")
    req = ScoreRequest(
        request_id=rid, mode=msg.mode, ids=torch.from_numpy(ids.astype(np.int64)),
        offsets=tuple(offs), response_starts=tuple(starts), candidates=candidates,
        k=int(msg.k), temperature=float(msg.temperature), dtype=msg.dtype, chunk_rows=int(msg.chunk_rows),
        vocab_limit=int(msg.vocab_limit), kept_rows=kept_rows,
    )
    # The backend first: its refusal names the backend that can answer (vLLM: `--backend hf`).
    why = backend.unsupported(req)
    if why:
        fail(ErrorCode.UNSUPPORTED, why)
    if msg.mode not in backend.modes and msg.mode != "prefill":   # any backend may hold none
        fail(ErrorCode.UNSUPPORTED, f"mode {msg.mode!r} not served by this {backend.name} backend ({backend.modes})")
    if msg.mode == "topk" and not 1 <= msg.k <= min(backend.max_k, msg.vocab_limit or backend.max_k):
        fail(ErrorCode.BAD_K, f"k = {msg.k} must lie in [1, {backend.max_k}] (max_k)"
                              + (f" and not exceed vocab_limit {msg.vocab_limit}" if msg.vocab_limit else ""))
    if msg.mode == "full":
        if msg.dtype not in LOGIT_DTYPES or msg.dtype not in backend.dtypes:
            fail(ErrorCode.BAD_REQUEST, f"dtype {msg.dtype!r} not in {list(backend.dtypes)}")
        if msg.chunk_rows < 1 or msg.chunk_rows * backend.vocab_size * 4 > MAX_CHUNK_BYTES:
            fail(ErrorCode.BAD_REQUEST, f"chunk_rows = {msg.chunk_rows} must lie in "
                                        f"[1, {MAX_CHUNK_BYTES // (4 * backend.vocab_size)}]")
        if not 1 <= msg.window <= MAX_WINDOW:
            fail(ErrorCode.BAD_REQUEST, f"window = {msg.window} must lie in [1, {MAX_WINDOW}]")

    return req


def sample_request(msg: Sample, arrays: list[np.ndarray], backend: TeacherBackend,
                   max_tokens_per_request: int) -> SampleRequest:
    """A SAMPLE as a SampleRequest: prompts within the model's positions and the
    request within max_tokens_per_request counting every response at full length."""
    rid = msg.request_id

    def fail(code: ErrorCode, text: str):
        raise ProtocolError(code, text, rid)

    if rid < 0:
        fail(ErrorCode.BAD_REQUEST, f"request_id must be >= 0 (-1 marks unreadable ids), got {rid}")
    if "sample" not in backend.modes:
        fail(ErrorCode.UNSUPPORTED, f"this {backend.name} backend does not sample (its modes: {backend.modes})")
    if len(arrays) != 2:
        fail(ErrorCode.MALFORMED, f"a SAMPLE carries 2 tensors (ids, offsets), got {len(arrays)}")
    ids, offsets = arrays
    B = len(offsets) - 1
    if B < 1:
        fail(ErrorCode.MALFORMED, "a SAMPLE needs at least one prompt")
    offs, lengths = _ragged(ids, offsets, B, "ids", fail)
    if min(lengths) < 1:
        fail(ErrorCode.BAD_REQUEST, f"prompt {lengths.index(min(lengths))} is empty")
    if not 1 <= msg.n <= MAX_SAMPLES:
        fail(ErrorCode.BAD_REQUEST, f"n = {msg.n} must lie in [1, {MAX_SAMPLES}]")
    if msg.max_new_tokens < 1:
        fail(ErrorCode.BAD_REQUEST, f"max_new_tokens must be >= 1, got {msg.max_new_tokens}")
    if not (math.isfinite(msg.temperature) and msg.temperature >= 0):
        fail(ErrorCode.BAD_REQUEST, f"temperature must be finite and >= 0 (0: greedy), got {msg.temperature}")
    if not 0 < msg.top_p <= 1:
        fail(ErrorCode.BAD_REQUEST, f"top_p must lie in (0, 1], got {msg.top_p}")
    if max(lengths) + msg.max_new_tokens > backend.max_positions:
        fail(ErrorCode.TOO_LONG, f"a prompt of {max(lengths)} tokens + max_new_tokens {msg.max_new_tokens} exceeds "
                                 f"the {backend.max_positions} positions the model takes")
    total = sum(lengths) + B * msg.n * msg.max_new_tokens
    if total > max_tokens_per_request:
        fail(ErrorCode.TOO_LONG, f"{B} prompts x {msg.n} responses of up to {msg.max_new_tokens} tokens make {total} "
                                 f"tokens, max_tokens_per_request is {max_tokens_per_request}")
    for name, values in (("token ids", ids), ("stop ids", np.asarray(msg.stop_ids, dtype=np.int64))):
        if len(values) and not 0 <= int(values.min()) <= int(values.max()) < backend.vocab_size:
            fail(ErrorCode.BAD_TOKEN, f"{name} must lie in [0, {backend.vocab_size}); "
                                      f"got min {int(values.min())}, max {int(values.max())}")
    return SampleRequest(request_id=rid, ids=torch.from_numpy(ids.astype(np.int64)), offsets=tuple(offs), n=int(msg.n),
                         max_new_tokens=int(msg.max_new_tokens), temperature=float(msg.temperature),
                         top_p=float(msg.top_p), seed=int(msg.seed), stop_ids=tuple(int(t) for t in msg.stop_ids))


def _row_mask(mask: np.ndarray, counts: list[int], fail) -> tuple[tuple[torch.Tensor, ...], list[int]]:
    """Check row_mask uint8 [sum(counts)] (counts[b]: sequence b's response rows), 0/1 only.
    Returns, per sequence, the indices of its ones into its own rows (int64 [R_b]), and R_b."""
    if mask.dtype != np.uint8 or mask.shape != (sum(counts),):
        fail(ErrorCode.MALFORMED, f"row_mask must be uint8 [response rows] = [{sum(counts)}], "
                                  f"got {mask.dtype} {list(mask.shape)}")
    if mask.size and int(mask.max()) > 1:
        fail(ErrorCode.MALFORMED, f"row_mask values must be 0 or 1, got {int(mask.max())}")
    ones = np.flatnonzero(mask)                          # [R] into all sequences' rows
    first = np.cumsum([0, *counts])                      # [B + 1] each sequence's first row
    cut = np.searchsorted(ones, first).tolist()          # [B + 1] each sequence's first one
    kept = tuple(torch.from_numpy(ones[a:b] - first[i]) for i, (a, b) in enumerate(zip(cut, cut[1:])))
    return kept, [b - a for a, b in zip(cut, cut[1:])]


def _ragged(ids: np.ndarray, offsets: np.ndarray, B: int, name: str, fail) -> tuple[list[int], list[int]]:
    """Check `name` int32 [T] with its offsets int32 [B + 1] (rising from 0 to T); (offsets, lengths)."""
    if ids.dtype != np.dtype("<i4") or offsets.dtype != np.dtype("<i4") or ids.ndim != 1 or offsets.ndim != 1:
        fail(ErrorCode.MALFORMED, f"{name} and its offsets must be 1-D int32")
    if len(offsets) != B + 1:
        fail(ErrorCode.MALFORMED, f"{B} response_starts need {B + 1} offsets of {name}, got {len(offsets)}")
    offs = offsets.tolist()  # B + 1 Python ints: for a few dozen, cheaper than numpy calls
    lengths = [b - a for a, b in zip(offs, offs[1:])]
    if offs[0] != 0 or offs[-1] != len(ids) or min(lengths) < 0:
        fail(ErrorCode.MALFORMED, f"offsets of {name} must rise from 0 to {len(ids)} (their number)")
    return offs, lengths
