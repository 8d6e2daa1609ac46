"""Client behaviour against in-process servers over real TCP: BUSY and retries, timeouts,
reconnection to a restarted teacher, a changed fingerprint, CURVE, and the CLI's guards."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import zmq

from opd.teachers.launch import free_port
from opd.teachers.client import TeacherClient, TeacherError
from opd.teachers.protocol import Error, ErrorCode, Score, TopK, decode, encode
from opd.teachers.server import ServerLimits, serving_in_thread


@pytest.fixture(scope="module")
def teacher(tiny_teacher_dir):
    from opd.teachers.hf_backend import HFBackend

    return HFBackend(tiny_teacher_dir, name="teacher", max_k=16)


@pytest.fixture(scope="module")
def other_teacher(tiny_model_dir):
    from opd.teachers.hf_backend import HFBackend

    return HFBackend(tiny_model_dir, name="other", max_k=16)


running = serving_in_thread  # the package's in-thread server, stopped and drained on exit


SEQS = [[10, 20, 30, 40, 50, 60], [7, 8, 9]]
STARTS = [2, 1]


def test_busy_past_inflight_budget_then_client_retries(teacher):
    limits = ServerLimits(max_tokens_per_request=64, max_inflight_tokens=64)
    seq = (np.arange(60) % 200).astype("<i4")
    with running(teacher, limits=limits) as server:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.address)
        for rid in range(6):  # 6 x 60 tokens against a budget of 64, sent without waiting
            sock.send_multipart(encode(Score(request_id=rid, mode="topk", response_starts=[1], k=4),
                                       (seq, np.array([0, 60], dtype="<i4"))))
        outcome = {}
        while len(outcome) < 6:
            assert sock.poll(10_000)
            msg, _ = decode(sock.recv_multipart())
            if isinstance(msg, Error):
                assert msg.code == ErrorCode.BUSY and msg.retryable
                outcome[msg.request_id] = "busy"
            elif isinstance(msg, TopK):
                outcome[msg.request_id] = "done"
        sock.close()
        assert "busy" in outcome.values() and "done" in outcome.values()
        assert server.stats["busy"] == list(outcome.values()).count("busy")

        with TeacherClient(server.address, retries=50, backoff_s=0.005, max_backoff_s=0.05) as client:
            want = client.score_topk([seq.tolist()], [1], k=4)
            futures = [client.submit_topk([seq.tolist()], [1], k=4) for _ in range(6)]
            for f in futures:
                got = f.result(timeout=60)
                assert torch.equal(got.ids, want.ids)
                torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-6, rtol=0)


def test_busy_is_waited_out_for_timeout_s_not_retries(teacher):
    # An open full-vocabulary stream holds the whole budget (a training step reading it); a
    # top-k request meanwhile gets BUSY. With retries=0 it still succeeds once the stream ends
    # 1.5 s later: BUSY is retried within timeout_s, however many times.
    seq = [(3 * j) % 200 + 3 for j in range(60)]
    with running(teacher, limits=ServerLimits(max_tokens_per_request=64, max_inflight_tokens=64)) as server:
        with TeacherClient(server.address) as a, TeacherClient(server.address, retries=0, timeout_s=20,
                                                              backoff_s=0.05, max_backoff_s=0.2) as b:
            stream = a.score_full([seq], [1], chunk_rows=8, window=1)
            first = next(stream)                      # the stream is open and holds its 60 tokens
            later = b.submit_topk([seq[:30]], [1], k=4)
            time.sleep(1.5)
            assert not later.done() and server.stats["busy"] >= 2
            rows = first.logits.shape[0] + sum(c.logits.shape[0] for c in stream)
            assert rows == 59 and later.result(timeout=20).ids.shape == (29, 4)
        with TeacherClient(server.address) as a, TeacherClient(server.address, timeout_s=0.5, backoff_s=0.05) as b:
            stream = a.score_full([seq], [1], chunk_rows=8, window=1)
            next(stream)
            t0 = time.monotonic()
            with pytest.raises(TeacherError, match="BUSY"):   # still full after timeout_s: it fails
                b.score_topk([seq[:30]], [1], k=4)
            assert 0.4 < time.monotonic() - t0 < 3
            with TeacherClient(server.address, retries=0, busy_timeout_s=0) as c:   # a replica pool's
                t0 = time.monotonic()
                with pytest.raises(TeacherError, match="BUSY"):
                    c.score_topk([seq[:30]], [1], k=4)
                assert time.monotonic() - t0 < 0.4
            stream.close()


def test_timeout_when_nobody_answers():
    address = f"tcp://127.0.0.1:{free_port()}"
    with TeacherClient(address, timeout_s=0.3, retries=1, heartbeat_s=0.1) as client:
        t0 = time.monotonic()
        with pytest.raises(TeacherError) as e:
            client.info()
        assert e.value.code == "TIMEOUT" and address in e.value.message
        assert time.monotonic() - t0 < 5


def test_restart_same_teacher_is_transparent_other_teacher_is_refused(teacher, other_teacher):
    address = f"tcp://127.0.0.1:{free_port()}"
    with TeacherClient(address, timeout_s=5, heartbeat_s=0.2) as client:
        with running(teacher, address):
            first = client.score_topk(SEQS, STARTS, k=4)
        with running(teacher, address):        # same model again: the client carries on
            time.sleep(0.3)
            again = client.score_topk(SEQS, STARTS, k=4)
            assert torch.equal(first.ids, again.ids)
        with running(other_teacher, address):  # another model: refuse rather than mix teachers
            time.sleep(0.3)
            with pytest.raises(TeacherError) as e:
                client.score_topk(SEQS, STARTS, k=4)
    assert e.value.code == "FINGERPRINT_CHANGED"
    assert teacher.model_fingerprint in e.value.message and other_teacher.model_fingerprint in e.value.message


def test_a_stream_is_sent_at_once_and_one_dropped_unread_frees_the_budget(teacher, monkeypatch):
    # score_full sends its request before the first read, so the teacher computes while the
    # caller does. A stream dropped unread is cancelled: its 60 tokens leave the server's
    # budget of 64, and a top-k request of 30 goes through (with the stream left open, it
    # gets BUSY until busy_timeout_s).
    seq = [(3 * j) % 200 + 3 for j in range(60)]
    asked = threading.Event()
    score_full = teacher.score_full
    monkeypatch.setattr(teacher, "score_full", lambda req: (asked.set(), score_full(req))[1])
    with running(teacher, limits=ServerLimits(max_tokens_per_request=64, max_inflight_tokens=64)) as server:
        with TeacherClient(server.address, retries=0, busy_timeout_s=3, backoff_s=0.05) as client:
            stream = client.score_full([seq], [1], chunk_rows=8, window=1)
            assert asked.wait(10), "the request did not go out before the first read"
            del stream
            assert client.score_topk([seq[:30]], [1], k=4).ids.shape == (29, 4)
            kept = client.score_full([seq], [1], chunk_rows=8, window=1)
            with pytest.raises(TeacherError, match="BUSY"):
                client.score_topk([seq[:30]], [1], k=4)
            assert sum(c.logits.shape[0] for c in kept) == 59


def test_server_dies_mid_stream_client_resumes_on_restart(teacher):
    """The server goes away after the first chunk; the restarted one finishes the stream and
    the caller sees every row exactly once."""
    address = f"tcp://127.0.0.1:{free_port()}"
    seq = list(range(1, 41))
    with TeacherClient(address, timeout_s=5, heartbeat_s=0.2, retries=5) as client:
        with running(teacher, address, limits=ServerLimits(drain_timeout_s=0.2)):  # dies with work in flight
            want = torch.cat([c.logits for c in client.score_full([seq], [1], chunk_rows=8, window=1)])
            stream = client.score_full([seq], [1], chunk_rows=8, window=1)
            chunks = [next(stream)]
        with running(teacher, address):
            chunks += list(stream)
    assert [c.row_start for c in chunks] == [0, 8, 16, 24, 32]
    torch.testing.assert_close(torch.cat([c.logits for c in chunks]), want, atol=0, rtol=0)


def test_curve_admits_allowed_keys_only(teacher, tmp_path):
    from opd.teachers.keys import generate, load_allow_list, load_keypair

    server_pub, server_sec = generate(tmp_path / "keys", "server")
    ok_pub, ok_sec = generate(tmp_path / "clients", "trainer")
    _, bad_sec = generate(tmp_path / "other", "intruder")
    public, secret = load_keypair(server_sec)
    ctx = zmq.Context()  # its own context: the ZAP handler must not see other tests' sockets
    with running(teacher, curve_secret_key=secret, curve_public_key=public,
                 curve_allow=load_allow_list(tmp_path / "clients"), context=ctx) as server:
        with TeacherClient(server.address, timeout_s=5, curve=(ok_sec, server_pub)) as client:
            r = client.score_topk(SEQS, STARTS, k=4)
            assert r.ids.shape == (6, 4) and r.row_offsets == [0, 4, 6]
        for curve in [(bad_sec, server_pub), None]:
            with TeacherClient(server.address, timeout_s=0.5, retries=0, heartbeat_s=0.2, curve=curve) as client:
                with pytest.raises(TeacherError) as e:
                    client.info()
                assert e.value.code == "TIMEOUT"
    ctx.term()


def test_curve_servers_share_a_process_and_a_failed_bind_leaves_nothing_running(teacher):
    # ZeroMQ has one authentication handler per context: CURVE servers get their own context,
    # which `opd serve-teacher` relies on (it passes none); a bind that fails stops the handler.
    from opd.teachers.server import TeacherServer

    pub, sec = zmq.curve_keypair()
    cpub, csec = zmq.curve_keypair()
    keys = dict(curve_secret_key=sec, curve_public_key=pub, curve_allow={cpub})
    with running(teacher, **keys) as a:
        threads = threading.active_count()
        with pytest.raises(zmq.ZMQError, match="in use"):
            TeacherServer(teacher, a.address, **keys)                    # the port is taken
        assert threading.active_count() == threads
        with running(teacher, **keys) as b:
            for server in (a, b):
                with TeacherClient(server.address, timeout_s=5, curve=(cpub, csec, pub)) as client:
                    assert client.score_topk(SEQS, STARTS, k=4).ids.shape == (6, 4)


def test_curve_handler_runs_before_the_port_opens(teacher, monkeypatch):
    # Between a bind and the handler's start, ZeroMQ admits any CURVE client: the handler
    # must already run when the listening socket binds.
    from opd.teachers.server import TeacherServer

    bind, at_bind = TeacherServer._bind, []

    def spy(self, address, *args, **kwargs):
        at_bind.append(self._auth is not None and self._auth.is_alive())
        return bind(self, address, *args, **kwargs)

    monkeypatch.setattr(TeacherServer, "_bind", spy)
    pub, sec = zmq.curve_keypair()
    with running(teacher, curve_secret_key=sec, curve_public_key=pub, curve_allow=set()):
        assert at_bind == [True]


def test_a_request_far_over_the_limit_gets_too_long_not_a_dropped_connection(teacher):
    # Frames up to 64 MiB are read and validated; before, a frame over 8 bytes per allowed token
    # made ZeroMQ drop the connection, and the sender waited for its timeout.
    with running(teacher, limits=ServerLimits(max_tokens_per_request=64)) as server:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.address)
        for n in (1000, 300_000):
            ids = np.full(n, 5, dtype="<i4")
            sock.send_multipart(encode(Score(request_id=n, mode="topk", response_starts=[1], k=2),
                                       (ids, np.array([0, n], dtype="<i4"))))
            assert sock.poll(10_000), n
            msg, _ = decode(sock.recv_multipart())
            assert isinstance(msg, Error) and msg.code == ErrorCode.TOO_LONG and msg.request_id == n
        sock.close()


def test_non_loopback_bind_needs_curve_or_insecure(tiny_teacher_dir, capsys):
    from opd.cli import main
    from opd.teachers.serve import check_bind

    code = main(["serve-teacher", "--model", str(tiny_teacher_dir), "--bind", f"tcp://0.0.0.0:{free_port()}"])
    assert code == 2 and "--insecure" in capsys.readouterr().err
    assert check_bind("tcp://0.0.0.0:5555", curve=False, insecure=True) is None
    assert "WITHOUT authentication" in capsys.readouterr().err
    assert check_bind("tcp://10.1.2.3:5555", curve=True, insecure=False) is None
    assert check_bind("tcp://127.0.0.1:5555", curve=False, insecure=False) is None
    assert check_bind("tcp://[::1]:5555", curve=False, insecure=False) is None


def test_help_lists_every_option(tmp_path):
    from opd.teachers import keys, serve

    for argv, module in [(["serve-teacher", "--help"], serve), (["keys", "generate", "--help"], None)]:
        out = subprocess.run([sys.executable, "-m", "opd.cli", *argv], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        if module is not None:
            parser = argparse.ArgumentParser()
            module.add_arguments(parser)
            options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
            assert len(options) >= 17
            for option in options:
                assert option in out.stdout, option
    for option in ("--out", "--name", "--force"):
        assert option in out.stdout
    from opd.cli import main

    assert main(["keys", "generate", "--out", str(tmp_path), "--name", "t"]) == 0
    assert (tmp_path / "t.key").is_file() and (tmp_path / "t.key_secret").stat().st_mode & 0o077 == 0
    with pytest.raises(FileExistsError):
        keys.generate(tmp_path, "t")


def test_silent_peer_loses_its_stream(teacher):
    """A client that stops sending heartbeats mid-stream: the server cancels its work."""
    limits = ServerLimits(heartbeat_s=0.1, peer_timeout_s=0.3)
    with running(teacher, limits=limits) as server:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.address)
        ids = np.arange(1, 41, dtype="<i4")
        sock.send_multipart(encode(Score(request_id=3, mode="full", response_starts=[1], chunk_rows=4, window=1),
                                   (ids, np.array([0, 40], dtype="<i4"))))
        assert sock.poll(10_000)
        sock.recv_multipart()                      # one chunk, then silence: no credit, no ping
        deadline = time.monotonic() + 10
        while server._jobs and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server._jobs and server._inflight_tokens == 0
        msg, _ = decode(sock.recv_multipart())     # it was told, in case it was only slow
        assert isinstance(msg, Error) and msg.code == ErrorCode.CANCELLED
        sock.close()


def test_the_client_pings_as_often_as_the_server_asks(teacher):
    # A client set to ping every 5 s, a server that drops peers silent for 0.6 s: the client
    # takes the WELCOME's heartbeat_s, so a stream it reads slowly (a long training step
    # between reads) is not cancelled under it.
    with running(teacher, limits=ServerLimits(heartbeat_s=0.1, peer_timeout_s=0.6)) as server:
        with TeacherClient(server.address, heartbeat_s=5.0, timeout_s=20) as client:
            stream = client.score_full([list(range(1, 41))], [1], chunk_rows=4, window=1)
            first = next(stream)
            time.sleep(2.0)
            assert first.logits.shape[0] + sum(c.logits.shape[0] for c in stream) == 39
            assert client.heartbeat_s == 0.1


def test_backend_failure_is_internal_and_server_keeps_serving(teacher):
    class Flaky:
        """The real backend, except that k == 13 raises inside the forward pass."""

        def __getattr__(self, name):
            return getattr(teacher, name)

        def score_topk(self, reqs):
            if any(r.k == 13 for r in reqs):
                raise RuntimeError("simulated out of memory")
            return teacher.score_topk(reqs)

    with running(Flaky()) as server, TeacherClient(server.address, retries=2, backoff_s=0.01) as client:
        with pytest.raises(TeacherError) as e:
            client.score_topk(SEQS, STARTS, k=13)
        assert e.value.code == "INTERNAL" and "simulated out of memory" in e.value.message
        assert client.score_topk(SEQS, STARTS, k=4).ids.shape == (6, 4)


def test_pending_requests_share_one_backend_call(teacher):
    groups = []

    class Recording:
        def __getattr__(self, name):
            return getattr(teacher, name)

        def score_topk(self, reqs):
            groups.append(len(reqs))
            return teacher.score_topk(reqs)

    with running(Recording()) as server, TeacherClient(server.address) as client:
        futures = [client.submit_topk(SEQS, STARTS, k=4) for _ in range(8)]
        results = [f.result(timeout=60) for f in futures]
    assert sum(groups) == 8 and max(groups) > 1, groups
    for r in results[1:]:
        torch.testing.assert_close(r.logprobs, results[0].logprobs, atol=1e-6, rtol=0)


def test_full_mode_default_chunk_fits_a_large_vocabulary():
    """A fixed 1024-row chunk exceeded the server's 256 MiB CHUNK limit past V = 65,536 (found
    by `opd bench step --vocab 152064`); the client now sizes chunks from the WELCOME."""
    from opd.benchmarks.transport import PrecomputedBackend
    from opd.teachers.protocol import default_chunk_rows
    from opd.teachers.server import serving_in_thread

    vocab = 262144                                   # 1 MiB per fp32 row: 64 rows per chunk
    assert default_chunk_rows(vocab, "float32") == 64 and default_chunk_rows(vocab, "bfloat16") == 128
    assert default_chunk_rows(152064, "float32") == 110 and default_chunk_rows(260, "float32") == 1024
    backend = PrecomputedBackend(vocab, max_rows=8, chunk_rows=64)
    with serving_in_thread(backend) as server, TeacherClient(server.address) as client:
        chunks = list(client.score_full([[1] * 101], [1]))
        assert [(c.row_start, c.logits.shape) for c in chunks] == [(0, (64, vocab)), (64, (36, vocab))]
        with pytest.raises(TeacherError) as e:      # an explicit size past the limit is still refused
            list(client.score_full([[1] * 101], [1], chunk_rows=1024))
        assert e.value.code == "BAD_REQUEST" and "[1, 256]" in e.value.message


def test_pack_takes_lists_arrays_and_tensors_alike():
    from opd.teachers.client import _pack

    want_ids, want_offsets = [5, 6, 7, 8, 9], [0, 3, 3, 5]
    for seqs in ([[5, 6, 7], [], [8, 9]], [(5, 6, 7), (), (8, 9)],
                 [np.array([5, 6, 7]), np.array([], dtype=np.int64), np.array([8, 9])],
                 [torch.tensor([5, 6, 7]), torch.tensor([], dtype=torch.long), torch.tensor([8, 9])]):
        ids, offsets = _pack(seqs)
        assert ids.dtype == np.dtype("<i4") and offsets.dtype == np.dtype("<i4")
        assert ids.tolist() == want_ids and offsets.tolist() == want_offsets
    for too_big in ([[1, 2 ** 31]], [torch.tensor([1, 2 ** 31])]):
        with pytest.raises(ValueError, match="int32"):
            _pack(too_big)


def test_many_requests_in_flight_from_several_threads_all_answer(teacher):
    """Wakes of the client's I/O thread and of the server's socket thread are coalesced (one
    byte per loop turn). A lost wake leaves a command waiting for the I/O loop's poll timeout,
    heartbeat_s / 4 = 5 s here: ten requests in turn would take 50 s instead of well under 1 s."""
    from concurrent.futures import ThreadPoolExecutor

    with running(teacher) as server, TeacherClient(server.address, timeout_s=60, retries=0,
                                                   heartbeat_s=20) as client:
        want = client.score_topk(SEQS, STARTS, k=4).logprobs
        t0 = time.monotonic()
        for _ in range(10):
            client.score_topk(SEQS, STARTS, k=4)
        assert time.monotonic() - t0 < 15

        def burst(_):
            futures = [client.submit_topk(SEQS, STARTS, k=4) for _ in range(16)]
            return [f.result(timeout=30).logprobs for f in futures]

        with ThreadPoolExecutor(4) as pool:
            results = [r for rs in pool.map(burst, range(4)) for r in rs]
    assert len(results) == 64
    for r in results:
        torch.testing.assert_close(r, want, atol=1e-6, rtol=0)


def test_a_batch_over_the_request_limit_is_split_and_joined(teacher):
    # 10 sequences, 291 tokens, against 64 tokens per request and 128 in flight: the batch
    # must go as several requests, never more than the budget at once (no BUSY answer), and
    # come back equal to one request to an unlimited server.
    seqs = [[(7 * i + j) % 250 + 3 for j in range(20 + (i * 7) % 16)] for i in range(10)]
    starts = [1 + i % 5 for i in range(10)]
    small = ServerLimits(max_tokens_per_request=64, max_inflight_tokens=128)
    with running(teacher, limits=small) as split_srv, running(teacher) as whole_srv:
        with TeacherClient(split_srv.address, retries=0) as split, TeacherClient(whole_srv.address) as whole:
            got, want = split.score_topk(seqs, starts, k=8), whole.score_topk(seqs, starts, k=8)
            assert got.row_offsets == want.row_offsets and got.stats is None
            assert torch.equal(got.ids, want.ids)
            for f in ("logprobs", "tail_logmass", "token_logprob", "lse"):
                torch.testing.assert_close(getattr(got, f), getattr(want, f), rtol=1e-5, atol=1e-5)
            chunks = list(split.score_full(seqs, starts, chunk_rows=16))
            full = list(whole.score_full(seqs, starts, chunk_rows=1000))
            assert [c.row_start for c in chunks] == sorted(c.row_start for c in chunks)
            assert chunks[0].row_start == 0 and len(full) == 1
            torch.testing.assert_close(torch.cat([c.logits for c in chunks]), full[0].logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(torch.cat([c.token_logprob for c in chunks]), full[0].token_logprob,
                                       rtol=1e-5, atol=1e-5)
            assert split_srv.stats["busy"] == 0
            with pytest.raises(ValueError, match="sequence 1 has 70 tokens, more than the teacher's "
                                                 "max_tokens_per_request \\(64\\)"):
                split.submit_topk([[5] * 10, [5] * 70], [1, 1], k=4)


def test_a_split_batch_stops_sending_after_a_part_fails(teacher, monkeypatch):
    # 6 parts of one sequence each, 2 in flight; part 1 holds a token outside the vocabulary.
    # The batch fails with BAD_TOKEN, and the parts after it are not computed for nothing: at
    # most part 0 and the one sent when part 0 came back reach the model.
    seqs = [[5 + i] * 40 for i in range(6)]
    seqs[1][3] = teacher.vocab_size
    computed = []
    score_topk = teacher.score_topk
    monkeypatch.setattr(teacher, "score_topk", lambda reqs: (computed.extend(reqs), score_topk(reqs))[1])
    with running(teacher, limits=ServerLimits(max_tokens_per_request=40, max_inflight_tokens=80)) as server:
        with TeacherClient(server.address, retries=0) as client:
            with pytest.raises(TeacherError, match="BAD_TOKEN"):
                client.score_topk(seqs, [1] * 6, k=4)
            time.sleep(0.5)   # answers to parts still in flight come back: nothing more goes out
            n = len(computed)   # 5 before: every part but the bad one
            assert server.stats["BAD_TOKEN"] == 1 and n <= 2, n


def test_a_malformed_address_is_an_error_at_once_not_a_hang():
    # The I/O thread used to connect, die with the ZMQError, and leave every call waiting forever.
    t0 = time.monotonic()
    with pytest.raises(TeacherError, match=r"BAD_ADDRESS: cannot connect to '127.0.0.1:5711' .*tcp://HOST:PORT"):
        TeacherClient("127.0.0.1:5711", timeout_s=2)
    assert time.monotonic() - t0 < 1


def test_a_lost_connection_drops_prefill_hints_and_sends_the_scores_again():
    # A prefill sent again after a reconnection can reach the server after the SCORE it
    # announced and leave prompt-cache entries nobody reads: hints are dropped, requests kept.
    from opd.teachers.streams import Call as _Call

    client = object.__new__(TeacherClient)   # the decision alone, without the I/O thread
    hint, score = _Call("prefill", rid=1, sent=True), _Call("topk", rid=2, sent=True)
    client._calls, client._hellos, client._verified = {1: hint, 2: score}, [], True
    client._unsend_all()
    assert list(client._calls) == [2] and score.sent is False and not client._verified
    with pytest.raises(TeacherError) as e:
        hint.future.result(timeout=0)
    assert e.value.code == "DROPPED"
