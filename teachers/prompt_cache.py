"""The hf teacher's prompt cache: the keys and values of prompts a client announced before it
needs them scored (SCORE mode "prefill", docs/protocol.md).

Why: a student samples for seconds before it can send prompt + response to be scored, and on
a machine where sampling is bound by memory bandwidth a core sits idle meanwhile. Announced at
the start of the rollout, the prompts are prefilled then, and the later SCORE computes only
the response tokens over their cached keys and values (docs/benchmarks.md measures the saving).
With several samples per prompt, the prompt is computed once for all of them.

An entry is keyed by the exact token ids of a sequence's first P tokens and where its rows
start (s, the prompt's length: what the teacher sees before the response, after a teacher
context replaced the prompt). It holds, per layer, keys and values [kv_heads, P, head_dim] and
the body's hidden states at positions s - 1 .. P - 1, which score rows 0 .. P - s. A prompt
alone is P = s; the trainer also announces each response as it grows (at a quarter, half and
three quarters of rollout.max_new_tokens), each entry continuing the last, so the SCORE after
the rollout computes only the last quarter. A SCORE's sequence reads its longest held prefix,
and the SCORE then drops that entry and its prompt's: the cache hands one step's announced
sequences over to their scoring (a prompt seen again is announced again), so it holds one
step's worth, not its budget. Entries are also evicted least recently used first, past
`max_tokens` tokens in all (an entry a longer one of the same sequence continued is dropped
then); a miss is scored as before.

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
    """A sequence's first P tokens, whose rows start at `start` (its prompt's length)."""
    keys: list[torch.Tensor]      # [layers] of [kv_heads, P, head_dim], the model's dtype
    values: list[torch.Tensor]    # as keys
    hidden: torch.Tensor          # [P - start + 1, H]: the body's output at positions start - 1 .. P - 1
    start: int

    @property
    def tokens(self) -> int:
        return int(self.keys[0].shape[1])


def key_of(ids: torch.Tensor, start: int) -> bytes:
    """The cache key of a sequence's first tokens `ids` (int64 [P]) whose rows start at `start`."""
    return start.to_bytes(4, "little") + ids.to(torch.int64).contiguous().numpy().tobytes()


class PromptCache:
    """Entries by (start, token ids), least recently used evicted first past `max_tokens` tokens.
    `lookup` finds a sequence's longest held prefix among those announced with its prompt."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.tokens = 0
        self._entries: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        # prompt's key -> how many entries of each length it starts (n samples of one prompt share it)
        self._lengths: dict[bytes, collections.Counter] = {}
        self.hits = self.misses = 0   # sequences scored over an entry, or without one

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def lookup(self, seq: torch.Tensor, start: int, limit: int, count: bool = True) -> Entry | None:
        """The longest entry of `seq`'s first P <= limit tokens with rows from `start`, else None."""
        for n in sorted(self._lengths.get(key_of(seq[:start], start), ()), reverse=True):
            key = key_of(seq[:n], start)
            if n <= limit and (entry := self._entries.get(key)) is not None:
                self._entries.move_to_end(key)
                self.hits += count
                return entry
        self.misses += count
        return None

    def put(self, key: bytes, entry: Entry, prompt_key: bytes) -> bool:
        """Keep `entry` (False: it alone exceeds max_tokens, and is not kept)."""
        if entry.tokens > self.max_tokens:
            return False
        self.drop(key)
        while self._entries and self.tokens + entry.tokens > self.max_tokens:
            self.drop(next(iter(self._entries)))
        self._entries[key] = entry
        self._lengths.setdefault(prompt_key, collections.Counter())[entry.tokens] += 1
        self.tokens += entry.tokens
        return True

    def drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self.tokens -= entry.tokens
        prompt_key = key[:4] + key[4:4 + 8 * entry.start]
        lengths = self._lengths[prompt_key]
        lengths[entry.tokens] -= 1
        if lengths[entry.tokens] == 0:
            del lengths[entry.tokens]
        if not lengths:
            del self._lengths[prompt_key]


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
