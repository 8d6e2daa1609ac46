"""The processes `opd bench transport` times, and what they answer with.

    PrecomputedBackend   a teacher backend whose answers are ready-made random tensors, so
                         only the transport is measured
    _opd_server          `opd serve-teacher`'s server over it, in its own process
    _push_server         the ceiling: a bare ZeroMQ PUSH of the same bytes
    _reference_server    a bare request/response of the same answers (with and without
                         opd's per-message work), and RequestResponse, its client
    _http_server         the answers as JSON over HTTP (OpenAI-compatible prompt log-probs)
"""

from __future__ import annotations

import collections
import json
import multiprocessing as mp
import time
from typing import Iterator

import numpy as np
import torch
import zmq

from opd.teachers.backend import FullChunkAnswer, ScoreRequest, TeacherBackend, TopKAnswer
from opd.teachers.batching import pack
from opd.teachers.client import TopKResult
from opd.teachers.protocol import Done, Score, TopK, decode, encode, send_frames, to_torch
from opd.teachers.server import ServerLimits, serve
from opd.teachers.validate import score_request

MAX_K = 64
IN_FLIGHT = 4   # top-k requests a client keeps outstanding


class PrecomputedBackend(TeacherBackend):
    """Answers of the right shapes from pre-made random tensors: the transport alone is timed."""

    name = "precomputed"
    model_id = "precomputed"
    model_fingerprint = "precomputed"
    tokenizer_fingerprint = "precomputed"
    modes = ("topk", "full")
    dtypes = ("float32", "bfloat16")

    def __init__(self, vocab_size: int, max_rows: int, chunk_rows: int, max_k: int = MAX_K):
        g = torch.Generator().manual_seed(0)
        self.vocab_size, self.max_k, self.max_positions = vocab_size, max_k, 1 << 20
        lp = torch.log_softmax(torch.randn(max_rows, max_k, generator=g), -1) - 1.0
        self._topk = TopKAnswer(torch.randint(0, vocab_size, (max_rows, max_k), generator=g, dtype=torch.int32),
                                lp, torch.full((max_rows,), -1.0), lp[:, 0].clone(), torch.zeros(max_rows))
        self._logits = {dt: torch.randn(chunk_rows, vocab_size, generator=g).to(getattr(torch, dt))
                        for dt in self.dtypes}
        self._rows = torch.zeros(chunk_rows)

    def score_topk(self, reqs: list[ScoreRequest]) -> list[TopKAnswer]:
        out = []
        for r in reqs:
            n = r.row_offsets()[-1]
            a = self._topk
            out.append(TopKAnswer(a.ids[:n, :r.k], a.logprobs[:n, :r.k], a.tail_logmass[:n],
                                  a.token_logprob[:n], a.lse[:n]))
        return out

    def score_full(self, req: ScoreRequest) -> Iterator[FullChunkAnswer]:
        total = req.row_offsets()[-1]
        logits = self._logits[req.dtype]
        for start in range(0, total, req.chunk_rows):
            n = min(req.chunk_rows, total - start)
            yield FullChunkAnswer(start, logits[:n], self._rows[:n], self._rows[:n])


# ---- servers, each in its own process ---------------------------------------------------

def _opd_server(bind: str, vocab: int, rows: int, chunk_rows: int, curve, q) -> None:

    backend = PrecomputedBackend(vocab, rows, chunk_rows)
    kwargs = {}
    if curve is not None:
        kwargs = dict(curve_public_key=curve["server_public"], curve_secret_key=curve["server_secret"],
                      curve_allow={curve["client_public"]})
    limits = ServerLimits(max_tokens_per_request=1 << 20, max_inflight_tokens=1 << 24, batch_tokens=1 << 20)
    serve(backend, bind, ready=lambda s: q.put(s.address), signals=True, limits=limits, **kwargs)


def _push_server(bind: str, frames_sizes: list[int], q) -> None:

    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 8)
    s.bind(bind)
    q.put(s.getsockopt_string(zmq.LAST_ENDPOINT))
    # Written memory, like the answers the opd server sends (np.zeros would map the zero page).
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, n, dtype=np.uint8) for n in frames_sizes]
    while True:
        s.send_multipart(frames, copy=False)


