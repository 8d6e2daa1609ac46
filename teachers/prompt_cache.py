"""The hf teacher's prompt cache: the keys and values of prompts a client announced before it
needs them scored (SCORE mode "prefill", protocol 2.6).

Why: a student samples for seconds before it can send prompt + response to be scored, and on
a machine where sampling is bound by memory bandwidth a core sits idle meanwhile. Announced at
the start of the rollout, the prompts are prefilled then, and the later SCORE computes only
the response tokens over their cached keys and values (on the 2-core bench, the teacher's body
over the responses took 0.42 s against 1.06 s over prompt + response; docs/benchmarks.md).
With several samples per prompt, the prompt is computed once for all of them.

An entry is keyed by the exact token ids of a prompt: what the teacher sees before the
response (ids[:s_b] of a SCORE, after a teacher context replaced the prompt). It holds, per
layer, keys and values [kv_heads, P, head_dim] and the body's last hidden state [H] at
position P - 1, which scores the response's first row. Entries are evicted least recently
used first, past `max_tokens` prompt tokens in all; a missed prompt is scored as before.

Only models whose cache is one full-attention DynamicCache per layer qualify (`why_not`): a
sliding window or a longrope switch would make a continued forward differ from a whole one.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from opd.rope import longrope_switch


@dataclass
class Entry:
    keys: list[torch.Tensor]      # [layers] of [kv_heads, P, head_dim], the model's dtype
    values: list[torch.Tensor]    # as keys
    last_hidden: torch.Tensor     # [H]: the body's output at position P - 1

    @property
    def tokens(self) -> int:
        return int(self.keys[0].shape[1])


def key_of(ids: torch.Tensor) -> bytes:
    """The cache key of a prompt: its token ids (int64 [P]) as bytes."""
    return ids.to(torch.int64).contiguous().numpy().tobytes()


class PromptCache:
    """Entries by prompt, least recently used evicted first past `max_tokens` prompt tokens."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.tokens = 0
        self._entries: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        self.hits = self.misses = 0   # prompts scored over an entry, or without one

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> Entry | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return entry

    def put(self, key: bytes, entry: Entry) -> bool:
        """Keep `entry` (False: it alone exceeds max_tokens, and is not kept)."""
        if entry.tokens > self.max_tokens:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.tokens -= old.tokens
        while self._entries and self.tokens + entry.tokens > self.max_tokens:
            self.tokens -= self._entries.popitem(last=False)[1].tokens
        self._entries[key] = entry
        self.tokens += entry.tokens
        return True


def why_not(model) -> str | None:
    """None when a forward continued over cached keys and values computes what one whole
    forward does for this model's architecture; else why not. (The backend also checks it on
    a few tokens at load: `HFBackend` compares both ways.)"""
    cfg = model.config
    if longrope_switch(cfg) is not None:
        return "its longrope factors depend on the whole sequence's length"
    sliding = getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)   # Qwen2: off
    if sliding or getattr(cfg, "attention_chunk_size", None):
        return "it attends within a sliding window or chunks"
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"its layers are {sorted(kinds)}, not all full attention"
    return None


def batched_cache(entries: list[Entry], config):
    """A DynamicCache [n, kv_heads, P, head_dim] per layer holding the entries left-padded to
    the longest (P), and its attention mask int64 [n, P] (0 over the padding)."""
    from transformers import DynamicCache   # lazy, as the backend's own import

    n, width = len(entries), max(e.tokens for e in entries)
    cache = DynamicCache(config=config)
    for layer in range(len(entries[0].keys)):
        k0 = entries[0].keys[layer]
        keys = k0.new_zeros(n, k0.shape[0], width, k0.shape[2])
        values = keys.clone()
        for j, e in enumerate(entries):
            keys[j, :, width - e.tokens:] = e.keys[layer]
            values[j, :, width - e.tokens:] = e.values[layer]
        cache.update(keys, values, layer)
    mask = torch.zeros(n, width, dtype=torch.long)
    for j, e in enumerate(entries):
        mask[j, width - e.tokens:] = 1
    return cache, mask
