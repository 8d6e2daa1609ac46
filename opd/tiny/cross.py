"""A second tokenizer for cross-tokenizer tests and examples, built locally with `tokenizers`.

`build_bpe_tokenizer` is a byte-level BPE whose merges come from a list or are learned from a
corpus in-process; the special tokens and chat template are those of opd.tiny's byte
tokenizer, but every id differs from it (specials first, then the 256 bytes, then the merges),
so a student with the byte tokenizer and a teacher with this one share texts, not ids.
`build_cross_teacher` saves a tiny model with it: a `tokenizer: cross` teacher.
"""

from __future__ import annotations

from pathlib import Path

from opd.tiny.models import CHAT_TEMPLATE, SPECIAL_TOKENS


def build_bpe_tokenizer(out_dir: str | Path, *, merges: list[tuple[str, str]] | None = None,
                        corpus: list[str] | None = None, vocab_size: int = 400, chat: bool = False):
    """A byte-level BPE tokenizer saved to `out_dir`: `merges` given as pairs of byte-level
    strings (Ġ is a space), or learned from `corpus` up to `vocab_size` tokens. Words keep
    their leading space (GPT-2's pre-tokenizer), so " cat" can be one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if corpus is not None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet,
                                      show_progress=False)
        tok.train_from_iterator(corpus, trainer)
    else:
        merged = dict(vocab)
        for a, b in merges or []:
            merged.setdefault(a + b, len(merged))
        tok = Tokenizer(models.BPE(vocab=merged, merges=list(merges or [])))
        tok.pre_tokenizer = pre
        tok.add_special_tokens(SPECIAL_TOKENS)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>" if chat else "<|endoftext|>",
                                   pad_token="<|pad|>", bos_token=None, unk_token=None)
    fast.model_max_length = 4096
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_cross_teacher(out_dir: str | Path, corpus: list[str], *, vocab_size: int = 400, layers: int = 2,
                        hidden: int = 64, init_std: float = 0.02, seed: int = 7) -> Path:
    """A randomly initialised tiny Qwen2-style model with a BPE tokenizer learned from `corpus`
    (opd.tiny.build_tiny_model's shape otherwise). init_std sets how peaked its answers are."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_bpe_tokenizer(out, corpus=corpus, vocab_size=vocab_size)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      initializer_range=init_std, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id, torch_dtype="float32")
    torch.manual_seed(seed)
    Qwen2ForCausalLM(cfg).eval().save_pretrained(str(out), safe_serialization=True)
    return out
