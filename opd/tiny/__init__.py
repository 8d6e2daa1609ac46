"""Tiny models, tokenizers and verifiable data built locally: nothing is downloaded.

    models.py   a byte-level tokenizer and tiny Qwen2-style models (SFT's `tiny:` start,
                tests, benchmarks), a perturbed copy or an LM-head change as a teacher
    data.py     the demo's synthetic math, code and general prompt sets with held-out splits
"""

from opd.tiny.models import SPECIAL_TOKENS, build_tiny_model, build_tokenizer, lm_head_teacher, perturb_model

__all__ = ["SPECIAL_TOKENS", "build_tiny_model", "build_tokenizer", "lm_head_teacher", "perturb_model"]
