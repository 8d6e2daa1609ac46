"""The distillation objective of one batch: each teacher's rows, weighted, backward in micro-batches.

    L = sum_d lambda_d * L^d  +  lambda_sft * L_SFT  [+ the reward term, with `rewards`]
                                                    [+ the terms of `terms:`, opd.spine.terms]

L^d is the mean loss (per token or per sequence, `loss.length_norm`) of the response rows
routed to domain d, each row's loss the divergence to its teacher (top-k with the tail bucket,
full vocabulary, or the sampled-token reverse-KL advantage) times that teacher's weight and
share of the sample (opd.spine.rows.row_weights). Rows come from opd.kernels, on the student's
response rows only: prompt and padding are never scored, the rows past the answer's end
were trimmed before the teachers saw them, and a multi-turn trajectory's rows are its own
tokens (its tool observations are context: `Batch.row_mask`, opd.spine.rows.pack).

With `rewards`, every response token also carries alpha times its sequence's group advantage
as a policy-gradient term (opd.spine.objective, the same maths `opd rl` adds teachers with).
The two policy-gradient terms (sampled mode, the reward) weigh a domain's tokens alike (its
token mean) under either `loss.length_norm`, and sampled mode subtracts its teacher's
leave-one-out baseline (opd.spine.objective says why). Rows of a batch sampled by older weights
(run.pipeline, run.max_staleness) are weighted by their importance ratio (loss.off_policy): a
top-k or full divergence by its prefix's, sampled mode by its prefix's times its token's, the
reward by its token's.

`train_batch` runs the first micro-batch's student forward before it waits for the teachers
(they score in their own processes meanwhile), and reads a full-vocabulary answer's rows
micro-batch by micro-batch as they stream in.
"""

from __future__ import annotations

import time

import torch

from opd.data import encode_prompt
from opd.diagnostics import bucket_entropy, topk_overlap
from opd.distill.batch import Batch
from opd.distill.cross import cross_loss
from opd.distill.stats import StepStats
from opd.teachers.session import Answer, TeacherSet
from opd.kernels import distill_loss, fused_linear_distill_loss, sampled_token_reverse_kl
from opd.spine import objective, terms
from opd.spine.optim import TrainError
from opd.spine.dist import World
from opd.spine.rows import (group_counts, pack, row_weights, rows_logits, select_rows, sft_loss, student_rows,
                            token_logprobs)


def teacher_loss(spec, rows, answer: Answer, idx: torch.Tensor, targets: torch.Tensor, impl: str,
                 segments: list[int] | None = None, baseline: torch.Tensor | None = None):
    """(loss rows with grad, divergence rows for metrics) of one teacher on the student's rows
    `rows` (logits [n, V], or (hidden [n, H], lm_head weight [V, H]) when fused) against its
    answer rows `idx`; targets [n]: the sampled tokens. T^2 is applied when the spec asks.
    segments: where each sequence's rows start in `rows` (sampled mode with gamma > 0: each
    token's advantage discounts its sequence's later tokens' terms into it). baseline [n]:
    sampled mode, subtracted from each row's estimate before it is an advantage."""
    if getattr(spec, "tokenizer", "same") == "cross":   # another vocabulary: its answer aligned to these rows
        return cross_loss(spec, rows, answer, idx, targets, impl)
    t2 = spec.temperature ** 2 if spec.scale_by_t2 else 1.0
    if spec.mode == "sampled":
        device = rows[0].device if isinstance(rows, tuple) else rows.device
        student_lp = token_logprobs(rows, targets.to(device), temperature=spec.temperature, impl=impl)
        teacher_lp = answer.token_logprob[idx].to(student_lp.device)
        adv = objective.teacher_advantage(student_lp, teacher_lp, segments if segments is not None else
                                          [0, len(student_lp)], spec.gamma,
                                          baseline_N=0.0 if baseline is None else baseline.to(student_lp.device))
        return objective.policy_gradient(student_lp, adv) * t2, sampled_token_reverse_kl(student_lp, teacher_lp)
    teacher = answer.teacher_rows(idx, rows[0].device if isinstance(rows, tuple) else rows.device)
    if isinstance(rows, tuple):
        hidden, weight = rows
        if isinstance(teacher, torch.Tensor) and teacher.shape[1] != weight.shape[0]:
            raise TrainError(f"teacher vocabulary {teacher.shape[1]} != student LM head {weight.shape[0]}")
        kl = fused_linear_distill_loss(hidden, weight, teacher, beta=spec.beta, temperature=spec.temperature,
                                       reduction="none", impl=impl)
    else:
        rows, teacher = common_vocabulary(rows, teacher)
        kl = distill_loss(rows, teacher, beta=spec.beta, temperature=spec.temperature, reduction="none", impl=impl)
    return kl * t2, kl.detach()


