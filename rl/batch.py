"""GRPO's batch as the response rows every loop trains on (opd.spine.rows.Packed).

    collate(rollouts, pad_id) -> RolloutRows   the packed sequences, their rows, the rollout log-probs
    rows.sequences(idx)       -> RolloutRows   a minibatch or micro-batch of them

A row is a response token the policy sampled: the packed rows of opd train, in the same order
(sequence by sequence, then position). A multi-turn trajectory (opd.agent) is one rollout whose
response holds the model's turns and the tool observations between them: all of it is in the
sequence (the context each turn saw), and only the tokens the model sampled (`Rollout.sampled`)
are rows, so the loss, the KL, the entropy, every normalizer and the teachers' terms count
assistant tokens alone.

A part of the batch keeps where its sequences and rows sit in the whole (`seq_B`, `index_N`):
what is computed once per step (advantages, reference log-probs, the teachers' answers) is
indexed by them.

The policy's log-probs of the rows are rl/logprobs.py's (never [B, T, V]); the plain
computation they are held to is tests/oracles.py:response_logits.
"""

from __future__ import annotations

import dataclasses

import torch

from opd.spine.rows import Packed, pack, rows_of, subset


@dataclasses.dataclass
class RolloutRows:
    """Rollouts as packed response rows (N rows over B sequences)."""
    packed: Packed                 # right-padded sequences; row_b_N, targets_N, row_offsets
    old_logprobs_N: torch.Tensor   # fp32 [N]: the rollout policy's raw log-probs of the rows' tokens
    seq_B: torch.Tensor            # long [B]: each sequence's index in the step's batch
    index_N: torch.Tensor          # long [N]: each row's index among the step's batch's rows

    @property
    def lengths(self) -> list[int]:
        """Rows per sequence."""
        o = self.packed.row_offsets
        return [o[b + 1] - o[b] for b in range(len(o) - 1)]

    def sequences(self, idx: slice | torch.Tensor | list[int]) -> "RolloutRows":
        """The sequences `idx` (in that order) as a batch of their own."""
        seqs = list(range(len(self.seq_B)))[idx] if isinstance(idx, slice) else [int(b) for b in idx]
        rows = rows_of(self.packed, seqs)
        return RolloutRows(subset(self.packed, seqs), self.old_logprobs_N[rows], self.seq_B[seqs], self.index_N[rows])

    def per_row(self, values_B: torch.Tensor) -> torch.Tensor:
        """[N]: a per-sequence value [B] at each of the sequence's rows."""
        return values_B[self.packed.row_b_N.to(values_B.device)]


def collate(rollouts, pad_id: int) -> RolloutRows:
    """Pack the rollouts (right padding) with their sampled tokens as rows, and take the rollout
    policy's log-probs of those tokens (a trajectory's observations have none that count)."""
    masks = [None if r.mask is None else r.sampled() for r in rollouts]
    packed = pack([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts], pad_id, masks)
    old = [lp for r in rollouts for lp, m in zip(r.logprobs, r.sampled()) if m]
    n = packed.row_offsets[-1]
    return RolloutRows(packed, torch.tensor(old, dtype=torch.float32).reshape(n), torch.arange(len(rollouts)),
                       torch.arange(n))
