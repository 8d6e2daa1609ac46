"""The teacher logit store (opd.store) on the tiny models: written once from a live teacher,
replayed by `opd train` with no teacher running.

The teacher is the student with a rank-4 change of its LM head (opd.tiny.lm_head_teacher): the
same tokenizer, clearly other answers. It is served in a thread for the tests that write.
"""

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from opd.cli import main
from opd.config import from_dict, load_yaml
from opd.data import DataError, write_jsonl
from opd.distill.config import TrainConfig, load_train_config
from opd.distill.loss import train_batch
from opd.distill.stats import StepStats
from opd.distill.stored import open_store
from opd.distill.trainer import Trainer
from opd.fingerprint import tokenizer_fingerprint
from opd.metrics import read_metrics
from opd.routing.config import TeacherClientSettings, TeacherSpec
from opd.spine.config import ModelConfig
from opd.spine.model import load_policy, load_tokenizer
from opd.store import shards
from opd.store.config import StoreConfig, StoredSource
from opd.store.shards import StoreError, read_manifest, read_shard
from opd.store.write import build_store
from opd.teachers.hf_backend import HFBackend
from opd.teachers.server import serving_in_thread
from opd.teachers.session import TeacherSet
from opd.tiny import lm_head_teacher

pytestmark = pytest.mark.timeout(300)

K = 8


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("store")
    teacher = lm_head_teacher(tiny_model_dir, root / "teacher")
    rows = [{"prompt": f"q{i}: what is {i}+{i}?", "response": f"{2 * i} because {i}+{i}", "domain": "math"}
            for i in range(10)]
    write_jsonl(root / "pairs.jsonl", rows)
    write_jsonl(root / "prompts.jsonl", [{"prompt": f"say {i}"} for i in range(3)])
    with serving_in_thread(HFBackend(teacher, name="t", max_k=16)) as server:
        yield {"root": root, "student": tiny_model_dir, "teacher": teacher, "address": server.address}


def _store_cfg(env, out, **over) -> StoreConfig:
    d = {"student": {"path": str(env["student"])}, "teacher": {"address": env["address"], "name": "t"},
         "sequences": {"path": str(env["root"] / "pairs.jsonl")}, "out": str(out), "k": K, "shard_size": 4,
         "batch_size": 2}
    for key, value in over.items():
        d[key] = {**d[key], **value} if isinstance(value, dict) else value
    return from_dict(d, StoreConfig)


@pytest.fixture(scope="module")
def store(env):
    out = env["root"] / "store"
    build_store(_store_cfg(env, out), env["root"] / "store.yaml")
    return out


def _arrays(store: Path) -> list[dict]:
    m = read_manifest(store)
    return [read_shard(store, e, m)[0] for e in m["shards"]]


def test_manifest_and_dtypes(env, store):
    m = read_manifest(store)
    assert m["complete"] and m["sequences"] == 10 and len(m["shards"]) == 3          # 4 + 4 + 2
    assert m["k"] == K and m["temperature"] == 1.0 and m["vocab_size"] == 260
    tok = load_tokenizer(env["student"])
    assert m["tokenizer_fingerprint"] == tokenizer_fingerprint(tok) == m["teacher"]["tokenizer_fingerprint"]
    assert m["teacher"]["model_id"] and m["teacher"]["model_fingerprint"]
    a = _arrays(store)[0]
    assert a["topk_ids"].dtype == np.uint16 and a["tokens"].dtype == np.uint16      # V = 260 <= 65536
    assert a["topk_logprobs"].dtype == np.float16 and a["topk_logprobs"].shape[1] == K
    assert a["tail_logmass"].dtype == np.float32 and a["token_logprob"].dtype == np.float32
    # the tail is the mass outside the k, as the server sent it: with the fp16 k it sums to ~1
    total = np.exp(a["topk_logprobs"].astype(np.float64)).sum(1) + np.exp(a["tail_logmass"].astype(np.float64))
    assert np.allclose(total, 1.0, atol=2e-3)
    # bytes per answer row: k ids x 2 + k log-probs x 2 + tail 4 + token 4 (+ the sequence's own ids)
    assert a["topk_ids"].nbytes + a["topk_logprobs"].nbytes + 8 * len(a["tail_logmass"]) == \
        len(a["tail_logmass"]) * (4 * K + 8)


