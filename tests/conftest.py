"""Shared fixtures: tiny local models built once per test session (nothing is downloaded)."""

from __future__ import annotations

import os
import socket

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer Qwen2-style model (vocab 260, byte tokenizer), fp32, seed 0."""
    from opd.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_teacher_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model with noise added: a teacher that differs from the student."""
    from opd.tiny import perturb_model

    return perturb_model(tiny_model_dir, tmp_path_factory.mktemp("tiny") / "teacher", scale=1.0, seed=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def free_tcp_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"
