"""`opd bench transport`: how fast teacher answers cross a socket, with the model taken out.

Three ways to move the same answers, measured side by side in one run:
  opd      this project's server and client (ROUTER/DEALER, msgpack header + raw tensor
           frames), serving a `PrecomputedBackend` that returns ready-made answers of the
           right shapes, so no forward pass is timed; 4 requests in flight.
  ceiling  a bare ZeroMQ PUSH -> PULL moving exactly the frames of the same answers.
  http     an HTTP server returning the same top-k answer as JSON, shaped like the
           `prompt_logprobs` of OpenAI-compatible servers ({token_id: {logprob, rank,
           decoded_token}} per position), parsed back into arrays by the client.
For top-k, two references between the ceiling and `opd` say where the gap comes from, both
one thread per side, 4 requests in flight:
  reqresp  a bare DEALER -> ROUTER request/response answering with the same frames: the
           cost of round trips alone;
  work     the same plus this project's per-message work (pack and encode the SCORE; decode,
           validate and answer it; decode the TOPK into tensors), without the client's I/O
           thread and the server's worker thread that `opd` needs to stay responsive.
Reported: scored positions per second, bytes per position on the wire, the ratio of `opd`
to the ceiling and to HTTP/JSON, and the CPU time both processes of each method spent per
position (all threads, from /proc). On a machine whose cores are all busy the ratio to the
ceiling follows the ratio of those CPU times, which swing far less between runs than rates.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from opd.benchmarks.transport_servers import (IN_FLIGHT, MAX_K, PrecomputedBackend, RequestResponse,  # noqa: F401
                                              _http_server, _opd_server, _push_server, _reference_server, _start,
                                              _stop, _pipelined, _requests, _topk_frame_sizes)
from opd.config import positive_int
from opd.teachers.client import TeacherClient


# ---- measurements -----------------------------------------------------------------------

def _bind(transport: str, tmp: str, name: str) -> str:
    return "tcp://127.0.0.1:*" if transport == "tcp" else f"ipc://{tmp}/{name}.sock"


def measure_opd(address: str, mode: str, k: int, dtype: str, positions: int, seconds: float,
                curve=None, in_flight: int = IN_FLIGHT, chunk_rows: int = 64) -> float:
    """Positions per second through this project's client."""

    seqs, starts = _requests(positions, min(512, positions))
    rows = sum(len(s) - st for s, st in zip(seqs, starts))
    cli_curve = None if curve is None else (curve["client_public"], curve["client_secret"], curve["server_public"])
    with TeacherClient(address, timeout_s=120, curve=cli_curve) as client:
        client.info()
        if mode == "topk":
            return _pipelined(seconds, rows, lambda: client.submit_topk(seqs, starts, k), lambda f: f.result(),
                              in_flight)
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for chunk in client.score_full(seqs, starts, dtype=dtype, chunk_rows=chunk_rows, window=4):
                done += chunk.logits.shape[0]
        return done / (time.perf_counter() - t0)


