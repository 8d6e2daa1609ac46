"""Shared fixtures: tiny local models built once per test session (nothing is downloaded)."""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
import types
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share the cores: one OpenMP thread each (and in the processes they start) instead
    # of one per core in each, whose spin-waiting made a torch-heavy test 5x slower (6 s -> 33 s).
    # Set before anything imports torch; a test that needs more threads sets them itself.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer Qwen2-style model (vocab 260, byte tokenizer), fp32, seed 0."""
    from opd.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_teacher_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model with noise added: a teacher that differs from the student."""
    from opd.tiny import perturb_model

    return perturb_model(tiny_model_dir, tmp_path_factory.mktemp("tiny") / "teacher", scale=1.0, seed=1)


@pytest.fixture(scope="session")
def tiny_longrope_dir(tmp_path_factory):
    """A 2-layer Phi-3-style model with longrope factors that switch past 32 tokens (short
    factors 1, long 4), weights scaled up so that positions move its log-probs visibly in fp32."""
    import torch
    import transformers as tf

    from opd.tiny import build_tokenizer

    out = tmp_path_factory.mktemp("longrope") / "phi"
    tok = build_tokenizer(out)
    cfg = tf.Phi3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                        original_max_position_embeddings=32,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 16,
                                         "long_factor": [4.0] * 16, "original_max_position_embeddings": 32},
                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = tf.Phi3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10)
    model.save_pretrained(out)
    return out


from opd.teachers import launch as _launch  # noqa: E402
from opd.teachers.launch import free_port  # noqa: E402  (import it from there, not from conftest)


def _servers_die_with_their_test_process(start):
    """`start_server_process` whose servers, started from a test process's main thread (its
    fixtures, its tests), get Linux's SIGTERM when that process dies: a pytest worker killed
    mid-run (a timeout, Ctrl-C twice, CI cancelling) left its `opd serve-teacher` processes
    running. A caller's explicit die_with_parent wins; other threads keep the library default
    (the signal comes when the starting thread ends, which for them may be too soon)."""
    @functools.wraps(start)
    def start_server_process(args, *, die_with_parent=None, **kwargs):
        if die_with_parent is None:
            die_with_parent = threading.current_thread() is threading.main_thread()
        return start(args, die_with_parent=die_with_parent, **kwargs)
    return start_server_process


_launch.start_server_process = _servers_die_with_their_test_process(_launch.start_server_process)


@pytest.fixture
def free_tcp_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


# ---- vLLM (marked `vllm`): one engine of each kind per session, shared by the tests ----

@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    """A tiny model with 2 heads of dim 32 (vLLM's CPU attention supports head sizes from 32
    up), built apart from `tiny_model_dir` so that vLLM tests do not depend on its settings."""
    from opd.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "vllm_model", seed=0, heads=2, kv_heads=1)


@pytest.fixture(scope="session")
def vllm_teacher_backend(vllm_model_dir):
    from opd.teachers.vllm_backend import VLLMBackend

    backend = VLLMBackend(vllm_model_dir, name="tiny", max_k=64, max_positions=256)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def vllm_rollout_engine(vllm_model_dir):
    """Serves `vllm_model_dir`'s weights; a test that pushes other weights pushes them back."""
    from opd.rollout.vllm import VLLMRolloutEngine

    engine = VLLMRolloutEngine(vllm_model_dir, max_model_len=256, seed=0, max_num_seqs=32)
    yield engine
    engine.close()


# ---- vLLM's placement options without an engine: what `vllm.LLM` is given -----------------

@pytest.fixture
def llm_calls(monkeypatch):
    """vllm.LLM replaced by a recorder: the list of the keyword arguments of each construction
    (with the few methods the teacher backend and the rollout engine call after it)."""
    vllm = pytest.importorskip("vllm")
    calls = []

    class FakeLLM:
        def __init__(self, **kwargs):
            calls.append(kwargs)
            self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=lambda: None))

        def get_tokenizer(self):
            return types.SimpleNamespace(eos_token_id=0)

        def collective_rpc(self, method, args=()):
            return [True]

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    return calls


@pytest.fixture
def one_numa_node(monkeypatch):
    """vLLM's CPU build with its default thread binding on a machine with one NUMA node."""
    cr = pytest.importorskip("vllm.utils.cpu_resource_utils")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_SIM_MULTI_NUMA", raising=False)
    monkeypatch.setattr(cr, "get_visible_memory_node", lambda: [0])


@pytest.fixture
def two_vllm_ranks(monkeypatch):
    """What a real engine of tensor-parallel size 2 needs here: on vLLM's CPU build, one CPU list
    per rank in VLLM_CPU_OMP_THREADS_BIND (its default binding wants a NUMA node per rank) and
    two CPUs; on CUDA, two GPUs. Skips the test where the machine has fewer."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        if torch.cuda.device_count() < 2:
            pytest.skip("tensor parallelism over 2 ranks needs 2 GPUs")
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("2 ranks need 2 CPUs")
    half = len(cpus) // 2
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, c)) for c in (cpus[:half], cpus[half:])))


RAY_INIT = dict(num_cpus=2, include_dashboard=False, namespace="opd-test", log_to_driver=False)


def _ray_up():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(**RAY_INIT)
    return ray


@pytest.fixture(scope="session")
def _ray_shut_at_the_end():
    yield
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_module(_ray_shut_at_the_end):
    """The session's local Ray cluster (below), for a module-scoped fixture that needs it."""
    return _ray_up()


@pytest.fixture
def ray_cluster(ray_module):
    """A local Ray cluster (Ray's local_mode no longer exists), one for the whole test session:
    every test file that joins one runs on the same pytest-xdist worker (the "ray" group below),
    and each start took 9-20 s here. A test leaves it as it found it: its actors and placement
    groups gone, its CPUs free; started again only after a test that needed none
    (`without_ray_session`). Here rather than in tests/cluster/conftest.py: a second conftest.py
    shadows this one for `from conftest import ...`."""
    return _ray_up()


@pytest.fixture
def without_ray_session():
    """No Ray session in this process for the test (one that checks what a command does when it
    starts its own); the next test that asks for `ray_cluster` starts it again."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    return ray


# ---- `make test` runs on two pytest-xdist workers -----------------------------------------------
# Each test file stays on one worker, so that a module's fixtures (servers, models) start once.
# The files with a test that starts vLLM go to one worker, whose session engines they share; so
# do the Ray tests, tests/cluster/ and any file that runs a command with `mode: ray` (one local
# cluster at a time on this 2-core box). Scheduled by file path:
# xdist's own `--dist loadgroup` reads `_nodeid`, which pytest 9 no longer uses.

def _xdist_scope(rootpath: Path) -> dict[str, str]:
    """{test file as its node id has it: its work unit}."""
    scope = {}
    for path in sorted(Path(__file__).parent.rglob("test_*.py")):
        name = path.relative_to(rootpath).as_posix()
        if "pytest.mark.vllm" in path.read_text():
            scope[name] = "vllm"
        elif name.startswith("tests/cluster/") or "mode: ray" in path.read_text():
            scope[name] = "ray"
    return scope


if importlib.util.find_spec("xdist") is not None:
    def pytest_xdist_make_scheduler(config, log):
        from xdist.scheduler import LoadScopeScheduling

        scope = _xdist_scope(config.rootpath)

        class ByFile(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                path = nodeid.split("::", 1)[0]
                return scope.get(path, path)

        return ByFile(config, log)
