"""Smoke test of `opd bench transport`: the pieces move the right bytes; no timing asserts."""

from __future__ import annotations

import argparse

import pytest
import torch

from opd.benchmarks import transport
from opd.teachers.client import TeacherClient
from opd.teachers.server import ServerLimits, serving_in_thread


def test_precomputed_answers_cross_the_real_client_unchanged():
    backend = transport.PrecomputedBackend(vocab_size=1000, max_rows=64, chunk_rows=8)
    seqs, starts = transport._requests(40, seq_rows=20)          # 2 sequences x 20 scored rows
    limits = ServerLimits(max_tokens_per_request=1024)
    with serving_in_thread(backend, limits=limits) as server, TeacherClient(server.address) as client:
        got = client.score_topk(seqs, starts, k=8)
        assert got.row_offsets == [0, 20, 40] and got.stats.rows == 40
        want = backend._topk
        assert torch.equal(got.ids, want.ids[:40, :8])
        assert torch.equal(got.logprobs, want.logprobs[:40, :8])
        assert torch.equal(got.tail_logmass, want.tail_logmass[:40])
        chunks = list(client.score_full(seqs, starts, dtype="bfloat16", chunk_rows=8))
        assert [c.row_start for c in chunks] == [0, 8, 16, 24, 32]
        assert all(torch.equal(c.logits, backend._logits["bfloat16"]) for c in chunks)


def test_interleaved_takes_turns_in_a_rotating_order():
    # A fixed order always ran opd while the ceiling's PUSH refilled its queue.
    calls = []
    res = transport.interleaved({n: lambda s, n=n, v=v: calls.append(n) or v for n, v in [("a", 1.0), ("b", 2.0),
                                                                                          ("c", 3.0)]},
                                rounds=3, seconds=0.0)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert res == {"a": [1.0] * 3, "b": [2.0] * 3, "c": [3.0] * 3}


def test_positions_that_are_not_whole_sequences_are_refused():
    p = argparse.ArgumentParser()
    transport.add_arguments(p)
    assert p.parse_args(["--positions", "300", "1024"]).positions == [300, 1024]
    with pytest.raises(SystemExit):
        p.parse_args(["--positions", "1000"])   # opd sent 512 rows against ceiling messages of 1000


def test_run_cases_writes_one_row_per_size_and_mode():
    p = argparse.ArgumentParser()
    transport.add_arguments(p)
    args = p.parse_args(["--transports", "tcp", "--ks", "8", "--positions", "128", "256", "--vocabs", "1024",
                         "--dtypes", "bfloat16", "--chunk-rows", "8", "--seconds", "0.1", "--rounds", "2"])
    rows = transport.run_cases(args)
    assert [(r["mode"], r["positions_per_request"]) for r in rows] == [("topk", 128), ("topk", 256), ("full", 64)]
    top, full = rows[0], rows[2]
    assert top["bytes_per_position"] == 8 * 8 + 12 and full["bytes_per_position"] == 1024 * 2 + 8
    for r in rows:
        assert len(r["rounds"]["opd"]) == len(r["rounds"]["ceiling"]) == 2
        assert r["ratio_to_ceiling"] == r["positions_per_s"] / r["ceiling_positions_per_s"] > 0
        assert r["ratio_to_ceiling_rounds"] == [a / b for a, b in zip(r["rounds"]["opd"], r["rounds"]["ceiling"])]
        assert r["cpu_us_per_position"] > 0 and r["ceiling_cpu_us_per_position"] > 0
    assert top["http_json_positions_per_s"] > 0 and full["ratio_to_http"] is None
    for name in ("reqresp", "work"):  # the references, top-k only
        assert len(top["rounds"][name]) == 2
        assert top[f"{name}_ratio_to_ceiling"] == top[f"{name}_positions_per_s"] / top["ceiling_positions_per_s"] > 0
        assert f"{name}_positions_per_s" not in full


def test_references_answer_with_the_frames_of_the_case():
    server, address = transport._start(transport._reference_server, "tcp://127.0.0.1:*", 1000, 64)
    ref = transport.RequestResponse(address, positions=40, k=8)
    try:
        ref.send_bare()
        sizes = [len(f.buffer) for f in ref.sock.recv_multipart(copy=False)]
        assert sizes == transport._topk_frame_sizes(40, 8)
        ref.send_score()  # `work`: validated and answered as opd's server does
        got, want = ref.recv_topk(), transport.PrecomputedBackend(1000, 64, 1)._topk
        assert got.row_offsets == [0, 40] and got.stats.rows == 40
        assert torch.equal(got.ids, want.ids[:40, :8]) and torch.equal(got.lse, want.lse[:40])
    finally:
        ref.close()
        transport._stop(server)


def test_with_cpu_counts_this_process_and_the_other_per_position():
    import subprocess
    import sys
    import time

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        def busy(seconds):  # 0.3 s of CPU here, reported as 1000 positions/s
            t0 = time.process_time()
            while time.process_time() - t0 < 0.3:
                pass
            return 1000.0

        out: list[float] = []
        t0 = time.perf_counter()
        assert transport.with_cpu(busy, other.pid, out)(0.3) == 1000.0
        wall = time.perf_counter() - t0
    finally:
        other.kill()
    # 0.3 s of CPU over 1000 * wall positions (a loaded machine stretches the wall, not the
    # CPU). Reading only the other (sleeping) process would give ~0, counting this one twice 2x.
    want = 1e6 * 0.3 / (1000 * wall)
    assert len(out) == 1 and 0.75 * want < out[0] < 1.3 * want, (out, want)
