"""Rollout engines as Ray actors: student sampling spread over workers.

Each `RolloutWorker` actor holds its own copy of the student and an `HFRolloutEngine`
(opd/rollout/hf.py). A `RolloutPool` splits a batch of prompts into contiguous shards,
one per worker, and concatenates the answers in prompt order, so `generate` returns what
one engine would (exactly so when greedy; with sampling each worker draws from its own
seed, `seed + rank`).

On-policy weights: after a training step rank 0 writes a checkpoint (opd/cluster_dp.py);
`sync_weights(checkpoint_dir)` makes every worker load its `trainable.safetensors`. The
weights travel by file (a shared filesystem across nodes), not through Ray's object store.
"""

from __future__ import annotations

import dataclasses

from opd.rollout.base import Rollout, SamplingParams


class RolloutWorkerDiedError(RuntimeError):
    pass


class RolloutWorker:
    """One rollout engine (used as a Ray actor)."""

    def __init__(self, model_dir: str, *, threads: int = 1, batch_size: int = 64, device: str = "cpu"):
        import torch
        from transformers import AutoTokenizer

        from opd.cluster_dp import load_student
        from opd.rollout.hf import HFRolloutEngine

        torch.set_num_threads(max(1, threads))
        self.model = load_student(model_dir, device).eval()
        self.engine = HFRolloutEngine(self.model, AutoTokenizer.from_pretrained(str(model_dir)), batch_size=batch_size)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        return self.engine.generate(prompts, params)

    def load_checkpoint(self, path: str) -> int:
        """Load a checkpoint's trained weights (opd/checkpoint.py layout); returns its step."""
        from opd.checkpoint import load_checkpoint

        return int(load_checkpoint(path, model=self.model, restore_rng=False)["step"])


class RolloutPool:
    def __init__(self, workers: list):
        self.workers = workers

    @classmethod
    def start(cls, model_dir: str, num_workers: int, *, num_cpus_per_worker: float = 1.0,
              num_gpus_per_worker: float = 0.0, batch_size: int = 64) -> "RolloutPool":
        """Start the actors (asynchronously: the first call waits for them to load)."""
        import ray

        actor_cls = ray.remote(RolloutWorker)
        device = "cuda" if num_gpus_per_worker > 0 else "cpu"
        return cls([actor_cls.options(num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker).remote(
            str(model_dir), threads=max(1, int(num_cpus_per_worker)), batch_size=batch_size, device=device)
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
        n = min(len(self.workers), len(prompts))
        bounds = [len(prompts) * i // n for i in range(n + 1)]
        refs = []
        for rank in range(n):
            p = params if params.seed is None else dataclasses.replace(params, seed=params.seed + rank)
            refs.append(self.workers[rank].generate.remote(prompts[bounds[rank]:bounds[rank + 1]], p))
        out: list[Rollout] = []
        for rank, shard in enumerate(self._gather(refs)):
            for r in shard:
                r.prompt_index += bounds[rank]
            out.extend(shard)
        return out

    def sync_weights(self, checkpoint_dir: str) -> int:
        """Every worker loads `checkpoint_dir`; returns the checkpoint's step."""
        steps = self._gather([w.load_checkpoint.remote(str(checkpoint_dir)) for w in self.workers])
        return steps[0]

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
