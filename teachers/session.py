"""The trainer's side of its teachers (opd train's and opd rl's): checked connections and
answers as futures. Built from its own slice of a config: the teacher specs (routing's
TeacherSpec, read by field), the client settings, where the config lists them.

`connect_teachers` refuses, before any compute, a teacher that is unreachable, has another
tokenizer than the student, or cannot answer the configured mode and k; with `cluster.mode: ray`
a teacher of `cluster.teachers` is a ReplicaPool over its Ray-placed replicas (opd/cluster). `TeacherSet.request`
sends one teacher the sequences routed to it and returns a Future of an `Answer`, so the
next batch can be scored while the current one trains. A full-vocabulary answer is a
`RowStream`: the loss reads its rows micro-batch by micro-batch as the chunks arrive, so the
trainer never holds a batch's [rows, V] logits.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
from transformers import AutoConfig

from opd.errors import TrainError
from opd.fingerprint import tokenizer_fingerprint
from opd.kernels import TopKTeacher
from opd.teachers.align import CrossAnswer, load_cross
from opd.teachers.batching import answered_rows, row_masks, scored_lengths
from opd.teachers.client import TeacherClient, TeacherError, _as_curve
from opd.teachers.pool import ReplicaPool
from opd.teachers.welcome import check_welcome

log = logging.getLogger("opd.teachers")


FULL_WINDOW = 4   # full mode: chunks a teacher may send ahead of the loss reading them (per request)


@dataclass
class Answer:
    """One teacher's rows for the sequences it scored, in request order."""
    topk: object | None            # kernels.TopKTeacher [R, k] (topk / sampled modes)
    logits: "RowStream | None"     # [R, V] raw logits, read in row order (full mode)
    token_logprob: torch.Tensor    # [R] (full mode: filled as the rows arrive)
    row_offsets: list[int]         # [B_t + 1]
    latency_s: float               # request to last row (full mode: set by RowStream.finish)

    def teacher_rows(self, idx: torch.Tensor, device) -> "torch.Tensor | TopKTeacher":
        """The teacher's side of answer rows `idx` on `device`: fp32 logits [n, V] (full mode,
        read from the stream) or a TopKTeacher of those rows."""
        if self.topk is None:
            return self.logits[idx].float().to(device)
        return TopKTeacher(*(x[idx.to(x.device)].to(device) for x in self.topk))


