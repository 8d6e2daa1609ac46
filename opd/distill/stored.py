"""What `opd train` trains against with a `store:` section: a store's sequences and answers
(opd.store), no teacher running.

    open_store(source, spec, student_fingerprint, seed) -> Replay (teachers, batches, prompts)

`StoredTeachers` has the interface of opd.teachers.session.TeacherSet that the trainer and
opd.distill.loss use (specs, request -> Future of an Answer, answers, finish, topk_ids,
welcome): a request is answered from the rows the batch source handed it, as a TopKTeacher
with fp32 log-probs (the stored fp16 widened), the exact tail and the token's log-prob, so
`teacher_loss` computes the same {top-k, tail} divergence a live answer gives.

`StoreBatches` yields the stored sequences as Batches, one sequence per sample: each epoch
takes the shards in a seeded random order and each shard's sequences shuffled (so one or two
shards are in memory at a time). The sequences are off-policy and fixed: they are trained as
stored (loss.trim does not cut them; they were scored as they are), and nothing is
importance-weighted (their sampler is not the student being trained).
"""

from __future__ import annotations

import bisect
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import torch

from opd.data import Sample
from opd.distill.batch import Batch
from opd.distill.prompts import Prompts
from opd.errors import TrainError
from opd.kernels import TopKTeacher
from opd.rollout.base import Rollout
from opd.routing.config import RouterConfig
from opd.routing.router import Route, Router
from opd.store.shards import StoreError, check_shard, read_manifest, read_shard
from opd.teachers.protocol import Welcome
from opd.teachers.session import Answer

# (start, ids int32 [n, k], logprobs fp32 [n, k], tail fp32 [n], token log-prob fp32 [n]) of one sequence
Rows = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class StoredTeachers:
    """One teacher's answers, read from a store instead of asked of a server."""

    has_full = False
    memory_note = None

    def __init__(self, spec, welcome: Welcome):
        self.specs = {spec.name: spec}
        self._welcome = welcome     # the scoring teacher's, its model_id naming the store (the card's teacher)
        self.vocab_notes: list[str] = []
        self.vocab_limit: dict[str, int] = {}
        self._rows: dict[tuple[int, ...], Rows] = {}

    def hold(self, rows: dict[tuple[int, ...], Rows]) -> None:
        """The answers of the batch about to be sent, by sequence (prompt + response ids)."""
        self._rows = rows

    def welcome(self, name: str) -> Welcome:
        return self._welcome

    def tokenizer(self, name: str, student_tokenizer):
        """The tokenizer the teacher reads: the student's (a store is refused otherwise)."""
        return student_tokenizer

    def prefill(self, teacher: str, sequences, starts=None) -> None:
        """Nothing to announce: the answers exist."""

    def request(self, teacher: str, sequences: list[list[int]], starts: list[int], contexts=None, candidates=None,
                rows=None) -> Future:
        if contexts is not None or candidates is not None or rows is not None:
            raise TrainError("a store answers the sequences it scored, from the student's prompt, at the teacher's "
                             "own top k, every response row: no teacher context, student_topk or multi-turn rows")
        parts = []
        for seq, start in zip(sequences, starts):
            got = self._rows.get(tuple(seq))
            if got is None or got[0] != start:
                raise TrainError(f"the store holds no answer for a sequence of {len(seq)} tokens (response from "
                                 f"{start}): only the stored sequences can be trained against a store")
            parts.append(got)
        offsets = np.concatenate([[0], np.cumsum([len(p[4]) for p in parts])]).tolist()
        cat = [torch.cat([p[i] for p in parts]) for i in range(1, 5)]
        fut: Future = Future()
        fut.set_result(Answer(TopKTeacher(cat[0], cat[1], cat[2]), None, cat[3], offsets, 0.0))
        return fut

    def answers(self, futures: dict[str, Future]) -> dict[str, Answer]:
        return {t: f.result() for t, f in futures.items()}

    @staticmethod
    def finish(answers: dict[str, Answer]) -> float:
        return 0.0

    def topk_ids(self, spec, answer: Answer, idx: torch.Tensor) -> torch.Tensor:
        return answer.topk.ids[idx.to(answer.topk.ids.device)]

    def close(self) -> None:
        pass


