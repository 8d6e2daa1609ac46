"""opd rl's teachers: the servers whose sampled-token reverse KL joins each token's GRPO advantage.

`connect` checks them before any step (reachable, the policy's tokenizer; opd train's client
side, opd.teachers.session), `submit` sends a step's responses right after sampling, `terms`
collects each teacher's log-probs of the sampled tokens, and `token_advantages` adds their
discounted reverse-KL terms to the sequence advantage (opd.spine.objective, the objective
opd train computes with `rewards`).

Multi-turn trajectories (`agent`): a teacher reads the whole trajectory, observations
included, and answers only the tokens the policy sampled (SCORE's row masks,
`Rollout.sampled`); its terms go to those positions (`mask_B_T`), an observation's term is 0,
and the discount runs over the sampled tokens alone (`objective.discounted_B_T`), as opd train's rows
are. A batch of single turns sends no masks: what a server without row masks reads too.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from opd.teachers.session import TeacherSet
from opd.fingerprint import tokenizer_fingerprint
from opd.rl.batch import PaddedRollouts
from opd.spine import objective


@dataclass(frozen=True)
class TeacherTerm:
    """One teacher's part of the per-token advantage."""
    lam: float                 # its weight
    gamma: float               # discount of later tokens' terms
    lp_B_T: torch.Tensor       # its log-probs of the sampled tokens (0 off its sequences)
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


def terms(teachers: TeacherSet, specs, futures: dict, batch: PaddedRollouts, world=None) -> list[TeacherTerm]:
    """Each teacher's log-probs of the sampled tokens, [B, T] (0 off its sequences and off the
    mask: its answer's rows are a sequence's masked positions in order), and with `baseline:
    batch` each sequence's leave-one-out mean estimate over the teacher's other sequences, from
    the rollout's own log-probs (opd.spine.objective; over every rank's, `world` sharded)."""
    answers = teachers.answers({t: f for t, (_, f) in futures.items()})
    out = []
    for spec in specs:
        if spec.name not in futures:
            continue
        seqs, answer = futures[spec.name][0], answers[spec.name]
        lp_B_T, on_B = torch.zeros_like(batch.old_logprobs_B_T), torch.zeros(batch.mask_B_T.shape[0])
        for j, b in enumerate(seqs):
            a, e = answer.row_offsets[j], answer.row_offsets[j + 1]
            at = batch.mask_B_T[b].nonzero(as_tuple=True)[0]   # one turn: 0 .. len - 1
            lp_B_T[b, at] = torch.as_tensor(answer.token_logprob[a:e], dtype=lp_B_T.dtype)
            on_B[b] = 1.0
        baseline_B = sampled_baseline(batch, lp_B_T, on_B, world) if spec.baseline == "batch" else torch.zeros_like(on_B)
        out.append(TeacherTerm(spec.weight, spec.gamma, lp_B_T, on_B, baseline_B))
    return out


def sampled_baseline(batch: PaddedRollouts, lp_B_T: torch.Tensor, on_B: torch.Tensor, world=None) -> torch.Tensor:
    """[B]: each scored sequence's leave-one-out mean of the estimate log pi_rollout(x) -
    log pi_teacher(x) over the other scored sequences' tokens (0 off the teacher's sequences)."""
    m = batch.mask_B_T.to(lp_B_T.dtype) * on_B[:, None]
    est_B = ((batch.old_logprobs_B_T - lp_B_T) * m).sum(1).double()
    total = None
    if world is not None and world.sharded:
        both = world.sum({"sum": float(est_B.sum()), "count": float(m.sum())})
        total = (both["sum"], both["count"])
    return objective.leave_one_out(est_B, m.sum(1), total) * on_B


def token_advantages(adv_B, lp_B_T, mask_B_T, terms, rows, sl):
    """([B, T] advantages: adv_B plus every teacher's discounted reverse-KL term on its
    sequences, {summed |signal| of the reward and of the teachers} over real tokens)."""
    m = mask_B_T.to(lp_B_T.dtype)
    adv_B_T = adv_B[:, None].expand_as(lp_B_T)
    signal = {"signal/reward": float((adv_B_T.abs() * m).sum()), "signal/teacher": 0.0}
    for term in terms:
        on = term.on_B[rows][sl].to(lp_B_T.device)[:, None] * m
        base = term.baseline_B[rows][sl].to(lp_B_T.device)[:, None]
        adv_t = objective.teacher_advantage(lp_B_T, term.lp_B_T[rows][sl].to(lp_B_T.device), term.lam, base)
        t_B_T = objective.discounted_B_T(adv_t, on, term.gamma)
        adv_B_T = adv_B_T + t_B_T
        signal["signal/teacher"] += float(t_B_T.abs().sum())
    return adv_B_T, signal
