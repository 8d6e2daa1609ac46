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
    """[N, V]: the logits that predict each row of a GRPO batch (rl/batch.py's RolloutRows),
    from the model's own forward over each sequence alone (no padding, no batching): the plain
    computation that rl/logprobs.py's chunked log-probs and entropies must equal, whatever the
    model (a longrope one's rows are each sequence's own)."""
    device = next(model.parameters()).device
    p = batch.packed
    out = []
    for b in range(len(p.row_offsets) - 1):
        n = int(p.attention_B_L[b].sum())
        logits = model(input_ids=p.input_ids_B_L[b:b + 1, :n].to(device)).logits[0]
        out.append(logits[p.row_pos_N[p.row_b_N == b].to(device)])
    return torch.cat(out)