class RowStream:
    """A full-vocabulary answer of R rows, read in order while it streams in.

    `stream[index]` (index: ascending row numbers, never below an earlier call's lowest) pulls
    chunks until its last row has arrived and returns those rows; chunks wholly below its lowest
    row are dropped. So the trainer holds one micro-batch's rows and the chunks in flight (the
    client's window), not [R, V]. `finish()` drains what nobody asked for (rows of zero-weight
    sequences) and checks the count. Errors come out as TrainError via `on_error`.
    """

    def __init__(self, send, rows: int, on_error, t0: float, on_done=None):
        """send(): sends the request and returns its iterator of FullChunks (called by `open()`,
        or at the first read); on_done(): called once, when the stream has ended."""
        self._send, self._chunks = send, None
        self.rows, self._on_error, self._t0, self._on_done = rows, on_error, t0, on_done
        self._held: list[tuple[int, torch.Tensor]] = []   # (first row, logits [n, V]) in row order
        self._end = 0                                     # rows received so far
        self._low = 0                                     # rows below this were dropped
        self.vocab: int | None = None
        self.token_logprob = torch.zeros(rows)
        self.waited_s = 0.0                               # blocked in next(chunks)
        self.peak_rows = 0                                # most rows held at once
        self.latency_s: float | None = None

    def __len__(self) -> int:
        return self.rows

    @property
    def shape(self) -> tuple[int, int]:
        if self.vocab is None and self.rows:
            self._pull(1)
        return (self.rows, self.vocab or 0)

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        index = torch.as_tensor(index).reshape(-1)
        if len(index) == 0:
            return torch.zeros(0, self.shape[1])
        lo, hi = int(index.min()), int(index.max()) + 1
        if lo < self._low or hi > self.rows:
            raise IndexError(f"rows {lo}..{hi} of a stream of {self.rows} whose rows below {self._low} are gone")
        self._low = lo
        block = self._gather(lo, hi)
        return block if len(index) == hi - lo and bool((index == torch.arange(lo, hi)).all()) else block[index - lo]

    def _gather(self, lo: int, hi: int) -> torch.Tensor:
        """Rows lo..hi as one tensor: a view where one held piece has them all; otherwise one
        block that the pieces are copied into as they arrive, each dropped once copied (so the
        rows are held once, not twice), and kept for the next read of the same rows."""
        self._held = [(a, x) for a, x in self._held if a + len(x) > lo]
        self._pull(lo + 1)
        a, x = self._held[0]
        if hi <= a + len(x):
            return x[lo - a:hi - a]
        block = torch.empty(hi - lo, x.shape[1], dtype=x.dtype)
        rest: list[tuple[int, torch.Tensor]] = []

        def put(a: int, x: torch.Tensor) -> None:
            s, e = max(a, lo), min(a + len(x), hi)
            if s < e:
                block[s - lo:e - lo] = x[s - a:e - a]
            if a + len(x) > hi:   # rows of the next reads: kept (the tail copied, so the head is freed)
                rest.append((hi, x[hi - a:].clone()) if a < hi else (a, x))

        for a, x in self._held:
            put(a, x)
        self._held = []
        while self._end < hi:
            put(*self._receive())
        self._held = [(lo, block), *rest]
        self.peak_rows = max(self.peak_rows, sum(len(x) for _, x in self._held))
        return block

    def _pull(self, until: int) -> None:
        """Receive chunks until row `until` - 1 has arrived, holding them."""
        while self._end < until:
            self._held.append(self._receive())
            self.peak_rows = max(self.peak_rows, sum(len(x) for _, x in self._held))

    def _receive(self) -> tuple[int, torch.Tensor]:
        """The next chunk as (first row, logits), checked to follow the rows before it."""
        c = self._next()
        if c is None:
            raise TrainError(f"teacher stream ended after {self._end} of {self.rows} rows")
        n = c.logits.shape[0]
        if c.row_start != self._end or self._end + n > self.rows:
            raise TrainError(f"teacher sent rows {c.row_start}..{c.row_start + n} after {self._end} of {self.rows}")
        self.vocab = c.logits.shape[1]
        self.token_logprob[self._end:self._end + n] = c.token_logprob
        self._end += n
        if self._end == self.rows and self.latency_s is None:
            self.latency_s = time.perf_counter() - self._t0
        return c.row_start, c.logits

    def open(self) -> None:
        """Send the request now (it is sent at the first read otherwise)."""
        if self._chunks is None:
            try:
                self._chunks = iter(self._send())
            except TeacherError as e:
                raise self._on_error(e) from None

    def _next(self):
        """The next chunk, or None at the end of the stream (the server's DONE)."""
        t0 = time.perf_counter()
        try:
            self.open()
            return next(self._chunks)
        except StopIteration:
            if self._on_done is not None:
                self._on_done()
                self._on_done = None
            return None
        except TeacherError as e:
            raise self._on_error(e) from None
        finally:
            self.waited_s += time.perf_counter() - t0

    def finish(self) -> float:
        """Receive the rows nobody read (dropping each chunk), check that no more come; the
        request's latency in seconds."""
        self._low, self._held = self.rows, []
        while self._end < self.rows:
            self._receive()
        if self._next() is not None:
            raise TrainError(f"teacher sent more than the {self.rows} rows asked for")
        return self.latency_s if self.latency_s is not None else time.perf_counter() - self._t0


def teacher_curve(client, key: str, i: int, spec):
    """`curve=` for TeacherClient: (client secret key file, server public key file), or None;
    `client` the teacher_client settings, `key` where the config lists the teachers (messages)."""
    secret = client.curve_secret_key
    if not spec.curve_server_key:
        return None
    if not secret:
        raise TrainError(f"{key}[{i}] ({spec.name}) uses CURVE (curve_server_key) but "
                         f"teacher_client.curve_secret_key is not set: give the client's .key_secret file "
                         f"(`opd keys generate`; its public key must be on the server's --curve-allow list)")
    try:
        _as_curve((secret, spec.curve_server_key))  # readable, and a secret key where one is needed
    except (OSError, ValueError) as e:
        raise TrainError(f"{key}[{i}] ({spec.name}): cannot load the CURVE keys "
                         f"(teacher_client.curve_secret_key {secret}, curve_server_key "
                         f"{spec.curve_server_key}): {e}") from None
    return (secret, spec.curve_server_key)


def _check_welcome(key: str, i: int, spec, where: str, welcome, student_fingerprint: str, student_path: str,
                   teacher_fingerprint: str | None = None) -> None:
    problems = check_welcome(spec, welcome, student_fingerprint, at=where,
                             teacher_tokenizer_fingerprint=teacher_fingerprint)
    if problems:
        raise TrainError(f"{key}[{i}] ({spec.name}), student {student_path}: " + "; ".join(problems))


