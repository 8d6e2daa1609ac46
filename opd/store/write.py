"""`opd store`'s work: one teacher's top-k answers on a fixed set of sequences, written once.

    build_store(cfg, cfg_path) -> the manifest

1. the sequences: a prompt/response JSONL encoded with the student's tokenizer (the prompt with
   its chat template, the response + EOS, as `opd sft` trains them), or the student's own
   rollouts of a prompt file, sampled shard by shard with a per-shard seed;
2. the teacher: a running server, or `teacher.model` served as a subprocess for the run; the
   trainer's own client (opd.teachers.session.TeacherSet) checks it before anything is
   scored: reachable, the student's tokenizer, able to answer top-k at k;
3. shard by shard: its sequences' requests all in flight at once, the answers narrowed
   (ids uint16 where V allows, log-probs fp16; tail and token log-prob kept fp32) and written
   atomically, then listed in the manifest. A rerun resumes after the last listed shard and
   rewrites a listed shard whose file no longer matches its sha256; a rerun with another
   teacher, k, temperature, shard size or source is refused.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import msgspec
import numpy as np
import torch
from tqdm import tqdm

from opd.config import near, to_dict
from opd.data import DataError, Sample, encode_prompt, load_jsonl
from opd.fingerprint import model_fingerprint, tokenizer_fingerprint
from opd.rollout.base import SamplingParams
from opd.routing.config import TeacherSpec
from opd.spine.config import RolloutConfig
from opd.spine.model import load_policy, load_tokenizer, make_engine
from opd.store.config import StoreConfig
from opd.store.shards import (FORMAT, LOGPROB_DTYPE, StoreError, check_shard, ids_dtype, read_manifest,
                              write_manifest, write_shard)
from opd.teachers.launch import start_server_process
from opd.teachers.session import TeacherSet

Sequence = tuple[list[int], list[int], dict]   # (prompt ids, response ids, {prompt, domain, answer})


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _meta(s: Sample) -> dict:
    return {"prompt": s.prompt, "domain": s.domain, **({"answer": s.answer} if s.answer is not None else {})}


class JsonlSequences:
    """Prompt/response rows, encoded as `opd sft` encodes them."""

    def __init__(self, path: Path, tok, limit: int | None):
        samples, _ = load_jsonl(path)
        missing = [i for i, s in enumerate(samples) if not s.response]
        if missing:
            raise DataError(f"{path}: row {missing[0] + 1} has no `response`: sequences.path holds prompt/response "
                            f"rows (opd generate writes them); to store the student's own answers to prompts, give "
                            f"sequences.prompts instead")
        self.samples, self.tok = samples[:limit] if limit else samples, tok
        self.source = {"kind": "jsonl", "path": str(path), "sha256": _sha256(path), "max_sequences": limit}

    def __len__(self) -> int:
        return len(self.samples)

    def get(self, first: int, n: int, shard: int) -> list[Sequence]:
        eos = [self.tok.eos_token_id] if self.tok.eos_token_id is not None else []
        return [(encode_prompt(self.tok, s.chat), self.tok(s.response, add_special_tokens=False)["input_ids"] + eos,
                 _meta(s)) for s in self.samples[first:first + n]]


class RolloutSequences:
    """The student's own answers, `n` per prompt, sampled when their shard is written (each
    shard with its own seed: a resumed store samples what an uninterrupted one would)."""

    def __init__(self, cfg: StoreConfig, path: Path, tok):
        s = cfg.sequences
        samples, _ = load_jsonl(path)
        self.samples, self.tok, self.s = samples, tok, s
        self.count = min(len(samples) * s.n, s.max_sequences or len(samples) * s.n)
        model, _ = load_policy(cfg.student.model(), seed=s.seed, tokenizer=tok, train=False, what="student.path")
        rollout = RolloutConfig(engine=s.engine, max_new_tokens=s.max_new_tokens, batch_size=max(64, s.n))
        self.engine = make_engine(rollout, cfg.student.model(), model, tok, seed=s.seed)
        self.source = rollout_source(cfg, path)

    def __len__(self) -> int:
        return self.count

    def get(self, first: int, n: int, shard: int) -> list[Sequence]:
        s = self.s
        a, b = first // s.n, -(-min(first + n, self.count) // s.n)   # the prompts these sequences answer
        prompts = self.samples[a:b]
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens, n=s.n,
                                seed=s.seed * 1_000_003 + shard)
        rollouts = self.engine.generate([encode_prompt(self.tok, p.chat) for p in prompts], params)
        out = [(ro.prompt_ids, ro.response_ids, _meta(prompts[ro.prompt_index])) for ro in rollouts]
        return out[first - a * s.n:first - a * s.n + n]

    def close(self) -> None:
        self.engine.close()


def rollout_source(cfg: StoreConfig, path: Path) -> dict:
    """Where the student's rollouts come from: what makes them the same on a resume."""
    s = cfg.sequences
    return {"kind": "rollouts", "prompts": str(path), "sha256": _sha256(path),
            "student_fingerprint": model_fingerprint(cfg.student.path),
            "sampling": {k: getattr(s, k) for k in ("n", "temperature", "top_p", "max_new_tokens", "seed", "engine",
                                                    "max_sequences")}}


