"""A missing or mismatched teacher is refused at start, before any compute, with a clear message."""

from __future__ import annotations

import socket

import pytest

from opd.routing.checks import TeacherCheckError, check_teachers
from opd.routing.config import TeacherSpec
from opd.teachers.protocol import PROTOCOL_VERSION, Welcome


def _unused_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def math_server(tiny_teacher_dir):
    from opd.teachers.launch import start_server_process

    with start_server_process(["--model", tiny_teacher_dir, "--name", "math", "--max-k", "16"]) as server:
        yield server


def test_real_teacher_passes_and_mismatches_are_refused(math_server, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from opd.fingerprint import tokenizer_fingerprint, tokenizer_fingerprint_of_dir

    student_fp = tokenizer_fingerprint_of_dir(tiny_model_dir)
    ok = TeacherSpec(name="math", address=math_server.address, domains=["math"], k=16)
    welcomes = check_teachers([ok], student_fp, timeout_s=10)
    assert welcomes["math"].tokenizer_fingerprint == student_fp == math_server.tokenizer_fingerprint

    # a student whose tokenizer differs by one added token
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_tokens(["<extra>"])
    other_fp = tokenizer_fingerprint(tok)
    assert other_fp != student_fp
    with pytest.raises(TeacherCheckError) as e:
        check_teachers([ok], other_fp, timeout_s=10)
    msg = str(e.value)
    assert "'math'" in msg and math_server.address in msg and student_fp in msg and other_fp in msg

    # one reachable teacher asking for too large a k, one teacher nobody serves: both named at once
    missing = TeacherSpec(name="code", address=_unused_address(), domains=["code"])
    greedy = TeacherSpec(name="math", address=math_server.address, domains=["math"], k=64)
    with pytest.raises(TeacherCheckError) as e:
        check_teachers([greedy, missing], student_fp, timeout_s=1.0)
    msg = str(e.value)
    assert "k=64 exceeds the server's max_k=16" in msg
    assert f"teacher 'code' at {missing.address}: not reachable within 1s" in msg


class _FakeClient:
    def __init__(self, welcome):
        self.welcome, self.closed = welcome, False

    def info(self):
        return self.welcome

    def close(self):
        self.closed = True


def _welcome(**kw) -> Welcome:
    base = dict(version=PROTOCOL_VERSION, teacher="t", model_id="/m", model_fingerprint="m1",
                tokenizer_fingerprint="tok", vocab_size=260, max_k=32, modes=["topk"], dtypes=["float32"],
                max_tokens_per_request=4096, max_inflight_tokens=8192, heartbeat_s=1.0, backend="hf")
    return Welcome(**{**base, **kw})


def test_mode_support_is_checked():
    clients = []

    def factory(address, timeout_s, curve):
        clients.append(_FakeClient(_welcome()))
        return clients[-1]

    full = TeacherSpec(name="t", address="tcp://x:1", mode="full")
    with pytest.raises(TeacherCheckError, match=r"mode 'full' needs 'full', the server offers \['topk'\]"):
        check_teachers([full], "tok", timeout_s=1, client_factory=factory)
    # sampled-token reverse KL is answered from a top-k answer's token log-probs
    sampled = TeacherSpec(name="t", address="tcp://x:1", mode="sampled", k=1)
    assert check_teachers([sampled], "tok", timeout_s=1, client_factory=factory)["t"].teacher == "t"
    assert all(c.closed for c in clients)


def test_a_temperature_the_backend_cannot_answer_is_refused():
    # A vLLM teacher scores at temperature 1 only: every request came back UNSUPPORTED, the
    # first at the step-0 evaluation, after the student had loaded.
    def factory(address, timeout_s, curve):
        return _FakeClient(_welcome(backend="vllm", supports_temperature=False))

    warm = TeacherSpec(name="t", address="tcp://x:1", temperature=2.0)
    with pytest.raises(TeacherCheckError, match=r"temperature 2.0 is not answered by its vllm backend"):
        check_teachers([warm], "tok", timeout_s=1, client_factory=factory)
    assert check_teachers([TeacherSpec(name="t", address="tcp://x:1")], "tok", timeout_s=1,
                          client_factory=factory)["t"].backend == "vllm"


def test_curve_teacher_without_client_key_is_refused():
    spec = TeacherSpec(name="t", address="tcp://x:1", curve_server_key="/keys/server.key")
    with pytest.raises(TeacherCheckError, match="uses CURVE"):
        check_teachers([spec], "tok", timeout_s=1, client_factory=lambda *a: _FakeClient(_welcome()))
