"""Data-parallel student training: one Ray actor per worker, torch.distributed between them.

Each worker holds a full copy of the student and the optimizer, and gets a shard of the
batch. Gradient averaging matches one process with the whole batch exactly:

    loss_w   = (sum of worker w's token losses) / (tokens of ALL workers)
    grad     = all_reduce_sum(grad of loss_w)          (one flat bucket per step)
             = grad of (sum of all token losses / all tokens)

so the mean is over the combined batch, not a mean of per-worker means (which would weigh
a short shard like a long one). The token count itself is all-reduced first, so workers
need not know each other's shards. gloo on CPU, NCCL on GPU.

Only rank 0 writes checkpoints (opd/checkpoint.py, atomic). A worker that dies stops the
job: `DataParallelGroup.step` raises `WorkerDiedError` naming the rank, kills the others
(which would otherwise wait in all_reduce until the collective timeout) and leaves the
last complete checkpoint as it was.

Batches (token ids, a few KB) go through Ray's object store; nothing larger does.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Callable

import torch

from opd.cluster import StudentWorkers
from opd.distill import padded_cross_entropy

LossFn = Callable[[torch.nn.Module, dict], "tuple[torch.Tensor, torch.Tensor]"]


class WorkerDiedError(RuntimeError):
    """A data-parallel worker died; the job cannot continue without it."""

    def __init__(self, rank: int, world_size: int, cause: str, last_checkpoint):
        self.rank = rank
        self.last_checkpoint = last_checkpoint
        super().__init__(f"data-parallel worker rank {rank} of {world_size} died ({cause}); the job stops. "
                         f"Last good checkpoint: {last_checkpoint or 'none written yet'}")


def token_loss_sum(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy summed over tokens whose label is not -100, and their count.

    batch: input_ids int64 [B, L], labels int64 [B, L] (-100: not trained),
    optional attention_mask [B, L] (right padding).
    """
    loss_sum = padded_cross_entropy(model, batch["input_ids"], batch["labels"], batch.get("attention_mask"), "sum")
    return loss_sum, (batch["labels"][:, 1:] != -100).sum()


def split_batch(batch: dict, n: int) -> list[dict]:
    """Split a batch of [B, ...] tensors into n shards along B (sizes differ by at most 1)."""
    size = next(iter(batch.values())).shape[0]
    if size < n:
        raise ValueError(f"batch of {size} sequences cannot feed {n} workers")
    bounds = [size * i // n for i in range(n + 1)]
    return [{k: v[bounds[i]:bounds[i + 1]] for k, v in batch.items()} for i in range(n)]


def make_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float):
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {name!r}")


def load_student(model_dir: str, device: str = "cpu", dtype: str = "float32") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    return model.to(device).train()


def local_step(model, optimizer, batch: dict, loss_fn: LossFn = token_loss_sum) -> float:
    """The single-process step the data-parallel step must equal: mean loss over `batch`."""
    loss_sum, count = loss_fn(model, batch)
    (loss_sum / count.clamp(min=1)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss_sum.detach() / count.clamp(min=1))


class DPWorker:
    """One data-parallel rank (used as a Ray actor; plain class so it can be tested alone)."""

    def __init__(self, rank: int, world_size: int, model_dir: str, *, backend: str = "gloo",
                 optimizer: str = "sgd", lr: float = 1e-3, weight_decay: float = 0.0,
                 loss_fn: LossFn = token_loss_sum, threads: int = 1):
        torch.set_num_threads(max(1, threads))
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = "cuda" if backend == "nccl" else "cpu"
        self.model = load_student(model_dir, self.device)
        self.optimizer = make_optimizer(self.model, optimizer, lr, weight_decay)
        self.loss_fn = loss_fn

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0: an address on its node where the others can reach the process group store."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def init_process_group(self, host: str, port: int, timeout_s: float) -> int:
        import torch.distributed as dist

        dist.init_process_group(self.backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.world_size, timeout=datetime.timedelta(seconds=timeout_s))
        return os.getpid()

    def step(self, batch: dict) -> tuple[float, int]:
        """Forward + backward on this rank's shard, all-reduce gradients, optimizer step.

        Returns (this shard's summed loss, this shard's token count).
        """
        import torch.distributed as dist

        batch = {k: v.to(self.device) for k, v in batch.items()}
        loss_sum, count = self.loss_fn(self.model, batch)
        total = count.detach().to(torch.float32).clone()
        dist.all_reduce(total)                       # tokens of the combined batch
        (loss_sum / total.clamp(min=1)).backward()
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)                        # sum of the parts = grad of the global mean
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(p).clone()
            offset += g.numel()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss_sum.detach()), int(count)

    def save_checkpoint(self, root: str, step: int, state: dict | None = None) -> str | None:
        from opd.checkpoint import save_checkpoint

        if self.rank != 0:
            return None
        return str(save_checkpoint(root, step, model=self.model, optimizer=self.optimizer, state=state))

    def load_checkpoint(self, path: str) -> dict:
        from opd.checkpoint import load_checkpoint

        return load_checkpoint(path, model=self.model, optimizer=self.optimizer, restore_rng=False)

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in self.model.named_parameters()}

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class StepResult:
    loss: float        # mean token loss over the combined batch (before the update)
    tokens: int


