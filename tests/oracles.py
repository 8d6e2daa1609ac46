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


def forward_topk_ids(model, rollout, k: int) -> torch.Tensor:
    """[T, k]: the k most likely ids at each response position of `rollout` under the raw logits
    of one transformers forward (most likely first): a rollout's `topk_ids`."""
    ids = torch.tensor(rollout.ids)
    with torch.no_grad():
        logits = model(ids[None]).logits[0].float()
    p = len(rollout.prompt_ids)
    return logits[p - 1:len(ids) - 1].topk(k, -1).indices


def response_logits(model, batch) -> torch.Tensor:
    """[B, T, V]: the logits that predict each response token of a GRPO batch (rl/batch.py's
    PaddedRollouts), from the model's own forward over [B, L]: the plain computation that
    rl/logprobs.py's chunked log-probs and entropies must equal. A longrope model gets one pass
    per side of its switch length (opd.rope), rows put back in order."""
    from opd.rope import rope_groups

    device = next(model.parameters()).device
    T = batch.response_B_T.shape[1]

    def logits(rows=slice(None)) -> torch.Tensor:
        out = model(input_ids=batch.input_ids_B_L[rows].to(device), attention_mask=batch.attention_B_L[rows].to(device),
                    position_ids=batch.position_B_L[rows].to(device))
        return out.logits[:, batch.start - 1:batch.start - 1 + T]

    groups = rope_groups(model, batch.attention_B_L.sum(1).tolist())
    if len(groups) == 1:
        return logits()
    outs = torch.cat([logits(torch.tensor(g)) for g in groups])
    back = torch.argsort(torch.cat([torch.tensor(g) for g in groups]))
    return outs[back.to(device)]