def common_vocabulary(student_N_V: torch.Tensor, teacher):
    """(student, teacher) logits cut to the vocabulary both have when one side's LM head is
    padded past the tokenizer (e.g. 151,936 against 152,064 columns); a top-k teacher as it is."""
    if isinstance(teacher, torch.Tensor) and teacher.shape[1] != student_N_V.shape[1]:
        v = min(teacher.shape[1], student_N_V.shape[1])
        return student_N_V[:, :v], teacher[:, :v]
    return student_N_V, teacher


def train_batch(model, batch: Batch, teachers: TeacherSet, *, cfg, lam: dict[str, float], pad_id: int,
                scale: float, stats: StepStats, world: World = World(), stale: bool = False) -> None:
    """Loss and backward of one batch, micro-batch by micro-batch (the gradients accumulate).
    lam: each domain's lambda (merge.domain_weights times its normalizer multiplier); scale: the
    batch's share of the optimizer step (1 / grad_accum). world: the batch is this rank's share
    of the step: rows are weighted by every rank's counts, and every micro-batch runs forward
    and backward, rows or not, since a sharded model's passes are collectives. stale: the batch
    was sampled by older weights than those trained (its rows get importance weights)."""
    responses = batch.responses()
    offsets = [0]   # each sequence's rows: its kept tokens the model sampled
    for s in range(len(responses)):
        offsets.append(offsets[-1] + batch.rows(s))
    domains = [batch.route_of(s).domain for s in range(len(responses))]
    counts = world.sum(group_counts(offsets, domains)) if world.sharded else None
    weights_N = row_weights(offsets, domains, lam, cfg.loss.length_norm, counts) * scale
    # Policy-gradient terms: the token mean, whatever length_norm says (opd.spine.objective).
    pg_weights_N = weights_N if cfg.loss.length_norm == "token" else \
        row_weights(offsets, domains, lam, "token", counts) * scale
    off = cfg.loss.off_policy
    corrected = stale and off.correction != "none"
    answers: dict[str, Answer] | None = None
    mb = cfg.optim.micro_batch_size
    for a in range(0, len(responses), mb):
        seqs = list(range(a, min(a + mb, len(responses))))
        packed = pack([batch.rollouts[s].prompt_ids for s in seqs], [responses[s] for s in seqs], pad_id,
                      [batch.row_mask(s) for s in seqs])
        if packed.row_offsets[-1] == 0 and not world.sharded:
            continue
        rows = student_rows(model, packed, fused=cfg.loss.fused_linear)
        if answers is None:   # only now does the student need them: they were computed meanwhile
            answers = _wait(teachers, batch, stats)
            where = {t: {seq: answers[t].row_offsets[j] for j, seq in enumerate(members)}
                     for t, members in batch.members.items()}   # a sequence's first row in each answer
            baselines = sampled_baselines(batch, teachers.specs, answers, world)
        device = rows[0].device if isinstance(rows, tuple) else rows.device
        # 0 x the rows keeps every parameter in the graph: a rank whose rows go to no teacher
        # still joins the others' gradient reduction.
        loss = sum(x.sum() for x in (rows if isinstance(rows, tuple) else (rows,))) * 0.0 if world.sharded else \
            torch.zeros((), device=device)
        # The trained weights' raw log-probs of the sampled tokens: the reward's policy gradient
        # (with grad) and the importance ratios against the sampler's (opd.spine.objective).
        # (Without rewards no gradient: the ratios alone would keep a [rows, V] graph alive.)
        lp_N = None
        if batch.advantages is not None or stale:
            with torch.enable_grad() if batch.advantages is not None else torch.no_grad():
                lp_N = token_logprobs(rows, packed.targets_N.to(device), impl=cfg.loss.impl)
        ratios = None
        if lp_N is not None:
            sampler_N = torch.tensor([x for s in seqs for x in batch.sampler_logprobs(s)])
            ratios = objective.importance(lp_N, sampler_N, packed.row_offsets, [stale] * len(seqs), off.correction,
                                          off.cap, tuple(off.band))
            stats.add_importance(ratios)
        diag_logits = None
        for t in batch.members:
            spec = teachers.specs[t]
            local, remote, w_rows, row_domain, pos = _routed_rows(t, batch, seqs, packed.row_offsets, where[t], offsets,
                                                             pg_weights_N if spec.mode == "sampled" else weights_N,
                                                             spec.weight)
            if not local:
                continue
            local_i, remote_i = torch.tensor(local), torch.tensor(remote)
            segments = [0]
            for w in w_rows:
                segments.append(segments[-1] + len(w))
            base = None
            if t in baselines:   # each row: its sequence's leave-one-out baseline
                base = torch.cat([baselines[t][s].expand(offsets[s + 1] - offsets[s]) for s in seqs
                                  if s in where[t] and batch.route_of(s).weights.get(t, 0.0) > 0])
            loss_rows, kl_rows = teacher_loss(spec, select_rows(rows, local_i.to(device)), answers[t],
                                              remote_i, packed.targets_N[local_i], cfg.loss.impl, segments, base)
            weighted = torch.cat(w_rows).to(device) * loss_rows
            if corrected:   # sampled: the prefix's ratio times its token's (opd.spine.objective)
                iw = ratios.prefix_N * ratios.token_N if spec.mode == "sampled" else ratios.prefix_N
                weighted = weighted * iw[local_i].to(device)
            loss = loss + weighted.sum()
            stats.add_signal("teacher", float((kl_rows.detach().abs() * spec.weight).sum()), len(local))
            # Diagnostics, from the same rows.
            diag_logits = rows_logits(rows) if diag_logits is None else diag_logits
            ids = teachers.topk_ids(spec, answers[t], remote_i)   # None: the teacher's own top k is unknown
            overlap = None if ids is None else topk_overlap(diag_logits[local_i.to(diag_logits.device)], ids)
            topk = answers[t].topk
            tail = topk.tail_logmass[remote_i].exp() if topk is not None else None
            entropy = bucket_entropy(topk.logprobs[remote_i], topk.tail_logmass[remote_i]) if topk is not None else None
            stats.add_teacher_rows(t, row_domain, weighted, kl_rows, overlap, tail, lam, torch.tensor(pos), entropy)
        if batch.advantages is not None and packed.row_offsets[-1]:   # the reward's term, every row
            adv_N = torch.tensor([cfg.loss.reward_weight * batch.advantages[s]
                                  for s in seqs for _ in range(offsets[s + 1] - offsets[s])])
            w_N = torch.cat([pg_weights_N[offsets[s]:offsets[s + 1]] for s in seqs])
            if corrected:
                w_N = w_N * ratios.token_N
            reward_loss = objective.policy_gradient(lp_N, adv_N.to(device), w_N.to(device)).sum()
            loss = loss + reward_loss
            stats.reward_loss += float(reward_loss.detach())
            stats.add_signal("reward", float(adv_N.abs().sum()), len(adv_N))
        if cfg.terms.needs_entropy and packed.row_offsets[-1]:   # opd.spine.terms, every row
            ent_N = terms.entropy(rows)
            w_N = torch.cat([pg_weights_N[offsets[s]:offsets[s + 1]] for s in seqs])
            if corrected:   # an exact expectation given the prefix: the prefix's ratio
                w_N = w_N * ratios.prefix_N
            loss = loss + (w_N.to(device) * terms.token_loss(cfg.terms, entropy=ent_N)).sum()
            stats.add_signal("entropy", float(ent_N.detach().sum()), len(ent_N))
        loss.backward()
        stats.loss += float(loss.detach())
    if answers is None:   # every response trimmed to nothing: the answers are collected all the same
        answers = _wait(teachers, batch, stats)
    stats.wait_s += teachers.finish(answers)   # full mode: the time blocked on streamed rows
    for t, a in answers.items():   # a cross-tokenizer teacher's three parts (opd.distill.cross)
        for part, (total, n) in getattr(a, "parts", {}).items():
            stats.add_signal(f"cross/{t}/{part}", total, n)
    stats.latencies += [a.latency_s for a in answers.values()]


