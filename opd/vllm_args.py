"""The `vllm.LLM` arguments both vLLM engines share: the teacher backend (teachers/vllm_backend.py)
and the rollout engine (opd/rollout/vllm.py).

    engine_options(tensor_parallel_size, gpu_memory_utilization, enforce_eager)
        tensor parallelism as asked, eager only on the CPU build unless asked (CUDA graphs on
        GPUs), vLLM's own memory share unless one is given
    cpu_binding_problem(tensor_parallel_size)
        why the CPU build would die starting that many ranks here, or None

vLLM is imported inside the functions: it is optional and takes seconds to import.
"""

from __future__ import annotations

import os


def engine_options(tensor_parallel_size: int = 1, gpu_memory_utilization: float | None = None,
                   enforce_eager: bool | None = None) -> dict:
    """The `vllm.LLM` arguments of these three settings; ValueError for a tensor-parallel size
    the CPU build cannot start (`cpu_binding_problem`)."""
    from vllm.platforms import current_platform

    if enforce_eager is None:
        # The CPU build has no CUDA graphs, and without eager it compiles the model with
        # torch.compile (inductor) at every start; on CUDA, graphs are what makes decoding fast.
        enforce_eager = current_platform.is_cpu()
    problem = cpu_binding_problem(tensor_parallel_size)
    if problem:
        raise ValueError(problem)
    out = dict(tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager)
    if gpu_memory_utilization is not None:
        out["gpu_memory_utilization"] = gpu_memory_utilization
    return out


def cpu_binding_problem(tensor_parallel_size: int) -> str | None:
    """Why vLLM's CPU build cannot start `tensor_parallel_size` ranks here, else None. Its
    default thread binding (VLLM_CPU_OMP_THREADS_BIND=auto) gives every rank a NUMA node of its
    own and asserts otherwise, inside the engine process (vllm/utils/ompmultiprocessing.py),
    which the caller sees only as "Engine core initialization failed". With ranks bound by hand
    tensor parallelism runs on the CPU build (over gloo), so only this case is refused."""
    from vllm.platforms import current_platform

    if (tensor_parallel_size <= 1 or not current_platform.is_cpu()
            or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto"
            or os.environ.get("VLLM_CPU_SIM_MULTI_NUMA", "0") != "0"):
        return None
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    nodes = len(get_visible_memory_node())
    if nodes >= tensor_parallel_size:
        return None
    return (f"tensor parallel size {tensor_parallel_size} on vLLM's CPU build: its default thread binding puts "
            f"each rank on a NUMA node of its own and this machine has {nodes}; bind the ranks yourself with "
            f"VLLM_CPU_OMP_THREADS_BIND, one CPU list per rank (e.g. '0-7|8-15' for 2 ranks), or lower the "
            f"tensor parallel size")
