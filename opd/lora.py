"""LoRA students and experts: one config block and one way to attach the adapter.

Shared by `opd train` (student.lora) and `opd rl` (model.lora). The reference policy of a
LoRA run needs no second model copy: it is the base with the adapter switched off.
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


def add_lora(model, spec: LoraSpec, model_path: str = ""):
    """`model` wrapped by peft with a fresh adapter on the target modules that exist in it.

    A target module missing from this architecture is skipped; none present is an error.
    """
    from peft import LoraConfig, get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [t for t in spec.target_modules if t in present]
    if not targets:
        raise ValueError(f"none of lora.target_modules {list(spec.target_modules)} exist in {model_path or 'the model'}")
    return get_peft_model(model, LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                                            target_modules=targets, task_type="CAUSAL_LM"))


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as max_lora_rank that holds an adapter of `rank`."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), rank)
