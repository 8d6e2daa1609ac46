"""Several processes training one model: torchrun's ranks, FSDP2 shards, the collectives a loop needs.

    init_world(device)     the World this process is in: under torchrun it joins the process
                           group (NCCL on CUDA, gloo on CPU) on cuda:LOCAL_RANK or the CPU and
                           the model is sharded; otherwise a world of one, unsharded, with no
                           process group and no collective ever called
    shard_model(model)     FSDP2 (`fully_shard`) on every decoder layer, then on the root;
                           gradients are SUMMED across ranks, so a loss whose terms are
                           normalized over every rank's tokens gives one process's gradient
    ranks_for(n, argv)     the World of a command asked to run on n ranks: torchrun's (or Ray's,
                           opd.cluster.ranks) when it started us, else `launch` (or Ray's
                           launcher) starts them and returns None
    launch(argv, n)        run `python -m opd.cli ARGV` on n local ranks with torchrun's
                           launcher; a rank that dies stops the others, and the error names it
    World.sum / gather / broadcast / all_true
                           the few collectives the loops use, each a no-op in a world of one

A world of one is the single-process code path of before, unchanged: every helper returns
its input. Everything that must be the same on every rank (the data a step draws, the
multipliers of the domains, whether to stop sampling) is computed the same way on every rank
or broadcast from rank 0; only rank 0 writes the run directory's files.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from opd.lm_head import parts
from opd.spine.optim import TrainError


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    sharded: bool = False    # started by torchrun: the model is sharded, even over one rank

    @property
    def main(self) -> bool:
        return self.rank == 0

    def shard(self, items: list) -> list:
        """This rank's contiguous share of `items` (the loops check that it divides evenly)."""
        if self.size == 1:
            return items
        n = len(items) // self.size
        return items[self.rank * n:(self.rank + 1) * n]

    def padded_share(self, items: list) -> tuple[list, int]:
        """(this rank's share, how many of it are real) of `items` that need not divide evenly
        (held-out prompts): ceil(len / size) each, the last share padded with repeats of the last
        item so that every rank runs as many forwards (a sharded model's are collectives); the
        repeats are to be left out of every metric."""
        share = -(-len(items) // self.size)
        padded = items + items[-1:] * (share * self.size - len(items))
        return padded[self.rank * share:(self.rank + 1) * share], max(0, min(share, len(items) - self.rank * share))

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """{key: value summed over the ranks}; every rank gets the union of the keys."""
        if self.size == 1:
            return dict(values)
        out: dict[str, float] = {}
        for part in self.gather(values):
            for k, v in part.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank (small, picklable things only)."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank: a loop that calls the sharded model stops only
        when all ranks stop, since each forward pass is a collective."""
        if self.size == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    @property
    def comm_device(self) -> torch.device:
        return self.device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")

    def main_first(self, fn):
        """fn() on rank 0, its result (or its error, raised again) on every rank: a check that
        reads or changes the run directory is made once, and no rank is left waiting for a
        collective that a failed rank 0 will never join."""
        if self.size == 1:
            return fn()
        result = error = None
        if self.main:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - handed to every rank
                error = e
        result, error = self.broadcast((result, error))
        if error is not None:
            raise error
        return result


def init_world(device: str = "auto", backend: str = "auto", timeout_s: float = 300.0) -> World:
    """The world of this process. Under torchrun (even with one rank: the FSDP2 path on one GPU)
    the device is cuda:LOCAL_RANK when CUDA is there and `device` does not say cpu, the backend
    NCCL there and gloo on the CPU (`backend` to choose); a collective that waits longer than
    timeout_s fails. Without torchrun: a world of one, unsharded (the loops resolve `device`
    themselves)."""
    if "RANK" not in os.environ:   # not started by torchrun (or as a rank on Ray, the same variables)
        return World()
    size, rank, local = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and not device.startswith("cpu")
    if cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group(backend if backend != "auto" else "nccl" if cuda else "gloo",
                                timeout=timedelta(seconds=timeout_s))
    return World(rank, size, local, torch.device(f"cuda:{local}") if cuda else torch.device("cpu"), sharded=True)


def ranks_for(num_workers: int, argv: list[str], device: str = "auto", backend: str = "auto",
              timeout_s: float = 300.0, launcher=None) -> World | None:
    """The World a command runs in. Started by torchrun or as a rank on Ray (WORLD_SIZE set), it
    is that launcher's: its size must be num_workers unless that is 1 (the default). Otherwise,
    with num_workers > 1, this process starts `opd ARGV` on num_workers ranks with `launcher`
    (argv, n) (opd.cluster.ranks: Ray actors) or, when it is None, torchrun's (`launch`), and
    returns None once they are done: the caller has nothing left to do."""
    size = int(os.environ.get("WORLD_SIZE", "0"))
    if not size and num_workers > 1:
        (launcher or launch)(argv, num_workers)
        return None
    if size and num_workers > 1 and size != num_workers:
        raise TrainError(f"torchrun started {size} ranks, the config asks for {num_workers} "
                         f"(num_workers): make them agree, or leave num_workers at 1 under torchrun")
    return init_world(device, backend, timeout_s)


def close_world() -> None:
    """Leave the process group at the end of a command (no-op in a world of one). Called from a
    `finally`: when the command ended normally every rank first meets the others, so no rank
    tears its group down while another's last collective is in flight (gloo's worker threads
    then hold work that is destroyed with the interpreter: SIGABRT, "terminate called without
    an active exception", after a run that had finished). After an error nobody waits: a rank
    that died would hold the others for the collective timeout."""
    if not dist.is_initialized():
        return
    if sys.exc_info()[0] is None and dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


def shard_model(model: torch.nn.Module, world: World, *, mixed_precision: bool = False,
                cpu_offload: bool = False, meta: bool = False) -> torch.nn.Module:
    """`model` sharded over the world with FSDP2: one group per decoder layer (its parameters are
    gathered for that layer's forward and backward only), then the root (embeddings, final norm,
    LM head). Each rank keeps its shard of its own copy, so the copies must be equal: loaded from
    one directory, and anything random (a LoRA adapter's init) drawn after the same seed. mixed_precision: compute in bf16, reduce gradients in fp32, keep the fp32 shards as
    the optimizer's master weights (GPUs). cpu_offload: shards and their optimizer state in CPU
    memory. Gradients are summed, not averaged, across ranks (see the module docstring). meta:
    the model was built on the meta device; its shards are allocated (uninitialised) on the
    rank's device, for weights that arrive by broadcast (shards.broadcast_from_rank0)."""
    if not meta:
        model.to(world.device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
        else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    body, _ = parts(model)
    for layer in body.layers:
        fully_shard(layer, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # SUM with no division: gloo has no pre-multiplied sum, and a sum is what a loss
            # normalized over all ranks' tokens needs.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    if meta:
        # to_empty reallocates buffers too: the ones computed at build time (load_shards.params_on_meta
        # keeps RoPE's inverse frequencies real) are put back.
        kept = {n: b.detach().clone() for n, b in model.named_buffers() if not b.is_meta}
        model.to_empty(device="cpu" if cpu_offload else world.device)
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in kept:
                    b.copy_(kept[n])
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules())


def memory_per_rank(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds of the weights, of their gradients (the trainable weights' shards:
    a gradient shard has its weight shard's shape) and of the optimizer's state: with FSDP2 about
    1/N of one process's for N ranks. For the training card."""
    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list(model.parameters())
    state = [v for s in (optimizer.state.values() if optimizer is not None else []) for v in s.values()
             if isinstance(v, torch.Tensor)]
    return {"weights": sum(local(p) for p in params), "gradients": sum(local(p) for p in params if p.requires_grad),
            "optimizer_state": sum(local(v) for v in state)}


def launch(argv: list[str], nproc: int) -> int:
    """`python -m opd.cli ARGV` on `nproc` ranks of this machine (torchrun's elastic launcher,
    standalone rendezvous, no restarts). Returns 0, or raises TrainError naming the first rank
    that failed and how; the launcher has then stopped the others."""
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.5,
                          start_method="spawn")
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "opd.cli", *argv)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        how = (f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
               else f"exit code {code}")
        raise TrainError(f"rank {rank} of {nproc} failed ({how}); the other ranks were stopped. Its output is above; "
                         f"--resume continues from the last checkpoint") from None
    return 0