class Ceiling:
    """A bare ZeroMQ PUSH (its own process) -> PULL (here) moving exactly the given frames,
    kept open so that its rounds interleave with the other methods' rounds."""

    def __init__(self, bind: str, frame_sizes: list[int], rows_per_msg: int):
        import zmq

        self.proc, address = _start(_push_server, bind, frame_sizes)
        self.rows_per_msg = rows_per_msg
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 8)
        self.sock.connect(address)
        self.sock.recv_multipart(copy=False)  # connection up

    def measure(self, seconds: float) -> float:
        # PUSH refilled its queue while the other methods ran: those messages arrive in no time
        # and would count for the ceiling (5-7 of them, 2.7 % of a round at 32768 positions).
        for _ in range(64):
            if not self.sock.poll(0):
                break
            self.sock.recv_multipart(copy=False)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            self.sock.recv_multipart(copy=False)
            n += 1
        return n * self.rows_per_msg / (time.perf_counter() - t0)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
        _stop(self.proc)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all threads (Linux /proc)."""
    f = Path(f"/proc/{pid}/stat").read_text()
    f = f[f.rindex(")") + 2:].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def with_cpu(fn, pid: int, out: list[float]):
    """`fn(seconds) -> positions/s`, also appending to `out` the CPU microseconds per position
    spent by this process and process `pid` (the other end) together."""
    def run(seconds: float) -> float:
        c0, t0 = _cpu_s(pid) + _cpu_s(os.getpid()), time.perf_counter()
        rate = fn(seconds)
        positions = rate * (time.perf_counter() - t0)
        out.append(1e6 * (_cpu_s(pid) + _cpu_s(os.getpid()) - c0) / positions)
        return rate
    return run


def interleaved(methods: dict, rounds: int, seconds: float) -> dict[str, list[float]]:
    """Each method measured `rounds` times, in turns, the order rotated each round (a, b, c;
    b, c, a; ...): drifts of a shared machine hit every method alike, no method always runs
    right after another, and the medians are compared."""
    out = {name: [] for name in methods}
    names = list(methods)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(methods[name](seconds))
    return out


def measure_http(k: int, positions: int, seconds: float) -> float:
    import http.client

    p, port = _start(_http_server, positions, k)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = json.dumps({"positions": positions})
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds or done == 0:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            data = json.loads(conn.getresponse().read())["prompt_logprobs"][1:]
            # What a trainer must do with it: arrays of ids and log-probs.
            ids = np.array([[int(t) for t in pos] for pos in data], dtype=np.int32)
            lps = np.array([[v["logprob"] for v in pos.values()] for pos in data], dtype=np.float32)
            done += ids.shape[0] + 0 * lps.shape[0]
        return done / (time.perf_counter() - t0)
    finally:
        _stop(p)


def run_cases(args) -> list[dict]:
    torch.set_num_threads(1)
    rows_out = []
    tmp = tempfile.mkdtemp(prefix="opd-bench-")
    curve = None
    if args.curve:
        import zmq

        cpub, csec = zmq.curve_keypair()
        spub, ssec = zmq.curve_keypair()
        curve = dict(client_public=cpub, client_secret=csec, server_public=spub, server_secret=ssec)

    def compare(case: dict, ceiling: Ceiling, methods: dict, server_pid: int) -> dict:
        cpu = {"opd": [], "ceiling": []}
        methods = dict(methods, opd=with_cpu(methods["opd"], server_pid, cpu["opd"]),
                       ceiling=with_cpu(ceiling.measure, ceiling.proc.pid, cpu["ceiling"]))
        try:
            res = interleaved(methods, args.rounds, args.seconds)
        finally:
            ceiling.close()
        med = {name: statistics.median(v) for name, v in res.items()}
        row = dict(case, positions_per_s=med["opd"], ceiling_positions_per_s=med["ceiling"],
                   ratio_to_ceiling=med["opd"] / med["ceiling"], rounds=res,
                   # each round's own ratio: how far one run's figure can be trusted on this box
                   ratio_to_ceiling_rounds=[a / b for a, b in zip(res["opd"], res["ceiling"])],
                   cpu_us_per_position=statistics.median(cpu["opd"]),
                   ceiling_cpu_us_per_position=statistics.median(cpu["ceiling"]))
        if "curve" in med:
            row["curve_positions_per_s"] = med["curve"]
            row["curve_cost"] = 1 - med["curve"] / med["opd"]
        for name in ("reqresp", "work"):
            if name in med:
                row[f"{name}_positions_per_s"] = med[name]
                row[f"{name}_ratio_to_ceiling"] = med[name] / med["ceiling"]
        return row

    for transport in args.transports:
        for vocab in ([32768] if args.quick else args.vocabs):
            has_topk = vocab == (32768 if args.quick else args.vocabs[0])
            server, address = _start(_opd_server, _bind(transport, tmp, f"opd{vocab}"), vocab,
                                     max(args.positions), args.chunk_rows, None)
            cserver = caddress = refserver = None
            if has_topk and args.ks:
                refserver, refaddress = _start(_reference_server, _bind(transport, tmp, f"ref{vocab}"), vocab,
                                               max(args.positions))
            if curve is not None and has_topk:
                cserver, caddress = _start(_opd_server, _bind(transport, tmp, f"curve{vocab}"), vocab,
                                           max(args.positions), args.chunk_rows, curve)
            try:
                for k in args.ks if has_topk else []:
                    http = measure_http(k, min(max(args.positions), 1024), args.seconds) if transport == "tcp" else None
                    for n in args.positions:
                        methods = {"opd": lambda sec, n=n, k=k: measure_opd(address, "topk", k, "float32", n, sec)}
                        if caddress is not None:
                            methods["curve"] = lambda sec, n=n, k=k: measure_opd(caddress, "topk", k, "float32", n,
                                                                                 sec, curve=curve)
                        ref = RequestResponse(refaddress, n, k)
                        methods.update(reqresp=ref.bare, work=ref.work)
                        ceiling = Ceiling(_bind(transport, tmp, "push"), _topk_frame_sizes(n, k), n)
                        try:
                            row = compare(dict(transport=transport, mode="topk", k=k, vocab=None, dtype="float32",
                                               positions_per_request=n, bytes_per_position=k * 8 + 12), ceiling,
                                          methods, server.pid)
                        finally:
                            ref.close()
                        row["http_json_positions_per_s"] = http
                        row["ratio_to_http"] = row["positions_per_s"] / http if http else None
                        rows_out.append(row)
                        print(_fmt(row), flush=True)
                for dtype in args.dtypes:
                    n = args.chunk_rows * 8
                    item = 4 if dtype == "float32" else 2
                    methods = {"opd": lambda sec, dtype=dtype, n=n: measure_opd(address, "full", 0, dtype, n, sec,
                                                                               chunk_rows=args.chunk_rows)}
                    ceiling = Ceiling(_bind(transport, tmp, "push"),
                                      [200, args.chunk_rows * vocab * item, args.chunk_rows * 4, args.chunk_rows * 4],
                                      args.chunk_rows)
                    row = compare(dict(transport=transport, mode="full", k=None, vocab=vocab, dtype=dtype,
                                       positions_per_request=n, bytes_per_position=vocab * item + 8), ceiling, methods,
                              server.pid)
                    row["http_json_positions_per_s"] = row["ratio_to_http"] = None
                    rows_out.append(row)
                    print(_fmt(row), flush=True)
            finally:
                _stop(server)
                for p in (cserver, refserver):
                    if p is not None:
                        _stop(p)
    return rows_out


def ratio_spread(r: dict) -> str:
    """Lowest-highest of the per-round ratios to the ceiling, in %; '-' for rows without them."""
    v = r.get("ratio_to_ceiling_rounds")
    return f"{100 * min(v):.0f}-{100 * max(v):.0f}%" if v else "-"


def _fmt(r: dict) -> str:
    what = f"top-{r['k']}" if r["mode"] == "topk" else f"full V={r['vocab']} {r['dtype']}"
    http = f"{r['http_json_positions_per_s']:>10.0f}" if r.get("http_json_positions_per_s") else f"{'-':>10}"
    ratio_http = f"{r['ratio_to_http']:>7.1f}x" if r.get("ratio_to_http") else f"{'-':>8}"
    curve = f"  curve -{100 * r['curve_cost']:.0f}%" if "curve_cost" in r else ""
    if "reqresp_ratio_to_ceiling" in r:
        curve += (f"  (of the ceiling: reqresp {100 * r['reqresp_ratio_to_ceiling']:.0f}%, "
                  f"+work {100 * r['work_ratio_to_ceiling']:.0f}%)")
    return (f"{r['transport']:<4} {what:<24} {r['positions_per_request']:>6}/req {r['positions_per_s']:>12.0f} pos/s {r['bytes_per_position']:>8} B/pos "
            f"ceiling {r['ceiling_positions_per_s']:>12.0f} ({100 * r['ratio_to_ceiling']:5.1f}%, rounds "
            f"{ratio_spread(r)}) "
            f"cpu {r['cpu_us_per_position']:.3g}/{r['ceiling_cpu_us_per_position']:.3g} us/pos "
            f"http {http} {ratio_http}{curve}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    p.add_argument("--transports", nargs="+", default=["tcp", "ipc"], choices=["tcp", "ipc"],
                   help="ZeroMQ transports measured: tcp on loopback (also against HTTP/JSON), ipc (a Unix socket)")
    p.add_argument("--ks", nargs="+", type=int, default=[1, 8, 64], help="top-k sizes")
    p.add_argument("--vocabs", nargs="+", type=int, default=[32768, 152064], help="full-mode vocabulary sizes")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"],
                   help="dtypes of the full-mode logits sent (top-k answers are always float32)")
    p.add_argument("--positions", nargs="+", type=_positions, default=[4096, 16384, 32768],
                   help="scored positions per top-k request (each size is a row): 4096 = 8 sequences x 512, "
                        "16384 = a training batch of 32 x 512, 32768 = the server's default "
                        "--max-tokens-per-request, the requests a large batch is split into")
    p.add_argument("--chunk-rows", type=int, default=32, help="rows per CHUNK in full mode")
    p.add_argument("--seconds", type=float, default=1.0, help="measuring time per round, case and method")
    p.add_argument("--rounds", type=int, default=3, help="rounds per case; methods take turns, medians are compared")
    p.add_argument("--curve", action="store_true", help="also measure top-k with CURVE encryption")
    p.add_argument("--quick", action="store_true", help="one vocabulary (32768) for full mode; set --seconds, "
                                                        "--rounds and --positions for short runs (opd bench all "
                                                        "--quick does)")


def _positions(text: str) -> int:
    """--positions: requests are whole sequences of 512 rows above 512, so another size would
    compare opd's smaller requests with ceiling messages of the size asked for."""
    n = positive_int(text)
    if n > 512 and n % 512:
        raise argparse.ArgumentTypeError(f"above 512 it must be a multiple of 512 (sequences of 512 rows), got {n}")
    return n


def run(args) -> int:
    rows = run_cases(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": _machine(), "rows": rows}, indent=1))
    return 0


def _machine() -> str:
    import platform

    return f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}"