class DataParallelGroup:
    """N DPWorker actors in one placement group; the driver hands out shards and steps them."""

    def __init__(self, workers: list, placement_group, world_size: int):
        self.workers = workers
        self.placement_group = placement_group
        self.world_size = world_size
        self.last_checkpoint: str | None = None

    @classmethod
    def start(cls, model_dir: str, spec: StudentWorkers, *, optimizer: str = "sgd", lr: float = 1e-3,
              weight_decay: float = 0.0, loss_fn: LossFn = token_loss_sum,
              ready_timeout_s: float = 300.0) -> "DataParallelGroup":
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n = spec.num_workers
        backend = spec.backend if spec.backend != "auto" else ("nccl" if spec.num_gpus_per_worker > 0 else "gloo")
        bundle = {k: v for k, v in {"CPU": spec.num_cpus_per_worker, "GPU": spec.num_gpus_per_worker}.items() if v}
        pg = None
        if bundle:  # Ray refuses bundles of zeros; without reservations the workers float
            pg = placement_group([dict(bundle)] * n, strategy=spec.strategy)
            ready, _ = ray.wait([pg.ready()], timeout=ready_timeout_s)
            if not ready:
                ray.util.remove_placement_group(pg)
                raise TimeoutError(f"the cluster could not reserve {n} x {bundle} for the student workers within "
                                   f"{ready_timeout_s:.0f}s; lower cluster.student.num_workers or its resources")
        actor_cls = ray.remote(DPWorker)
        workers = []
        for rank in range(n):
            opts = {"num_cpus": spec.num_cpus_per_worker, "num_gpus": spec.num_gpus_per_worker, "max_restarts": 0}
            if pg is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
            workers.append(actor_cls.options(**opts).remote(
                rank, n, str(model_dir), backend=backend, optimizer=optimizer, lr=lr, weight_decay=weight_decay,
                loss_fn=loss_fn, threads=max(1, int(spec.num_cpus_per_worker))))
        self = cls(workers, pg, n)
        try:   # a failed rendezvous (its port taken meanwhile, a worker that cannot load) frees the group
            host, port = self._gather([workers[0].rendezvous_address.remote()])[0]
            self._gather([w.init_process_group.remote(host, port, spec.collective_timeout_s) for w in workers])
        except BaseException:
            self.shutdown()
            raise
        return self

    def _gather(self, refs: list, ranks: list[int] | None = None) -> list:
        """ray.get that turns a dead actor into WorkerDiedError. Any failure stops the other
        workers at once: they would wait in an all_reduce for collective_timeout_s otherwise.
        An error raised in a worker (RayTaskError: out of memory, a bad batch) is re-raised as
        it is, unless another worker died meanwhile: a dead peer makes the others' collectives
        fail too, and the death is the cause."""
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

        dead = (RayActorError, ActorDiedError, ActorUnavailableError)
        rank_of = dict(zip(refs, ranks if ranks is not None else range(len(refs))))
        pending, results = list(refs), {}
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                results[ready[0]] = ray.get(ready[0])
            except dead as e:
                self.shutdown()
                raise WorkerDiedError(rank_of[ready[0]], self.world_size, type(e).__name__, self.last_checkpoint) from e
            except RayTaskError:
                # A death among the others explains this error better; Ray reports one in seconds.
                done, _ = ray.wait(pending, num_returns=len(pending), timeout=5) if pending else ([], [])
                for ref in done:
                    try:
                        ray.get(ref)
                    except dead as d:
                        self.shutdown()
                        raise WorkerDiedError(rank_of[ref], self.world_size, type(d).__name__,
                                              self.last_checkpoint) from d
                    except Exception:  # noqa: BLE001 - the first error is the one raised
                        pass
                self.shutdown()
                raise
        return [results[r] for r in refs]

    def step(self, shards: list[dict]) -> StepResult:
        if len(shards) != self.world_size:
            raise ValueError(f"{len(shards)} shards for {self.world_size} workers; use split_batch(batch, n)")
        out = self._gather([w.step.remote(s) for w, s in zip(self.workers, shards)])
        tokens = sum(c for _, c in out)
        return StepResult(loss=sum(l for l, _ in out) / max(tokens, 1), tokens=tokens)

    def save_checkpoint(self, root: str, step: int, state: dict | None = None) -> str:
        path = self._gather([self.workers[0].save_checkpoint.remote(str(root), step, state)])[0]
        self.last_checkpoint = path
        return path

    def load_checkpoint(self, path: str) -> dict:
        return self._gather([w.load_checkpoint.remote(str(path)) for w in self.workers])[0]

    def weights(self, rank: int = 0) -> dict[str, torch.Tensor]:
        return self._gather([self.workers[rank].weights.remote()], [rank])[0]

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