def sampled_baselines(batch: Batch, specs: dict, answers: dict[str, Answer], world: World = World()) -> dict:
    """{teacher: {sequence: b}} for each sampled-mode teacher with `baseline: batch`: the mean of
    the sampled-token estimate log pi(x) - log pi_teacher(x) over the rows of the teacher's other
    sequences (objective.leave_one_out), from the sampler's log-probs, known before the student's
    forward (so b is the same for any micro-batch size; on-policy at temperature 1 they are the
    trained weights' own). Over every rank's sequences when the batch is one rank's share."""
    out = {}
    for t, spec in specs.items():
        if spec.mode != "sampled" or spec.baseline != "batch":
            continue
        members = batch.members.get(t, [])
        a = answers[t]
        sums, counts = torch.zeros(len(members), dtype=torch.float64), torch.zeros(len(members))
        for j, s in enumerate(members):
            lo, hi = a.row_offsets[j], a.row_offsets[j + 1]
            teacher = torch.as_tensor(a.token_logprob[lo:hi], dtype=torch.float64)
            sampler = torch.tensor(batch.sampler_logprobs(s), dtype=torch.float64)
            if len(sampler) != hi - lo:
                raise TrainError(f"teacher {t!r} answered {hi - lo} rows of sequence {s}, which has {len(sampler)}")
            sums[j], counts[j] = float((sampler - teacher).sum()), float(hi - lo)
        b = objective.leave_one_out(sums, counts, objective.ranks_total(sums, counts, world))
        out[t] = {s: b[j] for j, s in enumerate(members)}
    return out


