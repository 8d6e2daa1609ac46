"""A small text classifier for routing prompts to domains: numpy only, saved as JSON.

Model: multinomial logistic regression on sparse features of the lowercased prompt,
character 2..4-grams ("c:" prefix) and word/punctuation tokens ("w:" prefix). A feature's
value is log(1 + count), and each prompt's vector has unit L2 norm, so long prompts do
not get sharper probabilities just by being long. Trained full-batch with Adam on the
mean cross-entropy plus an L2 penalty, with the bias fixed at the log class priors (a
prompt with no known feature gets the priors). The features are the `max_features` most
frequent ones (by document frequency). Logistic regression rather than naive Bayes
because its probabilities are usable as confidences (the `min_confidence` of the rule);
naive Bayes with hundreds of n-grams puts p=1.0000 on nearly everything.

The file is plain JSON (labels, features, weights): no pickle, readable by anything.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

import numpy as np

FORMAT = "opd-text-classifier"
VERSION = 1
_WORD = re.compile(r"\w+|[^\w\s]")


def features(text: str, ngram_range: tuple[int, int] = (2, 4)) -> Counter:
    """Feature counts of a text: word tokens and character n-grams of the lowercased text."""
    low = " ".join(text.lower().split())
    feats = Counter("w:" + w for w in _WORD.findall(low))
    lo, hi = ngram_range
    padded = f" {low} "
    for n in range(lo, hi + 1):
        feats.update("c:" + padded[i:i + n] for i in range(len(padded) - n + 1))
    return feats


class Classifier:
    def __init__(self, labels: list[str], vocab: list[str], weights_D_C: np.ndarray, bias_C: np.ndarray,
                 ngram_range: tuple[int, int] = (2, 4), meta: dict | None = None):
        self.labels = list(labels)
        self.vocab = list(vocab)
        self.index = {f: i for i, f in enumerate(self.vocab)}
        self.weights_D_C = np.asarray(weights_D_C, dtype=np.float64)
        self.bias_C = np.asarray(bias_C, dtype=np.float64)
        self.ngram_range = tuple(ngram_range)
        self.meta = dict(meta or {})

    # -- inference ----------------------------------------------------------------------
    def _vector(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(feature indices, values) of a text, L2-normalized over the known features."""
        feats = features(text, self.ngram_range)
        known = [(self.index[f], math.log1p(c)) for f, c in feats.items() if f in self.index]
        if not known:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        idx, val = map(np.asarray, zip(*known))
        return idx.astype(np.int64), val / np.linalg.norm(val)

    def predict_proba(self, text: str) -> dict[str, float]:
        idx, val = self._vector(text)
        logits_C = self.bias_C + val @ self.weights_D_C[idx]
        p = np.exp(logits_C - logits_C.max())
        p /= p.sum()
        return {lab: float(x) for lab, x in zip(self.labels, p)}

    def predict(self, text: str) -> str:
        probs = self.predict_proba(text)
        return max(probs, key=probs.get)

    def accuracy(self, texts: list[str], labels: list[str]) -> float:
        if not texts:
            raise ValueError("accuracy of an empty set")
        return sum(self.predict(t) == y for t, y in zip(texts, labels)) / len(texts)

    # -- files --------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        obj = {"format": FORMAT, "version": VERSION, "labels": self.labels,
               "ngram_range": list(self.ngram_range), "meta": self.meta,
               "bias": [round(float(b), 6) for b in self.bias_C],
               "features": self.vocab,
               "weights": [[round(float(w), 6) for w in row] for row in self.weights_D_C]}
        tmp = path.with_suffix(path.suffix + ".tmp")
        try:
            tmp.write_text(json.dumps(obj, ensure_ascii=False, separators=(",", ":")))
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)   # a failed write or rename leaves no stray file
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Classifier":
        path = Path(path)
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read a routing classifier: {e}") from None
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise ValueError(f"{path}: not an {FORMAT} file (write one with `opd route fit`)")
        if obj.get("version") != VERSION:
            raise ValueError(f"{path}: classifier format version {obj.get('version')}, this opd reads {VERSION}")
        w = np.asarray(obj["weights"], dtype=np.float64).reshape(len(obj["features"]), len(obj["labels"]))
        return cls(obj["labels"], obj["features"], w, np.asarray(obj["bias"]), tuple(obj["ngram_range"]),
                   obj.get("meta"))