def connect_teachers(specs: list, s, student_fingerprint: str, student_path: str, *, key: str,
                     cluster=None, on_ray: set[str] = frozenset(), fingerprints: dict | None = None) -> dict:
    """One client per teacher spec, checked before any compute: reachable, same tokenizer, able
    to answer the configured mode and k (`s`: the teacher_client settings; `key`: where the config
    lists the teachers, for messages). A teacher named in `on_ray` (cluster.mode: ray) gets the
    cluster's ReplicaPool over its replicas instead of a TeacherClient at its address, and one
    with `replicas` a ReplicaPool over its address and theirs.
    Returns {name: (client, welcome)}."""
    out: dict = {}
    try:
        for i, spec in enumerate(specs):
            curve = teacher_curve(s, key, i, spec)
            if spec.name in on_ray or spec.replicas:   # a pool over the replicas: its own failover
                addresses = [spec.address, *spec.replicas]
                try:
                    pool = (cluster.teacher_pool(spec.name, backoff_s=s.backoff_s, curve=curve) if spec.name in on_ray
                            else ReplicaPool(addresses, timeout_s=s.timeout_s, backoff_s=s.backoff_s, curve=curve,
                                             wait_for_replica_s=s.connect_timeout_s, name=f"opd-train:{spec.name}"))
                    welcome = pool.info()
                except TeacherError as e:
                    if spec.name in on_ray:
                        raise TrainError(f"teacher {spec.name!r} on the Ray cluster is unusable ({e})") from None
                    hint = f"; start them or fix {key}[{i}].address/replicas" if e.code == "NO_REPLICA" else ""
                    raise TrainError(f"teacher {spec.name!r}: its replicas {addresses} are unusable ({e}){hint}") from None
                out[spec.name] = (pool, welcome)
                _check_welcome(key, i, spec, f"replicas {pool.live_addresses()}", welcome, student_fingerprint,
                               student_path, (fingerprints or {}).get(spec.name))
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
                                 f"`opd serve-teacher` or fix {key}[{i}].address "
                                 f"(waited teacher_client.connect_timeout_s = {s.connect_timeout_s}s){hint}") from None
            finally:
                check.close()
            _check_welcome(key, i, spec, spec.address, welcome, student_fingerprint, student_path,
                           (fingerprints or {}).get(spec.name))
            client = TeacherClient(spec.address, timeout_s=s.timeout_s, retries=s.retries, curve=curve,
                                   backoff_s=s.backoff_s, name=f"opd-train:{spec.name}")
            out[spec.name] = (client, client.info())
    except BaseException:
        for client, _ in out.values():
            client.close()
        raise
    return out


def _vocab_limits(specs: dict, welcome, student_path: str) -> tuple[dict[str, int], list[str]]:
    """{teacher: vocab_limit} for teachers whose LM head has more rows than the student's (one
    tokenizer, heads padded to other sizes: Qwen2.5's 0.5-3B have 151,936 rows, 7B and up
    152,064). Such a teacher is asked for its distribution over the student's rows (protocol
    2.2; vLLM servers from 2.3): a top-k answer naming a padding row stopped the run, and full
    answers were cut and renormalised only in the unfused path. A teacher that cannot (a vLLM
    server before 2.3, any server before 2.2) is said in the card: its top-k answers still name
    the rows the student has, almost always."""
    try:
        rows = int(getattr(AutoConfig.from_pretrained(student_path), "vocab_size", 0) or 0)
    except (OSError, ValueError):   # a peft adapter directory: no config of its own
        return {}, []
    limits, notes = {}, []
    for name in specs:
        w = welcome(name)
        if not rows or w.vocab_size <= rows:
            continue
        if tuple(w.version) >= ((2, 2) if w.backend != "vllm" else (2, 3)):
            limits[name] = rows
            notes.append(f"teacher {name!r} has {w.vocab_size} LM-head rows, the student {rows}: it scores over "
                         f"the first {rows} (the rest are padding)")
        else:
            notes.append(f"teacher {name!r} has {w.vocab_size} LM-head rows, the student {rows}, and its "
                         f"{w.backend} server (protocol {tuple(w.version)}) cannot leave out the rest: a top-k "
                         f"answer naming one of them stops the run")
    return limits, notes


