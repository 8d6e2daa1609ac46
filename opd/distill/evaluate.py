"""Held-out evaluation of a distillation run: the divergence to each prompt's teacher, accuracy.

The held-out prompts (datasets' eval_path) are answered once by the student at the training
temperature with a fixed seed; each teacher scores the answers routed to it, and the KL is
the training divergence per response row (without T^2). Where the verifiers of opd.rewards
check a prompt (an `answer` or `tests` field), the accuracy is the share of fully correct
answers and the verifier score the mean (a code answer's partial credit included). A multi-turn
trajectory's answer is its last turn (Rollout.text), and its divergence is taken on its own
tokens, not on the tool observations. The random generators are left as they were, so
training does not depend on when it is evaluated.
"""

from __future__ import annotations

import torch

from opd.checkpoint import rng_state, set_rng_state
from opd.diagnostics import DomainTally, topk_overlap
from opd.distill import agentic
from opd.distill.batch import Batch, trimmed
from opd.distill.context import support_k
from opd.distill.cross import cross_loss
from opd.distill.loss import common_vocabulary
from opd.kernels import distill_loss
from opd.rewards import accuracy as share_correct
from opd.rollout.base import SamplingParams
from opd.spine.rows import pack, student_rows


@torch.no_grad()
def evaluate(trainer) -> dict:
    """The metrics of one evaluation (eval/...), for `trainer`'s held-out prompts."""
    state = rng_state()
    try:
        return _evaluate(trainer)
    finally:
        set_rng_state(state)


def _evaluate(tr) -> dict:
    cfg, prompts, world = tr.cfg, tr.prompts, tr.world
    # Each rank answers its share of the held-out prompts (the last padded: `padded_share`).
    mine, real = world.padded_share(list(zip(prompts.eval_samples, prompts.eval_routes)))
    samples, routes = [s for s, _ in mine], [r for _, r in mine]
    r = cfg.rollout
    params = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens, n=1,
                            seed=cfg.run.seed + 12_345, share=(world.rank * len(mine), len(prompts.eval_samples))
                            if world.sharded else None, topk=support_k(cfg.merge.teachers))
    rollouts = tr.rollout(tr.engine, samples, routes, params)
    keep, masks = trimmed(rollouts, tr.trim)
    batch = tr._submit(Batch(index=-1, samples=samples, routes=routes, rollouts=rollouts, keep=keep, masks=masks,
                             policy_version=tr.version))
    answers = tr.teachers.answers(batch.futures)
    tally = DomainTally()
    for ro, route in zip(rollouts[:real], routes):
        tally.add_response(route.domain, ro.response_ids, ro.finish_reason)
    scores: dict[str, list[float]] = {}
    texts = [ro.text(tr.tok) for ro in rollouts[:real]]
    verdicts = tr.verify(samples[:real], texts) if tr.verify is not None and real else [None] * len(texts)
    for route, v in zip(routes, verdicts):
        if v is not None:
            scores.setdefault(route.domain, []).append(float(v))
    if world.main:   # this rank's answers, for a person to read (RUN/samples/step_N.md)
        tr.run_dir.write_samples(tr.steps_done, [{"prompt": s.prompt, "answer": t, "score": v, "domain": r.domain}
                                                 for s, t, v, r in zip(samples, texts, verdicts, routes)],
                                 cfg.run.dump_samples)
    _divergences(tr, batch, answers, real, tally)
    tr.teachers.finish(answers)
    parts = world.gather((tally.plain(), scores, [len(ro.response_ids) for ro in rollouts[:real]],
                          agentic.sums(rollouts[:real])))
    tally = DomainTally.merged([t for t, *_ in parts])
    scores = {}
    for _, part, *_ in parts:
        for d, v in part.items():
            scores.setdefault(d, []).extend(v)
    lengths = [n for _, _, ns, _ in parts for n in ns]
    diag = tally.metrics(tr.stop_ids, cfg.run.ngram, prefix="eval")
    row = {k: v for k, v in diag.items() if not k.endswith("loss_share")}
    kl = tally.row_mean("kl")
    if kl is not None:
        row["eval/kl"] = kl
    for d in {k.split("/")[1] for k in diag}:
        if f"eval/{d}/kl" in diag:
            row[f"eval/kl/{d}"] = diag[f"eval/{d}/kl"]
    row["eval/response_len"] = sum(lengths) / len(lengths)
    sums = agentic.zeros()
    for *_, part in parts:
        sums = agentic.add(sums, part)
    row.update(agentic.metrics(sums, prefix="eval/agent/"))
    if scores:
        # Accuracy counts fully correct answers (score 1); the mean verifier score, with a code
        # answer's partial credit for the share of tests it passes, is its own metric.
        every = [x for v in scores.values() for x in v]
        row["eval/accuracy"] = share_correct(every)
        row["eval/verifier_score"] = sum(every) / len(every)
        row["eval/scored"] = len(every)
        for d, v in scores.items():
            row[f"eval/accuracy/{d}"] = share_correct(v)
        if len(scores) > 1:
            tr.history.warn_lopsided(tr.steps_done, {d: row[f"eval/accuracy/{d}"] for d in scores},
                                     "eval accuracy", cfg.run.lopsided_factor)
    return row


def _divergences(tr, batch: Batch, answers: dict, real: int, tally: DomainTally) -> None:
    """Each teacher's divergence (the training one, no T^2) and top-k overlap on the student's
    rows (a trajectory's own tokens) of the first `real` sequences, micro-batch by micro-batch (one forward each, rows or
    not: the ranks of a sharded student run as many)."""
    rollouts, mb = batch.rollouts, tr.cfg.optim.micro_batch_size
    first_row = {t: {seq: answers[t].row_offsets[j] for j, seq in enumerate(seqs)} for t, seqs in batch.members.items()}
    was = tr.model.training
    tr.model.eval()
    for a in range(0, len(rollouts), mb):
        seqs = list(range(a, min(a + mb, len(rollouts))))
        kept = [rollouts[s].response_ids[:batch.keep[s]] for s in seqs]
        packed = pack([rollouts[s].prompt_ids for s in seqs], kept, tr.tok.pad_token_id,
                      [batch.row_mask(s) for s in seqs])
        logits = student_rows(tr.model, packed, fused=False).float()
        for t in batch.members:
            spec, ans = tr.teachers.specs[t], answers[t]
            for j, s in enumerate(seqs):
                n = batch.rows(s)
                if n == 0 or s >= real or s not in first_row[t]:
                    continue
                rows = logits[packed.row_offsets[j]:packed.row_offsets[j] + n]
                idx = torch.arange(first_row[t][s], first_row[t][s] + n)
                if getattr(spec, "tokenizer", "same") == "cross":   # its three parts' divergence rows
                    targets = packed.targets_N[packed.row_offsets[j]:packed.row_offsets[j] + n]
                    kl = cross_loss(spec, rows, ans, idx, targets)[1]
                else:
                    rows, teacher = common_vocabulary(rows, ans.teacher_rows(idx, rows.device))
                    kl = distill_loss(rows, teacher, beta=spec.divergence_beta, temperature=spec.temperature,
                                      reduction="none")
                domain = batch.route_of(s).domain
                tally.add_rows(domain, "kl", kl)
                tally.add_rows_by_position(domain, "kl", kl, torch.arange(n))
                ids = tr.teachers.topk_ids(spec, ans, idx)
                if ids is not None:
                    tally.add_rows(domain, "topk_overlap", topk_overlap(rows, ids))
    tr.model.train(was)
