"""Full-vocabulary answers as streams: the half of `TeacherClient` (teachers/client.py) that sends
a batch's full-mode SCOREs and hands their CHUNKs to the caller as an iterator, one CREDIT per
chunk read, so at most `window` chunks ([rows, V] each) are ever buffered. `Call` is the record
of one request both halves keep: the I/O thread fills a stream's `chunks` queue, the caller's
iterator drains it.
"""

from __future__ import annotations

import queue
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from opd.teachers.batching import answered_rows, check_batch, pack, pack_masks, part_of, split_by_tokens
from opd.teachers.protocol import Sample, Score, default_chunk_rows
from opd.teachers.results import FullChunk

END = object()   # the end of a stream in its chunks queue


@dataclass(eq=False)
class Call:
    kind: str                          # "hello" | "topk" | "full" | "prefill" | "sample"
    score: Score | Sample | None = None
    arrays: tuple = ()
    future: Future = field(default_factory=Future)
    chunks: queue.Queue | None = None  # full mode: FullChunk | exception | END
    rid: int = -1
    attempts: int = 0
    deadline: float = 0.0
    retry_at: float | None = None      # waiting out a back-off
    busy_since: float | None = None    # first BUSY answer of this call
    busy: int = 0                      # BUSY answers so far
    delivered_rows: int = 0            # full mode: rows handed to the caller
    server_credit: int = 0             # full mode: chunks the server may still send
    sent: bool = False                 # on the wire on the current, verified connection


class FullStreams:
    """score_full and its streams, mixed into TeacherClient: `info()`, `address` and
    `_command(what, call)` (a command for the I/O thread) are the client's."""

    def score_full(self, sequences, response_starts, temperature: float = 1.0, dtype: str = "float32",
                   chunk_rows: int | None = None, window: int = 4, vocab_limit: int = 0,
                   contexts: Sequence[Sequence[int]] | None = None, rows=None) -> Iterator[FullChunk]:
        """Full-vocabulary rows, streamed: at most `window` chunks are ever buffered here.
        `chunk_rows` None: ~64 MiB chunks for this teacher's vocabulary (`default_chunk_rows`).
        A batch over the teacher's max_tokens_per_request is streamed as several requests, one
        after the other, `row_start` counting over the whole batch. `contexts`, `rows`: as
        submit_topk's (with `rows`, only the marked rows are streamed)."""
        welcome = self.info()
        if chunk_rows is None:
            chunk_rows = default_chunk_rows(welcome.vocab_size, dtype)
        lengths, masks = check_batch(welcome, self.address, sequences, response_starts, contexts, rows=rows)
        parts = split_by_tokens(lengths, welcome.max_tokens_per_request)
        args = (temperature, dtype, chunk_rows, window, vocab_limit)
        # The (first) request goes out now, so the teacher computes while the caller does.
        first = self._score_full(sequences[:parts[0][1]], response_starts[:parts[0][1]], *args,
                                 part_of(contexts, 0, parts[0][1]), part_of(masks, 0, parts[0][1]))
        if len(parts) == 1:
            return first
        return self._score_full_parts(first, sequences, response_starts, parts, args, contexts, masks)

    def _score_full_parts(self, first, sequences, response_starts, parts, args, contexts,
                          masks) -> Iterator[FullChunk]:
        """The parts' streams one after the other (each next request sent when the previous ended)."""
        shift, answered = 0, answered_rows(sequences, response_starts, masks)
        for i, (a, b) in enumerate(parts):
            stream = first if i == 0 else self._score_full(sequences[a:b], response_starts[a:b], *args,
                                                           part_of(contexts, a, b), part_of(masks, a, b))
            for chunk in stream:
                yield chunk._replace(row_start=chunk.row_start + shift)
            shift += sum(answered[a:b])

    def _score_full(self, sequences, response_starts, temperature: float, dtype: str, chunk_rows: int,
                    window: int, vocab_limit: int, contexts=None, masks=None) -> Iterator[FullChunk]:
        arrays = pack(sequences) + (pack(contexts) if contexts is not None else ()) + pack_masks(masks)
        score = Score(request_id=0, mode="full", response_starts=[int(s) for s in response_starts],
                      temperature=float(temperature), dtype=dtype, chunk_rows=int(chunk_rows), window=int(window),
                      vocab_limit=int(vocab_limit), context=contexts is not None, rows=masks is not None)
        call = Call("full", score, arrays, chunks=queue.Queue())
        self._command("submit", call)
        stream = self._iterate(call)
        # A generator dropped before its first read runs no `finally`: cancel it then, or the
        # server would hold the request's tokens in its in-flight budget for as long as this
        # client lives (its pings keep the peer alive). Cancelling an ended call does nothing.
        weakref.finalize(stream, self._command, "cancel", call).atexit = False
        return stream

    def _iterate(self, call: Call) -> Iterator[FullChunk]:
        finished = False
        try:
            while True:
                item = call.chunks.get()
                if item is END:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                self._command("credit", call)
                yield item
        finally:
            if not finished:
                self._command("cancel", call)
