"""Reference computations the tests hold the code to (importable from every test folder:
pytest puts this folder, the one of the root conftest.py, on sys.path)."""

from __future__ import annotations

import torch


def forward_logprobs(model, rollout) -> torch.Tensor:
    """[T] raw log_softmax(logits) of each response token of `rollout`, from one transformers
    forward pass over prompt + response: what every rollout engine must report."""
    ids = torch.tensor(rollout.ids)
    with torch.no_grad():
        lp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
    p = len(rollout.prompt_ids)
    return lp[p - 1:len(ids) - 1].gather(1, ids[p:, None]).squeeze(1)
