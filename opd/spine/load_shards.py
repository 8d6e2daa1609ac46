"""A model directory read straight into each rank's FSDP2 shards, one tensor at a time.

    with params_on_meta():   model = AutoModelForCausalLM.from_config(...)   # no weight storage
    shard_model(model, world, meta=True)                                    # each rank's shards, empty
    stream_weights(model, files, world, dtype)                              # rank 0 reads, ranks get slices

Without it every rank, or rank 0 alone, first holds the whole model in host memory: 8 ranks x
an 8B model in fp32 is 256 GB on one node, and even rank 0 alone holds the whole copy beside
its shards. Here rank 0 reads one tensor from the safetensors files (memory-mapped), cuts it
into the ranks' row slices as FSDP2 shards it (dim 0, torch.chunk's sizes), and scatters
them: a rank holds its 1/N of the model plus one slice in flight, rank 0 one whole tensor
more. Buffers that are not weights (RoPE's inverse frequencies) are computed by each rank as
the model is built, so nothing else crosses.
"""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Shard

from opd.spine.dist import World


@contextmanager
def params_on_meta():
    """Parameters created inside go to the meta device as they are registered; buffers stay
    real. transformers' own meta context (torch.device("meta")) takes the buffers too, and a
    RoPE's inverse frequencies are then lost. nn.Linear's torch.empty before the move is never
    written, so it costs address space, not memory; its init runs on the meta copy (free)."""
    register = torch.nn.Module.register_parameter

    def to_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = to_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def weight_files(path: str | Path) -> dict[str, Path] | None:
    """{tensor name: the safetensors file holding it} of a model directory (one file, or an
    index's shards), or None when it has none (a .bin checkpoint, a GGUF file)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {k: single for k in f.keys()}
    return None


def file_keys(model: torch.nn.Module, files: dict[str, Path]) -> dict[str, str] | None:
    """{state-dict name: the file's tensor name} for every distinct tensor of `model`, or None
    when the files lack one (renamed keys, a weight the checkpoint leaves to the model's init):
    the caller then loads the directory the way transformers does. Tied weights (one tensor
    under two names) need one of their names in the files."""
    state = model.state_dict(keep_vars=True)
    names: dict[int, list[str]] = {}
    for name, t in state.items():
        names.setdefault(id(t), []).append(name)
    out = {}
    for group in names.values():
        found = [n for n in group if n in files]
        if not found:
            return None
        out.update({n: found[0] for n in group})
    return out


def stream_weights(model: torch.nn.Module, files: dict[str, Path], keys: dict[str, str], world: World,
                   dtype: torch.dtype) -> None:
    """Fill every rank's shards of `model` (sharded from the meta device: allocated, not
    written) from the files; rank 0 reads, one tensor at a time, cast to `dtype`. A
    collective: every rank calls it with the same model and keys."""
    def read(name: str) -> torch.Tensor:
        # The file is opened for each tensor: a mapping held open keeps every page read so far
        # resident (a whole model's worth by the end, counted in the process's RSS).
        with safe_open(str(files[keys[name]]), framework="pt") as f:
            return f.get_tensor(keys[name]).to(dtype)

    state = model.state_dict(keep_vars=True)
    _check_shapes(state, files, keys, world)
    done: set[int] = set()
    with torch.no_grad():
        for name, target in state.items():
            if id(target) in done:       # a tied weight, filled under its first name
                continue
            done.add(id(target))
            full = read(name) if world.main else None
            if isinstance(target, DTensor):
                _scatter_rows(full, target, world, name)
            else:
                _broadcast(full, target, world)


def _check_shapes(state: dict, files: dict[str, Path], keys: dict[str, str], world: World) -> None:
    """Rank 0 compares each tensor's shape in the files' headers (nothing is read) with the
    model's; every rank raises the same refusal, naming both shapes. Raised on rank 0 alone
    it left the other ranks waiting in the tensor's scatter or broadcast."""
    error = None
    if world.main:
        with ExitStack() as stack:
            opened = {}
            for name, target in state.items():
                path = files[keys[name]]
                if path not in opened:
                    opened[path] = stack.enter_context(safe_open(str(path), framework="pt"))
                shape = tuple(opened[path].get_slice(keys[name]).get_shape())
                if shape != tuple(target.shape):
                    error = f"{name}: the file holds {shape}, the model {tuple(target.shape)}"
                    break
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ValueError(box[0])


def _scatter_rows(full: torch.Tensor | None, target: DTensor, world: World, name: str) -> None:
    """Rank r's rows of `full` (rank 0's) into its local shard of `target`: FSDP2 shards dim 0
    as torch.chunk does (ceil(rows / N) each, the last ranks' shorter or empty). Scatter wants
    equal sizes, so each slice travels padded to that size [chunk, *rest]."""
    if target.placements != (Shard(0),):
        raise ValueError(f"{name}: sharded as {target.placements}, not Shard(0) as FSDP2 shards a weight")
    n = dist.get_world_size()
    rows, rest = target.shape[0], tuple(target.shape[1:])
    chunk = -(-rows // n)
    local = target.to_local()
    mine = max(0, min(chunk, rows - world.rank * chunk))
    if local.shape[0] != mine:
        raise ValueError(f"{name}: rank {world.rank} holds {local.shape[0]} rows, expected {mine} of {rows}")
    device = world.device
    out = torch.empty((chunk, *rest), dtype=local.dtype, device=device)
    pieces = None
    if world.main:   # full's shape is the model's (_check_shapes)
        pieces = []
        for r in range(n):
            piece = full[r * chunk:(r + 1) * chunk]
            if piece.shape[0] < chunk:
                piece = torch.cat([piece, piece.new_zeros((chunk - piece.shape[0], *rest))])
            pieces.append(piece.to(device=device, dtype=local.dtype).contiguous())
    dist.scatter(out, pieces, src=0)
    local.copy_(out[:mine])


def _broadcast(full: torch.Tensor | None, target: torch.Tensor, world: World) -> None:
    """A tensor every rank holds whole (a buffer kept in the state dict)."""
    buf = full.to(world.device) if world.main else torch.empty(target.shape, dtype=target.dtype, device=world.device)
    dist.broadcast(buf, src=0)
    target.copy_(buf)