def _identity(cfg: StoreConfig, source: dict, tokenizer_fp: str) -> dict:
    """What a resumed store must share with the one on disk."""
    return {"k": cfg.k, "temperature": cfg.temperature, "shard_size": cfg.shard_size, "source": source,
            "tokenizer_fingerprint": tokenizer_fp}


def _start_teacher(cfg: StoreConfig, base: Path):
    """(address, the server process or None): teacher.model served for the run as a subprocess."""
    t = cfg.teacher
    if t.address is not None:
        return t.address, None
    args = ["--model", near(base, t.model), "--backend", t.backend, "--name", t.name, *t.serve_args]
    if "--max-k" not in t.serve_args:
        args += ["--max-k", str(max(cfg.k, 64))]
    try:
        server = start_server_process(args, timeout_s=t.startup_timeout_s, threads=None, die_with_parent=True)
    except RuntimeError as e:
        raise StoreError(f"teacher.model {t.model}: the server did not start: {str(e)[-500:]}") from None
    print(f"store: teacher {t.name!r} serving at {server.address} (pid {server.proc.pid})", flush=True)
    return server.address, server


def score_shard(teachers: TeacherSet, name: str, seqs: list[Sequence], batch_size: int, vocab: int,
                k: int) -> dict[str, np.ndarray]:
    """The shard's arrays (shards.py) from one teacher's answers on `seqs`: every request in flight
    at once, the answers narrowed to the store's dtypes."""
    futures = [teachers.request(name, [p + r for p, r, _ in seqs[a:a + batch_size]],
                                [len(p) for p, _, _ in seqs[a:a + batch_size]])
               for a in range(0, len(seqs), batch_size)]
    answers = [teachers.answers({name: f})[name] for f in futures]
    ids = torch.cat([a.topk.ids for a in answers])
    if ids.shape[1] != k:
        raise StoreError(f"teacher answered {ids.shape[1]} ids per row, {k} were asked for")
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise StoreError(f"teacher answered an id outside its vocabulary of {vocab}")
    rows = [len(r) for _, r, _ in seqs]
    if sum(rows) != len(ids):
        raise StoreError(f"teacher answered {len(ids)} rows for {sum(rows)} response tokens")
    dtype = ids_dtype(vocab)
    lengths = [len(p) + len(r) for p, r, _ in seqs]
    return {
        "tokens": np.fromiter((t for p, r, _ in seqs for t in p + r), dtype=np.int64).astype(dtype),
        "seq_offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "starts": np.array([len(p) for p, _, _ in seqs], dtype=np.int32),
        "row_offsets": np.concatenate([[0], np.cumsum(rows)]).astype(np.int64),
        "topk_ids": ids.numpy().astype(dtype),
        "topk_logprobs": torch.cat([a.topk.logprobs for a in answers]).numpy().astype(LOGPROB_DTYPE),
        "tail_logmass": torch.cat([a.topk.tail_logmass for a in answers]).float().numpy(),
        "token_logprob": torch.cat([torch.as_tensor(a.token_logprob) for a in answers]).float().numpy(),
    }


