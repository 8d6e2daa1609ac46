"""How `TeacherClient` turns a batch of sequences into requests, and their answers into one.

    check_batch(welcome, ...)        the server speaks the protocol the batch needs; its lengths and masks
    pack(sequences)                  flat int32 token ids + [B + 1] offsets, as SCORE carries them
    scored_lengths(...)              the length of each sequence the teacher scores (contexts included)
    row_masks(sequences, starts, rows)  the rows to answer per sequence (SCORE's row mask), checked
    split_by_tokens(lengths, limit)  consecutive parts within the teacher's max_tokens_per_request
    prefill_parts(welcome, seqs)     the prefill SCOREs announcing sequences, if the teacher keeps any
    SplitBatch(submit, parts, budget)  sends a top-k batch's parts within max_inflight_tokens
    join_topk(results)               the parts' TopKResults as one
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future

import numpy as np

from opd.teachers.protocol import ErrorCode, Score
from opd.teachers.results import SampleResult, TeacherError, TopKResult


def check_batch(welcome, address: str, sequences, response_starts, contexts=None, candidates=None, k: int = 0,
                rows=None) -> tuple[list[int], list[np.ndarray] | None]:
    """(scored_lengths, row_masks) of a batch for the teacher that sent `welcome`, once it is known
    to speak 2.4 if contexts or candidates are given, and 2.5 if rows are (TeacherError UNSUPPORTED)."""
    version = tuple(welcome.version)
    if (contexts is not None or candidates is not None) and version < (2, 4):
        raise TeacherError(ErrorCode.UNSUPPORTED, f"teacher at {address} speaks protocol {version}: teacher "
                                                  f"contexts and given candidates need 2.4")
    if rows is not None and version < (2, 5):
        raise TeacherError(ErrorCode.UNSUPPORTED, f"teacher at {address} speaks protocol {version}: row masks "
                                                  f"need 2.5")
    masks = row_masks(sequences, response_starts, rows)
    return scored_lengths(sequences, response_starts, contexts, candidates, k, masks), masks


def scored_lengths(sequences, response_starts, contexts=None, candidates=None, k: int = 0,
                   masks=None) -> list[int]:
    """The length of each sequence the teacher scores: with a non-empty context (docs/protocol.md),
    the context + the response. ValueError when contexts or candidates [rows, k] do not fit
    (rows: the response rows, or the ones of `masks`, row_masks' answer, when given)."""
    rows = [len(s) - int(st) for s, st in zip(sequences, response_starts)]
    if contexts is not None and len(contexts) != len(sequences):
        raise ValueError(f"{len(contexts)} contexts for {len(sequences)} sequences")
    answered = sum(rows) if masks is None else sum(int(m.sum()) for m in masks)
    if candidates is not None and (candidates.ndim != 2 or tuple(candidates.shape) != (answered, k)):
        raise ValueError(f"candidates must be [rows, k] = [{answered}, {k}]"
                         + (" (rows: the row masks' ones)" if masks is not None else "")
                         + f", got {list(candidates.shape)}")
    return [len(s) if contexts is None or not len(c) else len(c) + r
            for s, c, r in zip(sequences, contexts or sequences, rows)]


def row_masks(sequences, response_starts, rows) -> list[np.ndarray] | None:
    """`rows` (SCORE's row mask: per sequence, which of its len - start response rows to answer, as
    bools or 0/1) as uint8 arrays, checked; None stays None. ValueError when they do not fit."""
    if rows is None:
        return None
    if len(rows) != len(sequences):
        raise ValueError(f"{len(rows)} row masks for {len(sequences)} sequences")
    masks = []
    for b, (s, st, m) in enumerate(zip(sequences, response_starts, rows)):
        m = np.asarray(m.cpu() if hasattr(m, "cpu") else m).reshape(-1)
        if len(m) != len(s) - int(st):
            raise ValueError(f"row mask {b} has {len(m)} entries; its sequence has {len(s) - int(st)} response "
                             f"rows (len - start = {len(s)} - {int(st)})")
        if m.size and not np.isin(m, (0, 1)).all():
            raise ValueError(f"row mask {b} holds values other than 0/1 (or True/False)")
        masks.append(m.astype(np.uint8))
    return masks


def answered_rows(sequences, response_starts, masks) -> list[int]:
    """Rows the teacher answers per sequence: its response rows, or its mask's ones."""
    if masks is None:
        return [len(s) - int(st) for s, st in zip(sequences, response_starts)]
    return [int(m.sum()) for m in masks]


def part_of(x, a: int, b: int):
    """x[a:b], or None when x is None (a batch's contexts, row masks or candidates, when not given)."""
    return None if x is None else x[a:b]


def split_by_tokens(lengths: list[int], limit: int) -> list[tuple[int, int]]:
    """[a, b) ranges of consecutive sequences of at most `limit` tokens each (the teacher's
    max_tokens_per_request), in order; a sequence longer than `limit` alone is a ValueError."""
    parts, a, total = [], 0, 0
    for i, n in enumerate(lengths):
        if n > limit:
            raise ValueError(f"sequence {i} has {n} tokens, more than the teacher's max_tokens_per_request "
                             f"({limit}); start the server with a larger --max-tokens-per-request")
        if total + n > limit:
            parts.append((a, i))
            a, total = i, 0
        total += n
    parts.append((a, len(lengths)))
    return parts


def prefill_parts(welcome, sequences, starts=None) -> list[tuple[Score, tuple]]:
    """(SCORE, tensors) of mode "prefill" (docs/protocol.md) announcing `sequences` (token ids: prompts,
    or prompt + the response so far with `starts` [B] where each response starts; None: prompts),
    each part within max_tokens_per_request; none where the WELCOME offers no prompt cache."""
    if tuple(welcome.version) < (2, 6) or welcome.prompt_cache_tokens <= 0 or not sequences:
        return []
    lengths = [len(p) for p in sequences]
    starts = lengths if starts is None else [int(s) for s in starts]
    if len(starts) != len(lengths) or not all(1 <= s <= n for s, n in zip(starts, lengths)):
        raise ValueError("each sequence to prefill needs a token, and its start within it (1 <= start <= length)")
    return [(Score(request_id=0, mode="prefill", response_starts=starts[a:b]), pack(sequences[a:b]))
            for a, b in split_by_tokens(lengths, welcome.max_tokens_per_request)]


class SplitBatch:
    """One top-k batch sent as several requests: parts go out while the tokens in flight stay
    within `budget` (the server's max_inflight_tokens, past which it answers BUSY), the next
    one as each answer arrives; `future` gets the answers joined in order, or the first
    error, after which no part goes out."""

    def __init__(self, submit, parts: list[tuple[int, int, int]], budget: int):
        """submit(a, b) -> Future of the TopKResult of sequences a..b; parts: (a, b, tokens)."""
        self.submit, self.parts, self.budget = submit, parts, budget
        self.results: list[TopKResult | None] = [None] * len(parts)
        self.future: Future = Future()
        self.lock = threading.Lock()
        self.next = 0
        self.inflight = 0                  # tokens of parts sent and not yet answered
        self._send_more()

    def _send_more(self) -> None:
        with self.lock:
            ready = []
            while not self.future.done() and self.next < len(self.parts) and (
                    self.inflight == 0 or self.inflight + self.parts[self.next][2] <= self.budget):
                ready.append(self.next)
                self.inflight += self.parts[self.next][2]
                self.next += 1
        for i in ready:
            a, b, _ = self.parts[i]
            try:
                fut = self.submit(a, b)
            except BaseException as e:  # noqa: BLE001 - the caller sees it through the future
                self._finish(exc=e)
                return
            fut.add_done_callback(lambda f, i=i: self._answered(i, f))

    def _answered(self, i: int, fut: Future) -> None:
        if fut.exception() is not None:
            self._finish(exc=fut.exception())
            return
        with self.lock:
            self.results[i] = fut.result()
            self.inflight -= self.parts[i][2]
            complete = all(r is not None for r in self.results)
        if complete:
            self._finish(result=join_topk(self.results))
        else:
            self._send_more()

    def _finish(self, result=None, exc=None) -> None:
        with self.lock:
            if self.future.done():
                return
            if exc is not None:
                self.future.set_exception(exc)
            else:
                self.future.set_result(result)


def join_topk(results: list[TopKResult]) -> TopKResult:
    """Answers of consecutive parts of a batch as one: rows concatenated, offsets shifted."""
    import torch   # here, not at the top: the client side (opd.teachers, `opd keys`) imports without torch

    offsets, shift = [0], 0
    for r in results:
        offsets += [shift + o for o in r.row_offsets[1:]]
        shift += r.row_offsets[-1]
    fields = ("ids", "logprobs", "tail_logmass", "token_logprob", "lse")
    return TopKResult(*(torch.cat([getattr(r, f) for r in results]) for f in fields), row_offsets=offsets)


def pack_masks(masks) -> tuple:
    """A part's row masks as SCORE's row_mask tensor, (uint8 [its response rows],); () without."""
    return () if masks is None else (np.concatenate([np.zeros(0, np.uint8), *masks]),)


def pack(sequences) -> tuple[np.ndarray, np.ndarray]:
    """Flat int32 ids and [B + 1] int32 offsets of token-id sequences (lists, numpy arrays or
    torch tensors). Lists go through one `np.fromiter` (~25 ns a token, half of converting
    each list); arrays and tensors are concatenated without a detour through Python ints."""
    lengths = [len(s) for s in sequences]
    offsets = np.zeros(len(lengths) + 1, dtype="<i4")
    offsets[1:] = np.cumsum(lengths)
    if all(isinstance(s, (list, tuple)) for s in sequences):
        try:
            ids = np.fromiter(itertools.chain.from_iterable(sequences), dtype="<i4", count=int(offsets[-1]))
        except OverflowError:
            raise ValueError("token ids do not fit in int32") from None
        return ids, offsets
    parts = [np.asarray(s.cpu() if hasattr(s, "cpu") else s).reshape(-1) for s in sequences]
    ids = np.concatenate(parts)
    if ids.dtype != np.dtype("<i4"):
        if ids.size and (ids.min() < np.iinfo(np.int32).min or ids.max() > np.iinfo(np.int32).max):
            raise ValueError("token ids do not fit in int32")
        ids = ids.astype("<i4")
    return ids, offsets


def joined_samples(futures: list[Future]) -> Future:
    """One Future of the SampleResult of several SAMPLE parts, in their order."""
    if len(futures) == 1:
        return futures[0]
    out: Future = Future()

    def join(_: Future) -> None:
        if out.done() or not all(f.done() for f in futures):
            return
        try:
            parts = [f.result() for f in futures]
        except BaseException as e:   # noqa: BLE001 - the caller's future carries it
            out.set_exception(e)
            return
        out.set_result(SampleResult([r for p in parts for r in p.responses], [x for p in parts for x in p.finish]))
    for f in futures:
        f.add_done_callback(join)
    return out
