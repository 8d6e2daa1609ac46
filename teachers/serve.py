"""`opd serve-teacher`: load a teacher model and serve it over ZeroMQ until SIGTERM.

Prints one startup line (flushed) that scripts and `opd.teachers.launch` wait for:

    opd-teacher ready address=tcp://127.0.0.1:5555 backend=hf name=math model_fingerprint=... tokenizer_fingerprint=...
        curve=off device=cuda cuda_visible_devices=1      (on the same line; the last only when set)

Values are shell-quoted (`name='Qwen2.5 Math 7B'`); read it with `shlex.split`
(teachers/lifecycle.py writes and parses it; `READY` is importable from here too).

Binding anything but loopback needs CURVE keys (`opd keys generate`) or `--insecure`.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

import torch

from opd.config import number_arg, positive_int
from opd.teachers.hf_backend import HFBackend
from opd.teachers.keys import load_allow_list, load_keypair
from opd.teachers.lifecycle import READY  # noqa: F401 (callers import READY from here)
from opd.teachers.lifecycle import PARENT_ENV, die_with_parent, ready_line
from opd.teachers.server import ServerLimits
from opd.teachers.server import serve as run_server   # not `serve`: the name of this module
from opd.teachers.vllm_backend import VLLMBackend   # imports vllm only when a backend starts
from opd.vllm_args import cpu_binding_problem

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")   # transformers' strategies over GPUs
VLLM_ONLY = ("tensor_parallel_size", "gpu_memory_utilization", "enforce_eager")


def fraction(text: str) -> float:
    """argparse type of a share in (0, 1]."""
    value = number_arg(float, 0, strict=True)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be at most 1 (a share of the memory), got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local model directory (transformers format)")
    p.add_argument("--backend", choices=["hf", "vllm"], default="hf",
                   help="hf: transformers, exact in every mode; vllm: top-k at temperature 1 only")
    p.add_argument("--bind", default="tcp://127.0.0.1:5555",
                   help="ZeroMQ address to bind; port * picks a free port (the startup line prints it)")
    p.add_argument("--name", default=None, help="teacher name reported in WELCOME; None: the model directory name")
    p.add_argument("--max-k", type=positive_int, default=64, help="largest k a top-k request may ask for")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="model weights dtype")
    p.add_argument("--device-map", choices=DEVICE_MAPS, default=None,
                   help="hf backend, with --device cuda: spread the model's layers over all visible GPUs "
                        "(transformers' device_map: auto or balanced even them out, balanced_low_0 spares GPU 0, "
                        "sequential fills GPU 0 first) for a teacher larger than one GPU; None: one GPU")
    # None for the three vllm options: given with --backend hf they are refused (check_backend_args)
    p.add_argument("--tensor-parallel-size", type=positive_int, default=None,
                   help="vllm backend: GPUs the model is split over (tensor parallelism); None: 1. On vLLM's "
                        "CPU build each rank needs a NUMA node, or VLLM_CPU_OMP_THREADS_BIND with one CPU list per rank")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=None,
                   help="vllm backend: share of each GPU's memory vLLM takes for weights, activations and KV cache "
                        "(0 to 1); None: vLLM's default (0.92). Lower it when another process shares the GPU")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="vllm backend: run the model eagerly, without CUDA graphs or torch.compile; default: on for "
                        "vLLM's CPU build (which would compile at every start), off on CUDA (CUDA graphs)")
    p.add_argument("--max-positions", type=positive_int, default=None,
                   help="longest sequence accepted (at most the model's); None: the model's max_position_embeddings")
    p.add_argument("--max-tokens-per-request", type=positive_int, default=32768, help="larger SCORE requests get TOO_LONG")
    p.add_argument("--max-inflight-tokens", type=positive_int, default=131072,
                   help="accepted, unfinished tokens; past this a request gets BUSY (retryable)")
    p.add_argument("--batch-tokens", type=positive_int, default=16384, help="top-k requests grouped into one forward pass")
    p.add_argument("--prompt-cache-tokens", type=number_arg(int, 0), default=8192,
                   help="hf backend: keep the keys and values of prompts a student announces before its rollout "
                        "(SCORE mode prefill), up to this many prompt tokens, so that their scoring later computes only "
                        "the responses; 0: off. Each token costs 2 x layers x kv_heads x head_dim values")
    # 0 or less turned heartbeats off, or dropped every client at once as silent
    seconds = number_arg(float, 0, strict=True)
    p.add_argument("--heartbeat-s", type=seconds, default=1.0, help="heartbeat interval clients are told to use")
    p.add_argument("--peer-timeout-s", type=seconds, default=10.0,
                   help="a client silent this long loses its requests in flight (CANCELLED)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads; None: torch's choice")
    p.add_argument("--curve-secret-key", type=Path, default=None,
                   help="server secret key file (NAME.key_secret from `opd keys generate`): enables CURVE")
    p.add_argument("--curve-allow", type=Path, default=None,
                   help="client public key file (NAME.key) or a directory of them: the allow-list")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback bind without CURVE (anyone who reaches the port may use the teacher)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="server log verbosity: INFO also logs each refused request (code and reason), WARNING "
                        "only cancelled requests and refused keys")


def is_loopback(address: str) -> bool:
    if address.startswith(("ipc://", "inproc://")):
        return True
    host = urlparse(address).hostname or ""
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def check_bind(address: str, curve: bool, insecure: bool) -> str | None:
    """An error message when `address` may not be bound this way, else None (may print a warning)."""
    if is_loopback(address) or curve:
        return None
    if not insecure:
        return (f"refusing to bind {address} without authentication: pass --curve-secret-key and --curve-allow "
                f"(see `opd keys generate`), or --insecure to serve anyone who can reach the port")
    print(f"WARNING: serving {address} WITHOUT authentication or encryption (--insecure)", file=sys.stderr, flush=True)
    return None


def port_taken(address: str) -> bool:
    """tcp://HOST:PORT is bound by another process: checked before a model load that may take
    minutes (the server's own bind after it still decides; `*` ports are never taken)."""
    u = urlparse(address)
    try:
        port = u.port
    except ValueError:   # tcp://HOST:* picks a free port
        return False
    if u.scheme != "tcp" or not port:
        return False
    host = "" if u.hostname in (None, "*") else u.hostname
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as ZeroMQ binds: TIME_WAIT is no obstacle
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def check_backend_args(args) -> str | None:
    """An error message when the placement flags do not fit --backend and --device, else None."""
    if args.backend == "hf":
        given = ["--" + n.replace("_", "-") for n in VLLM_ONLY if getattr(args, n) is not None]
        if given:
            return (f"{', '.join(given)}: for the vllm backend only; the hf backend spreads a model over several "
                    f"GPUs with --device cuda --device-map auto")
        if args.device_map is not None and args.device != "cuda":
            return f"--device-map {args.device_map} spreads the model over GPUs: pass --device cuda with it"
    elif args.device_map is not None:
        return ("--device-map: an hf backend option; vLLM places the model itself, over several GPUs "
                "with --tensor-parallel-size N")
    elif (args.tensor_parallel_size or 1) > 1:
        return cpu_binding_problem(args.tensor_parallel_size)   # before a load that would fail minutes later
    return None


def load_backend(args):
    kwargs = dict(name=args.name or Path(args.model).name, max_k=args.max_k, max_positions=args.max_positions,
                  dtype=args.dtype, device=args.device)
    if args.backend == "vllm":
        return VLLMBackend(args.model, **kwargs, tensor_parallel_size=args.tensor_parallel_size or 1,
                           gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager)
    return HFBackend(args.model, **kwargs, batch_tokens=args.batch_tokens, device_map=args.device_map,
                     prompt_cache_tokens=args.prompt_cache_tokens)


def run(args, on_ready=None) -> int:
    """Serve until SIGTERM/SIGINT. `on_ready(line)` also gets the startup line (a forked server
    hands it to its parent through a pipe, opd.teachers.launch.fork_server)."""
    parent = os.environ.pop(PARENT_ENV, None)   # popped: the backend's own workers must not inherit it
    if parent:
        die_with_parent(int(parent))
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = check_backend_args(args) or check_bind(args.bind, args.curve_secret_key is not None, args.insecure)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    curve = {}
    if args.curve_secret_key is not None:
        if args.curve_allow is None:
            print("error: --curve-secret-key needs --curve-allow (the client public keys to admit)", file=sys.stderr)
            return 2
        try:
            public, secret = load_keypair(args.curve_secret_key)
            curve = dict(curve_secret_key=secret, curve_public_key=public,
                         curve_allow=load_allow_list(args.curve_allow))
        except (OSError, ValueError) as e:   # a missing or malformed key file
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if port_taken(args.bind):
        print(f"error: {args.bind} is already in use (another teacher?); pick another --bind port", file=sys.stderr)
        return 1
    backend = load_backend(args)
    limits = ServerLimits(max_tokens_per_request=args.max_tokens_per_request,
                          max_inflight_tokens=args.max_inflight_tokens, batch_tokens=args.batch_tokens,
                          heartbeat_s=args.heartbeat_s, peer_timeout_s=args.peer_timeout_s)

    def ready(server) -> None:
        fields = dict(address=server.address, backend=backend.name, name=server.name,
                      model_fingerprint=backend.model_fingerprint, tokenizer_fingerprint=backend.tokenizer_fingerprint,
                      curve="on" if curve else "off", device=args.device)
        if os.environ.get("CUDA_VISIBLE_DEVICES"):
            fields["cuda_visible_devices"] = os.environ["CUDA_VISIBLE_DEVICES"]
        line = ready_line(fields)
        print(line, flush=True)
        if on_ready is not None:
            on_ready(line)

    try:
        code = run_server(backend, args.bind, ready=ready, signals=True, limits=limits, name=args.name, **curve)
    finally:
        backend.close()
    print("opd-teacher stopped", flush=True)
    return code
