"""Which sequences may share one forward pass of a longrope model.

A longrope model (Phi-3/3.5/4 long-context) in transformers picks its RoPE factors once per
forward pass, from the largest position in it: the short factors while it is at most
`original_max_position_embeddings`, the long factors past it. A short sequence padded next to a
long one is then computed with the long factors, and its log-probabilities depend on what it
was batched with (on a tiny Phi-3, by up to 46 nats). Splitting a batch at that length gives
every sequence the factors it gets alone: teachers (opd.teachers.hf_backend) and students
(opd.distill, opd.sft, rl.trainer) follow the same rule, so both sides score a sequence alike.

vLLM decides once per engine instead: the long factors for every sequence when `max_model_len`
exceeds original_max_position_embeddings. A vLLM engine and a transformers forward agree on a
sequence past that length, and on every sequence when max_model_len stays within it.
"""

from __future__ import annotations

from typing import Sequence


def longrope_switch(config) -> int | None:
    """The length past which a longrope model switches to its long RoPE factors, else None."""
    for params in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if not isinstance(params, dict):
            continue
        # one set of parameters, or one per attention type ({"full_attention": {...}, ...})
        for p in [params] + [v for v in params.values() if isinstance(v, dict)]:
            if p.get("rope_type", p.get("type")) == "longrope":
                n = p.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", 0)
                return int(n) if n else None
    return None


def rope_groups(model, lengths: Sequence[int]) -> list[list[int]]:
    """Indices of the sequences (lengths in tokens, padding not counted) that may share a
    forward pass: all of them in one list, or for a longrope model those within its switch
    length and those past it, each list in order and none empty."""
    switch = longrope_switch(getattr(model, "config", None))
    everything = list(range(len(lengths)))
    if switch is None:
        return [everything]
    groups = [[i for i in everything if lengths[i] <= switch], [i for i in everything if lengths[i] > switch]]
    return [g for g in groups if g] or [everything]
