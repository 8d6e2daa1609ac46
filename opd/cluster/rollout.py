"""Rollout engines as Ray actors: student sampling spread over workers.

Each `RolloutWorker` actor holds its own copy of the student and an `HFRolloutEngine`
(opd/rollout/hf.py). A `RolloutPool` splits a batch of prompts into contiguous shards,
one per worker, and concatenates the answers in prompt order, so `generate` returns what
one engine would (exactly so when greedy; with sampling each worker draws from its own
seed, hashed from (seed, rank)).

On-policy weights: `sync_weights(checkpoint_dir)` makes every worker load a checkpoint's
`trainable.safetensors` (opd/checkpoint.py), or a bare `.safetensors` file of named
parameters, which is what `PoolEngine` (a RolloutEngine over a pool, used by `opd rl` on Ray)
writes after each step. The weights travel by file (a shared filesystem across nodes), not
through Ray's object store.

Ray is imported inside the functions that use it (optional, about a second to import).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from opd.checkpoint import load_checkpoint
from opd.rollout.base import Rollout, RolloutEngine, SamplingParams, prompt_seed
from opd.rollout.hf import HFRolloutEngine
from opd.spine.config import ModelConfig
from opd.spine.model import load_policy


class RolloutWorkerDiedError(RuntimeError):
    pass


class RolloutWorker:
    """One rollout engine (used as a Ray actor)."""

    def __init__(self, model_dir: str, *, threads: int = 1, batch_size: int = 64, device: str = "cpu",
                 dtype: str = "float32"):
        torch.set_num_threads(max(1, threads))
        # The trainer's dtype: rollout log-probs of an fp32 copy of a bf16 policy put the GRPO
        # ratio off 1 (max |log ratio| 0.12) before any update.
        self.model, tokenizer = load_policy(ModelConfig(path=str(model_dir), dtype=dtype, device=device), train=False)
        self.engine = HFRolloutEngine(self.model, tokenizer, batch_size=batch_size)
        self.generated = 0   # samples this actor produced (a pool's spread is visible from outside)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        out = self.engine.generate(prompts, params)
        self.generated += len(out)
        return out

    def samples_generated(self) -> int:
        return self.generated

    def load_weights(self, path: str) -> int:
        """Load a `.safetensors` file of named parameters (all of the trained ones); returns their count."""
        weights = load_file(path)
        params = dict(self.model.named_parameters())
        unknown = [n for n in weights if n not in params]
        if unknown:
            raise ValueError(f"{path}: weights do not fit the rollout model (unexpected {unknown[:3]})")
        with torch.no_grad():
            for n, w in weights.items():
                params[n].copy_(w)
        return len(weights)

    def load_checkpoint(self, path: str) -> int:
        """Load a checkpoint's trained weights (opd/checkpoint.py layout); returns its step."""
        return int(load_checkpoint(path, model=self.model, restore_rng=False)["step"])


class RolloutPool:
    def __init__(self, workers: list):
        self.workers = workers

    @classmethod
    def start(cls, model_dir: str, num_workers: int, *, num_cpus_per_worker: float = 1.0,
              num_gpus_per_worker: float = 0.0, batch_size: int = 64, dtype: str = "float32") -> "RolloutPool":
        """Start the actors (asynchronously: the first call waits for them to load)."""
        import ray

        actor_cls = ray.remote(RolloutWorker)
        device = "cuda" if num_gpus_per_worker > 0 else "cpu"
        return cls([actor_cls.options(num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker).remote(
            str(model_dir), threads=max(1, int(num_cpus_per_worker)), batch_size=batch_size, device=device,
            dtype=dtype)
            for _ in range(num_workers)])

    def _gather(self, refs: list) -> list:
        import ray
        from ray.exceptions import RayActorError

        out = []
        for rank, ref in enumerate(refs):
            try:
                out.append(ray.get(ref))
            except RayActorError as e:
                raise RolloutWorkerDiedError(f"rollout worker {rank} of {len(self.workers)} died "
                                             f"({type(e).__name__})") from e
        return out

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        """n samples per prompt, grouped by prompt, as RolloutEngine.generate."""
        if not prompts:
            return []
        n = min(len(self.workers), len(prompts))
        bounds = [len(prompts) * i // n for i in range(n + 1)]
        refs = []
        for rank in range(n):
            # Not seed + rank: the next step's seed (+1) would replay this step's shards one worker over.
            p = params if params.seed is None else dataclasses.replace(params, seed=prompt_seed(params.seed, rank))
            refs.append(self.workers[rank].generate.remote(prompts[bounds[rank]:bounds[rank + 1]], p))
        out: list[Rollout] = []
        for rank, shard in enumerate(self._gather(refs)):
            for r in shard:
                r.prompt_index += bounds[rank]
            out.extend(shard)
        return out

    def sync_weights(self, checkpoint_dir: str) -> int:
        """Every worker loads `checkpoint_dir` (returns its step) or a `.safetensors` weights file
        (returns the number of tensors). Only the path travels through Ray."""
        path = str(checkpoint_dir)
        if path.endswith(".safetensors"):
            return self._gather([w.load_weights.remote(path) for w in self.workers])[0]
        steps = self._gather([w.load_checkpoint.remote(path) for w in self.workers])
        return steps[0]

    def samples_generated(self) -> list[int]:
        """Samples each worker has produced so far, by rank."""
        return self._gather([w.samples_generated.remote() for w in self.workers])

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []


class PoolEngine(RolloutEngine):
    """A RolloutEngine over a RolloutPool: `sync_weights(model)` writes the model's trainable
    weights to `weights_path` (atomically) and has every actor load that file."""

    def __init__(self, pool: RolloutPool, weights_path: str | Path):
        self.pool = pool
        self.weights_path = Path(weights_path)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        return self.pool.generate(prompts, params)

    def sync_weights(self, model) -> None:
        self.weights_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.weights_path.with_name(f"{self.weights_path.stem}.tmp-{os.getpid()}.safetensors")
        save_file({n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad},
                  str(tmp))
        os.replace(tmp, self.weights_path)   # an actor never reads a half-written file
        self.pool.sync_weights(str(self.weights_path))

    def close(self) -> None:
        self.pool.shutdown()
