"""A real `opd serve-teacher` process on a free port, spoken to over TCP.

Answers are compared with a direct `log_softmax(model(x).logits / T)` of the same model
loaded in the test process. One server for the whole module; the last test drains it
with SIGTERM.
"""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np
import pytest
import torch
import zmq

from opd.teachers.client import TeacherClient, TeacherError
from opd.teachers.launch import start_server_process
from opd.teachers.protocol import (PROTOCOL_VERSION, Cancel, Chunk, Credit, Done, Error, ErrorCode, Hello, Ping,
                                   Pong, Score, TopK, Welcome, decode, encode)

MAX_K = 260          # = vocab: k == V must give a tail of -inf
MAX_TOKENS = 256


@pytest.fixture(scope="module")
def server(tiny_teacher_dir):
    s = start_server_process(["--model", tiny_teacher_dir, "--max-k", MAX_K, "--max-positions", 128,
                              "--max-tokens-per-request", MAX_TOKENS, "--heartbeat-s", 0.5])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model(tiny_teacher_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_teacher_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def client(server):
    c = TeacherClient(server.address, timeout_s=20, heartbeat_s=0.5)
    yield c
    c.close()


def make_batch(seed: int, lengths=(3, 17, 40, 9), starts=(1, 5, 39, 9)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 260, (n,), generator=g).tolist() for n in lengths], list(starts)


def direct_rows(model, seqs, starts, T: float):
    """Direct reference: logits / T at positions s-1 .. len-2, and the targets, all rows concatenated."""
    logits, targets = [], []
    with torch.no_grad():
        for seq, s in zip(seqs, starts):
            x = torch.tensor(seq)[None]
            logits.append(model(x).logits[0, s - 1:len(seq) - 1].float())
            targets.append(torch.tensor(seq[s:], dtype=torch.long))
    return torch.cat(logits), torch.cat(targets)


class Raw:
    """A bare DEALER for messages the client would never send."""

    def __init__(self, address: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, frames) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout_s: float = 10.0):
        assert self.sock.poll(int(timeout_s * 1000)), "no answer"
        return decode(self.sock.recv_multipart())

    def ask(self, frames, timeout_s: float = 10.0):
        self.send(frames)
        return self.recv(timeout_s)

    def close(self) -> None:
        self.sock.close(linger=0)


def score_frames(seqs, starts, rid=1, **kw) -> list:
    ids = np.array([t for s in seqs for t in s], dtype="<i4")
    offsets = np.cumsum([0, *map(len, seqs)]).astype("<i4")
    kw.setdefault("mode", "topk")
    kw.setdefault("k", 4)
    return encode(Score(request_id=rid, response_starts=list(starts), **kw), (ids, offsets))