def _load_cross(specs: list, student_tokenizer, key: str) -> dict:
    """The tokenizers of the `tokenizer: cross` teachers (opd.teachers.align), loaded before any connection."""
    if student_tokenizer is None:
        cross = [t.name for t in specs if getattr(t, "tokenizer", "same") == "cross"]
        if cross:
            raise TrainError(f"{key} {cross}: tokenizer cross is supported by opd train only")
        return {}
    try:
        return load_cross(specs, student_tokenizer)
    except ValueError as e:
        raise TrainError(f"{key}: {e}") from None


class TeacherSet:
    """The run's teachers: specs, checked clients and their WELCOMEs.

    specs: the teacher specs (opd train's merge.teachers, opd rl's teachers); client: the
    teacher_client settings; key: where the config lists them (messages); full_dtype: the dtype
    full-mode logits travel in; cluster, on_ray: a Ray cluster and the teachers it serves;
    check_memory(vocab_size, teachers) -> a note or None (raises TrainError): the caller's
    check of what its full-mode teachers' logits will hold. student_tokenizer: needed by
    `tokenizer: cross` teachers (opd.teachers.align; `cross`: theirs, by name)."""

    cross: Mapping = MappingProxyType({})   # {name: CrossTokenizers}; set by __init__ (tests build bare sets)

    def __init__(self, specs: list, client, student_fingerprint: str, student_path: str, *,
                 key: str = "merge.teachers", full_dtype: str = "float32", cluster=None,
                 on_ray: set[str] = frozenset(), check_memory=None, student_tokenizer=None):
        self.full_dtype = full_dtype
        self.specs = {t.name: t for t in specs}
        self.cross = _load_cross(specs, student_tokenizer, key)
        self.clients = connect_teachers(specs, client, student_fingerprint, student_path, key=key,
                                        cluster=cluster, on_ray=on_ray,
                                        fingerprints={n: tokenizer_fingerprint(c.teacher) for n, c in self.cross.items()})
        self._open_tokens = {name: 0 for name in self.specs}   # full mode: tokens of streams not yet ended
        self.vocab_limit, self.vocab_notes = _vocab_limits({n: s for n, s in self.specs.items() if n not in self.cross},
                                                           self.welcome, student_path)
        full = [name for name, spec in self.specs.items() if spec.mode == "full"]
        self.memory_note = None   # a full-mode run that may take over half the memory: said, and in the card
        if full and check_memory is not None:
            try:
                self.memory_note = check_memory(max(self.welcome(n).vocab_size for n in full), len(full))
            except TrainError:
                self.close()
                raise

    def welcome(self, name: str):
        return self.clients[name][1]

    def tokenizer(self, name: str, student_tokenizer):
        """The tokenizer teacher `name` reads: its own (`tokenizer: cross`), else the student's."""
        return self.cross[name].teacher if name in self.cross else student_tokenizer

    @property
    def has_full(self) -> bool:
        """A teacher answers in full mode (its streams hold the server's budget until read)."""
        return any(spec.mode == "full" for spec in self.specs.values())

    def prefill(self, teacher: str, sequences: list[list[int]], starts: list[int] | None = None) -> None:
        """Announce what `teacher` will score next (mode prefill; as it sees them: its context or the
        student's prompt, + the response so far from `starts`; None: prompts alone), so that a
        teacher with a prompt cache computes them while the student samples. A hint: a failed one
        is logged, and the SCOREs are answered alike. Not sent to a replica pool, where the
        replica that scores them is not known yet, nor to a cross-tokenizer teacher (these are the
        student's ids)."""
        client = self.clients[teacher][0]
        if not isinstance(client, TeacherClient) or teacher in self.cross:
            return
        try:
            futures = client.prefill(sequences, starts)
        except TeacherError as e:
            log.warning("teacher %r: prompts not announced (%s)", teacher, e)
            return
        for f in futures:
            f.add_done_callback(lambda f: f.exception() is None or
                                log.warning("teacher %r: prompts not announced (%s)", teacher, f.exception()))

    def request(self, teacher: str, sequences: list[list[int]], starts: list[int], contexts=None,
                candidates=None, rows=None) -> Future:
        """Future of `teacher`'s Answer for these sequences (prompt + response, response from starts).
        contexts [B]: the teacher's own prompts; candidates int32 [rows, k]: the ids it answers
        (mode student_topk). Both from opd.distill.context.teacher_inputs. rows [B] (a row mask):
        per sequence, which of its len - start response rows to answer (0/1); the answer's rows are
        then those (candidates one per such row). None: every row, and a request as before 2.5.
        A `tokenizer: cross` teacher scores its own tokens of the response after `contexts` (its
        prompt in its tokens): a Future of a CrossAnswer over the student's rows (opd.teachers.align)."""
        spec, client = self.specs[teacher], self.clients[teacher][0]
        t0 = time.perf_counter()
        if teacher in self.cross:
            def submit(seqs, st):
                return client.submit_topk(seqs, st, spec.k, temperature=spec.temperature)
            try:
                return self.cross[teacher].request(submit, sequences, starts, contexts)
            except TeacherError as e:
                failed: Future = Future()
                failed.set_exception(e)
                return failed
        if spec.mode == "full":
            offsets = [0]
            for n in answered_rows(sequences, starts, row_masks(sequences, starts, rows)):
                offsets.append(offsets[-1] + n)
            # A stream holds its tokens in the server's in-flight budget until its last row is
            # read. The request goes out now, so the teacher computes while the student does,
            # unless this client's open streams would then exceed that budget (BUSY until they
            # end): then it goes out at its first read, after the earlier streams ended.
            welcome = self.welcome(teacher)
            tokens = min(sum(scored_lengths(sequences, starts, contexts)), welcome.max_tokens_per_request)

            def done() -> None:
                self._open_tokens[teacher] -= tokens

            def send():
                self._open_tokens[teacher] += tokens
                return client.score_full(sequences, starts, temperature=spec.temperature,
                                         dtype=self.full_dtype, window=FULL_WINDOW,
                                         vocab_limit=self.vocab_limit.get(teacher, 0), contexts=contexts,
                                         rows=rows)

            stream = RowStream(send, offsets[-1], lambda e: self._error(teacher, e), t0, on_done=done)
            fut: Future = Future()
            try:
                if self._open_tokens[teacher] + tokens <= welcome.max_inflight_tokens:
                    stream.open()
                fut.set_result(Answer(None, stream, stream.token_logprob, offsets, 0.0))
            except TrainError as e:
                fut.set_exception(e)
            return fut

        outer: Future = Future()
        try:
            inner = client.submit_topk(sequences, starts, spec.k, temperature=spec.temperature,
                                       vocab_limit=self.vocab_limit.get(teacher, 0), contexts=contexts,
                                       candidates=candidates, rows=rows)
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

    def sample(self, teacher: str, prompts: list[list[int]], **kwargs) -> Future:
        """Future of `teacher`'s SampleResult for these prompts (SAMPLE; kwargs: n,
        max_new_tokens, temperature, top_p, seed, stop_ids, as TeacherClient.submit_sample)."""
        client = self.clients[teacher][0]
        if not isinstance(client, TeacherClient):
            raise TrainError(f"teacher {teacher!r} is served by replicas (a pool), which do not sample; measure its "
                             f"pass rates with `opd validate` and give them as merge.routing.pass_rates")
        try:
            return client.submit_sample(prompts, **kwargs)
        except TeacherError as e:
            raise self._error(teacher, e) from None

    def answers(self, futures: dict[str, Future]) -> dict[str, Answer]:
        """Wait for every teacher's answer; a teacher that changed its model stops the run."""
        out = {}
        for t, fut in futures.items():
            try:
                out[t] = fut.result()
            except TeacherError as e:
                raise self._error(t, e) from None
        return out

    def _error(self, t: str, e) -> TrainError:
        if e.code == "FINGERPRINT_CHANGED":
            return TrainError(f"teacher {t!r} restarted with a different model; stopping rather than "
                              f"mixing two teachers: {e.message}")
        return TrainError(f"teacher {t!r} at {self.specs[t].address} failed: {e}")

    @staticmethod
    def finish(answers: dict[str, Answer]) -> float:
        """Complete the full-mode streams of a batch (the rows nobody read, the latency); the
        seconds the trainer waited for their rows."""
        waited = 0.0
        for a in answers.values():
            if isinstance(a.logits, RowStream):
                a.latency_s = a.logits.finish()
                waited += a.logits.waited_s
        return waited

    def topk_ids(self, spec, answer: Answer, idx: torch.Tensor) -> torch.Tensor | None:
        """The teacher's top-k ids at answer rows `idx` (for the overlap diagnostic); None in mode
        student_topk, whose answer is at the student's ids and never names the teacher's own."""
        if spec.mode == "student_topk" or isinstance(answer, CrossAnswer):
            return None
        if answer.topk is not None:
            return answer.topk.ids[idx.to(answer.topk.ids.device)]
        # topk in the wire dtype: a bf16 answer's values are exact in fp32, so the order is the
        # same, without an fp32 copy of the micro-batch's [rows, V] for a diagnostic.
        return answer.logits[idx].topk(min(spec.k, answer.logits.shape[1]), -1).indices

    def close(self) -> None:
        for client, _ in self.clients.values():
            client.close()