def build_store(cfg: StoreConfig, cfg_path: Path) -> dict:
    """Score the config's sequences into cfg.out, resuming an unfinished store there; the manifest."""
    base = Path(cfg_path).resolve().parent
    out = Path(near(base, cfg.out))
    student = replace(cfg.student, path=near(base, cfg.student.path))
    cfg = replace(cfg, student=student)
    tok = load_tokenizer(student.path, "student.path")
    tokenizer_fp = tokenizer_fingerprint(tok)
    s = cfg.sequences
    if s.path is not None:
        source = JsonlSequences(Path(near(base, s.path)), tok, s.max_sequences)
    else:
        source = None   # sampled lazily below, once the store is known to need it
        prompts_path = Path(near(base, s.prompts))
        source_id = rollout_source(cfg, prompts_path)
    manifest = read_manifest(out)
    identity = _identity(cfg, source.source if source else source_id, tokenizer_fp)
    if manifest is not None:
        _check_resume(out, manifest, identity)
    elif out.exists() and any(out.iterdir()):
        raise StoreError(f"out {out} exists and is not a store (no {out}/manifest.json): give an empty or new "
                         f"directory; nothing was written")
    done = _verified_shards(out, manifest) if manifest is not None else []
    total = len(source) if source is not None else _rollout_count(s, prompts_path)
    n_shards = -(-total // cfg.shard_size)
    if manifest is not None and manifest.get("complete") and len(done) == n_shards:
        print(f"store: {out} is complete ({total} sequences in {n_shards} shards)", flush=True)
        return manifest
    out.mkdir(parents=True, exist_ok=True)
    address, server = _start_teacher(cfg, base)
    teachers = None
    try:
        spec = TeacherSpec(name=cfg.teacher.name, address=address, mode="topk", k=cfg.k, temperature=cfg.temperature,
                           curve_server_key=near(base, cfg.teacher.curve_server_key))
        client = replace(cfg.teacher_client, curve_secret_key=near(base, cfg.teacher_client.curve_secret_key))
        teachers = TeacherSet([spec], client, tokenizer_fp, student.path, key="teacher")
        welcome = teachers.welcome(spec.name)
        vocab = teachers.vocab_limit.get(spec.name, welcome.vocab_size)
        if manifest is not None and manifest["teacher"]["model_fingerprint"] != welcome.model_fingerprint:
            raise StoreError(f"store {out} was scored by teacher model {manifest['teacher']['model_fingerprint']} "
                             f"({manifest['teacher']['model_id']}); the server at {address} serves "
                             f"{welcome.model_fingerprint} ({welcome.model_id}): a store holds one teacher's answers; "
                             f"give another `out`")
        if manifest is None:
            manifest = {"format": FORMAT, **identity, "vocab_size": vocab, "teacher": msgspec.to_builtins(welcome),
                        "dtypes": {"tokens": ids_dtype(vocab), "topk_ids": ids_dtype(vocab),
                                   "topk_logprobs": LOGPROB_DTYPE, "tail_logmass": "float32",
                                   "token_logprob": "float32", "starts": "int32", "seq_offsets": "int64",
                                   "row_offsets": "int64"},
                        "sequences": total, "config": to_dict(cfg), "shards": [], "complete": False}
        if source is None:
            source = RolloutSequences(cfg, prompts_path, tok)
        manifest["shards"], manifest["complete"] = done, False
        todo = [i for i in range(n_shards) if i not in {int(e["file"][6:12]) for e in done}]
        t0 = time.perf_counter()
        for i in tqdm(todo, desc="opd store", unit="shard", dynamic_ncols=True):
            first = i * cfg.shard_size
            seqs = source.get(first, min(cfg.shard_size, total - first), i)
            arrays = score_shard(teachers, spec.name, seqs, cfg.batch_size, vocab, cfg.k)
            meta = [m for _, _, m in seqs]
            entry = {**write_shard(out, i, arrays, meta), "first": first,
                     "domains": dict(Counter(m["domain"] or "stored" for m in meta))}
            manifest["shards"] = sorted(manifest["shards"] + [entry], key=lambda e: e["first"])
            write_manifest(out, manifest)   # after the shard's rename: a listed shard is a whole file
        manifest["complete"] = True
        manifest["wall_s_last_run"] = round(time.perf_counter() - t0, 2)
        write_manifest(out, manifest)
        return manifest
    finally:
        if teachers is not None:
            teachers.close()
        if isinstance(source, RolloutSequences):
            source.close()
        if server is not None:
            server.stop()


def _rollout_count(s, prompts_path: Path) -> int:
    samples, _ = load_jsonl(prompts_path)
    return min(len(samples) * s.n, s.max_sequences or len(samples) * s.n)


def _check_resume(out: Path, manifest: dict, identity: dict) -> None:
    """A store on disk may be resumed only by the config that began it."""
    changed = [k for k, v in identity.items() if manifest.get(k) != v]
    if changed:
        said = "; ".join(f"{k}: the store has {manifest.get(k)!r}, the config {identity[k]!r}" for k in changed)
        raise StoreError(f"store {out} was begun with another {', '.join(changed)} ({said}): give another `out` "
                         f"(nothing was written)")


def _verified_shards(out: Path, manifest: dict) -> list[dict]:
    """The listed shards whose files are whole; a damaged one is said, and scored again."""
    kept = []
    for entry in manifest["shards"]:
        problem = check_shard(out, entry)
        if problem:
            print(f"store: {problem}; it is scored again", flush=True)
        else:
            kept.append(entry)
    return kept
