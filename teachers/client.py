"""The trainer's side of the teacher protocol: `TeacherClient`.

One I/O thread owns the DEALER socket (zmq sockets are not thread-safe); the public
methods hand it commands through a queue and wait on futures, so a trainer thread can
keep several requests in flight (`submit_topk`) while it computes.

Reliability, all inside the I/O thread:
- every request has a deadline (`timeout_s` since its last sign of progress); pings every
  `heartbeat_s` while it waits notice a dead server after `3 * heartbeat_s` of silence;
- every (re)connection starts with HELLO, and no request goes out on it before its
  WELCOME has been checked: a WELCOME with other fingerprints than the first one fails
  everything with FINGERPRINT_CHANGED rather than mixing two teachers. A lost connection
  (seen by the socket monitor, e.g. a killed server) re-sends every outstanding request but
  prefill hints after the next WELCOME; a timeout replaces the DEALER likewise;
- BUSY (the server's in-flight budget is full) is retried after an exponential back-off (up to
  `max_backoff_s`) for `busy_timeout_s` (default `timeout_s`) from the first BUSY: full-vocabulary
  streams or other runs sharing the server can hold the budget for longer than a few back-offs;
- the other retryable ERRORs (SHUTTING_DOWN, INTERNAL) are retried after an exponential
  back-off, at most `retries` times; anything else raises `TeacherError(code, message)`;
- full-vocabulary streams grant one CREDIT per chunk the caller has consumed, and resume
  after a reconnect by skipping rows they already delivered.

Its full-vocabulary half (`score_full`: a stream per request, credits as the caller reads) is
teachers/streams.py's FullStreams. What it returns and raises is in teachers/results.py (`TopKResult`, `FullChunk` and
`TeacherError` import from here too), how a batch is packed, split and joined in teachers/batching.py.
"""

from __future__ import annotations

import itertools
import queue
import random
import socket
import threading
import time
from concurrent.futures import Future
from typing import Sequence

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from opd.teachers.batching import (SplitBatch, answered_rows, check_batch, joined_samples, pack, pack_masks, part_of,
                                   prefill_parts, split_by_tokens)
from opd.teachers.keys import client_curve_keys
from opd.teachers.protocol import (PROTOCOL_VERSION, RETRYABLE, Cancel, Chunk, Credit, Done, Error, ErrorCode, Hello,
                                   Ping, ProtocolError, Sample, Samples, Score, TopK, Welcome, decode,
                                   encode, send_frames, to_torch)
from opd.teachers.results import FullChunk, SampleResult, TeacherError, TopKResult
from opd.teachers.streams import END, Call, FullStreams

# Callers import these from here too: the result types (teachers/results.py), _as_curve
# (opd.train_teachers) and _pack (the tests, opd.bench.transport).
_as_curve = client_curve_keys
_pack = pack