def _routed_rows(t: str, batch: Batch, seqs: list[int], local_offsets: list[int], first_row: dict[int, int],
                 offsets: list[int], weights_N: torch.Tensor, teacher_weight: float):
    """The rows of micro-batch `seqs` that teacher `t` scores: their indices in the micro-batch
    (local) and in t's answer (remote), their weights, their domains, and their positions in
    their responses (0-based, over the rows a sequence trains)."""
    local, remote, w_rows, row_domain, pos = [], [], [], [], []
    for j, s in enumerate(seqs):
        w = batch.route_of(s).weights.get(t, 0.0)
        if w <= 0 or s not in first_row:
            continue
        n = offsets[s + 1] - offsets[s]
        local.extend(range(local_offsets[j], local_offsets[j] + n))
        remote.extend(range(first_row[s], first_row[s] + n))
        w_rows.append(weights_N[offsets[s]:offsets[s] + n] * w * teacher_weight)
        row_domain += [batch.route_of(s).domain] * n
        pos.extend(range(n))
    return local, remote, w_rows, row_domain, pos


def _wait(teachers: TeacherSet, batch: Batch, stats: StepStats) -> dict[str, Answer]:
    t0 = time.perf_counter()
    answers = teachers.answers(batch.futures)
    stats.wait_s += time.perf_counter() - t0
    return answers


def sft_mix(model, tokenizer, pairs, lambda_sft: float, scale: float, world: World = World()) -> float:
    """merge.sft's cross-entropy on reference responses (prompt masked, EOS appended), backward
    at weight lambda_sft * scale; returns the unweighted loss (of the whole step's pairs when
    `pairs` is this rank's share of them)."""
    prompts = [encode_prompt(tokenizer, s.chat) for s in pairs]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    responses = [tokenizer(s.response, add_special_tokens=False)["input_ids"] + eos for s in pairs]
    tokens = world.sum({"n": float(sum(map(len, responses)))})["n"] if world.sharded else None
    ce = sft_loss(model, prompts, responses, tokenizer.pad_token_id, tokens)
    (lambda_sft * scale * ce).backward()
    return world.sum({"ce": float(ce.detach())})["ce"]
