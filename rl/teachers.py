"""opd rl's teachers: the servers whose sampled-token reverse KL joins each token's GRPO advantage.

`connect` checks them before any step (reachable, the policy's tokenizer; opd train's client
side, opd.teachers.session), `submit` sends a step's responses right after sampling, `terms`
collects each teacher's log-probs of the sampled tokens, and `token_advantages` adds their
discounted reverse-KL terms to the sequence advantage (opd.spine.objective, the objective
opd train computes with `rewards`).

Multi-turn trajectories (`agent`): a teacher reads the whole trajectory, observations
included, and answers only the tokens the policy sampled (SCORE's row masks,
`Rollout.sampled`): the batch's rows, an observation being none, so the discount runs over the
sampled tokens alone (`objective.discounted`), as opd train's rows do. A batch of single turns
sends no masks: what a server without row masks reads too.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from opd.teachers.session import TeacherSet
from opd.fingerprint import tokenizer_fingerprint
from opd.rl.batch import RolloutRows
from opd.spine import objective


@dataclass(frozen=True)
class TeacherTerm:
    """One teacher's part of the per-token advantage, over the step's rows (rl/batch.py)."""
    lam: float                 # its weight
    gamma: float               # discount of later tokens' terms
    lp_N: torch.Tensor         # its log-probs of the rows' tokens (0 off its sequences)
    on_B: torch.Tensor         # 1 on the sequences it scored
    baseline_B: torch.Tensor   # subtracted from each token's estimate (0: `baseline: none`)


def connect(cfg, tokenizer) -> TeacherSet:
    """The teacher servers, checked before any step: reachable, the policy's tokenizer, mode sampled."""
    return TeacherSet(cfg.teachers, cfg.teacher_client, tokenizer_fingerprint(tokenizer), cfg.model.path,
                      key="teachers")


def submit(teachers: TeacherSet, specs, rollouts_B, samples_P) -> dict[str, tuple[list[int], Future]]:
    """{teacher: (the sequences it scores, the Future of its answer)}: every response of a
    sample whose domain the teacher covers (all, when its `domains` is empty); with multi-turn
    trajectories, the rows it answers are the sampled tokens."""
    out = {}
    multi = any(r.mask is not None for r in rollouts_B)
    for spec in specs:
        seqs = [b for b, r in enumerate(rollouts_B) if not spec.domains or samples_P[r.prompt_index].domain in spec.domains]
        if seqs:
            rows = [rollouts_B[b].sampled() for b in seqs] if multi else None
            out[spec.name] = (seqs, teachers.request(spec.name, [rollouts_B[b].ids for b in seqs],
                                                     [len(rollouts_B[b].prompt_ids) for b in seqs], rows=rows))
    return out


def terms(teachers: TeacherSet, specs, futures: dict, batch: RolloutRows, world=None) -> list[TeacherTerm]:
    """Each teacher's log-probs of the sampled tokens, [N] (0 off its sequences: its answer's rows
    are a sequence's rows in order), and with `baseline: batch` each sequence's leave-one-out mean
    estimate over the teacher's other sequences, from the rollout's own log-probs
    (opd.spine.objective; over every rank's, `world` sharded)."""
    answers = teachers.answers({t: f for t, (_, f) in futures.items()})
    offsets = batch.packed.row_offsets
    out = []
    for spec in specs:
        if spec.name not in futures:
            continue
        seqs, answer = futures[spec.name][0], answers[spec.name]
        lp_N, on_B = torch.zeros_like(batch.old_logprobs_N), torch.zeros(len(batch.seq_B))
        for j, b in enumerate(seqs):
            a, e = answer.row_offsets[j], answer.row_offsets[j + 1]
            lp_N[offsets[b]:offsets[b + 1]] = torch.as_tensor(answer.token_logprob[a:e], dtype=lp_N.dtype)
            on_B[b] = 1.0
        baseline_B = sampled_baseline(batch, lp_N, on_B, world) if spec.baseline == "batch" else torch.zeros_like(on_B)
        out.append(TeacherTerm(spec.weight, spec.gamma, lp_N, on_B, baseline_B))
    return out


def sampled_baseline(batch: RolloutRows, lp_N: torch.Tensor, on_B: torch.Tensor, world=None) -> torch.Tensor:
    """[B]: each scored sequence's leave-one-out mean of the estimate log pi_rollout(x) -
    log pi_teacher(x) over the other scored sequences' tokens (0 off the teacher's sequences)."""
    on_N = batch.per_row(on_B).to(lp_N.dtype)
    b_N = batch.packed.row_b_N
    est_B = torch.zeros(len(on_B), dtype=torch.float64).index_add_(0, b_N, ((batch.old_logprobs_N - lp_N) * on_N).double())
    count_B = torch.tensor(batch.lengths, dtype=lp_N.dtype) * on_B
    return objective.leave_one_out(est_B, count_B, objective.ranks_total(est_B, count_B, world)) * on_B


def token_advantages(adv_N: torch.Tensor, lp_N: torch.Tensor, part: RolloutRows, terms: list[TeacherTerm]):
    """([N] advantages of a part's rows: each row's sequence advantage adv_N plus every
    teacher's discounted reverse-KL term on its sequences, {summed |signal| of the reward and of
    the teachers} over the rows). lp_N: the trained policy's log-probs of the part's rows."""
    signal = {"signal/reward": float(adv_N.abs().sum()), "signal/teacher": 0.0}
    dev = lp_N.device
    for term in terms:
        on_N = part.per_row(term.on_B[part.seq_B]).to(dev)
        base_N = part.per_row(term.baseline_B[part.seq_B]).to(dev)
        t_N = objective.teacher_advantage(lp_N, term.lp_N[part.index_N].to(dev), part.packed.row_offsets,
                                          term.gamma, term.lam, base_N) * on_N
        adv_N = adv_N + t_N
        signal["signal/teacher"] += float(t_N.abs().sum())
    return adv_N, signal
