"""Fuzz a real teacher server process: thousands of malformed messages (fixed seed), each must
get an ERROR answer; afterwards a good request is still answered exactly as before and the
server's memory has not grown."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import psutil
import pytest
import zmq

from opd.teachers.launch import start_server_process
from opd.teachers.protocol import Done, Error, ErrorCode, Score, TopK, decode, encode

COUNT = 2000
BATCH = 50
MAX_K = 16


@pytest.fixture(scope="module")
def server(tiny_teacher_dir):
    s = start_server_process(["--model", tiny_teacher_dir, "--max-k", MAX_K, "--max-positions", 64,
                              "--max-tokens-per-request", 128, "--log-level", "WARNING"])
    yield s
    assert s.stop() == 0


def good(rid: int = 1):
    ids = np.array([1, 2, 3, 4, 5, 6], dtype="<i4")
    return encode(Score(request_id=rid, mode="topk", response_starts=[2], k=4), (ids, np.array([0, 6], dtype="<i4")))


def header(d: dict) -> bytes:
    return msgspec.msgpack.encode(d)


def malformed(rng: random.Random) -> list[bytes]:
    """One bad message of a random kind."""
    ids = np.array([rng.randrange(0, 260) for _ in range(8)], dtype="<i4")
    offsets = np.array([0, 8], dtype="<i4")
    base = {"type": "score", "request_id": rng.randrange(1 << 30), "mode": "topk", "response_starts": [1], "k": 4,
            "tensors": [["int32", [8]], ["int32", [2]]]}
    kind = rng.randrange(12)
    if kind == 0:   # random bytes, one or several frames
        return [rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(1, 4))]
    if kind == 1:   # a good message truncated somewhere
        frames = [bytes(f) for f in good()]
        i = rng.randrange(len(frames))
        frames[i] = frames[i][:rng.randrange(len(frames[i]))]
        return frames
    if kind == 2:   # wrong frame count
        frames = [header(base), ids.tobytes(), offsets.tobytes()]
        return frames[:rng.randrange(1, 3)] if rng.random() < 0.5 else frames + [b"\0" * 4] * rng.randrange(1, 9)
    if kind == 3:   # dtypes that do not exist or do not fit
        base["tensors"] = [[rng.choice(["float64", "object", "<U8", "int8", "float32", ""]), [8]], ["int32", [2]]]
        return [header(base), ids.tobytes(), offsets.tobytes()]
    if kind == 4:   # shapes that do not match the bytes, negative or too many dims
        shape = rng.choice([[7], [9], [2, 4], [-8], [1, 1, 1, 1, 8], [0]])
        base["tensors"] = [["int32", shape], ["int32", [2]]]
        return [header(base), ids.tobytes(), offsets.tobytes()]
    if kind == 5:   # huge declared sizes with small frames
        shape = rng.choice([[1 << 40], [1 << 31, 1 << 31], [(1 << 62)], [1 << 20, 1 << 20, 1 << 20]])
        base["tensors"] = [["int32", shape], ["int32", [2]]]
        return [header(base), ids.tobytes(), offsets.tobytes()]
    if kind == 6:   # unknown or missing message type
        base["type"] = rng.choice(["scor", "exec", "", 7, None, "pickle"])
        return [header(base), ids.tobytes(), offsets.tobytes()]
    if kind == 7:   # out-of-vocabulary or negative token ids
        bad = ids.copy()
        bad[rng.randrange(8)] = rng.choice([-1, 260, 1 << 30, -(1 << 31)])
        return [header(base), bad.tobytes(), offsets.tobytes()]
    if kind == 8:   # sequence over the limits
        n = rng.choice([65, 129, 1000])
        base["tensors"] = [["int32", [n]], ["int32", [2]]]
        return [header(base), np.ones(n, dtype="<i4").tobytes(), np.array([0, n], dtype="<i4").tobytes()]
    if kind == 9:   # k out of range, temperatures, starts
        field, value = rng.choice([("k", 0), ("k", MAX_K + 1), ("k", -3), ("temperature", 0.0), ("temperature", -2.0),
                                   ("response_starts", [0]), ("response_starts", [9]), ("response_starts", [1, 1])])
        base[field] = value
        return [header(base), ids.tobytes(), offsets.tobytes()]
    if kind == 10:  # fields of the wrong type
        field = rng.choice(["request_id", "k", "mode", "response_starts", "temperature", "tensors"])
        base[field] = rng.choice(["x", [1, "a"], {"a": 1}, None, -(1 << 63) if field == "request_id" else "y"])
        return [header(base), ids.tobytes(), offsets.tobytes()]
    # offsets that do not describe the ids
    bad_offsets = np.array(rng.choice([[0, 9], [1, 8], [0, 4]]), dtype="<i4")
    return [header(base), ids.tobytes(), bad_offsets.tobytes()]


def test_fuzzed_messages_get_errors_and_leave_the_server_intact(server):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)

    def answers(n: int) -> list:
        out = []
        for _ in range(n):
            assert sock.poll(20_000), f"no answer after {len(out)} of {n}"
            out.append(decode(sock.recv_multipart()))
        return out

    sock.send_multipart(good(1))
    before = answers(1)
    assert isinstance(before[0][0], TopK) and isinstance(before[0][0].stats, Done)
    proc = psutil.Process(server.proc.pid)
    rss_before = proc.memory_info().rss

    rng = random.Random(1234)
    codes = {}
    for _ in range(COUNT // BATCH):
        for _ in range(BATCH):
            sock.send_multipart(malformed(rng))
        for msg, _ in answers(BATCH):
            assert isinstance(msg, Error), msg
            assert not msg.retryable
            codes[msg.code] = codes.get(msg.code, 0) + 1
    assert sum(codes.values()) == COUNT
    for code in (ErrorCode.MALFORMED, ErrorCode.UNKNOWN_TYPE, ErrorCode.BAD_TOKEN, ErrorCode.TOO_LONG,
                 ErrorCode.BAD_K, ErrorCode.BAD_REQUEST):
        assert codes.get(code, 0) > 0, (code, codes)

    sock.send_multipart(good(2))
    ((msg, arrays),) = answers(1)
    assert isinstance(msg, TopK) and msg.request_id == 2 and msg.stats.request_id == 2
    for a, b in zip(arrays, before[0][1]):
        np.testing.assert_array_equal(a, b)
    growth = proc.memory_info().rss - rss_before
    assert growth < 64 << 20, f"server RSS grew by {growth >> 20} MiB during the fuzz"
    sock.close()
