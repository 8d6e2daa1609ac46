"""Pieces the fault tests share: a teacher backend that sleeps, a process that serves it, and
the tiny `opd train` setup (a teacher that differs from the student in its LM head).

    python tests/faults/fault_helpers.py --model DIR --delay-s 0.5 --bind tcp://127.0.0.1:PORT

serves `SlowBackend(HFBackend(DIR))` through `opd.teachers.server.serve` and prints the same
ready line as `opd serve-teacher`, so `start_slow_server` can wait for it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

from opd.teachers.backend import FullChunkAnswer, ScoreRequest, TeacherBackend, TopKAnswer
from opd.teachers.launch import ServerProcess, free_port, spawn_until_ready  # noqa: F401 (free_port: re-exported)
from opd.teachers.serve import READY


class SlowBackend(TeacherBackend):
    """Another backend whose calls sleep `delay_s` first (only the first `slow_calls` calls when
    that is set); it records when each call started and how many tokens it held."""

    def __init__(self, inner: TeacherBackend, delay_s: float, slow_calls: int | None = None):
        self.inner = inner
        self.delay_s = delay_s
        self.slow_calls = slow_calls
        self.calls: list[tuple[float, int]] = []   # (monotonic start, tokens)
        for name in ("name", "model_id", "model_fingerprint", "tokenizer_fingerprint", "vocab_size",
                     "max_positions", "max_k", "modes", "dtypes"):
            setattr(self, name, getattr(inner, name))

    def _sleep(self, tokens: int) -> None:
        self.calls.append((time.monotonic(), tokens))
        if self.slow_calls is None or len(self.calls) <= self.slow_calls:
            time.sleep(self.delay_s)

    def unsupported(self, req: ScoreRequest) -> str | None:
        return self.inner.unsupported(req)

    def score_topk(self, reqs: list[ScoreRequest]) -> list[TopKAnswer]:
        self._sleep(sum(r.num_tokens for r in reqs))
        return self.inner.score_topk(reqs)

    def score_full(self, req: ScoreRequest) -> Iterator[FullChunkAnswer]:
        for chunk in self.inner.score_full(req):
            self._sleep(chunk.logits.shape[0])
            yield chunk

    def close(self) -> None:
        self.inner.close()


def start_slow_server(model_dir, bind: str, delay_s: float, *, max_k: int = 16, timeout_s: float = 120.0,
                      extra: list[str] = ()) -> ServerProcess:
    """A subprocess serving SlowBackend(HFBackend(model_dir)); returns once it is ready."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return spawn_until_ready([sys.executable, __file__, "--model", str(model_dir), "--bind", bind,
                              "--delay-s", str(delay_s), "--max-k", str(max_k), *extra], env, timeout_s)


def train_config_dict(student, address: str, data_dir: Path, out_dir: Path, *, steps: int = 6,
                      mode: str = "topk", **client) -> dict:
    """A tiny `opd train` config: 4 prompts per step, responses of at most 8 tokens."""
    return {
        "student": {"path": str(student)},
        "merge": {"teachers": [{"name": "t", "address": address, "mode": mode, "k": 8}],
                  "datasets": [{"domain": "gen", "path": str(data_dir / "train.jsonl"),
                                "eval_path": str(data_dir / "eval.jsonl")}]},
        "rollout": {"prompts_per_step": 4, "max_new_tokens": 8},
        "optim": {"lr": 3e-3, "micro_batch_size": 4},
        "teacher_client": {"connect_timeout_s": 10.0, **client},
        "run": {"steps": steps, "out_dir": str(out_dir), "progress": False, "tensorboard": False,
                "eval_prompts": 2},
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--bind", required=True)
    p.add_argument("--delay-s", type=float, required=True)
    p.add_argument("--max-k", type=int, default=16)
    p.add_argument("--max-inflight-tokens", type=int, default=131072)
    args = p.parse_args()
    torch.set_num_threads(1)
    from opd.teachers.hf_backend import HFBackend
    from opd.teachers.server import ServerLimits, serve

    backend = SlowBackend(HFBackend(args.model, name="slow", max_k=args.max_k), args.delay_s)

    def ready(server) -> None:
        print(f"{READY} address={server.address} backend=slow name={server.name} "
              f"model_fingerprint={backend.model_fingerprint} tokenizer_fingerprint={backend.tokenizer_fingerprint}",
              flush=True)

    return serve(backend, args.bind, ready=ready, signals=True,
                 limits=ServerLimits(max_inflight_tokens=args.max_inflight_tokens))


if __name__ == "__main__":
    sys.exit(main())
