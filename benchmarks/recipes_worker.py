"""`opd bench recipes`'s workers (teacher sampling, held-out evaluation), run as a script in a
subprocess: the library they import (inside the functions) is the snapshot on PYTHONPATH.

    python -P benchmarks/recipes_worker.py JOB_JSON
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

CODE_OPTIONS = {"timeout_s": 2.0, "workers": 2}   # the demo's code verifier options


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path




def _load(path: str, tokenizer_from: str | None = None):
    """(hf rollout engine, tokenizer) of a model dir; a checkpoint's model/ has no tokenizer
    files, so `tokenizer_from` (the SFT start, whose tokenizer every run keeps) gives it."""
    from opd.rollout.hf import HFRolloutEngine
    from opd.spine.config import ModelConfig
    from opd.spine.model import load_policy, load_tokenizer

    tok = load_tokenizer(tokenizer_from or path, "model")
    model, tok = load_policy(ModelConfig(path=path, device="cpu"), tokenizer=tok, train=False, what="model")
    return HFRolloutEngine(model, tok, batch_size=64), tok


def _generate(engine, tok, prompts: list[str], params) -> list:
    from opd.data import encode_prompt

    return engine.generate([encode_prompt(tok, p) for p in prompts], params)


def _text(tok, r) -> str:
    ids = r.response_ids[:-1] if r.finish_reason == "eos" else r.response_ids
    return tok.decode(ids, skip_special_tokens=True)


def worker_sample(job: dict) -> dict:
    """Each domain's teacher answers job n prompts of its training file (a seeded shuffled cycle
    over it), one sample each at temperature 1; written as prompt/response JSONL."""
    import random

    import torch

    from opd.rollout import SamplingParams

    torch.set_num_threads(1)
    tokens = 0
    for i, (d, spec) in enumerate(job["domains"].items()):
        rows = _read_jsonl(Path(spec["prompts"]))
        rng = random.Random(job["seed"] * 7919 + i)
        order: list[dict] = []
        while len(order) < spec["n"]:
            block = rows[:]
            rng.shuffle(block)
            order.extend(block)
        order = order[:spec["n"]]
        engine, tok = _load(spec["teacher"])
        params = SamplingParams(temperature=1.0, max_new_tokens=job["max_new_tokens"], n=1, seed=job["seed"])
        rollouts = _generate(engine, tok, [r["prompt"] for r in order], params)
        tokens += sum(len(r.response_ids) for r in rollouts)
        _write_jsonl(Path(spec["out"]), [{"prompt": r["prompt"], "response": _text(tok, ro), "domain": d}
                                         for r, ro in zip(order, rollouts)])
        engine.close()
    stats = {"tokens": tokens, "sequences": sum(s["n"] for s in job["domains"].values())}
    Path(job["stats"]).write_text(json.dumps(stats))
    return stats


def worker_eval(job: dict) -> dict:
    """Greedy held-out accuracy of each model: {key: {math, code, all}} (the share of answers
    the domain verifier scores 1, as `opd validate`'s greedy column)."""
    import torch
    from opd.rewards import accuracy, verify_batch

    from opd.data import load_jsonl
    from opd.rollout import SamplingParams

    torch.set_num_threads(1)
    sets = {d: load_jsonl(p)[0] for d, p in job["sets"].items()}
    params = SamplingParams(temperature=0.0, max_new_tokens=job["max_new_tokens"], n=1)
    results = {}
    for key, path in job["models"].items():
        engine, tok = _load(path, job.get("tokenizer"))
        res, right, n = {}, 0.0, 0
        for d, samples in sets.items():
            texts = [_text(tok, r) for r in _generate(engine, tok, [s.prompt for s in samples], params)]
            scores = [v if v is not None else 0.0 for v in verify_batch(samples, texts, **CODE_OPTIONS)]
            res[d] = accuracy(scores)
            right, n = right + res[d] * len(samples), n + len(samples)
        res["all"] = right / n
        results[key] = res
        engine.close()
        print(f"{key}: {res}", flush=True)
    Path(job["out"]).parent.mkdir(parents=True, exist_ok=True)
    Path(job["out"]).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    {"sample": worker_sample, "eval": worker_eval}[job["kind"]](job)