class StoreBatches:
    """The stored sequences, `n` at a time, epoch after epoch (seeded), as Batches."""

    def __init__(self, path: Path, manifest: dict, teachers: StoredTeachers, name: str, seed: int, shuffle: bool):
        self.path, self.manifest, self.teachers, self.name = path, manifest, teachers, name
        self.seed, self.shuffle = seed, shuffle
        self.shards = manifest["shards"]
        self.firsts = [e["first"] for e in self.shards]
        self.total = sum(e["sequences"] for e in self.shards)
        self.epoch, self.pos = 0, 0
        self._order = self._epoch_order(0)
        self._cache: dict[int, tuple[dict, list[dict]]] = {}   # shard number -> (arrays, meta): the last two read

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """Global sequence numbers [total] in the order epoch `epoch` draws them."""
        if not self.shuffle:
            return np.arange(self.total)
        rng = np.random.default_rng([self.seed, epoch])
        return np.concatenate([self.firsts[s] + rng.permutation(self.shards[s]["sequences"])
                               for s in rng.permutation(len(self.shards))])

    def _take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            if self.pos == self.total:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            m = min(n - len(out), self.total - self.pos)
            out += self._order[self.pos:self.pos + m].tolist()
            self.pos += m
        return out

    def _shard(self, s: int) -> tuple[dict, list[dict]]:
        if s not in self._cache:
            if len(self._cache) >= 2:
                self._cache.pop(next(iter(self._cache)))
            self._cache[s] = read_shard(self.path, self.shards[s], self.manifest)
        return self._cache[s]

    def batch(self, index: int, n: int, version: int, stop_ids) -> Batch:
        """The next `n` stored sequences as batch `index` (trained by weights of `version`:
        stored data is never importance-weighted); their answers go to the teachers."""
        samples, routes, rollouts, held = [], [], [], {}
        for j, g in enumerate(self._take(n)):
            s = bisect.bisect_right(self.firsts, g) - 1
            a, meta = self._shard(s)
            b = g - self.firsts[s]
            ids = a["tokens"][a["seq_offsets"][b]:a["seq_offsets"][b + 1]].astype(np.int64).tolist()
            start, r0, r1 = int(a["starts"][b]), int(a["row_offsets"][b]), int(a["row_offsets"][b + 1])
            m = meta[b]
            samples.append(Sample(prompt=m["prompt"], domain=m.get("domain"), answer=m.get("answer")))
            domain = m.get("domain") or "stored"
            routes.append(Route(teacher=self.name, weights={self.name: 1.0}, rule="store",
                                reason=f"stored sequence {g}", domain=domain))
            rollouts.append(Rollout(prompt_ids=ids[:start], response_ids=ids[start:], logprobs=[],
                                    finish_reason="eos" if ids[-1] in stop_ids else "length", prompt_index=j))
            held[tuple(ids)] = (start, torch.from_numpy(a["topk_ids"][r0:r1].astype(np.int32)),
                                torch.from_numpy(a["topk_logprobs"][r0:r1].astype(np.float32)),
                                torch.from_numpy(a["tail_logmass"][r0:r1]), torch.from_numpy(a["token_logprob"][r0:r1]))
        self.teachers.hold(held)
        return Batch(index=index, samples=samples, routes=routes, rollouts=rollouts,
                     keep=[len(ro.response_ids) for ro in rollouts], policy_version=version)

    # the checkpoint's data position (the trainer saves it as its prompt sampler's)
    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "store": self._identity()}

    def load_state(self, state: dict) -> None:
        """A checkpoint's position, refused when the store at the path now holds other answers
        (rescored by another teacher, or over other sequences) than the run trained on."""
        if state.get("store", self._identity()) != self._identity():
            raise StoreError(f"store {self.path} now holds other answers than this run's checkpoint was trained on "
                             f"(then {state['store']}, now {self._identity()}): resume with that store, or start a "
                             f"new run")
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._epoch_order(self.epoch)

    def _identity(self) -> dict:
        m = self.manifest
        return {"teacher": m["teacher"]["model_fingerprint"], "source": m["source"].get("sha256"),
                "sequences": m["sequences"], "k": m["k"]}


@dataclass
class Replay:
    teachers: StoredTeachers
    batches: StoreBatches
    prompts: Prompts


def open_store(source, spec, student_fingerprint: str, seed: int) -> Replay:
    """The store of a train config's `store:` section (`source`), checked against the run:
    complete, the student's tokenizer, the config's k and temperature; `spec`: the teacher
    spec the store stands for. StoreError (one line, what to change) otherwise."""
    path = Path(source.path)
    manifest = read_manifest(path)
    if manifest is None:
        raise StoreError(f"store.path {path}: no store there (no manifest.json); write one with `opd store CONFIG`")
    listed = sum(e["sequences"] for e in manifest["shards"])
    if not manifest.get("complete") or listed != manifest["sequences"]:
        raise StoreError(f"store {path} is unfinished ({len(manifest['shards'])} shards of "
                         f"{-(-manifest['sequences'] // manifest['shard_size'])}): run `opd store` with its config "
                         f"again to finish it")
    t = manifest["teacher"]
    if manifest["tokenizer_fingerprint"] != student_fingerprint:
        raise StoreError(f"store {path} was scored with tokenizer {manifest['tokenizer_fingerprint']} (teacher "
                         f"{t['model_id']}), the student's tokenizer is {student_fingerprint}: its ids mean other "
                         f"tokens; score the sequences again with this student (`opd store`)")
    if manifest["k"] != source.k:
        raise StoreError(f"store.k is {source.k}, the store {path} holds top-{manifest['k']} answers: set store.k: "
                         f"{manifest['k']} (or score a store at k {source.k})")
    if manifest["temperature"] != source.temperature:
        raise StoreError(f"store.temperature is {source.temperature}, the store {path} was scored at "
                         f"{manifest['temperature']}: set store.temperature: {manifest['temperature']}")
    for entry in manifest["shards"]:   # sizes now; each shard's sha256 when it is read
        problem = check_shard(path, entry, full=False)
        if problem:
            raise StoreError(f"store {path}: {problem}; run `opd store` with the store's config again: it rewrites "
                             f"the damaged shards and keeps the others")
    welcome = msgspec.structs.replace(msgspec.convert(t, Welcome),
                                      model_id=f"{t['model_id']} (answers from the store {path})")
    teachers = StoredTeachers(spec, welcome)
    print(f"store: {manifest['sequences']} sequences scored by {t['model_id']} (model {t['model_fingerprint']}), "
          f"top-{manifest['k']} at temperature {manifest['temperature']}, from {path}; no teacher runs", flush=True)
    batches = StoreBatches(path, manifest, teachers, spec.name, seed, source.shuffle)
    domains: dict[str, int] = {}
    for entry in manifest["shards"]:
        for d, c in entry.get("domains", {}).items():
            domains[d] = domains.get(d, 0) + c
    prompts = Prompts(datasets={d: range(c) for d, c in (domains or {"stored": batches.total}).items()},
                      sampler=batches, eval_samples=[], eval_routes=[], routes={}, sft=None, reports={})
    prompts.router = Router(RouterConfig(), [spec])   # one teacher, no rules: what "routed" the stored sequences
    return Replay(teachers, batches, prompts)
