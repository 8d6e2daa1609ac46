"""LoRA students and experts: the config block, and the ranks vLLM accepts.

Shared by `opd train` (student.lora) and `opd rl` (model.lora); the adapter is attached by
the one loader (opd.spine.model.load_policy). The reference policy of a LoRA run needs no
second model copy: it is the base with the adapter switched off.
"""

from __future__ import annotations

from dataclasses import dataclass

from opd.config import field

# Every linear projection of a Qwen2 / Llama block.
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# vLLM sizes its LoRA buffers from max_lora_rank, which must be one of these.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoraSpec:
    rank: int = field(16, help="LoRA rank r", min=1)
    alpha: float = field(32.0, help="LoRA alpha (the update is scaled by alpha / rank)", min=0.0)
    target_modules: list[str] = field(default_factory=lambda: list(ALL_LINEAR),
                                      help="names of the modules that get an adapter (default: every linear "
                                           "projection of a block; e.g. [lm_head] adapts the LM head only)")
    dropout: float = field(0.0, help="dropout on the adapter input", min=0.0, max=1.0)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as max_lora_rank that holds an adapter of `rank`."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), rank)
