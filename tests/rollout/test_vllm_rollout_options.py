"""VLLMRolloutEngine's placement options: what `vllm.LLM` receives (no engine starts: vllm.LLM
is faked). The real tensor-parallel engine: test_vllm_rollout_tensor_parallel.py (slow)."""

from __future__ import annotations

import pytest

from opd.rollout.vllm import VLLMRolloutEngine

vllm = pytest.importorskip("vllm")


def build(**kwargs) -> None:
    VLLMRolloutEngine("unused-model-dir", **kwargs).close()


def test_defaults_are_one_rank_eager_on_cpu_and_vllms_memory_share(llm_calls):
    build()
    kw = llm_calls[-1]
    assert (kw["tensor_parallel_size"], kw["enforce_eager"]) == (1, True)   # this machine: the CPU build
    assert "gpu_memory_utilization" not in kw


def test_the_options_reach_the_engine(llm_calls, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    build(tensor_parallel_size=2, gpu_memory_utilization=0.3, enforce_eager=False, lora={"rank": 8})
    kw = llm_calls[-1]
    assert (kw["tensor_parallel_size"], kw["gpu_memory_utilization"], kw["enforce_eager"]) == (2, 0.3, False)
    assert kw["enable_lora"] is True


def test_cuda_gets_cuda_graphs_by_default(llm_calls, monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    build(tensor_parallel_size=8)
    assert (llm_calls[-1]["enforce_eager"], llm_calls[-1]["tensor_parallel_size"]) == (False, 8)


def test_more_cpu_ranks_than_numa_nodes_is_refused_before_the_engine(llm_calls, one_numa_node):
    with pytest.raises(ValueError, match="this machine has 1.*VLLM_CPU_OMP_THREADS_BIND, one CPU list per rank"):
        build(tensor_parallel_size=2)
    assert llm_calls == []