@pytest.mark.parametrize("T", [0.5, 1.0, 2.0])
def test_topk_equals_direct_log_softmax(client, model, T):
    seqs, starts = make_batch(int(T * 10))
    k = 8
    r = client.score_topk(seqs, starts, k=k, temperature=T)
    logits, targets = direct_rows(model, seqs, starts, T)
    ref = torch.log_softmax(logits / T, dim=-1)
    top_vals, top_ids = ref.topk(k, dim=-1)
    assert r.row_offsets == [0, 2, 14, 15, 15]
    assert r.ids.shape == (15, k) and r.ids.dtype == torch.int32
    assert torch.equal(r.ids.long(), top_ids)
    torch.testing.assert_close(r.logprobs, top_vals, atol=1e-5, rtol=0)
    tail_ref = torch.logsumexp(ref.scatter(1, top_ids, float("-inf")), dim=-1)
    torch.testing.assert_close(r.tail_logmass, tail_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(r.token_logprob, ref.gather(1, targets[:, None]).squeeze(1), atol=1e-5, rtol=0)
    torch.testing.assert_close(r.lse, torch.logsumexp(logits / T, dim=-1), atol=1e-5, rtol=0)
    assert r.stats.rows == 15 and r.stats.tokens == sum(map(len, seqs))


def test_k_equal_to_vocab_has_no_tail(client, model):
    seqs, starts = make_batch(3, lengths=(6,), starts=(2,))
    r = client.score_topk(seqs, starts, k=MAX_K)
    assert torch.isneginf(r.tail_logmass).all()
    torch.testing.assert_close(r.logprobs.exp().sum(-1), torch.ones(4), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_full_chunks_equal_direct_logits(client, model, dtype):
    seqs, starts = make_batch(7)
    T = 0.7
    chunks = list(client.score_full(seqs, starts, temperature=T, dtype=dtype, chunk_rows=4, window=2))
    logits, targets = direct_rows(model, seqs, starts, T)
    assert [c.row_start for c in chunks] == [0, 4, 8, 12]       # 15 rows in chunks of 4
    got = torch.cat([c.logits for c in chunks])
    if dtype == "float32":
        torch.testing.assert_close(got, logits, atol=1e-5, rtol=0)
    else:
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), logits.to(torch.bfloat16).float(), atol=0.02, rtol=0.01)
    torch.testing.assert_close(torch.cat([c.lse for c in chunks]), torch.logsumexp(logits / T, -1), atol=1e-5, rtol=0)
    ref_lp = torch.log_softmax(logits / T, -1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(torch.cat([c.token_logprob for c in chunks]), ref_lp, atol=1e-5, rtol=0)


def test_requests_without_rows(client):
    r = client.score_topk([[4, 5, 6], [7]], [3, 1], k=3)
    assert r.ids.shape == (0, 3) and r.row_offsets == [0, 0, 0] and r.stats.rows == 0
    assert list(client.score_full([[4, 5, 6]], [3])) == []


def test_credit_window_bounds_the_stream(server):
    raw = Raw(server.address)
    try:
        raw.send(score_frames([list(range(30))], [1], rid=5, mode="full", chunk_rows=2, window=2))
        got = [raw.recv() for _ in range(2)]
        assert [m.row_start for m, _ in got] == [0, 2]
        assert not raw.sock.poll(400), "server sent past its credit window"
        raw.send(encode(Credit(request_id=5, chunks=1)))
        msg, arrays = raw.recv()
        assert isinstance(msg, Chunk) and msg.row_start == 4 and arrays[0].shape == (2, 260)
        raw.send(encode(Cancel(request_id=5)))
        msg, _ = raw.recv()
        assert isinstance(msg, Error) and msg.code == ErrorCode.CANCELLED and msg.request_id == 5
    finally:
        raw.close()


def test_two_concurrent_clients_get_their_own_answers(server, model):
    results, errors = {}, []

    def work(seed: int) -> None:
        try:
            with TeacherClient(server.address, timeout_s=20) as c:
                seqs, starts = make_batch(100 + seed, lengths=(12 + seed, 20), starts=(3, 10 + seed))
                futures = [c.submit_topk(seqs, starts, k=5, temperature=1.0 + 0.5 * i) for i in range(3)]
                results[seed] = (seqs, starts, [f.result(timeout=60) for f in futures])
        except Exception as e:  # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for seqs, starts, answers in results.values():
        for i, r in enumerate(answers):
            T = 1.0 + 0.5 * i
            logits, _ = direct_rows(model, seqs, starts, T)
            torch.testing.assert_close(r.logprobs, torch.log_softmax(logits / T, -1).topk(5).values, atol=1e-5, rtol=0)


GOOD = ([[5, 6, 7, 8]], [1])


def bad_messages():
    """(name, frames, expected code) for each kind of bad input."""
    ok_ids = np.array([5, 6, 7, 8], dtype="<i4")
    ok_offsets = np.array([0, 4], dtype="<i4")
    hdr = msgspec.msgpack.encode
    yield "token id >= vocab", score_frames([[5, 260, 7]], [1]), ErrorCode.BAD_TOKEN
    yield "negative token id", score_frames([[5, -1, 7]], [1]), ErrorCode.BAD_TOKEN
    yield "sequence over max_positions", score_frames([[1] * 129], [1]), ErrorCode.TOO_LONG
    yield "request over max tokens", score_frames([[1] * 100] * 3, [1, 1, 1]), ErrorCode.TOO_LONG
    yield "k over max", score_frames(*GOOD, k=MAX_K + 1), ErrorCode.BAD_K
    yield "k = 0", score_frames(*GOOD, k=0), ErrorCode.BAD_K
    yield "temperature 0", score_frames(*GOOD, temperature=0.0), ErrorCode.BAD_REQUEST
    yield "temperature < 0", score_frames(*GOOD, temperature=-1.0), ErrorCode.BAD_REQUEST
    yield "temperature nan", score_frames(*GOOD, temperature=float("nan")), ErrorCode.BAD_REQUEST
    # fp32 logits divided by 1e-39 (subnormal) were answered with NaN log-probs
    yield "temperature 1e-39", score_frames(*GOOD, temperature=1e-39), ErrorCode.BAD_REQUEST
    yield "vocab_limit past the vocabulary", score_frames(*GOOD, vocab_limit=10_000), ErrorCode.BAD_REQUEST
    yield "token id past vocab_limit", score_frames(*GOOD, vocab_limit=7), ErrorCode.BAD_TOKEN
    yield "start 0", score_frames([[5, 6, 7]], [0]), ErrorCode.BAD_REQUEST
    yield "start past the end", score_frames([[5, 6, 7]], [4]), ErrorCode.BAD_REQUEST
    yield "bad full dtype", score_frames(*GOOD, mode="full", dtype="int8"), ErrorCode.BAD_REQUEST
    yield "malformed header", [b"\xc1\xff not msgpack"], ErrorCode.MALFORMED
    yield "header of wrong shape", [hdr({"type": "score", "request_id": "x"})], ErrorCode.MALFORMED
    frames = score_frames(*GOOD)
    yield "missing frame", frames[:2], ErrorCode.MALFORMED
    yield "extra frame", [*frames, b"\0" * 4], ErrorCode.MALFORMED
    yield "wrong frame size", [frames[0], frames[1], b"\0" * 12], ErrorCode.MALFORMED
    yield "wrong dtype", encode(Score(request_id=1, mode="topk", response_starts=[1], k=4),
                                (ok_ids.astype("<f4"), ok_offsets)), ErrorCode.MALFORMED
    yield "offsets inconsistent", encode(Score(request_id=1, mode="topk", response_starts=[1], k=4),
                                         (ok_ids, np.array([0, 9], dtype="<i4"))), ErrorCode.MALFORMED
    yield "unknown message type", [hdr({"type": "launch_missiles", "request_id": 3})], ErrorCode.UNKNOWN_TYPE
    yield "server-only message", encode(Done(request_id=1, rows=0, tokens=0, queue_ms=0, compute_ms=0,
                                             total_ms=0)), ErrorCode.BAD_REQUEST


def assert_refused_and_serving(address: str, name: str, frames, code: ErrorCode) -> None:
    """`frames` get ERROR(code), not retryable, and a good request right after is answered."""
    raw = Raw(address)
    try:
        msg, _ = raw.ask(frames)
        assert isinstance(msg, Error) and msg.code == code, (name, msg)
        assert msg.retryable is False
        msg, arrays = raw.ask(score_frames(*GOOD, rid=77))
        assert isinstance(msg, TopK) and msg.request_id == 77 and arrays[0].shape == (3, 4)
        assert msg.stats.request_id == 77 and msg.stats.rows == 3  # TOPK ends the request: no DONE
    finally:
        raw.close()


@pytest.mark.parametrize("name,frames,code", list(bad_messages()), ids=[b[0] for b in bad_messages()])
def test_bad_input_gets_its_error_and_server_keeps_serving(server, name, frames, code):
    assert_refused_and_serving(server.address, name, frames, code)


def test_client_raises_typed_error(client):
    with pytest.raises(TeacherError) as e:
        client.score_topk(*GOOD, k=MAX_K + 1)
    assert e.value.code == "BAD_K" and "max_k" in e.value.message


def test_version_mismatch_refused_at_hello(server):
    raw = Raw(server.address)
    try:
        other_major = (PROTOCOL_VERSION[0] + 1, 0)
        msg, _ = raw.ask(encode(Hello(version=other_major)))
        assert isinstance(msg, Error) and msg.code == ErrorCode.BAD_VERSION
        msg, _ = raw.ask(encode(Hello(version=(PROTOCOL_VERSION[0], 7))))   # minor differences are fine
        assert isinstance(msg, Welcome) and msg.max_k == MAX_K and msg.vocab_size == 260
        msg, _ = raw.ask(encode(Ping(t=1.5)))
        assert isinstance(msg, Pong) and msg.t == 1.5
    finally:
        raw.close()
    with TeacherClient(server.address, timeout_s=5, protocol_version=(PROTOCOL_VERSION[0] - 1, 0)) as c:
        with pytest.raises(TeacherError) as e:
            c.info()
    assert e.value.code == "BAD_VERSION"


def test_sigterm_refuses_new_work_drains_and_exits_0(server):
    """Last test of the module: it stops the shared server."""
    raw = Raw(server.address)
    try:
        raw.send(score_frames([list(range(20))], [1], rid=9, mode="full", chunk_rows=4, window=1))
        msg, _ = raw.recv()
        assert isinstance(msg, Chunk) and msg.row_start == 0
        server.proc.terminate()
        time.sleep(0.5)
        msg, _ = raw.ask(score_frames(*GOOD, rid=10))
        assert isinstance(msg, Error) and msg.code == ErrorCode.SHUTTING_DOWN and msg.retryable
        starts = []
        while True:  # the stream in flight is finished, not dropped
            raw.send(encode(Credit(request_id=9, chunks=1)))
            msg, _ = raw.recv()
            if isinstance(msg, Done):
                break
            starts.append(msg.row_start)
        assert starts == [4, 8, 12, 16] and msg.chunks == 5
        assert server.proc.wait(timeout=20) == 0
    finally:
        raw.close()