def _design(docs: list[Counter], index: dict[str, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR-like (row of each entry, column, value) with rows L2-normalized."""
    rows, cols, vals = [], [], []
    for r, feats in enumerate(docs):
        known = [(index[f], math.log1p(c)) for f, c in feats.items() if f in index]
        if not known:
            continue
        norm = math.sqrt(sum(v * v for _, v in known))
        for c, v in known:
            rows.append(r)
            cols.append(c)
            vals.append(v / norm)
    return np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64), np.asarray(vals)


def fit(texts: list[str], labels: list[str], *, ngram_range: tuple[int, int] = (2, 4), max_features: int = 20000,
        l2: float = 1e-4, epochs: int = 150, lr: float = 0.1) -> Classifier:
    """Fit a classifier on (text, label) pairs. Deterministic: full-batch, zero initialization."""
    if len(texts) != len(labels) or not texts:
        raise ValueError(f"need equal, non-zero numbers of texts and labels, got {len(texts)} and {len(labels)}")
    if epochs < 1 or max_features < 1:   # 0 epochs or features fitted the priors only: every prompt alike
        raise ValueError(f"need epochs >= 1 and max_features >= 1, got epochs {epochs}, max_features {max_features}")
    label_set = sorted(set(labels))
    if len(label_set) < 2:
        raise ValueError(f"need at least two labels to route between, got {label_set}")
    docs = [features(t, ngram_range) for t in texts]
    df = Counter(f for d in docs for f in d)
    vocab = [f for f, _ in sorted(df.items(), key=lambda kv: (-kv[1], kv[0]))[:max_features]]
    index = {f: i for i, f in enumerate(vocab)}
    rows, cols, vals = _design(docs, index)

    n, d, c = len(texts), len(vocab), len(label_set)
    y = np.asarray([label_set.index(lab) for lab in labels])
    onehot_N_C = np.eye(c)[y]
    # the bias is fixed at the log class priors: a prompt with no known feature gets the priors,
    # not whatever a free bias absorbed from length differences between the classes
    b_C = np.log(onehot_N_C.mean(0))
    w_D_C = np.zeros((d, c))
    m_w, v_w = np.zeros_like(w_D_C), np.zeros_like(w_D_C)
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    for t in range(1, epochs + 1):
        # logits = X @ W + b, with X sparse: scatter-add each entry's contribution into its row
        contrib = vals[:, None] * w_D_C[cols]
        logits_N_C = np.stack([np.bincount(rows, weights=contrib[:, j], minlength=n) for j in range(c)], 1) + b_C
        p_N_C = np.exp(logits_N_C - logits_N_C.max(1, keepdims=True))
        p_N_C /= p_N_C.sum(1, keepdims=True)
        g_N_C = (p_N_C - onehot_N_C) / n
        # grad W = X^T @ G + l2 W
        gw = np.stack([np.bincount(cols, weights=vals * g_N_C[rows, j], minlength=d) for j in range(c)], 1)
        gw += l2 * w_D_C
        m_w *= beta1
        m_w += (1 - beta1) * gw
        v_w *= beta2
        v_w += (1 - beta2) * gw * gw
        w_D_C -= lr * (m_w / (1 - beta1 ** t)) / (np.sqrt(v_w / (1 - beta2 ** t)) + eps)
    meta = {"train_samples": n, "label_counts": dict(Counter(labels)), "epochs": epochs, "l2": l2}
    return Classifier(label_set, vocab, w_D_C, b_C, ngram_range, meta)
