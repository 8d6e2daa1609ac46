"""How a causal LM's logits follow from its decoder body's last hidden state, for students
(opd.distill) and teachers (opd.teachers.hf_backend) alike.

Both compute logits for the scored rows only: the body gives hidden states [B, L, H], the
rows are gathered, and the LM head runs on those. That is the model's own forward only if
nothing else comes after the head; models put soft-caps and scales there under names of
their own, and a fused loss that sees hidden @ lm_head.weight.T also misses a bias or a
LoRA adapter on the head. `head_form` says which of these hold, checked against the model's
own forward.
"""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple

import torch
from torch.distributed.fsdp import FSDPModule

FUSED_REFUSED = ("this model's logits are not hidden @ lm_head.weight.T (a soft-cap or scale after its LM head, "
                 "a bias, or a LoRA adapter on it), and the fused loss sees only that product: it would train "
                 "another distribution; set loss.fused_linear: false")


def parts(model):
    """(decoder body, LM head) of a causal LM, through a peft wrapper when there is one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def last_hidden(model, **inputs) -> torch.Tensor:
    """The decoder body's last hidden state [B, L, H] (after its final norm) for `inputs`, without
    the LM head on [B, L]. A model sharded with FSDP2 runs its own forward instead (the body's
    embeddings and norm belong to the root's shards, gathered only by the root's forward): its
    hidden states of every layer, which training keeps for backward anyway, and logits of one
    position; its LM head is then whole until backward, so it can be applied to rows."""
    if isinstance(model, FSDPModule):
        return model(**inputs, output_hidden_states=True, logits_to_keep=1).hidden_states[-1]
    body, _ = parts(model)
    return body(**inputs).last_hidden_state


class HeadForm(NamedTuple):
    post: Callable | None   # logits = post(lm_head(hidden)); None: not of that form
    fusable: bool           # logits = hidden @ lm_head.weight.T, all the fused loss sees


_HEADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # model -> HeadForm


def _identity(z: torch.Tensor) -> torch.Tensor:
    return z


def _post_head(cfg) -> Callable:
    """What a model's forward applies to lm_head's output, read from its config: Gemma 2's
    final_logit_softcapping (tanh(z / c) * c), Cohere's logit_scale (z * s), Granite's
    logits_scaling (z / s); the identity for the rest."""
    cap, scale, div = (getattr(cfg, k, None) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
    if cap is not None:
        return lambda z: torch.tanh(z / cap) * cap
    if scale not in (None, 1.0):
        return lambda z: z * scale
    if div not in (None, 1.0):
        return lambda z: z / div
    return _identity


def head_form(model) -> HeadForm:
    """How a causal LM's logits follow from its decoder body's last hidden state, checked
    against the model's own forward on 8 tokens, once per model (eval mode, no grad, no random
    numbers drawn). `post` is what follows lm_head (`_post_head`), None when the forward does
    something else; fusable only for a plain nn.Linear head without bias or post step (a peft
    LoRA head is a wrapper whose weight is the frozen base: the fused loss would skip it)."""
    if model in _HEADS:
        return _HEADS[model]
    _, head = parts(model)
    post = _post_head(model.config)
    device = next(model.parameters()).device
    ids = (torch.arange(1, 9, device=device) % head.weight.shape[0])[None]
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            want = model(input_ids=ids, use_cache=False).logits.float()
            hidden = last_hidden(model, input_ids=ids, use_cache=False)
            tol = 1e-4 * (1.0 + float(want.abs().max()))
            # .to: a teacher spread over GPUs (device_map) has its head's output where the head is
            ok = bool(torch.allclose(post(head(hidden)).float().to(want.device), want, rtol=0, atol=tol))
            # A plain nn.Linear without bias is hidden @ weight.T: `ok` covers it then.
            fusable = ok and post is _identity and type(head) is torch.nn.Linear and head.bias is None
    finally:
        model.train(training)
    _HEADS[model] = HeadForm(post if ok else None, fusable)
    return _HEADS[model]
