"""`opd bench step --preset small-real`: models at the shapes of a real small model, built here.

Nothing is downloaded: the teacher is a random-weight Llama model with SmolLM2-135M's published
configuration (hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1536, vocabulary
49,152, tied embeddings), the student a copy of its first 8 layers (same embeddings, final
norm and tied head). The tokenizer is a byte-level BPE of exactly 49,152 entries built from a
fixed, generated merges list (letters, then letter pairs, triples and word starts), so it is
instant and the same on every machine; the chat template is SmolLM2's ChatML one. The prompts
are chat turns a user might type.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
                    rope_theta=100000.0, max_position_embeddings=8192, hidden_act="silu", initializer_range=0.041666666666666664)
STUDENT_LAYERS = 8
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]   # ids 0, 1, 2 as in SmolLM2
CHAT_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                 "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
                 "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
PROMPTS = [
    "What is the capital of France, and why did it become the capital?",
    "Write a short Python function that checks whether a number is prime.",
    "Explain in two sentences how a rainbow forms.",
    "Give me three tips for keeping a sourdough starter healthy.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "How many minutes are there in a week? Show your working.",
    "What is the difference between a list and a tuple in Python?",
    "Suggest a name for a small bakery that sells only croissants.",
]


def bpe_tokenizer(vocab_size: int = 49152):
    """A byte-level BPE tokenizer with exactly `vocab_size` entries from a generated merges list:
    the 256 byte symbols, then lowercase pairs, word starts ('Ġ' + letter, 'Ġ' + pair), triples
    and word-start triples, then lowercase 4-grams until full. Deterministic; no training."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges: list[tuple[str, str]] = []
    full = vocab_size

    def add(a: str, b: str) -> None:
        if len(vocab) < full and a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append((a, b))

    L = string.ascii_lowercase
    pairs = [a + b for a in L for b in L]
    for a in L:
        add("Ġ", a)
    for p in pairs:
        add(p[0], p[1])
    for p in pairs:
        add("Ġ" + p[0], p[1])
    for p in pairs:
        for c in L:
            add(p, c)
    for p in pairs:
        for c in L:
            add("Ġ" + p, c)
    for p in pairs:
        for q in pairs:
            add(p, q)
    assert len(vocab) == full, len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 8192
    return fast


def build_small_real(work: Path | str, prompts: int = 4) -> tuple[Path, Path, Path]:
    """Teacher (SmolLM2-135M's config, random weights, seed 0), student (its first 8 layers),
    the tokenizer in both, and `prompts` distinct chat prompts as the dataset. fp32 safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    work = Path(work)
    tok = bpe_tokenizer(SMOLLM2_135M["vocab_size"])
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M, **ids, torch_dtype="float32")).eval()
    student = LlamaForCausalLM(LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": STUDENT_LAYERS}, **ids,
                                           torch_dtype="float32")).eval()
    state = {k: v for k, v in teacher.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < STUDENT_LAYERS}
    student.load_state_dict(state, strict=False)
    student.tie_weights()
    for name, model in (("teacher", teacher), ("student", student)):
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(str(work / name), safe_serialization=True)
        tok.save_pretrained(str(work / name))
    return work / "student", work / "teacher", prompts_file(work, prompts)


def prompts_file(work: Path | str, prompts: int = 4) -> Path:
    """`prompts` distinct chat prompts as the dataset (also alone, for `--student DIR --teacher
    DIR`). Distinct, so that no step of a run repeats one: opd's teacher keeps announced prompts'
    keys and values (teachers/prompt_cache.py), and a prompt seen again would cost it nothing,
    as it does not in a real run over a dataset far bigger than the cache. The number goes last, so
    the prompts share no more first tokens than the chat template's."""
    data = Path(work) / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{PROMPTS[i % len(PROMPTS)]} (Question {i + 1}.)",
                                        "domain": "math", "response": "0"}) + "\n" for i in range(prompts)))
    return data
