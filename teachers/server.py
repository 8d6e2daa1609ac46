"""The teacher server: a ZeroMQ ROUTER in front of one backend.

Two threads. The socket thread owns the ROUTER and runs one loop of numbered steps:
    1. poll    the ROUTER and the worker's inproc pipe (a short timeout, so SIGTERM and
               silent peers are noticed)
    2. read    every waiting message; dispatch on its type; validate SCOREs and SAMPLEs into
               Score/SampleRequests (teachers/validate.py); answer PING, HELLO, CREDIT, CANCEL
               and every ERROR (bad input, BUSY, SHUTTING_DOWN) at once
    3. batch   hand the accepted requests to the worker in one go
    4. send    forward the worker's answers (TOPK, CHUNK, DONE, ERROR) to their peers
    5. sweep   cancel streams of peers that stopped sending heartbeats; exit once drained
The worker thread (its methods: teachers/worker.py) owns the backend: it groups pending
top-k requests into one backend call up to `batch_tokens`, and steps full-vocabulary
streams one CHUNK per credit. It never touches the ROUTER (zmq sockets are not thread-safe): answers go back over an
outbox deque, with a one-byte wake on an inproc PAIR (skipped while one is pending), so
the socket thread keeps answering heartbeats and BUSY while it computes and answers cross
the thread boundary without being re-framed.

Backpressure: accepted tokens in flight are bounded by `max_inflight_tokens`; past it a
SCORE gets ERROR(BUSY, retryable), never a queue slot. ROUTER_MANDATORY turns a send to a
vanished peer into an error that cancels its work instead of a silent drop.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator

from opd.teachers.backend import TeacherBackend
from opd.teachers.protocol import (PROTOCOL_VERSION, Cancel, Credit, ErrorCode, Hello, Ping, Pong, ProtocolError, Sample,
                                   Score, Welcome, decode, encode, error, send_frames)
from opd.teachers.validate import sample_request, score_request
from opd.teachers.worker import Job, ServerWorker

log = logging.getLogger("opd.teachers.server")

_PIPE = "inproc://opd-teacher-worker-{}"
_PIPE_IDS = itertools.count()   # not id(self): zmq frees an inproc name after close(), asynchronously
MAX_FRAME_BYTES = 1 << 26       # 64 MiB: a larger frame drops the connection (zmq.MAXMSGSIZE)


@dataclass(frozen=True)
class ServerLimits:
    max_tokens_per_request: int = 32768   # larger SCOREs get TOO_LONG
    max_inflight_tokens: int = 131072     # accepted, unfinished tokens; past it BUSY
    batch_tokens: int = 16384             # top-k requests grouped into one backend call
    heartbeat_s: float = 1.0              # clients ping this often while they wait
    peer_timeout_s: float = 10.0          # a peer silent this long loses its streams
    drain_timeout_s: float = 60.0         # SIGTERM: longest wait for in-flight work


class TeacherServer(ServerWorker):
    def __init__(self, backend: TeacherBackend, bind: str = "tcp://127.0.0.1:5555", *,
                 name: str | None = None, limits: ServerLimits = ServerLimits(),
                 curve_secret_key: bytes | None = None, curve_public_key: bytes | None = None,
                 curve_allow: set[bytes] | None = None, context: zmq.Context | None = None):
        self.backend = backend
        self.limits = limits
        self.name = name or getattr(backend, "teacher", None) or backend.model_id
        # A CURVE server gets a context of its own: ZeroMQ has one authentication handler per
        # context (inproc://zeromq.zap.01), so a second CURVE server on a shared one cannot start.
        self._own_ctx = context is None and curve_secret_key is not None
        self.ctx = zmq.Context() if self._own_ctx else (context or zmq.Context.instance())
        self._auth = None
        self.router = self.pipe = None
        try:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.router.setsockopt(zmq.LINGER, 0)
            # Frames past this size drop the connection; requests far below it but over
            # max_tokens_per_request get TOO_LONG (teachers/validate.py).
            self.router.setsockopt(zmq.MAXMSGSIZE, max(MAX_FRAME_BYTES, 8 * limits.max_tokens_per_request + 4096))
            self.router.setsockopt(zmq.HEARTBEAT_IVL, int(limits.heartbeat_s * 1000))
            self.router.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(limits.peer_timeout_s * 1000))
            if curve_secret_key is not None:
                # The handler before the bind: without one, ZeroMQ admits any CURVE client.
                self._auth = ThreadAuthenticator(self.ctx)
                self._auth.start()
                self._auth.configure_curve_callback("*", _AllowList(curve_allow or set()))
                self.router.curve_server = True
                self.router.curve_secretkey = curve_secret_key
                self.router.curve_publickey = curve_public_key
            self._bind(bind)   # a failed bind stops the handler again (below)
            self.address = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            pipe = _PIPE.format(next(_PIPE_IDS))
            self.pipe = self.ctx.socket(zmq.PAIR)
            self.pipe.bind(pipe)
        except BaseException:
            self._close_sockets()
            raise
        self._cv = threading.Condition()
        self._outbox: collections.deque = collections.deque()   # (peer, frames) from the worker
        self._wake_pending = False                              # a wake byte is on the pipe
        self._pending: collections.deque[Job] = collections.deque()   # accepted, not started
        self._streams: list[Job] = []                                  # full mode, started
        self._jobs: dict[tuple[bytes, int], Job] = {}                  # every unfinished job
        self._inflight_tokens = 0
        self._streams_first = False
        self._draining = threading.Event()
        self._stop_worker = False
        self._last_seen: dict[bytes, float] = {}
        self.stats = collections.Counter()
        self._worker = threading.Thread(target=self._worker_loop, args=(pipe,), name="teacher-worker", daemon=True)
        self._worker.start()

    def _bind(self, address: str, wait_s: float = 3.0) -> None:
        # A server restarted on the same port in one process may find the old listener
        # still closing (zmq closes sockets asynchronously): wait for it briefly.
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self.router.bind(address)
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    # ---- control -------------------------------------------------------------------------

    def welcome(self) -> Welcome:
        b = self.backend
        return Welcome(version=PROTOCOL_VERSION, teacher=self.name, model_id=b.model_id,
                       model_fingerprint=b.model_fingerprint, tokenizer_fingerprint=b.tokenizer_fingerprint,
                       vocab_size=b.vocab_size, max_k=b.max_k, modes=list(b.modes), dtypes=list(b.dtypes),
                       max_tokens_per_request=self.limits.max_tokens_per_request,
                       max_inflight_tokens=self.limits.max_inflight_tokens,
                       heartbeat_s=self.limits.heartbeat_s, backend=b.name,
                       supports_temperature=b.supports_temperature, exact_lse=b.exact_lse,
                       max_positions=b.max_positions, prompt_cache_tokens=b.prompt_cache_tokens)

    def stop(self) -> None:
        """Stop accepting work (SHUTTING_DOWN), drain what is in flight, then return from serve_forever."""
        self._draining.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    # ---- the socket loop -----------------------------------------------------------------

    def serve_forever(self) -> int:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.pipe, zmq.POLLIN)
        drain_deadline = math.inf
        try:
            while True:
                # 1. poll
                ready = dict(poller.poll(timeout=100))
                now = time.monotonic()
                # 2. read + validate + answer control messages
                accepted: list[Job] = []
                if self.router in ready:
                    # EVENTS instead of recv-until-EAGAIN: a raised zmq.Again is slow, every loop.
                    for _ in range(1024):
                        if not self.router.get(zmq.EVENTS) & zmq.POLLIN:
                            break
                        frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                        self._handle(frames[0].bytes, frames[1:], now, accepted)
                # 3. batch: hand everything accepted in this round to the worker at once
                if accepted:
                    with self._cv:
                        self._pending.extend(accepted)
                        self._cv.notify()
                # 4. send the worker's answers
                if self.pipe in ready:
                    self._forward()
                # 5. sweep silent peers; finish draining
                self._sweep(now)
                if self._draining.is_set():
                    drain_deadline = min(drain_deadline, now + self.limits.drain_timeout_s)
                    with self._cv:
                        idle = not self._jobs
                    if idle or now > drain_deadline:
                        self._forward()
                        return 0
        finally:
            self.close()

    def _forward(self) -> None:
        """Send what the worker has put in the outbox. Clear the wake flag before draining:
        an answer queued after this drain began finds the flag clear and wakes us again."""
        while self.pipe.get(zmq.EVENTS) & zmq.POLLIN:
            self.pipe.recv(zmq.NOBLOCK)
        self._wake_pending = False
        while self._outbox:
            peer, frames = self._outbox.popleft()
            self._send(peer, frames)

    def _handle(self, peer: bytes, frames, now: float, accepted: list[Job]) -> None:
        self._last_seen[peer] = now
        self.stats["messages"] += 1
        try:
            msg, arrays = decode(frames)
        except ProtocolError as e:
            return self._refuse(peer, e.request_id, e.code, str(e))
        except Exception as e:  # anything decode did not foresee is still the sender's fault
            return self._refuse(peer, -1, ErrorCode.MALFORMED, f"undecodable message: {type(e).__name__}: {e}")
        if isinstance(msg, Ping):
            self._send(peer, encode(Pong(t=msg.t)))
        elif isinstance(msg, Pong):
            pass
        elif isinstance(msg, Hello):
            if tuple(msg.version)[:1] != PROTOCOL_VERSION[:1]:
                return self._refuse(peer, -1, ErrorCode.BAD_VERSION,
                                    f"client speaks protocol {tuple(msg.version)}, server {PROTOCOL_VERSION}; "
                                    f"major versions must match")
            self._send(peer, encode(self.welcome()))
        elif isinstance(msg, (Score, Sample)):
            job = self._admit(peer, msg, arrays, now)
            if job is not None:
                accepted.append(job)
        elif isinstance(msg, Credit):
            with self._cv:
                job = self._jobs.get((peer, msg.request_id))
                if job is not None and msg.chunks > 0:
                    job.credit = min(job.credit + msg.chunks, 1 << 20)
                    self._cv.notify()
        elif isinstance(msg, Cancel):
            self._cancel(peer, msg.request_id)
        else:
            self._refuse(peer, getattr(msg, "request_id", -1), ErrorCode.BAD_REQUEST,
                         f"{type(msg).__name__.upper()} is sent by servers, not clients")

    def _admit(self, peer: bytes, msg: Score | Sample, arrays, now: float) -> Job | None:
        rid = msg.request_id
        if self._draining.is_set():
            return self._refuse(peer, rid, ErrorCode.SHUTTING_DOWN, "server is draining; use another replica")
        check = score_request if isinstance(msg, Score) else sample_request
        try:
            req = check(msg, arrays, self.backend, self.limits.max_tokens_per_request)
        except ProtocolError as e:
            return self._refuse(peer, rid, e.code, str(e))
        except Exception as e:  # a check that tripped over the input is still a bad request
            return self._refuse(peer, rid, ErrorCode.MALFORMED,
                                f"invalid {type(msg).__name__.upper()}: {type(e).__name__}: {e}")
        job = Job(peer, req, now, credit=getattr(msg, "window", 0))
        with self._cv:
            if job.key in self._jobs:
                return self._refuse(peer, rid, ErrorCode.BAD_REQUEST, f"request id {rid} is already in flight")
            if self._inflight_tokens and self._inflight_tokens + req.num_tokens > self.limits.max_inflight_tokens:
                self.stats["busy"] += 1
                return self._refuse(peer, rid, ErrorCode.BUSY,
                                    f"{self._inflight_tokens} tokens in flight, budget {self.limits.max_inflight_tokens}")
            self._inflight_tokens += req.num_tokens
            self._jobs[job.key] = job
        return job

    def _cancel(self, peer: bytes, rid: int) -> None:
        with self._cv:
            job = self._jobs.get((peer, rid))
            if job is None:
                return
            if job in self._pending:  # not started: answer here
                self._pending.remove(job)
                self._finish_locked(job)
            else:                     # the worker answers CANCELLED when it gets to it
                job.cancelled = True
                self._cv.notify()
                return
        self._refuse(peer, rid, ErrorCode.CANCELLED, "cancelled by the client")

    def _sweep(self, now: float) -> None:
        silent = {p for p, t in self._last_seen.items() if now - t > self.limits.peer_timeout_s}
        if not silent:
            return
        with self._cv:
            for job in self._jobs.values():
                if job.peer in silent and not job.cancelled:
                    log.warning("peer %s silent for %.1fs: cancelling request %d",
                                job.peer.hex(), self.limits.peer_timeout_s, job.req.request_id)
                    job.cancelled = True
            busy_peers = {j.peer for j in self._jobs.values()}
            self._cv.notify()
        for p in silent - busy_peers:
            del self._last_seen[p]

    def _refuse(self, peer: bytes, rid: int, code: ErrorCode, text: str) -> None:
        self.stats[code.value] += 1
        log.info("ERROR %s to %s (request %d): %s", code.value, peer.hex(), rid, text[:300])
        self._send(peer, encode(error(rid, code, text[:1000])))

    def _send(self, peer: bytes, frames) -> None:
        try:
            send_frames(self.router, [peer, *frames])
        except zmq.ZMQError as e:  # EHOSTUNREACH (peer gone) or EAGAIN (peer not reading)
            with self._cv:
                jobs = [j for j in self._jobs.values() if j.peer == peer and not j.cancelled]
                for job in jobs:
                    job.cancelled = True
                self._cv.notify()
            (log.warning if jobs else log.debug)("cannot send to %s (%s): cancelled %d of its requests",
                                                 peer.hex(), e, len(jobs))

    def close(self) -> None:
        with self._cv:
            self._stop_worker = True
            for job in self._jobs.values():
                job.cancelled, job.cancel_code = True, ErrorCode.SHUTTING_DOWN
            self._cv.notify()
        self._worker.join(timeout=30)
        self._forward()
        self._close_sockets(linger_ms=2000)  # let the last answers reach their peers

    def _close_sockets(self, linger_ms: int = 0) -> None:
        if self.router is not None:
            self.router.close(linger=linger_ms)
        if self.pipe is not None:
            self.pipe.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        worker = getattr(self, "_worker", None)
        if self._own_ctx and (worker is None or not worker.is_alive()):
            self.ctx.term()   # waits for the router's linger (a worker still computing keeps its socket)


class _AllowList:
    """ZAP credentials provider: a client may connect iff its public key is listed."""

    def __init__(self, keys: set[bytes]):
        self.keys = set(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys
        if not ok:
            log.warning("CURVE client key %s is not allowed", key.decode(errors="replace"))
        return ok


@contextlib.contextmanager
def serving_in_thread(backend: TeacherBackend, bind: str = "tcp://127.0.0.1:*", **kwargs):
    """A TeacherServer on a background thread for the `with` block (tests, notebooks, benchmarks
    that share one process with the client); stopped and drained on exit."""
    server = TeacherServer(backend, bind, **kwargs)
    thread = threading.Thread(target=server.serve_forever, name="teacher-server", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(timeout=30)
        if thread.is_alive():
            raise RuntimeError(f"teacher server on {server.address} did not stop within 30 s")


def serve(backend: TeacherBackend, bind: str = "tcp://127.0.0.1:5555", *, ready=None,
          signals: bool = False, **kwargs) -> int:
    """Run a TeacherServer until stopped (SIGTERM with `signals=True`). `ready(server)` is
    called once the socket is bound, e.g. to print the startup line or keep a handle."""
    server = TeacherServer(backend, bind, **kwargs)
    if signals:
        server.install_signal_handlers()
    if ready is not None:
        ready(server)
    return server.serve_forever()