def test_stored_loss_equals_live(env, store):
    """The same batch through opd.distill.loss.train_batch against the store and against the live
    teacher: the loss and the gradient agree within the store's fp16 rounding of the log-probs."""
    student = str(env["student"])
    model, tok = load_policy(ModelConfig(path=student), seed=0)
    cfg = from_dict({"student": {"path": student}, "store": {"path": str(store), "k": K},
                     "optim": {"micro_batch_size": 3}, "run": {"out_dir": str(env["root"] / "unused")}},
                    TrainConfig)
    replay = open_store(cfg.store, cfg.merge.teachers[0], tokenizer_fingerprint(tok), seed=0)
    live = TeacherSet([TeacherSpec(name="store", address=env["address"], mode="topk", k=K)],
                      TeacherClientSettings(connect_timeout_s=5.0), tokenizer_fingerprint(tok), student)
    results = []
    try:
        for teachers in (replay.teachers, live):
            replay.batches.load_state({"epoch": 0, "pos": 0})
            batch = replay.batches.batch(0, 10, 0, {tok.eos_token_id})   # every stored sequence, one batch
            for t, (seqs, starts, _) in batch.requests().items():
                batch.futures[t] = teachers.request(t, seqs, starts)
            model.zero_grad()
            stats = StepStats()
            train_batch(model, batch, teachers, cfg=cfg, lam={"math": 1.0}, pad_id=tok.pad_token_id, scale=1.0,
                        stats=stats)
            grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            results.append((stats.loss, grad.clone()))
    finally:
        live.close()
    (stored_loss, stored_grad), (live_loss, live_grad) = results
    assert live_loss > 0.5                                        # the teacher really differs
    # fp16 keeps 11 significant bits: each stored log-prob is within 2^-11 of it, relatively (measured:
    # the loss 3e-5 apart, relatively)
    eps16 = 2.0 ** -11
    assert stored_loss == pytest.approx(live_loss, rel=eps16), (stored_loss, live_loss)
    assert stored_loss != live_loss                               # the fp16 rounding is really there
    assert (stored_grad - live_grad).norm() <= eps16 * live_grad.norm()


def test_opd_train_from_store_without_teacher(env, store):
    """`opd train` with `store:` (no merge, no teacher address anywhere): the stored divergence falls."""
    out = env["root"] / "train"
    cfg = from_dict({"student": {"path": str(env["student"])}, "store": {"path": str(store), "k": K},
                     "rollout": {"prompts_per_step": 5}, "optim": {"lr": 3e-3, "micro_batch_size": 5},
                     "run": {"steps": 16, "out_dir": str(out), "progress": False, "tensorboard": False,
                             "checkpoint_every": 8}}, TrainConfig)
    result = Trainer(cfg).run()
    assert result["step"] == 16 and result["evals"] == []            # no teacher: no held-out evaluation
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["staleness"] for r in rows] == [0] * 16                 # stored data is not importance-weighted
    first, last = np.mean([r["kl"] for r in rows[:2]]), np.mean([r["kl"] for r in rows[-2:]])
    assert last < 0.6 * first, (first, last)                          # two epochs of 10 sequences a 2 steps
    card = (out / "card.md").read_text()
    assert f"answers from the store {store}" in card
    assert json.loads((out / "card.json").read_text())["teacher store"]["model_fingerprint"] == \
        read_manifest(store)["teacher"]["model_fingerprint"]


def test_resume_from_a_checkpoint_continues_exactly(env, store, tmp_path):
    """The data position in the store is a checkpoint's: 2 + 2 resumed steps are the 4 steps; a
    store rescored in place since the checkpoint is refused."""
    copy = tmp_path / "store"
    shutil.copytree(store, copy)

    def cfg(name, steps, every=0):
        return from_dict({"student": {"path": str(env["student"])}, "store": {"path": str(copy), "k": K},
                          "rollout": {"prompts_per_step": 3}, "optim": {"lr": 3e-3},
                          "run": {"steps": steps, "out_dir": str(tmp_path / name), "progress": False,
                                  "tensorboard": False, "checkpoint_every": every}}, TrainConfig)

    Trainer(cfg("whole", 4, 2)).run()
    Trainer(cfg("part", 2)).run()
    Trainer(cfg("part", 4), resume=True).run()
    a, b = ({r["step"]: r["loss"] for r in read_metrics(tmp_path / n / "metrics.jsonl") if "loss" in r}
            for n in ("whole", "part"))
    assert sorted(b) == [1, 2, 3, 4] and all(abs(a[s] - b[s]) <= 1e-6 for s in a), (a, b)
    changed = read_manifest(copy)   # another teacher's answers at the same path since
    changed["teacher"]["model_fingerprint"] = "0" * 16
    shards.write_manifest(copy, changed)
    with pytest.raises(StoreError, match="now holds other answers than this run's checkpoint"):
        Trainer(cfg("part", 6), resume=True).run()


