"""`ReplicaPool`: one teacher served by several replicas, with TeacherClient's API.

    pool = ReplicaPool(group.addresses)          # or a fixed list of ZeroMQ addresses
    answer = pool.score_topk(sequences, starts, k=32)

Balancing: each request goes to the live replica with the fewest tokens in flight (ties:
the one that has served fewest requests), so a slow or long-busy replica gets less work.

Failure: one TeacherClient per replica, with `retries` kept low so a dead server is
noticed after `3 * heartbeat_s` of silence (the client pings while it waits). A request
that fails with TIMEOUT, CLOSED or SHUTTING_DOWN marks its replica dead and is re-sent to
another live one; BUSY/INTERNAL (after the client's own retries) go to another replica
without marking anything dead. Other errors (BAD_TOKEN, TOO_LONG, ...) are the caller's
and raise at once. Full-vocabulary streams resume on another replica from the first row
the caller has not seen.

Recovery: a monitor thread re-resolves the addresses every `recheck_s` (a callable, e.g.
the supervisor's `TeacherGroup.addresses`, may return new ones after a restart) and
probes dead replicas with HELLO (waiting at most ten heartbeats, so a replica that is down
does not hold the pool's start); one that answers is used again. `replica_stats()` says
why each replica was last marked dead or failed its probe.

Identity: every replica must report the same model and tokenizer fingerprints as the
first one; a replica that differs makes the pool refuse to work (FingerprintMismatch),
since mixing two teachers silently would corrupt the distillation target.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from opd.teachers.batching import scored_lengths
from opd.teachers.client import FullChunk, TeacherClient, TeacherError, TopKResult
from opd.teachers.protocol import Welcome

log = logging.getLogger("opd.teachers.pool")

DEAD_CODES = {"TIMEOUT", "CLOSED", "SHUTTING_DOWN"}          # the replica is gone: mark it dead
ELSEWHERE_CODES = {"BUSY", "INTERNAL"}                        # try another replica, keep this one


class FingerprintMismatch(TeacherError):
    def __init__(self, message: str):
        super().__init__("FINGERPRINT_MISMATCH", message)


@dataclass(eq=False)
class _Replica:
    address: str
    client: TeacherClient | None = None
    alive: bool = False
    inflight_tokens: int = 0
    requests: int = 0          # requests answered by this replica
    failures: int = 0          # times it was marked dead
    last_error: str = ""       # why it was last marked dead or last failed a probe


class ReplicaPool:
    def __init__(self, addresses: Sequence[str] | Callable[[], Sequence[str]], *, timeout_s: float = 120.0,
                 heartbeat_s: float = 1.0, retries: int = 1, backoff_s: float = 0.2, curve=None,
                 recheck_s: float = 2.0, wait_for_replica_s: float | None = None, max_attempts: int = 4,
                 name: str = "opd"):
        self._resolve_fn = addresses if callable(addresses) else (lambda a=tuple(addresses): a)
        # busy_timeout_s=0: a BUSY replica hands the request to another one at once (ELSEWHERE_CODES).
        self._client_kwargs = dict(timeout_s=timeout_s, heartbeat_s=heartbeat_s, retries=retries,
                                   backoff_s=backoff_s, curve=curve, name=name, busy_timeout_s=0.0)
        self.recheck_s = recheck_s
        self.max_attempts = max_attempts  # sends of one request to replicas before its error is raised
        self.wait_for_replica_s = timeout_s if wait_for_replica_s is None else wait_for_replica_s
        self._replicas: dict[str, _Replica] = {}
        self._lock = threading.Condition()
        self._welcome: Welcome | None = None
        self._fatal: TeacherError | None = None
        self._closed = threading.Event()
        self._refresh()
        if self._fatal is not None:
            self.close()
            raise self._fatal
        if not any(r.alive for r in self._replicas.values()):
            self.close()
            why = "; ".join(f"{r.address}: {r.last_error}" for r in self._replicas.values())
            raise TeacherError("NO_REPLICA", f"none of the replicas {list(self._replicas)} answered HELLO ({why})")
        self._monitor = threading.Thread(target=self._monitor_loop, name="replica-pool-monitor", daemon=True)
        self._monitor.start()

    # ---- TeacherClient's API ---------------------------------------------------------------

    def info(self, refresh: bool = False) -> Welcome:
        """The teacher's WELCOME (all replicas share its fingerprints)."""
        self._check_fatal()
        return self._welcome  # type: ignore[return-value]

    def submit_topk(self, sequences, response_starts, k: int, temperature: float = 1.0,
                    vocab_limit: int = 0, contexts=None, candidates=None, rows=None) -> Future:
        """Future of a TopKResult, answered by the least-loaded live replica (failing over if it dies).
        contexts, candidates: as TeacherClient.submit_topk's; rows: its row masks."""
        out: Future = Future()
        args = ([list(map(int, s)) if not hasattr(s, "tolist") else s.tolist() for s in sequences],
                list(response_starts), k, temperature, vocab_limit, contexts, candidates, rows)
        self._dispatch_topk(out, args, sum(scored_lengths(sequences, response_starts, contexts)), tried=set())
        return out

    def score_topk(self, sequences, response_starts, k: int, temperature: float = 1.0,
                   vocab_limit: int = 0, contexts=None, candidates=None, rows=None) -> TopKResult:
        return self.submit_topk(sequences, response_starts, k, temperature, vocab_limit, contexts, candidates,
                                rows).result()

    def score_full(self, sequences, response_starts, temperature: float = 1.0, dtype: str = "float32",
                   chunk_rows: int | None = None, window: int = 4, vocab_limit: int = 0,
                   contexts=None, rows=None) -> Iterator[FullChunk]:
        """Full-vocabulary rows, streamed. The request goes to the least-loaded live replica now,
        so the teacher computes while the caller does; a replica dying mid-stream is replaced
        from the next unseen row. contexts, rows: as TeacherClient.score_full's."""
        args = (sequences, response_starts, temperature, dtype, chunk_rows, window, vocab_limit, contexts, rows)
        tokens = sum(scored_lengths(sequences, response_starts, contexts))
        rep, client = self._acquire(tokens, set())
        try:
            chunks = client.score_full(*args)
        except TeacherError as e:   # its HELLO failed: the replica died just now; the stream fails over
            chunks = e
        unread = [True]
        stream = self._stream_full(rep, chunks, args, tokens, unread)
        # Dropped before its first read, a generator runs no `finally`: the replica gets its
        # tokens back here (and the client's stream, dropped with it, is cancelled).
        weakref.finalize(stream, lambda: unread[0] and self._release(rep, tokens, ok=False)).atexit = False
        return stream

    def _stream_full(self, rep: _Replica, chunks, args: tuple, tokens: int, unread: list) -> Iterator[FullChunk]:
        unread[0] = False   # from here on this generator releases its replicas itself
        delivered, tried, attempt = 0, set(), 0
        while True:
            try:
                if isinstance(chunks, TeacherError):
                    raise chunks
                for chunk in chunks:
                    end = chunk.row_start + chunk.logits.shape[0]
                    if end <= delivered:
                        continue
                    if chunk.row_start < delivered:  # partly seen: hand out only the new rows
                        cut = delivered - chunk.row_start
                        chunk = FullChunk(delivered, chunk.logits[cut:], chunk.lse[cut:], chunk.token_logprob[cut:])
                    delivered = end
                    yield chunk
                self._release(rep, tokens, ok=True)
                return
            except TeacherError as e:
                self._release(rep, tokens, ok=False, error=e)
                if not self._may_retry(e, attempt):   # sends, not replicas: with every replica
                    raise                             # tried, `tried` stops growing
                tried.add(rep.address)
                attempt += 1
            except BaseException:
                self._release(rep, tokens, ok=True)
                raise
            rep, client = self._acquire(tokens, tried)
            try:
                chunks = client.score_full(*args)
            except TeacherError as e:
                chunks = e

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            reps = list(self._replicas.values())
            self._lock.notify_all()
        for r in reps:
            if r.client is not None:
                r.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- observability ---------------------------------------------------------------------

    def replica_stats(self) -> list[dict]:
        """Per replica: address, alive, inflight_tokens, requests answered, failures seen, and
        last_error: why it was last marked dead or failed a HELLO probe ("" if never)."""
        with self._lock:
            return [dict(address=r.address, alive=r.alive, inflight_tokens=r.inflight_tokens,
                         requests=r.requests, failures=r.failures, last_error=r.last_error)
                    for r in self._replicas.values()]

    def live_addresses(self) -> list[str]:
        with self._lock:
            return [r.address for r in self._replicas.values() if r.alive]

    # ---- choosing, releasing, failing over -------------------------------------------------

    def _dispatch_topk(self, out: Future, args: tuple, tokens: int, tried: set, attempt: int = 0) -> None:
        while True:
            try:
                rep, client = self._acquire(tokens, tried)
            except BaseException as e:  # no replica at all, or the pool refuses to work
                out.set_exception(e)
                return
            try:
                fut = client.submit_topk(*args)
                break
            except TeacherError as e:  # its HELLO failed: the replica died just now
                self._release(rep, tokens, ok=False, error=e)
                if not self._may_retry(e, attempt):
                    out.set_exception(e)
                    return
                tried, attempt = tried | {rep.address}, attempt + 1

        def done(f: Future) -> None:
            err = f.exception()
            if err is None:
                self._release(rep, tokens, ok=True)
                out.set_result(f.result())
                return
            self._release(rep, tokens, ok=False, error=err)
            if self._may_retry(err, attempt):
                # re-send from another thread: this callback runs on the dead replica's I/O thread
                threading.Thread(target=self._dispatch_topk, daemon=True,
                                 args=(out, args, tokens, tried | {rep.address}, attempt + 1)).start()
            else:
                out.set_exception(err)

        fut.add_done_callback(done)

    def _may_retry(self, err: BaseException, attempt: int) -> bool:
        """Errors of a replica (not of the request) go elsewhere, a bounded number of times."""
        return (isinstance(err, TeacherError) and err.code in DEAD_CODES | ELSEWHERE_CODES
                and attempt < self.max_attempts and not self._closed.is_set())

    def _acquire(self, tokens: int, tried: set) -> tuple[_Replica, TeacherClient]:
        """The live replica with the fewest tokens in flight (preferring ones not tried for this
        request), and its client as of now: a probe may replace `rep.client` meanwhile."""
        deadline = time.monotonic() + self.wait_for_replica_s
        with self._lock:
            while True:
                self._check_fatal()
                if self._closed.is_set():
                    raise TeacherError("CLOSED", "replica pool is closed")
                live = [r for r in self._replicas.values() if r.alive and r.client is not None]
                fresh = [r for r in live if r.address not in tried] or live
                if fresh:
                    rep = min(fresh, key=lambda r: (r.inflight_tokens, r.requests))
                    rep.inflight_tokens += tokens
                    return rep, rep.client
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TeacherError("NO_REPLICA", f"no live replica among {list(self._replicas)} for "
                                                     f"{self.wait_for_replica_s:.0f}s")
                self._lock.wait(min(left, self.recheck_s))

    def _release(self, rep: _Replica, tokens: int, *, ok: bool, error: BaseException | None = None) -> None:
        with self._lock:
            rep.inflight_tokens -= tokens
            if ok:
                rep.requests += 1
            elif isinstance(error, TeacherError) and error.code in DEAD_CODES and rep.alive:
                rep.alive = False
                rep.failures += 1
                rep.last_error = str(error)
                log.warning("replica %s marked dead (%s); failing over", rep.address, error)

    def _check_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    # ---- discovery and recovery ------------------------------------------------------------

    def _monitor_loop(self) -> None:
        while not self._closed.wait(self.recheck_s):
            try:
                self._refresh()
            except Exception as e:  # a supervisor call may fail while the cluster shuts down
                log.warning("replica pool refresh failed: %s", e)

    def _refresh(self) -> None:
        """Re-resolve the addresses; drop vanished ones; probe new and dead ones with HELLO."""
        listed = list(dict.fromkeys(self._resolve_fn()))
        with self._lock:
            for addr in list(self._replicas):
                if addr not in listed:  # the supervisor no longer reports it (down, or moved port)
                    rep = self._replicas[addr]
                    if rep.inflight_tokens == 0:
                        del self._replicas[addr]
                        if rep.client is not None:
                            threading.Thread(target=rep.client.close, daemon=True).start()
                    elif rep.alive:
                        rep.alive, rep.failures = False, rep.failures + 1
            for addr in listed:
                self._replicas.setdefault(addr, _Replica(addr))
            to_probe = [r for r in self._replicas.values() if not r.alive]
        threads = [threading.Thread(target=self._probe, args=(r,), daemon=True) for r in to_probe]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _probe(self, rep: _Replica) -> None:
        with self._lock:
            old, rep.client = rep.client, None
        if old is not None:
            old.close()
        # A HELLO is answered by the server's socket thread, never queued behind compute: ten
        # heartbeats is long enough, and a replica that is down does not hold the pool's start
        # (or the monitor) for timeout_s. One still starting is probed again in recheck_s.
        hello_s = min(self._client_kwargs["timeout_s"], 10 * self._client_kwargs["heartbeat_s"])
        client = TeacherClient(rep.address, **{**self._client_kwargs, "retries": 0, "timeout_s": hello_s})
        try:
            welcome = client.info()
        except TeacherError as e:   # not up yet, or down: the monitor probes it again in recheck_s
            client.close()
            with self._lock:
                rep.last_error = f"HELLO probe: {e}"
            return
        # probed fast (no retries, a short deadline); requests get the pool's
        client.retries, client.timeout_s = self._client_kwargs["retries"], self._client_kwargs["timeout_s"]
        with self._lock:
            if self._welcome is None:
                self._welcome = welcome
            elif (welcome.model_fingerprint, welcome.tokenizer_fingerprint) != \
                    (self._welcome.model_fingerprint, self._welcome.tokenizer_fingerprint):
                self._fatal = FingerprintMismatch(
                    f"replica {rep.address} serves model {welcome.model_fingerprint} / tokenizer "
                    f"{welcome.tokenizer_fingerprint}, but this teacher's replicas serve "
                    f"{self._welcome.model_fingerprint} / {self._welcome.tokenizer_fingerprint}; "
                    f"every replica of one teacher must load the same model")
                self._lock.notify_all()
                client.close()
                return
            rep.client = client
            rep.alive = True
            self._lock.notify_all()

