"""Tiny local models and a byte-level tokenizer, built from a config with no download.

Tests and the demo need real transformers models; nothing may be downloaded at run time,
so they are built here from a Qwen2 config and a tokenizer made with `tokenizers`, and
saved like any local model directory. Real users point the same code at their own dirs.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

# The chat variant's template (build_tokenizer(chat=True)): ChatML turns and Hermes / Qwen tool
# calls, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` inside the assistant's text,
# with the tools named in one short system line (a byte-level model pays one token per byte, so
# the tiny template lists names and parameters where Qwen's lists full JSON schemas).
CHAT_TEMPLATE = (   # one line, no whitespace control: every newline in it is one the model sees
    "{% if tools %}<|im_start|>system\ntools:"
    "{% for t in tools %} {{ t.function.name }}({{ t.function.parameters.properties | join(',') }}){% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>tool\n{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': "
    "c.function.arguments} | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out_dir: str | Path, *, chat: bool = False):
    """A byte-level BPE tokenizer with no merges: every byte is one token (256 + 4 specials).

    Any text round-trips, and digits, code and whitespace are single tokens, which keeps
    the demo's arithmetic and code tasks learnable by a tiny model. chat: a chat model's
    tokenizer: CHAT_TEMPLATE, and <|im_end|> (the end of a turn) as its EOS.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>" if chat else "<|endoftext|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
    )
    fast.model_max_length = 4096
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(
    out_dir: str | Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 2,
    kv_heads: int = 1,
    intermediate: int = 128,
    max_positions: int = 512,
    seed: int = 0,
    init_std: float = 0.02,
    tie_embeddings: bool = False,
    vocab_size: int | None = None,
    chat: bool = False,
) -> Path:
    """Save a randomly initialised Qwen2-style causal LM plus the byte tokenizer to `out_dir`.

    `vocab_size` above the tokenizer's 260 pads the embedding and LM head, as real models pad
    theirs (Qwen2.5: 151,936 rows for 151,665 tokens): benchmarks get realistic [tokens x V]
    sizes; ids past the tokenizer decode to nothing. chat: with the chat tokenizer (tools in
    Hermes format, <|im_end|> ends a turn; `build_tokenizer`).

    Head size hidden / heads defaults to 32: vLLM's CPU attention accepts 32 and up, so
    every tiny model can be served and sampled by vLLM as well as transformers.

    fp32 weights in safetensors. The same seed gives bit-identical weights.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, chat=chat)
    cfg = Qwen2Config(
        vocab_size=max(len(tok), vocab_size or 0),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        initializer_range=init_std,
        tie_word_embeddings=tie_embeddings,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.eos_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def perturb_model(src_dir: str | Path, out_dir: str | Path, *, scale: float = 0.5, seed: int = 1) -> Path:
    """Copy a tiny model with Gaussian noise of relative size `scale` added to every weight.

    Gives a teacher that differs from a student in a controlled way for tests.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(src_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std().clamp_min(1e-3) * scale)
    out = Path(out_dir)
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(src_dir)).save_pretrained(str(out))
    return out


def lm_head_teacher(student_dir: str | Path, out_dir: str | Path, *, seed: int = 3) -> Path:
    """The student with a rank-4 change of its LM head (logit changes of ~2 nats): the same
    tokenizer and body, clearly other answers, reachable by full fine-tuning and by a LoRA
    adapter on `lm_head`. Reused if `out_dir` already holds a model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    model = AutoModelForCausalLM.from_pretrained(str(student_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    w = model.lm_head.weight
    with torch.no_grad():
        w.add_(torch.randn(w.shape[0], 4, generator=g) @ (torch.randn(4, w.shape[1], generator=g) * 0.125))
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(student_dir)).save_pretrained(str(out))
    return out
