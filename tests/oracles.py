"""Reference computations the tests hold the code to (importable from every test folder:
pytest puts this folder, the one of the root conftest.py, on sys.path)."""

from __future__ import annotations

from pathlib import Path

import torch


def process_gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped (a container's init may not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def forward_logprobs(model, rollout) -> torch.Tensor:
    """[T] raw log_softmax(logits) of each response token of `rollout`, from one transformers
    forward pass over prompt + response: what every rollout engine must report."""
    ids = torch.tensor(rollout.ids)
    with torch.no_grad():
        lp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
    p = len(rollout.prompt_ids)
    return lp[p - 1:len(ids) - 1].gather(1, ids[p:, None]).squeeze(1)
