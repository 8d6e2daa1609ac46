"""The teacher server's worker thread, the half of `TeacherServer` (teachers/server.py) that
owns the backend.

It groups pending top-k requests (or prompts to prefill, 2.6, or to sample, 2.7) into one
backend call up to `batch_tokens`, and steps
full-vocabulary streams one CHUNK per credit, alternating the two. It never touches the
ROUTER (zmq sockets are not thread-safe): answers go to the socket thread over an outbox
deque, with a one-byte wake on an inproc PAIR (skipped while one is pending). A `Job` is
one accepted request; the state both threads share is guarded by the server's `_cv`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from opd.teachers.backend import SampleRequest, ScoreRequest, TeacherBackend
from opd.teachers.protocol import Chunk, Done, ErrorCode, Samples, TopK, encode, error

log = logging.getLogger("opd.teachers.server")   # the server's logger: one name for both threads


@dataclass(eq=False)
class Job:
    """One accepted SCORE (or SAMPLE) request, from admission until its last answer is queued."""

    peer: bytes
    req: ScoreRequest | SampleRequest
    arrived: float
    credit: int = 0                       # full mode: CHUNKs the worker may still send
    cancelled: bool = False
    released: bool = False                # its tokens no longer count against max_inflight_tokens
    cancel_code: ErrorCode = ErrorCode.CANCELLED   # SHUTTING_DOWN when the server quits first
    started: float = 0.0
    stream: object = None                 # full mode: the backend's chunk iterator
    chunks_sent: int = 0
    row_offsets: list[int] = field(init=False)   # [B + 1], sent with every TOPK and CHUNK
    rows: int = field(init=False)

    def __post_init__(self):
        self.row_offsets = self.req.row_offsets()
        self.rows = self.row_offsets[-1]

    @property
    def key(self) -> tuple[bytes, int]:
        return self.peer, self.req.request_id


class ServerWorker:
    """The worker thread's methods, mixed into TeacherServer (whose own methods are the socket
    thread's). The attributes are set up by TeacherServer.__init__; the job state both threads
    use is read and written under `_cv`."""

    backend: TeacherBackend
    limits: Any                            # ServerLimits (teachers/server.py): batch_tokens
    ctx: zmq.Context
    _cv: threading.Condition
    _outbox: collections.deque             # (peer, frames) for the socket thread to send
    _wake_pending: bool                    # a wake byte is on the pipe
    _pending: collections.deque[Job]       # accepted, not started
    _streams: list[Job]                    # full mode, started
    _jobs: dict[tuple[bytes, int], Job]    # every unfinished job
    _inflight_tokens: int
    _streams_first: bool
    _stop_worker: bool

    def _release_locked(self, job: Job) -> None:
        if not job.released:
            job.released = True
            self._inflight_tokens -= job.req.num_tokens

    def _finish_locked(self, job: Job) -> None:
        if self._jobs.get(job.key) is not job:  # already finished
            return
        self._release_locked(job)
        del self._jobs[job.key]
        if job in self._streams:
            self._streams.remove(job)

    def _next_work(self):
        """Under the lock: alternately one chunk of a stream that has credit (round robin) and
        the next pending work (a group of top-k jobs, or a new stream)."""
        self._streams_first = not self._streams_first
        if self._streams_first or not self._pending:
            for i, job in enumerate(self._streams):
                if job.cancelled or job.credit > 0:
                    job.credit -= 1
                    self._streams.append(self._streams.pop(i))  # next time, the others first
                    return "chunk", job
        if not self._pending:
            return None
        if self._pending[0].req.mode == "full":
            job = self._pending.popleft()
            self._streams.append(job)
            return "start", job
        mode, group, tokens = self._pending[0].req.mode, [], 0   # "topk", "prefill", "sample": alike ones together
        while self._pending and self._pending[0].req.mode == mode:
            n = self._pending[0].req.num_tokens
            if group and tokens + n > self.limits.batch_tokens:
                break
            group.append(self._pending.popleft())
            tokens += n
        return mode, group

    def _worker_loop(self, pipe_address: str) -> None:
        out = self.ctx.socket(zmq.PAIR)
        out.connect(pipe_address)
        try:
            while True:
                with self._cv:
                    work = self._next_work()
                    while work is None and not self._stop_worker:
                        self._cv.wait()
                        work = self._next_work()
                    if work is None:
                        return
                kind, what = work
                try:
                    if kind in ("topk", "prefill", "sample"):
                        self._compute_group(out, what, kind)
                    else:
                        self._step_stream(out, what, start=kind == "start")
                except Exception as e:  # never let one request kill the worker
                    for job in what if kind in ("topk", "prefill", "sample") else [what]:
                        if job.key in self._jobs:
                            job.stream = None
                            self._internal(out, job, e)
        finally:
            out.close(linger=0)

    def _post(self, wake, peer: bytes, frames: list) -> None:
        """Worker side: queue an answer for the socket thread; wake it unless a wake is pending."""
        self._outbox.append((peer, frames))
        if not self._wake_pending:
            self._wake_pending = True
            wake.send(b"")

    def _done(self, out, job: Job, msg, tensors=()) -> None:
        # Its tokens are released before the answer leaves, so that a client which sends its
        # next request on receiving this answer finds the budget free (a batch split to fit
        # max_inflight_tokens, opd.teachers.client). The job is finished after queueing: once
        # the socket thread sees no jobs, every answer is in the outbox.
        frames = encode(msg, tensors)
        with self._cv:
            self._release_locked(job)
        self._post(out, job.peer, frames)
        with self._cv:
            self._finish_locked(job)

    def _stats(self, job: Job) -> Done:
        now = time.monotonic()
        return Done(request_id=job.req.request_id, rows=job.rows, tokens=job.req.num_tokens,
                    queue_ms=1e3 * (job.started - job.arrived), compute_ms=1e3 * (now - job.started),
                    total_ms=1e3 * (now - job.arrived), chunks=job.chunks_sent)

    def _internal(self, out, job: Job, e: Exception) -> None:
        log.exception("backend failed on request %d", job.req.request_id)
        self._done(out, job, error(job.req.request_id, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"[:1000]))

    def _cancelled(self, job: Job):
        why = "server shut down before finishing" if job.cancel_code == ErrorCode.SHUTTING_DOWN else "cancelled"
        return error(job.req.request_id, job.cancel_code, why)

    def _compute_group(self, out, group: list[Job], mode: str) -> None:
        """One backend call for a group of top-k requests (TOPK answers), of prefills (DONE) or of
        samples (SAMPLES)."""
        started = time.monotonic()
        for job in group:
            job.started = started
        live = [j for j in group if not j.cancelled]
        for job in group:
            if job.cancelled:    # cancelled before the call
                self._done(out, job, self._cancelled(job))
        try:
            call = {"topk": self.backend.score_topk, "prefill": self.backend.prefill,
                    "sample": self.backend.sample}[mode]
            answers = call([j.req for j in live]) if live else []
        except Exception as e:
            for job in live:
                self._internal(out, job, e)
            return
        for job, ans in zip(live, answers):
            if job.cancelled:    # cancelled during the call: one answer, CANCELLED
                self._done(out, job, self._cancelled(job))
                continue
            if mode == "prefill":   # ans: the prompt tokens the backend holds
                stats = self._stats(job)
                stats.cached = ans
                self._done(out, job, stats)
            elif mode == "sample":  # ans: a SampleAnswer, its responses flattened with their offsets
                ids = np.array([t for r in ans.responses for t in r], dtype="<i4")
                offsets = np.cumsum([0, *map(len, ans.responses)]).astype("<i4")
                self._done(out, job, Samples(request_id=job.req.request_id, finish=list(ans.finish),
                                             stats=self._stats(job)), (ids, offsets))
            else:
                self._done(out, job, TopK(request_id=job.req.request_id, row_offsets=job.row_offsets,
                                          stats=self._stats(job)), tuple(ans))

    def _step_stream(self, out, job: Job, start: bool) -> None:
        rid = job.req.request_id
        if job.cancelled:
            job.stream = None
            return self._done(out, job, self._cancelled(job))
        try:
            if start:
                job.started = time.monotonic()
                job.stream = iter(self.backend.score_full(job.req))
                with self._cv:
                    job.credit -= 1  # the first chunk goes out now
            n_chunks = -(-job.rows // job.req.chunk_rows)
            if job.chunks_sent < n_chunks:
                c = next(job.stream)
                msg = Chunk(request_id=rid, row_start=c.row_start, row_offsets=job.row_offsets)
                self._post(out, job.peer, encode(msg, (c.logits, c.lse, c.token_logprob)))
                job.chunks_sent += 1
            if job.chunks_sent == n_chunks:
                job.stream = None
                self._done(out, job, self._stats(job))
        except Exception as e:
            job.stream = None
            self._internal(out, job, e)
