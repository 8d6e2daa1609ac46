"""The trainer's side of its teachers: checked connections and answers as futures.

`connect_teachers` refuses, before any compute, a teacher that is unreachable, has another
tokenizer than the student, or cannot answer the configured mode and k; with `cluster.mode: ray`
a teacher of `cluster.teachers` is a ReplicaPool over its Ray-placed replicas (opd/cluster.py). `TeacherSet.request`
sends one teacher the sequences routed to it and returns a Future of an `Answer`, so the
next batch can be scored while the current one trains; full-vocabulary streams are drained
by a worker thread.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from opd.distill import take_rows


class TrainError(RuntimeError):
    """A run that cannot start or continue; the message says what to change."""


@dataclass
class Answer:
    """One teacher's rows for the sequences it scored, in request order."""
    topk: object | None            # kernels.TopKTeacher [R, k] (topk / sampled modes)
    logits: torch.Tensor | None    # [R, V] raw logits (full mode)
    token_logprob: torch.Tensor    # [R]
    row_offsets: list[int]         # [B_t + 1]
    latency_s: float


def teacher_curve(cfg, i: int, spec):
    """`curve=` for TeacherClient: (client secret key file, server public key file), or None."""
    secret = cfg.teacher_client.curve_secret_key
    if not spec.curve_server_key:
        return None
    if not secret:
        raise TrainError(f"merge.teachers[{i}] ({spec.name}) uses CURVE (curve_server_key) but "
                         f"teacher_client.curve_secret_key is not set: give the client's .key_secret file "
                         f"(`opd keys generate`; its public key must be on the server's --curve-allow list)")
    try:
        from opd.teachers.client import _as_curve

        _as_curve((secret, spec.curve_server_key))  # readable, and a secret key where one is needed
    except (OSError, ValueError) as e:
        raise TrainError(f"merge.teachers[{i}] ({spec.name}): cannot load the CURVE keys "
                         f"(teacher_client.curve_secret_key {secret}, curve_server_key "
                         f"{spec.curve_server_key}): {e}") from None
    return (secret, spec.curve_server_key)


def _check_welcome(i: int, spec, where: str, welcome, student_fingerprint: str, student_path: str) -> None:
    if welcome.tokenizer_fingerprint != student_fingerprint:
        raise TrainError(
            f"teacher {spec.name!r} at {where} uses tokenizer fingerprint "
            f"{welcome.tokenizer_fingerprint}, the student ({student_path}) {student_fingerprint}: "
            f"token-level distillation needs one shared vocabulary")
    wanted = "full" if spec.mode == "full" else "topk"
    if wanted not in welcome.modes:
        raise TrainError(f"teacher {spec.name!r} serves modes {welcome.modes}, not {wanted!r} "
                         f"(merge.teachers[{i}].mode: {spec.mode})")
    if spec.mode != "full" and spec.k > welcome.max_k:
        raise TrainError(f"merge.teachers[{i}].k = {spec.k} exceeds teacher {spec.name!r}'s max_k "
                         f"{welcome.max_k}")


def connect_teachers(cfg, student_fingerprint: str, student_path: str, cluster=None) -> dict:
    """One client per teacher, checked before any compute: reachable, same tokenizer, able to answer
    the configured mode and k. A teacher listed in `cluster.teachers` (cluster.mode: ray) gets the
    cluster's ReplicaPool over its replicas instead of a TeacherClient at its merge address.
    Returns {name: (client, welcome)}."""
    from opd.teachers.client import TeacherClient, TeacherError

    s = cfg.teacher_client
    on_ray = {t.name for t in cfg.cluster.teachers} if cluster is not None else set()
    out: dict = {}
    try:
        for i, spec in enumerate(cfg.merge.teachers):
            curve = teacher_curve(cfg, i, spec)
            if spec.name in on_ray:
                try:
                    pool = cluster.teacher_pool(spec.name, backoff_s=s.backoff_s, curve=curve)  # its own failover
                    welcome = pool.info()
                except TeacherError as e:
                    raise TrainError(f"teacher {spec.name!r} on the Ray cluster is unusable ({e})") from None
                out[spec.name] = (pool, welcome)
                _check_welcome(i, spec, f"replicas {pool.live_addresses()}", welcome, student_fingerprint,
                               student_path)
                continue
            # A short-lived client with a short timeout answers "reachable?" quickly; the working
            # client below retries patiently during training.
            check = TeacherClient(spec.address, timeout_s=s.connect_timeout_s, retries=0, curve=curve,
                                  name="opd-train-check")
            try:
                welcome = check.info()
            except TeacherError as e:
                hint = (" (with CURVE, no answer also means the client's public key is not on the server's "
                        "--curve-allow list or curve_server_key is not that server's key)" if curve else "")
                raise TrainError(f"teacher {spec.name!r} at {spec.address} is unreachable ({e}); start it with "
                                 f"`opd serve-teacher` or fix merge.teachers[{i}].address "
                                 f"(waited teacher_client.connect_timeout_s = {s.connect_timeout_s}s){hint}") from None
            finally:
                check.close()
            _check_welcome(i, spec, spec.address, welcome, student_fingerprint, student_path)
            client = TeacherClient(spec.address, timeout_s=s.timeout_s, retries=s.retries, curve=curve,
                                   backoff_s=s.backoff_s, name=f"opd-train:{spec.name}")
            out[spec.name] = (client, client.info())
    except BaseException:
        for client, _ in out.values():
            client.close()
        raise
    return out