class TeacherClient(FullStreams):
    def __init__(self, address: str, *, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 0.2,
                 max_backoff_s: float = 5.0, curve=None, heartbeat_s: float = 1.0, name: str = "opd",
                 protocol_version: tuple[int, int] = PROTOCOL_VERSION, busy_timeout_s: float | None = None):
        """busy_timeout_s: how long BUSY answers are retried from the first one (None: timeout_s;
        0: like the other retryable errors, at most `retries` times, e.g. for a replica pool
        that would rather send the request to another replica)."""
        self.address = address
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.heartbeat_s = heartbeat_s
        self.busy_timeout_s = timeout_s if busy_timeout_s is None else busy_timeout_s
        self.name = name
        self.protocol_version = tuple(protocol_version)
        self._curve = client_curve_keys(curve)
        self._ctx = zmq.Context.instance()
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_pending = False           # a wake byte is on its way to the I/O thread
        self._rids = itertools.count(1)
        self._calls: dict[int, Call] = {}   # wire request id -> call (top-k and full)
        self._hellos: list[Call] = []
        self._welcome: Welcome | None = None
        self._fatal: TeacherError | None = None
        self._closed = False
        self.reconnects = 0
        try:   # here, not on the I/O thread, where a malformed address left every call waiting
            self._connect()
        except zmq.ZMQError as e:
            self._wake_r.close()
            self._wake_w.close()
            raise TeacherError("BAD_ADDRESS", f"cannot connect to {address!r} ({e}); a teacher address "
                                              f"looks like tcp://HOST:PORT or ipc:///PATH") from None
        self._thread = threading.Thread(target=self._io_loop, name=f"teacher-client-{address}", daemon=True)
        self._thread.start()

    # ---- public API ----------------------------------------------------------------------

    def info(self, refresh: bool = False) -> Welcome:
        """HELLO -> WELCOME: the teacher's name, fingerprints and limits (cached)."""
        if self._welcome is None or refresh:
            self._command("submit", Call("hello")).result()
        return self._welcome  # type: ignore[return-value]

    def submit_topk(self, sequences: Sequence[Sequence[int]], response_starts: Sequence[int], k: int,
                    temperature: float = 1.0, vocab_limit: int = 0, contexts: Sequence[Sequence[int]] | None = None,
                    candidates=None, rows=None) -> Future:
        """Future of a TopKResult. Several may be in flight at once. A batch over the teacher's
        max_tokens_per_request goes as several requests (whole sequences each), kept within its
        max_inflight_tokens, and comes back as one result (`stats` None). vocab_limit > 0: the
        teacher's distribution over its first vocab_limit columns (docs/protocol.md).

        Protocol 2.4: `contexts` [B] (token ids; an empty one keeps that sequence's prompt) is what
        the teacher sees instead of each sequence's prompt, its rows still the response's;
        `candidates` int [R, k] (R rows, in row order) are the ids to answer per row instead of the
        teacher's top k (e.g. the student's own), distinct within a row.

        Protocol 2.5: `rows` [B], per sequence len - start bools (or 0/1), answers only the rows
        marked 1 (a multi-turn trajectory's assistant tokens; the rest is context the teacher
        reads but does not answer): R and row_offsets count those, candidates are [R, k]."""
        welcome = self.info()
        lengths, masks = check_batch(welcome, self.address, sequences, response_starts, contexts, candidates, k, rows)
        parts = split_by_tokens(lengths, welcome.max_tokens_per_request)
        args = (k, temperature, vocab_limit)
        row_at = [0, *itertools.accumulate(answered_rows(sequences, response_starts, masks))]

        def part(a: int, b: int) -> Future:
            return self._submit_topk(sequences[a:b], response_starts[a:b], *args, part_of(contexts, a, b),
                                     part_of(candidates, row_at[a], row_at[b]), part_of(masks, a, b))
        if len(parts) == 1:
            return part(0, len(sequences))
        return SplitBatch(part, [(a, b, sum(lengths[a:b])) for a, b in parts], welcome.max_inflight_tokens).future

    def _submit_topk(self, sequences, response_starts, k: int, temperature: float, vocab_limit: int,
                     contexts=None, candidates=None, masks=None) -> Future:
        arrays = pack(sequences) + (pack(contexts) if contexts is not None else ()) + pack_masks(masks)
        if candidates is not None:
            arrays += (np.ascontiguousarray(np.asarray(candidates.cpu() if hasattr(candidates, "cpu") else candidates),
                                            dtype="<i4"),)
        score = Score(request_id=0, mode="topk", response_starts=[int(s) for s in response_starts], k=int(k),
                      temperature=float(temperature), vocab_limit=int(vocab_limit), context=contexts is not None,
                      support="given" if candidates is not None else "teacher", rows=masks is not None)
        return self._command("submit", Call("topk", score, arrays))

    def prefill(self, sequences: Sequence[Sequence[int]], starts: Sequence[int] | None = None) -> list[Future]:
        """Protocol 2.6: announce what SCOREs will soon carry (a hint; batching.prefill_parts)."""
        return [self._command("submit", Call("prefill", *p)) for p in prefill_parts(self.info(), sequences, starts)]

    def submit_sample(self, prompts: Sequence[Sequence[int]], *, n: int = 1, max_new_tokens: int = 64,
                      temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                      stop_ids: Sequence[int] = ()) -> Future:
        """Protocol 2.7: Future of a SampleResult, n responses to each prompt (token ids as the
        teacher reads them), response j of prompt b at b * n + j; stop_ids: a response ends after
        the first (kept), none: the teacher's own EOS. A batch over max_tokens_per_request (each
        response counted at max_new_tokens) goes as several requests, joined in order."""
        welcome = self.info()
        if "sample" not in welcome.modes:
            raise TeacherError(ErrorCode.UNSUPPORTED, f"teacher at {self.address} ({welcome.backend}, protocol "
                                                      f"{tuple(welcome.version)}) does not sample: its modes are "
                                                      f"{welcome.modes}; serve it with opd >= protocol 2.7")
        args = dict(n=int(n), max_new_tokens=int(max_new_tokens), temperature=float(temperature), top_p=float(top_p),
                    seed=int(seed), stop_ids=[int(t) for t in stop_ids])
        parts = split_by_tokens([len(p) + n * max_new_tokens for p in prompts], welcome.max_tokens_per_request)
        return joined_samples([self._command("submit", Call("sample", Sample(request_id=0, **args),
                                                             pack(prompts[a:b]))) for a, b in parts])

    def sample(self, prompts, **kwargs) -> SampleResult:
        return self.submit_sample(prompts, **kwargs).result()

    def score_topk(self, sequences, response_starts, k: int, temperature: float = 1.0,
                   vocab_limit: int = 0, contexts=None, candidates=None, rows=None) -> TopKResult:
        return self.submit_topk(sequences, response_starts, k, temperature, vocab_limit, contexts, candidates,
                                rows).result()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._command("close", None)
            self._thread.join(timeout=5)
            self._wake_r.close()
            self._wake_w.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _command(self, what: str, call: Call | None) -> Future:
        if self._fatal is not None and what == "submit":
            raise self._fatal
        if self._closed and what == "submit":
            raise TeacherError("CLOSED", "client is closed")
        self._cmds.put((what, call))
        # One wake byte per I/O-loop turn is enough: the loop clears the flag before it drains
        # the queue, so a command put after that drain began finds it clear and wakes it again.
        if not self._wake_pending:
            self._wake_pending = True
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass
        return call.future if call is not None else Future()

    # ---- the I/O thread ------------------------------------------------------------------

    def _connect(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)   # queue nothing for a peer that is not connected
        if self._curve is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self._curve
        self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        self._sock = sock
        self._verified = False              # WELCOME checked on the current connection
        self._last_recv = time.monotonic()
        self._last_ping = 0.0

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(timeout=max(10, int(self.heartbeat_s * 250))))
                now = time.monotonic()
                if self._wake_r.fileno() in ready or self._wake_r in ready:
                    try:
                        self._wake_r.recv(4096)
                    except BlockingIOError:
                        pass
                self._wake_pending = False
                while True:
                    try:
                        what, call = self._cmds.get_nowait()
                    except queue.Empty:
                        break
                    if what == "close":
                        self._fail_all(TeacherError("CLOSED", "client closed"))
                        return
                    self._on_command(what, call, now)
                if self._monitor in ready:
                    while self._monitor.poll(0):
                        self._on_event(recv_monitor_message(self._monitor)["event"], now)
                if self._sock in ready:
                    for _ in range(256):  # EVENTS, not recv-until-EAGAIN: a raised zmq.Again is slow
                        if not self._sock.get(zmq.EVENTS) & zmq.POLLIN:
                            break
                        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        self._last_recv = now
                        self._on_message(frames, now)
                if self._tick(now):  # replace the connection
                    for sock in (self._sock, self._monitor):
                        poller.unregister(sock)
                    self._close_socket()
                    self._connect()
                    poller.register(self._sock, zmq.POLLIN)
                    poller.register(self._monitor, zmq.POLLIN)
                    self.reconnects += 1
                    self._unsend_all()
        finally:
            self._close_socket()

    def _close_socket(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    def _on_event(self, event: int, now: float) -> None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            # A (re)connection, maybe to a restarted server: check who it is before any SCORE.
            self._last_recv = now
            self._send(encode(Hello(version=self.protocol_version, client=self.name)))
        elif event == zmq.EVENT_DISCONNECTED:
            self._verified = False
            self._unsend_all()

    def _unsend_all(self) -> None:
        """The connection was lost: every request goes out again after the next WELCOME, but a
        prefill hint, dropped: sent again it may land after its SCORE (docs/protocol.md)."""
        self._verified = False
        for call in list(self._calls.values()):
            if call.kind == "prefill":
                self._fail(call, TeacherError("DROPPED", "connection replaced: a prefill hint is not sent again"))
            else:
                call.sent = False

    def _on_command(self, what: str, call: Call, now: float) -> None:
        if what == "submit":
            self._send_call(call, now)
        elif what == "credit" and self._calls.get(call.rid) is call and call.sent:
            call.server_credit += 1
            call.deadline = now + self.timeout_s
            self._send(encode(Credit(request_id=call.rid, chunks=1)))
        elif what == "cancel" and self._calls.pop(call.rid, None) is not None and call.sent:
            self._send(encode(Cancel(request_id=call.rid)))

    def _send(self, frames) -> bool:
        try:
            send_frames(self._sock, frames)
            return True
        except zmq.Again:
            return False  # not connected or full: the deadline or the next WELCOME sends it again

    def _send_call(self, call: Call, now: float) -> None:
        call.retry_at = None
        call.deadline = now + self.timeout_s
        if call.kind == "hello":
            if call not in self._hellos:
                self._hellos.append(call)
            self._send(encode(Hello(version=self.protocol_version, client=self.name)))
            return
        self._calls.pop(call.rid, None)
        call.rid = next(self._rids)
        call.score.request_id = call.rid
        call.server_credit = getattr(call.score, "window", 0)
        call.sent = self._verified and self._send(encode(call.score, call.arrays))
        self._calls[call.rid] = call

    def _tick(self, now: float) -> bool:
        """Retries due, pings, deadlines. True when the connection should be replaced."""
        outstanding = [*self._hellos, *self._calls.values()]
        if not outstanding:
            self._last_recv = now  # silence only counts while something is awaited
            return False
        for call in outstanding:
            if call.retry_at is not None and now >= call.retry_at:
                self._send_call(call, now)
        if now - self._last_ping >= self.heartbeat_s:
            self._last_ping = now
            self._send(encode(Ping(t=time.time())))
        # A silent server (killed, partitioned) is noticed within 3 heartbeats: replace the
        # connection. Only `timeout_s` without progress costs a request one of its attempts.
        silent = now - self._last_recv > 3 * self.heartbeat_s
        expired = [c for c in outstanding if c.retry_at is None and now > c.deadline
                   and not (c.kind == "full" and c.sent and c.server_credit <= 0)]
        for call in expired:
            call.attempts += 1
            call.deadline = now + self.timeout_s
            if call.attempts > self.retries:
                self._fail(call, TeacherError("TIMEOUT", f"no answer from {self.address} within timeout_s="
                                                         f"{self.timeout_s} ({call.attempts} attempts); raise "
                                                         f"timeout_s/retries or check the server"))
        return silent or bool(expired)

    def _on_message(self, frames, now: float) -> None:
        try:
            msg, arrays = decode(frames)
        except ProtocolError:
            return  # not from a server that speaks this protocol: ignore
        if isinstance(msg, Welcome):
            return self._on_welcome(msg)
        if isinstance(msg, Error) and msg.request_id == -1 and msg.code == ErrorCode.BAD_VERSION:
            err = TeacherError(msg.code, msg.message)
            for call in self._hellos:
                call.future.set_exception(err)
            self._hellos.clear()
            return
        call = self._calls.get(getattr(msg, "request_id", -1))
        if call is None:
            return  # a stale answer to an earlier attempt
        call.deadline = now + self.timeout_s
        if isinstance(msg, TopK):
            del self._calls[call.rid]
            call.future.set_result(TopKResult(*[to_torch(a) for a in arrays], row_offsets=list(msg.row_offsets),
                                              stats=msg.stats))
        elif isinstance(msg, Chunk):
            call.server_credit -= 1
            rows = arrays[0].shape[0]
            if msg.row_start < call.delivered_rows:   # resumed stream: the caller has these rows already
                call.server_credit += 1
                self._send(encode(Credit(request_id=call.rid, chunks=1)))
                return
            call.delivered_rows = msg.row_start + rows
            call.chunks.put(FullChunk(msg.row_start, *(to_torch(a, s.dtype) for a, s in zip(arrays, msg.tensors))))
        elif isinstance(msg, Samples):
            del self._calls[call.rid]
            ids, offsets = (a.tolist() for a in arrays)
            call.future.set_result(SampleResult([ids[a:b] for a, b in zip(offsets, offsets[1:])], list(msg.finish),
                                                msg.stats))
        elif isinstance(msg, Done):   # the end of a full-mode stream, or a prefill's answer
            del self._calls[call.rid]
            if call.chunks is not None:
                call.chunks.put(END)
            call.future.set_result(msg)
        elif isinstance(msg, Error):
            busy = msg.code == ErrorCode.BUSY and now - (call.busy_since or now) < self.busy_timeout_s
            if busy or (msg.code in RETRYABLE and call.attempts < self.retries):
                if busy:   # waited out for busy_timeout_s, not counted against retries
                    call.busy_since, call.busy = call.busy_since or now, call.busy + 1
                else:
                    call.attempts += 1
                delay = min(self.backoff_s * 2 ** min((call.busy if busy else call.attempts) - 1, 30),
                            self.max_backoff_s)
                call.retry_at = now + delay * (0.5 + random.random())  # jitter: retries do not arrive in step
            else:
                self._fail(call, TeacherError(msg.code, msg.message))

    def _on_welcome(self, msg: Welcome) -> None:
        first = self._welcome
        if msg.version[0] != PROTOCOL_VERSION[0]:
            err = TeacherError(ErrorCode.BAD_VERSION, f"server speaks protocol {tuple(msg.version)}, "
                                                      f"this client {PROTOCOL_VERSION}")
        elif first is not None and (first.model_fingerprint, first.tokenizer_fingerprint) != \
                (msg.model_fingerprint, msg.tokenizer_fingerprint):
            err = TeacherError("FINGERPRINT_CHANGED",
                               f"teacher at {self.address} changed: model {first.model_fingerprint} -> "
                               f"{msg.model_fingerprint}, tokenizer {first.tokenizer_fingerprint} -> "
                               f"{msg.tokenizer_fingerprint}")
        else:
            self._welcome = msg
            if msg.heartbeat_s > 0:   # the server drops peers it has not heard from: ping as often as it asks
                self.heartbeat_s = min(self.heartbeat_s, msg.heartbeat_s)
            for call in self._hellos:
                call.future.set_result(msg)
            self._hellos.clear()
            if not self._verified:
                self._verified = True
                now = time.monotonic()
                for call in list(self._calls.values()):
                    if not call.sent and call.retry_at is None:
                        self._send_call(call, now)
            return
        self._fatal = err
        self._fail_all(err)

    def _fail(self, call: Call, err: Exception) -> None:
        if call.kind == "hello":
            if call in self._hellos:
                self._hellos.remove(call)
        else:
            self._calls.pop(call.rid, None)
        if call.chunks is not None:
            call.chunks.put(err)
        if not call.future.done():
            call.future.set_exception(err)

    def _fail_all(self, err: Exception) -> None:
        for call in [*self._hellos, *self._calls.values()]:
            self._fail(call, err)