def _reference_server(bind: str, vocab: int, rows: int, q) -> None:
    """The server end of the request/response references: one thread, one ROUTER. A request of
    one frame, b"<rows> <k>", gets the frames of a top-k answer that size straight back (`reqresp`);
    a SCORE is decoded, validated, answered by the backend and encoded as `opd`'s server does,
    but in this thread (`work`)."""

    backend = PrecomputedBackend(vocab, rows, 1)
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.bind(bind)
    q.put(s.getsockopt_string(zmq.LAST_ENDPOINT))
    rng = np.random.default_rng(0)
    bare: dict[bytes, list] = {}
    while True:
        peer, *frames = s.recv_multipart(copy=False)
        if len(frames) == 1:
            key = frames[0].bytes
            if key not in bare:  # written memory, like the ceiling's
                n, k = map(int, key.split())
                bare[key] = [rng.integers(0, 256, size, dtype=np.uint8) for size in _topk_frame_sizes(n, k)]
            send_frames(s, [peer, *bare[key]])
            continue
        msg, arrays = decode(frames)
        req = score_request(msg, arrays, backend, 1 << 24)
        offsets = req.row_offsets()
        stats = Done(request_id=req.request_id, rows=offsets[-1], tokens=req.num_tokens, queue_ms=0.0,
                     compute_ms=0.0, total_ms=0.0)
        answer = backend.score_topk([req])[0]
        send_frames(s, [peer, *encode(TopK(request_id=req.request_id, row_offsets=offsets, stats=stats), answer)])


class RequestResponse:
    """This process's end of the references (see the module docstring): one thread keeping
    IN_FLIGHT requests outstanding on a DEALER."""

    def __init__(self, address: str, positions: int, k: int):

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(address)
        self.k = k
        self.seqs, self.starts = _requests(positions, min(512, positions))
        self.rows = sum(len(s) - st for s, st in zip(self.seqs, self.starts))

    def bare(self, seconds: float) -> float:
        return _pipelined(seconds, self.rows, self.send_bare, lambda _: self.sock.recv_multipart(copy=False))

    def work(self, seconds: float) -> float:
        return _pipelined(seconds, self.rows, self.send_score, lambda _: self.recv_topk())

    def send_bare(self) -> None:
        self.sock.send(f"{self.rows} {self.k}".encode())

    def send_score(self) -> None:

        score = Score(request_id=1, mode="topk", response_starts=[int(s) for s in self.starts], k=self.k)
        send_frames(self.sock, encode(score, pack(self.seqs)))

    def recv_topk(self):

        msg, arrays = decode(self.sock.recv_multipart(copy=False))
        return TopKResult(*[to_torch(a) for a in arrays], row_offsets=list(msg.row_offsets), stats=msg.stats)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _http_server(rows: int, k: int, port_q) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    rng = np.random.default_rng(0)
    # k distinct token ids per position (a dict per position cannot hold duplicates).
    ids = (rng.integers(0, 152064, size=(rows, 1)) + 1009 * np.arange(k)[None, :]) % 152064
    lps = np.sort(rng.standard_normal((rows, k)))[:, ::-1] - 3.0

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_POST(self):
            n = int(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["positions"])
            # One dict per position, as OpenAI-compatible servers return prompt_logprobs.
            body = json.dumps({"prompt_logprobs": [None] + [
                {str(int(ids[i, j])): {"logprob": float(lps[i, j]), "rank": j + 1, "decoded_token": "tok"}
                 for j in range(k)} for i in range(n)]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port_q.put(srv.server_address[1])
    srv.serve_forever()


def _start(target, *args) -> tuple[mp.Process, object]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q), daemon=True)
    p.start()
    return p, q.get(timeout=120)


def _stop(p: mp.Process) -> None:
    p.terminate()
    p.join(10)
    if p.is_alive():
        p.kill()


# ---- what goes on the wire ---------------------------------------------------------------

def _requests(positions: int, seq_rows: int = 512) -> tuple[list[np.ndarray], list[int]]:
    """Sequences of seq_rows + 1 tokens scored from position 1: `positions` rows in total.
    int32 arrays, as a sampler's output tensors are: a trainer that holds Python lists pays
    ~25 ns a token more to pack them (`opd.teachers.batching.pack`), which is input conversion, not transport."""
    n = max(1, positions // seq_rows)
    return [np.ones(seq_rows + 1, dtype=np.int32)] * n, [1] * n


def _pipelined(seconds: float, rows: int, submit, wait, in_flight: int = IN_FLIGHT) -> float:
    """Positions per second with `in_flight` requests of `rows` positions kept outstanding:
    `submit()` sends one and returns a handle, `wait(handle)` takes its answer. Requests still
    in flight when the time is up are waited for and counted."""
    t0 = time.perf_counter()
    handles = collections.deque(submit() for _ in range(in_flight))
    done = 0
    while time.perf_counter() - t0 < seconds:
        wait(handles.popleft())
        done += 1
        handles.append(submit())
    for h in handles:
        wait(h)
    return (done + len(handles)) * rows / (time.perf_counter() - t0)


def _topk_frame_sizes(rows: int, k: int) -> list[int]:
    return [200, rows * k * 4, rows * k * 4, rows * 4, rows * 4, rows * 4]