def full_logits_bytes(cfg, vocab_size: int) -> int:
    """Most bytes of full-mode teacher logits the trainer holds at once: a batch's [rows, V],
    every response at max_new_tokens, in loss.full_dtype; two batches with run.pipeline (the
    next one is scored while the current one trains)."""
    r = cfg.rollout
    rows = r.prompts_per_step * r.samples_per_prompt * r.max_new_tokens
    item = 4 if cfg.loss.full_dtype == "float32" else 2
    return rows * vocab_size * item * (2 if cfg.run.pipeline else 1)


def check_full_memory(cfg, vocab_size: int, available: int | None) -> str | None:
    """Refuse a full-mode run whose teacher logits cannot fit in `available` bytes (None:
    unknown); a note when they may take over half of it."""
    need = full_logits_bytes(cfg, vocab_size)
    if available is None or need <= available // 2:
        return None
    r = cfg.rollout
    what = (f"mode full holds up to {_size(need)} of teacher logits: prompts_per_step "
            f"{r.prompts_per_step} x samples_per_prompt {r.samples_per_prompt} x max_new_tokens {r.max_new_tokens} "
            f"rows x V={vocab_size} x {cfg.loss.full_dtype}{' x 2 batches (run.pipeline)' if cfg.run.pipeline else ''}")
    if need > available:
        raise TrainError(f"{what}, and this machine has {_size(available)} available; use mode: topk, "
                         f"loss.full_dtype: bfloat16, run.pipeline: false, or fewer rollout.prompts_per_step or "
                         f"max_new_tokens")
    return f"{what}: over half of the {_size(available)} available"


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class TeacherSet:
    """The run's teachers: specs, checked clients and their WELCOMEs."""

    def __init__(self, cfg, student_fingerprint: str, student_path: str, cluster=None):
        self.cfg = cfg
        self.specs = {t.name: t for t in cfg.merge.teachers}
        self.clients = connect_teachers(cfg, student_fingerprint, student_path, cluster)
        self.pool = ThreadPoolExecutor(max_workers=2 * len(self.specs), thread_name_prefix="teacher-full")
        full = [name for name, spec in self.specs.items() if spec.mode == "full"]
        self.memory_note = None   # a full-mode run that may take over half the memory: said, and in the card
        if full:
            try:
                self.memory_note = check_full_memory(cfg, max(self.welcome(n).vocab_size for n in full),
                                                     _mem_available())
            except TrainError:
                self.close()
                raise

    def welcome(self, name: str):
        return self.clients[name][1]

    def request(self, teacher: str, sequences: list[list[int]], starts: list[int]) -> Future:
        """Future of `teacher`'s Answer for these sequences (prompt + response, response from starts)."""
        spec, client = self.specs[teacher], self.clients[teacher][0]
        t0 = time.perf_counter()
        if spec.mode == "full":
            def collect() -> Answer:
                offsets = [0]
                for s, st in zip(sequences, starts):
                    offsets.append(offsets[-1] + len(s) - st)
                rows, logits, token_lp, got = offsets[-1], None, torch.zeros(offsets[-1]), 0
                # Each chunk is copied into one [rows, V] buffer as it arrives and then dropped:
                # holding the chunks and concatenating them needed twice the answer's memory.
                for c in client.score_full(sequences, starts, temperature=spec.temperature,
                                           dtype=self.cfg.loss.full_dtype):
                    if logits is None:
                        logits = torch.empty(rows, c.logits.shape[1], dtype=c.logits.dtype)
                    n = c.logits.shape[0]
                    if c.row_start + n > rows:
                        raise TrainError(f"teacher {teacher!r} sent rows past the {rows} requested")
                    logits[c.row_start:c.row_start + n] = c.logits
                    token_lp[c.row_start:c.row_start + n] = c.token_logprob
                    got += n
                if got != rows:
                    raise TrainError(f"teacher {teacher!r} returned {got} rows, expected {rows}")
                if logits is None:
                    logits = torch.zeros(0, 0)
                return Answer(None, logits, token_lp, offsets, time.perf_counter() - t0)
            return self.pool.submit(collect)

        from opd.kernels import TopKTeacher
        from opd.teachers.client import TeacherError

        outer: Future = Future()
        try:
            inner = client.submit_topk(sequences, starts, spec.k, temperature=spec.temperature)
        except TeacherError as e:  # e.g. FINGERPRINT_CHANGED seen at submit time: answers() reports it
            outer.set_exception(e)
            return outer

        def done(f: Future) -> None:
            try:
                r = f.result()
                outer.set_result(Answer(TopKTeacher(r.ids, r.logprobs, r.tail_logmass), None, r.token_logprob,
                                        list(r.row_offsets), time.perf_counter() - t0))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting trainer
                outer.set_exception(e)
        inner.add_done_callback(done)
        return outer

    def answers(self, futures: dict[str, Future]) -> dict[str, Answer]:
        """Wait for every teacher's answer; a teacher that changed its model stops the run."""
        from opd.teachers.client import TeacherError

        out = {}
        for t, fut in futures.items():
            try:
                out[t] = fut.result()
            except TeacherError as e:
                if e.code == "FINGERPRINT_CHANGED":
                    raise TrainError(f"teacher {t!r} restarted with a different model; stopping rather than "
                                     f"mixing two teachers: {e.message}") from None
                raise TrainError(f"teacher {t!r} at {self.specs[t].address} failed: {e}") from None
        return out

    def topk_ids(self, spec, answer: Answer, idx: torch.Tensor) -> torch.Tensor:
        if answer.topk is not None:
            return take_rows(answer.topk.ids, idx)
        return take_rows(answer.logits, idx).float().topk(min(spec.k, answer.logits.shape[1]), -1).indices

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for client, _ in self.clients.values():
            client.close()
