"""Fingerprints that tell whether two sides can be distilled into each other.

Token-level distillation compares distributions over the same token ids, so the student
and every teacher must share one tokenizer. `tokenizer_fingerprint` hashes what defines
the id space: the vocabulary (token -> id), the added/special tokens and their ids, and the
chat template every prompt is formatted with. Two backends loading the same directory
report the same fingerprint.

`model_fingerprint` identifies the weights a teacher serves, so a trainer notices when a
teacher is restarted with another model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

# Above this many bytes of weights, hash headers plus strided samples instead of every
# byte (a 60 GB checkpoint would otherwise take a minute to fingerprint at start).
FULL_HASH_LIMIT = 2 << 30
SAMPLE_BYTES = 1 << 16
SAMPLE_STRIDE = 64 << 20


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 (first 16 hex) of what makes the student's token ids mean the same to a teacher:
    the vocabulary with its added tokens, the special tokens (they are never split, so they
    change how text encodes) and EOS/BOS, and the chat template, which formats every prompt
    (`opd.data.encode_prompt`: a teacher trained on templated prompts would otherwise score
    raw ones, or the other way round, without a word). The pad token is left out: each side
    pads its own batches and no id the teacher scores depends on it."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    specials = set(tokenizer.all_special_tokens)
    if tokenizer.pad_token not in (tokenizer.eos_token, tokenizer.bos_token, tokenizer.unk_token):
        specials.discard(tokenizer.pad_token)
    payload = {
        "vocab": vocab,
        "special": [(t, tokenizer.convert_tokens_to_ids(t)) for t in sorted(specials)],
        "eos": tokenizer.eos_token_id,
        "bos": tokenizer.bos_token_id,
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False, sort_keys=True).encode()).hexdigest()[:16]


class ModelDirError(ValueError):
    """A model directory that is missing, is no model, or has no tokenizer."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_model_dir(model_dir: str | Path, what: str = "model") -> Path:
    """`model_dir` as a Path if it holds a model (or peft adapter) and its tokenizer files.

    A missing path would read as a Hub repo id and fail with the Hub's message; without
    tokenizer files, transformers returns a tokenizer whose whole vocabulary is one special
    token (every prompt encodes to nothing, and two such directories share a fingerprint)."""
    p = Path(model_dir)
    if not p.is_dir():
        raise ModelDirError(f"{what} {model_dir}: " + ("is a file, not a model directory" if p.exists()
                                                     else "no such directory"))
    if not ((p / "config.json").is_file() or (p / "adapter_config.json").is_file()):
        raise ModelDirError(f"{what} {model_dir}: no config.json, not a transformers model directory")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise ModelDirError(f"{what} {model_dir}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); save the "
                            f"tokenizer beside the model (tokenizer.save_pretrained(DIR))")
    return p


def load_model_tokenizer(model_dir: str | Path, what: str = "model"):
    """The tokenizer of a model directory that `check_model_dir` accepts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(check_model_dir(model_dir, what)))
    if len(tokenizer) < 2:
        raise ModelDirError(f"{what} {model_dir}: its tokenizer has {len(tokenizer)} token(s)")
    return tokenizer


def tokenizer_fingerprint_of_dir(model_dir: str | Path) -> str:
    return tokenizer_fingerprint(load_model_tokenizer(model_dir, "teacher model"))


def _hash_file(h: "hashlib._Hash", path: Path, full: bool) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        if full:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
            return
        for offset in range(0, size, SAMPLE_STRIDE):
            f.seek(offset)
            h.update(f.read(SAMPLE_BYTES))
        f.seek(max(0, size - SAMPLE_BYTES))
        h.update(f.read(SAMPLE_BYTES))


def model_fingerprint(model_dir: str | Path) -> str:
    """sha256 (first 16 hex) of config.json and the weight files of a local model directory.

    Weights up to FULL_HASH_LIMIT bytes are hashed in full; larger checkpoints are hashed
    by file sizes and strided samples (safetensors headers included, since they sit at
    offset 0), which still changes with any retrained or swapped model in practice.
    """
    d = Path(model_dir)
    h = hashlib.sha256()
    cfg = d / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    weights = sorted([*d.glob("*.safetensors"), *d.glob("*.bin"), *d.glob("*.pt")])
    total = sum(p.stat().st_size for p in weights)
    for p in weights:
        _hash_file(h, p, full=total <= FULL_HASH_LIMIT)
    return h.hexdigest()[:16]
