"""The tokenizer fingerprint changes exactly when a teacher would read the student's ids otherwise."""

from __future__ import annotations

from transformers import AutoTokenizer

from opd.data import encode_prompt
from opd.fingerprint import tokenizer_fingerprint


def test_the_chat_template_counts_and_the_pad_token_does_not(tiny_model_dir):
    base = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    fp = tokenizer_fingerprint(base)

    # A chat template reformats every prompt: the ids a teacher scores change (it used to
    # share the fingerprint, so a templated teacher silently scored raw prompts).
    templated = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    templated.chat_template = "{% for m in messages %}<|user|>{{ m['content'] }}\n{% endfor %}"
    assert encode_prompt(templated, "1+2=") != encode_prompt(base, "1+2=")
    assert tokenizer_fingerprint(templated) != fp

    # Another pad token changes no id of a prompt or response (it used to refuse the run).
    padded = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    other = next(t for t in padded.get_vocab() if t not in (padded.eos_token, padded.pad_token))
    padded.pad_token = other
    assert encode_prompt(padded, "1+2=") == encode_prompt(base, "1+2=")
    assert tokenizer_fingerprint(padded) == fp

    # A new special token changes how text containing it encodes: it counts.
    special = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    special.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    assert tokenizer_fingerprint(special) != fp
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(tiny_model_dir))) == fp   # stable
