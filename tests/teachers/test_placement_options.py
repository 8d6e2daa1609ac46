"""Placement options of the teachers: what `vllm.LLM` and `from_pretrained` receive for each
`opd serve-teacher` flag, and the combinations refused (no engine starts: vllm.LLM is faked)."""

from __future__ import annotations

import argparse

import pytest
import torch

from opd.teachers import serve
from opd.teachers.hf_backend import HFBackend

vllm = pytest.importorskip("vllm")


def on_cuda(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(["--model", "unused", *argv])


def serve_vllm(model_dir, *flags: str):
    args = parse("--backend", "vllm", *flags)
    args.model = str(model_dir)
    assert serve.check_backend_args(args) is None
    return serve.load_backend(args)


def test_vllm_defaults_are_one_rank_eager_on_cpu_and_vllms_memory_share(vllm_model_dir, llm_calls):
    serve_vllm(vllm_model_dir)
    kw = llm_calls[-1]
    assert kw["tensor_parallel_size"] == 1
    assert kw["enforce_eager"] is True                 # this machine: vLLM's CPU build
    assert "gpu_memory_utilization" not in kw           # vLLM's own default


def test_each_vllm_flag_reaches_the_engine(vllm_model_dir, llm_calls, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")   # ranks bound by hand: nothing to refuse
    serve_vllm(vllm_model_dir, "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.5", "--no-enforce-eager")
    kw = llm_calls[-1]
    assert (kw["tensor_parallel_size"], kw["gpu_memory_utilization"], kw["enforce_eager"]) == (2, 0.5, False)
    serve_vllm(vllm_model_dir, "--enforce-eager")
    assert llm_calls[-1]["enforce_eager"] is True


def test_cuda_gets_cuda_graphs_unless_eager_is_asked(vllm_model_dir, llm_calls, monkeypatch, one_numa_node):
    on_cuda(monkeypatch)
    serve_vllm(vllm_model_dir, "--tensor-parallel-size", "4")   # the NUMA rule is the CPU build's only
    assert (llm_calls[-1]["enforce_eager"], llm_calls[-1]["tensor_parallel_size"]) == (False, 4)
    serve_vllm(vllm_model_dir, "--enforce-eager")
    assert llm_calls[-1]["enforce_eager"] is True


def test_more_cpu_ranks_than_numa_nodes_is_refused_before_the_engine(vllm_model_dir, llm_calls, one_numa_node,
                                                                      monkeypatch):
    from opd.teachers.vllm_backend import VLLMBackend

    with pytest.raises(ValueError, match="NUMA node of its own and this machine has 1.*VLLM_CPU_OMP_THREADS_BIND"):
        VLLMBackend(vllm_model_dir, tensor_parallel_size=2)
    assert llm_calls == []
    args = parse("--backend", "vllm", "--tensor-parallel-size", "2")
    assert "VLLM_CPU_OMP_THREADS_BIND" in serve.check_backend_args(args)
    import vllm.utils.cpu_resource_utils as cr

    monkeypatch.setattr(cr, "get_visible_memory_node", lambda: [0, 1])
    VLLMBackend(vllm_model_dir, tensor_parallel_size=2)          # a node per rank: passed through
    assert llm_calls[-1]["tensor_parallel_size"] == 2


@pytest.mark.parametrize("flags, needle", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size: for the vllm backend only; the hf backend spreads"),
    (["--gpu-memory-utilization", "0.5", "--enforce-eager"], "--gpu-memory-utilization, --enforce-eager: for the vllm backend only"),
    (["--no-enforce-eager"], "--enforce-eager: for the vllm backend only"),
    (["--device-map", "auto"], "--device-map auto spreads the model over GPUs: pass --device cuda"),
    (["--backend", "vllm", "--device-map", "auto"], "--device-map: an hf backend option; vLLM places the model "
                                                    "itself, over several GPUs with --tensor-parallel-size N"),
])
def test_placement_flags_that_do_not_fit_the_backend_are_refused(flags, needle, capsys):
    args = parse(*flags)
    assert needle in serve.check_backend_args(args)
    assert serve.run(args) == 2                                  # before any model load
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--gpu-memory-utilization", "0"], ["--gpu-memory-utilization", "1.5"],
                                   ["--tensor-parallel-size", "0"], ["--device-map", "everywhere"]])
def test_out_of_range_values_are_parse_errors(flags, capsys):
    with pytest.raises(SystemExit):
        parse(*flags)
    assert flags[0] in capsys.readouterr().err


def test_help_lists_the_placement_flags():
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    text = " ".join(p.format_help().split())
    for flag in ("--tensor-parallel-size", "--gpu-memory-utilization", "--enforce-eager", "--no-enforce-eager",
                 "--device-map"):
        assert flag in text
    assert "auto,balanced,balanced_low_0,sequential" in text


def test_hf_device_map_reaches_from_pretrained(tiny_teacher_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    load, seen = AutoModelForCausalLM.from_pretrained, []

    def recording(path, **kwargs):
        seen.append(dict(kwargs))
        kwargs.pop("device_map", None)   # no GPU here: the real load places the tiny model on the CPU
        return load(path, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording)
    args = parse("--device", "cuda", "--device-map", "balanced")
    args.model = str(tiny_teacher_dir)
    assert serve.check_backend_args(args) is None
    backend = serve.load_backend(args)                       # model.to("cuda") would fail: not called
    assert seen[-1]["device_map"] == "balanced" and seen[-1]["dtype"] == torch.float32
    assert backend.device == torch.device("cpu")             # the ids go where the embeddings are

    seq = torch.arange(1, 21)
    from opd.teachers.backend import ScoreRequest

    req = ScoreRequest(1, "topk", seq, (0, 20), (5,), 4, 1.0, "float32", 1024)
    plain = HFBackend(tiny_teacher_dir, max_k=8)
    assert "device_map" not in seen[-1]                      # without one: loaded, then moved to --device
    got, want = backend.score_topk([req])[0], plain.score_topk([req])[0]
    torch.testing.assert_close(got.logprobs, want.logprobs)
    with pytest.raises(ValueError, match="needs device='cuda'"):
        HFBackend(tiny_teacher_dir, device_map="auto")
