"""The tokens a tool message adds to a trajectory, as the tokenizer's chat template renders it.

The model's own turns stay the tokens it sampled (re-rendering them could tokenize them
differently, and the trained rows would then not be what was sampled). What comes between
two of its turns (the end of its turn as the template writes it, the tool messages, the
next assistant header) is the template's, found by rendering a stand-in conversation with
and without the tool messages and taking the difference:

    head = render([user, assistant T])
    full = render([user, assistant T, tool r1, tool r2], add_generation_prompt=True)
    observation = (what head writes after the model's stop token) + full[len(head):]

The template must render a conversation's start the same whichever messages follow
(every ChatML / Llama / Qwen template does); one that does not is refused by name.
"""

from __future__ import annotations

_TURN = "opd-stand-in-turn"   # the stand-in assistant turn: text no template writes itself
_STAND_IN = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _TURN}]


class ChatTemplateError(ValueError):
    pass


def observation_ids(tokenizer, results: list[str], stop_text: str, tools: list[dict] | None = None) -> list[int]:
    """Token ids that follow the model's stop token (`stop_text`, decoded) up to where its next
    turn begins, given the tool messages `results` (one per call of its turn, in order)."""
    render = dict(tools=tools or None, tokenize=False)
    head = tokenizer.apply_chat_template(_STAND_IN, **render)
    msgs = _STAND_IN + [{"role": "tool", "content": r} for r in results]
    full = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, **render)
    if not full.startswith(head):
        raise ChatTemplateError("the chat template renders the start of a conversation differently once tool messages "
                                "follow it; multi-turn rollouts need a template whose renderings extend one another")
    # The model sampled its turn up to its stop token; the template may write more after it ("\n").
    end = head.find(stop_text, head.rindex(_TURN) + len(_TURN)) if stop_text else -1
    after_stop = head[end + len(stop_text):] if end >= 0 else ""
    return list(tokenizer(after_stop + full[len(head):], add_special_tokens=False)["input_ids"])