def test_crash_while_writing_resumes(env, store, monkeypatch):
    """The writer dies half-way through writing its second shard: the store lists the first
    shard only, is refused for training as unfinished, and a rerun finishes it with the
    answers an uninterrupted run wrote."""
    out = env["root"] / "crashed"
    real = shards._atomic_write

    def dying(path, data):
        if path.name == "shard_000001.npz":
            Path(str(path) + ".tmp").write_bytes(data[:len(data) // 2])   # half a file, then the crash
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(shards, "_atomic_write", dying)
    with pytest.raises(KeyboardInterrupt):
        build_store(_store_cfg(env, out), env["root"] / "store.yaml")
    monkeypatch.setattr(shards, "_atomic_write", real)
    m = read_manifest(out)
    assert [e["file"] for e in m["shards"]] == ["shard_000000.npz"] and not m["complete"]
    assert (out / "shard_000001.npz.tmp").is_file() and not (out / "shard_000001.npz").exists()
    with pytest.raises(StoreError, match="unfinished .*run `opd store`"):
        open_store(StoredSource(path=str(out), k=K), StoredSource(path="x").teacher_spec("store"),
                   m["tokenizer_fingerprint"], 0)
    first = (out / "shard_000000.npz").stat().st_mtime_ns
    build_store(_store_cfg(env, out), env["root"] / "store.yaml")
    assert read_manifest(out)["complete"] and (out / "shard_000000.npz").stat().st_mtime_ns == first  # kept
    for a, b in zip(_arrays(out), _arrays(store), strict=True):
        for name in shards.ARRAYS:
            assert np.array_equal(a[name], b[name]), name


def test_bad_input_is_refused_and_loses_nothing(env, store, tmp_path):
    tok = load_tokenizer(env["student"])
    fp = tokenizer_fingerprint(tok)
    spec = StoredSource(path="x").teacher_spec("store")
    # a mismatched k
    with pytest.raises(StoreError, match=f"store.k is 4, .* holds top-{K} answers: set store.k: {K}"):
        open_store(StoredSource(path=str(store), k=4), spec, fp, 0)
    # a store made with another tokenizer (the student's with another chat template)
    other = tmp_path / "other"
    shutil.copytree(env["student"], other)
    tc = json.loads((other / "tokenizer_config.json").read_text())
    tc["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (other / "tokenizer_config.json").write_text(json.dumps(tc))
    other_fp = tokenizer_fingerprint(load_tokenizer(other))
    assert other_fp != fp
    with pytest.raises(StoreError, match="scored with tokenizer .* the student's tokenizer is"):
        open_store(StoredSource(path=str(store), k=K), spec, other_fp, 0)
    # a truncated shard: refused at open, with the fix; `opd store` rewrites it and keeps the others
    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    damaged = copy / "shard_000001.npz"
    damaged.write_bytes(damaged.read_bytes()[:100])
    kept = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in copy.glob("shard_00000[02].npz")}
    with pytest.raises(StoreError, match="shard_000001.npz is 100 bytes.*truncated.*run `opd store`"):
        open_store(StoredSource(path=str(copy), k=K), spec, fp, 0)
    with pytest.raises(StoreError, match="truncated"):
        read_shard(copy, read_manifest(copy)["shards"][1], read_manifest(copy))
    build_store(_store_cfg(env, copy), env["root"] / "store.yaml")
    assert {p: hashlib.sha256((copy / p).read_bytes()).hexdigest() for p in kept} == kept
    assert np.array_equal(_arrays(copy)[1]["topk_logprobs"], _arrays(store)[1]["topk_logprobs"])
    # resuming with another k is refused before anything is written
    before = sorted((p.name, p.stat().st_mtime_ns) for p in copy.iterdir())
    with pytest.raises(StoreError, match="begun with another k"):
        build_store(_store_cfg(env, copy, k=4), env["root"] / "store.yaml")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in copy.iterdir()) == before
    # rows without a response are not sequences
    with pytest.raises(DataError, match="no `response`.*sequences.prompts"):
        build_store(_store_cfg(env, tmp_path / "s2", sequences={"path": str(env["root"] / "prompts.jsonl")}),
                    env["root"] / "store.yaml")
    # a train config with both a store and live teachers
    with pytest.raises(Exception, match="give `store` or `merge`, not both"):
        from_dict({"student": {"path": "s"}, "store": {"path": "st"},
                   "merge": {"teachers": [{"name": "t", "address": "tcp://127.0.0.1:1"}],
                             "datasets": [{"domain": "d", "path": "p"}]}}, TrainConfig)


def test_student_rollouts_store(env):
    """Lightning-OPD's source: the student answers the prompts once; the teacher scores that."""
    out = env["root"] / "rollouts"
    cfg = _store_cfg(env, out, sequences={"path": None, "prompts": str(env["root"] / "prompts.jsonl"), "n": 2,
                                          "max_new_tokens": 6}, shard_size=2)
    m = build_store(cfg, env["root"] / "store.yaml")
    assert m["complete"] and m["sequences"] == 6 and m["source"]["kind"] == "rollouts"
    a, meta = read_shard(out, m["shards"][0], m)
    assert [x["prompt"] for x in meta] == ["say 0", "say 0"]
    assert all(1 <= n <= 6 for n in np.diff(a["row_offsets"]))


def test_cli_help_and_describe():
    run = [sys.executable, "-m", "opd.cli", "store"]
    help_ = subprocess.run(run + ["--help"], capture_output=True, text=True, check=True).stdout
    assert "teacher logit store" in help_ and "shard_size" in help_ and "sequences:" in help_
    described = subprocess.run(run + ["--describe"], capture_output=True, text=True, check=True).stdout
    assert described.startswith("student:") and "k (int, default 32)" in described
    missing = subprocess.run(run, capture_output=True, text=True)
    assert missing.returncode == 2 and "a config file is needed" in missing.stderr


def test_cli_serves_its_teacher_and_refuses_a_mismatch_in_one_line(env, store, tmp_path, capsys):
    """`opd store` with teacher.model (served for the run, then stopped); a finished store is not
    scored again; `opd train` against a store of another k is one line, exit 1."""
    cfg = {"student": {"path": str(env["student"])}, "teacher": {"model": str(env["teacher"])},
           "sequences": {"path": str(env["root"] / "pairs.jsonl"), "max_sequences": 3}, "out": "s", "k": K}
    (tmp_path / "store.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["store", str(tmp_path / "store.yaml")]) == 0
    out = capsys.readouterr().out
    assert "teacher 'teacher' serving at tcp://" in out and "store: 3 sequences" in out
    assert read_manifest(tmp_path / "s")["complete"]
    assert main(["store", str(tmp_path / "store.yaml")]) == 0
    assert "is complete (3 sequences in 1 shards)" in capsys.readouterr().out   # no teacher started
    train = {"student": {"path": str(env["student"])}, "store": {"path": str(store), "k": 16},
             "run": {"out_dir": str(tmp_path / "run")}}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(train))
    assert main(["train", str(tmp_path / "train.yaml")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("opd train: error: store.k is 16") and f"set store.k: {K}" in err[-1]


def test_example_configs_load_and_spell_out_every_key():
    """configs/store.yaml names every key of `opd store` (as train_single.yaml does for opd train)."""
    root = Path(__file__).resolve().parents[2] / "configs"
    cfg = load_yaml(root / "store.yaml", StoreConfig)
    assert cfg.k == 16 and cfg.sequences.path and cfg.teacher.model
    assert load_train_config(root / "train_stored.yaml").store.k == cfg.k

    def keys(cls, prefix=""):
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            inner = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
            yield prefix + f.name
            if inner:
                yield from keys(inner[0], f"{prefix}{f.name}.")

    def present(node, prefix=""):
        for k, v in node.items():
            yield prefix + k
            if isinstance(v, dict):
                yield from present(v, f"{prefix}{k}.")

    assert set(keys(StoreConfig)) <= set(present(yaml.safe_load((root / "store.yaml").read_text())))


def test_writer_killed_mid_shard_resumes(env, store, tmp_path):
    """The writer process gets SIGKILL half-way through writing its second shard (nothing of it
    runs after: no `finally`, no flush); a rerun finishes the store with the uninterrupted answers."""
    out = tmp_path / "killed"
    cfg = {"student": {"path": str(env["student"])}, "teacher": {"address": env["address"], "name": "t"},
           "sequences": {"path": str(env["root"] / "pairs.jsonl")}, "out": str(out), "k": K, "shard_size": 4,
           "batch_size": 2}
    (tmp_path / "store.yaml").write_text(yaml.safe_dump(cfg))
    script = f"""
import os, signal
from pathlib import Path
from opd.config import load_yaml
from opd.store import shards
from opd.store.config import StoreConfig
from opd.store.write import build_store
real = shards._atomic_write
def dying(path, data):
    if path.name == "shard_000001.npz":
        Path(str(path) + ".tmp").write_bytes(data[:len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    real(path, data)
shards._atomic_write = dying
build_store(load_yaml({str(tmp_path / "store.yaml")!r}, StoreConfig), Path({str(tmp_path / "store.yaml")!r}))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    m = read_manifest(out)
    assert [e["file"] for e in m["shards"]] == ["shard_000000.npz"] and not m["complete"]
    build_store(load_yaml(tmp_path / "store.yaml", StoreConfig), tmp_path / "store.yaml")
    for a, b in zip(_arrays(out), _arrays(store), strict=True):
        for name in shards.ARRAYS:
            assert np.array_equal(a[name], b[name]), name
