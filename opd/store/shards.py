"""The store's on-disk format: a JSON manifest and one .npz file per `shard_size` sequences.

    STORE/manifest.json        what the store is (teacher, tokenizer, k, temperature, V, dtypes,
                               where the sequences came from) and the shards completed, each with
                               its size and sha256
    STORE/shard_000000.npz     sequences [first, first + n) of the store:
        tokens        ids dtype [T]      prompt + response ids of every sequence, concatenated
        seq_offsets   int64 [n + 1]      sequence b is tokens[seq_offsets[b]:seq_offsets[b + 1]]
        starts        int32 [n]          where each response starts (its first row)
        row_offsets   int64 [n + 1]      sequence b's answer rows, R = row_offsets[n] in all
        topk_ids      ids dtype [R, k]   uint16 when V <= 65536, else int32
        topk_logprobs float16 [R, k]     at the store's temperature
        tail_logmass  float32 [R]        log(1 - sum of the k probabilities), exact as the server sent it
        token_logprob float32 [R]        the teacher's log-prob of the response's token at the row
        meta          str (0-d)          JSON list of {prompt, domain} per sequence

Writes are atomic: a shard is written to a temporary name and renamed, then the manifest
(also written to a temporary name and renamed) lists it. A crash leaves at most a stray
temporary file, which the next `opd store` run overwrites; a listed shard is whole unless it
was damaged afterwards, which its size and sha256 reveal (`read_shard`, `check_shard`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from pathlib import Path

import numpy as np

FORMAT = "opd-store/1"
MANIFEST = "manifest.json"
ARRAYS = ("tokens", "seq_offsets", "starts", "row_offsets", "topk_ids", "topk_logprobs", "tail_logmass",
          "token_logprob")
LOGPROB_DTYPE = "float16"


class StoreError(ValueError):
    """A store that cannot be written or read as asked; the message says which file and what to do."""


def ids_dtype(vocab_size: int) -> str:
    """The narrowest dtype that holds every id of a vocabulary of `vocab_size` rows."""
    return "uint16" if vocab_size <= 1 << 16 else "int32"


def shard_name(index: int) -> str:
    return f"shard_{index:06d}.npz"


def _atomic_write(path: Path, data: bytes) -> None:
    """`data` at `path`, or nothing there: written beside it, flushed to disk, renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(store: Path) -> dict | None:
    """The manifest of `store`, or None where there is none yet."""
    p = Path(store) / MANIFEST
    if not p.is_file():
        return None
    try:
        m = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise StoreError(f"{p}: not a store manifest ({e}); it is written atomically, so this file was damaged "
                         f"after the fact: delete the store or restore the file") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise StoreError(f"{p}: not an opd store manifest (format {m.get('format') if isinstance(m, dict) else m!r}, "
                         f"expected {FORMAT})")
    return m


def write_manifest(store: Path, manifest: dict) -> None:
    _atomic_write(Path(store) / MANIFEST, json.dumps(manifest, indent=1).encode())


def write_shard(store: Path, index: int, arrays: dict[str, np.ndarray], meta: list[dict]) -> dict:
    """Write shard `index` atomically; its manifest entry (file, sequences, rows, tokens, bytes, sha256)."""
    buf = io.BytesIO()
    np.savez(buf, **arrays, meta=np.array(json.dumps(meta, ensure_ascii=False)))
    data = buf.getvalue()
    name = shard_name(index)
    _atomic_write(Path(store) / name, data)
    return {"file": name, "sequences": len(arrays["starts"]), "rows": int(arrays["row_offsets"][-1]),
            "tokens": int(arrays["seq_offsets"][-1]), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def check_shard(store: Path, entry: dict, *, full: bool = True) -> str | None:
    """What is wrong with a listed shard's file (missing, another size, another sha256 when
    `full`), or None when it is the file the manifest lists."""
    p = Path(store) / entry["file"]
    if not p.is_file():
        return f"{p} is missing"
    size = p.stat().st_size
    if size != entry["bytes"]:
        return f"{p} is {size} bytes, the manifest lists {entry['bytes']} (truncated or replaced)"
    if full and hashlib.sha256(p.read_bytes()).hexdigest() != entry["sha256"]:
        return f"{p} does not match its sha256 in the manifest (damaged or replaced)"
    return None


def read_shard(store: Path, entry: dict, manifest: dict) -> tuple[dict[str, np.ndarray], list[dict]]:
    """A listed shard's arrays and per-sequence meta, checked against the manifest (size, sha256,
    array names, dtypes and shapes); StoreError naming the file and the fix otherwise."""
    problem = check_shard(store, entry)
    fix = "run `opd store` with the store's config again: it rewrites the damaged shards and keeps the others"
    if problem:
        raise StoreError(f"store {store}: {problem}; {fix}")
    p = Path(store) / entry["file"]
    try:
        with np.load(p, allow_pickle=False) as z:
            arrays = {name: z[name] for name in ARRAYS}
            meta = json.loads(str(z["meta"]))
    except (zipfile.BadZipFile, KeyError, ValueError, OSError) as e:
        raise StoreError(f"store {store}: {p} is not a readable shard ({e}); {fix}") from None
    want = manifest["dtypes"]
    k, n = manifest["k"], entry["sequences"]
    rows = int(arrays["row_offsets"][-1]) if len(arrays["row_offsets"]) else -1
    shapes = {"topk_ids": (rows, k), "topk_logprobs": (rows, k), "tail_logmass": (rows,), "token_logprob": (rows,),
              "starts": (n,), "seq_offsets": (n + 1,), "row_offsets": (n + 1,)}
    for name, shape in shapes.items():
        if arrays[name].shape != shape:
            raise StoreError(f"store {store}: {p}: {name} has shape {arrays[name].shape}, expected {shape}; {fix}")
    for name, dtype in want.items():
        if str(arrays[name].dtype) != dtype:
            raise StoreError(f"store {store}: {p}: {name} is {arrays[name].dtype}, the manifest says {dtype}; {fix}")
    if rows != entry["rows"] or len(meta) != n:
        raise StoreError(f"store {store}: {p} holds {rows} rows / {len(meta)} sequences, the manifest lists "
                         f"{entry['rows']} / {n}; {fix}")
    return arrays, meta
