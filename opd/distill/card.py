"""The training card of `opd train`: every setting a distillation result needs to be reproduced."""

from __future__ import annotations

from pathlib import Path

from opd.card import write_card
from opd.cluster.cores import wait_policy
from opd.distill import agentic


def divergence_words(beta: float) -> str:
    if beta == 0.0:
        return "forward KL(teacher || student): mode-covering"
    if beta == 1.0:
        return "reverse KL(student || teacher): mode-seeking"
    return f"generalized JSD with beta={beta:g} (between forward and reverse KL)"


def _cross_facts(t, parts: dict) -> dict:
    """A `tokenizer: cross` teacher: what it reads, and its loss's three parts over the run
    (parts: {"cross/<teacher>/<part>": [weighted |value| summed, rows]}; opd.distill.cross)."""
    mine = {k.rsplit("/", 1)[1]: v for k, v in parts.items() if k.startswith(f"cross/{t.name}/")}
    unaligned = mine.pop("unaligned", [0.0, 0])
    total = sum(v[0] for v in mine.values())
    return {"tokenizer": f"cross-tokenizer: its own ({t.cross.tokenizer_path}); the response retokenized, its "
                         f"answers aligned to the student's rows over text spans",
            "sees": (f"its own prompt, context {t.context!r}," if t.context else "the sample's prompt")
                    + " rendered with its own chat template in its own tokens, then the student's response as text",
            "cross_parts": {p: {"weight": getattr(t.cross, p), "mean_per_row": v[0] / v[1] if v[1] else 0.0,
                                "share": v[0] / total if total else 0.0} for p, v in mine.items()}
            or "not measured",
            "responses_not_retokenized_exactly": (f"{unaligned[0] / unaligned[1]:.1%} of {unaligned[1]} (each one "
                                                  f"span: the teacher's tokens decode to another text)"
                                                  if unaligned[1] else "not measured")}


def _teacher_facts(cfg, t, welcome, tail: list[float], share: float, student_fingerprint: str) -> dict:
    """tail: [sum of the teacher's tail mass over the rows trained on, rows]; student_fingerprint:
    the model fingerprint of the student's start (a teacher with it is a frozen copy)."""
    return {
        "address": t.address, "model": welcome.model_id, "model_fingerprint": welcome.model_fingerprint,
        "tokenizer_fingerprint": welcome.tokenizer_fingerprint, "domains": t.domains,
        "scoring": (f"full vocabulary ({cfg.loss.full_dtype} logits)" if t.mode == "full" else
                    f"top-k, k={t.k}: the teacher's top k + one tail bucket" if t.mode == "topk" else
                    f"top-k, k={t.k}: the student's own top k at sampling + one tail bucket" if t.mode == "student_topk"
                    else f"sampled token (reverse-KL advantage, "
                         + ("leave-one-out batch baseline" if t.baseline == "batch" else "no baseline")
                         + (f", discount gamma {t.gamma}" if t.gamma else "") + f"), top-{t.k} for diagnostics"),
        "sees": (f"its own prompt, context {t.context!r} (the sample's fields), then the student's response"
                 if t.context else "the student's prompt and response"),
        **({"self": "a frozen copy of the student's start (its model fingerprint)"}
           if welcome.model_fingerprint == student_fingerprint else {}),
        "mean_teacher_tail_mass": ("0 (full vocabulary)" if t.mode == "full" else
                                   tail[0] / tail[1] if tail[1] else "not measured"),
        "temperature": t.temperature, "divergence": divergence_words(t.divergence_beta), "beta": t.divergence_beta,
        "t2_scaling": t.scale_by_t2, "loss_weight": t.weight, "sample_share": share,
    }


def _correction_facts(off, importance: list[float] | None) -> dict:
    total, peak, cut, rows = importance or [0.0, 0.0, 0.0, 0]
    how = {"tis": f"truncated importance sampling, ratio cap {off.cap}",
           "mask": f"tokens whose ratio leaves [{off.band[0]}, {off.band[1]}] masked",
           "none": "none: off-policy rows trained as if on-policy"}[off.correction]
    return {"method": how, "ratio": "pi_now / pi_sampler of the sampled token (raw, temperature-1 log-probs)",
            **({"ratio_mean": total / rows, "ratio_max": peak, "share_cut": cut / rows, "rows": int(rows)}
               if rows else {"rows": "no row was sampled by older weights" if importance is not None else 0})}


def write_train_card(out: Path, cfg, *, welcomes: dict, student: dict, teacher_samples: dict[str, float],
                     tail_mass: dict[str, list[float]], staleness: list[int], prompts: dict[str, int],
                     eval_prompts: int, evals: list[dict], warnings: list[str], steps: int,
                     skipped_lines: dict | None = None, trimmed: list[int] | None = None, ranks: int = 1,
                     memory: dict | None = None, importance: list[float] | None = None,
                     agent: list[float] | None = None, cross: dict | None = None,
                     teacher_weights: list[str] | None = None) -> None:
    """card.md + card.json in `out`. `student`: model/tokenizer fingerprints and trained parameter count;
    `trimmed`: [response tokens trimmed after the answer, response tokens sampled] over the run;
    `skipped_lines`: {file: {loaded, skipped, first}} for files with malformed lines skipped;
    `importance`: [sum of the importance ratios, their max, rows cut by the correction, rows];
    `agent`: the run's trajectory sums (opd.agent.totals.sums), stated with `cfg.agent`;
    `cross`: the cross-tokenizer teachers' parts over the run (History.cross, opd.distill.cross);
    `teacher_weights`: a line per pass-rate measurement of the run (opd.distill.pass_rates)."""
    total = sum(teacher_samples.values()) or 1.0
    st = staleness or [0]
    lora = cfg.student.lora
    facts = {
        "student": {
            "path": cfg.student.path, **student, "dtype": cfg.student.dtype,
            "training": (f"LoRA r={lora.rank} alpha={lora.alpha} on {', '.join(lora.target_modules)} "
                         f"dropout={lora.dropout} (checkpoints hold the adapter alone)") if lora
            else "full fine-tuning"},
        **{f"teacher {t.name}": {**_teacher_facts(cfg, t, welcomes[t.name], tail_mass.get(t.name) or [0.0, 0],
                                                  teacher_samples.get(t.name, 0.0) / total,
                                                  student["model_fingerprint"]),
                                   **(_cross_facts(t, cross or {}) if t.tokenizer == "cross" else {})}
           for t in cfg.merge.teachers},
        "trajectories": {
            "source": f"sampled by the student being trained ({cfg.rollout.engine} engine"
                      + (", multi-turn with tools: see agent)" if cfg.agent else ")"),
            "pipelined": cfg.run.pipeline if cfg.run.max_staleness is None else
            f"rollouts run ahead by at most {cfg.run.max_staleness} optimizer steps (run.max_staleness)",
            "staleness": (f"mean {sum(st) / len(st):.3g}, max {max(st)} optimizer steps between the sampling "
                          f"weights and the trained weights; batches per staleness: "
                          f"{ {k: st.count(k) for k in sorted(set(st))} }"),
            "off_policy_correction": _correction_facts(cfg.loss.off_policy, importance),
            "temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
            "max_new_tokens": cfg.rollout.max_new_tokens, "samples_per_prompt": cfg.rollout.samples_per_prompt,
            "trimming": cfg.loss.trim + (f" (marker {cfg.loss.answer_end_marker!r})"
                                         if cfg.loss.trim == "marker" else "")
                        + (f"; {trimmed[0] / trimmed[1]:.1%} of the {trimmed[1]} response tokens sampled were "
                           f"trimmed, not distilled" if trimmed and trimmed[1] else ""),
        },
        **({"agent": agentic.facts(cfg, agent)} if cfg.agent is not None else {}),
        "objective": {
            "loss": "sum_d lambda_d * L_OPD^d + lambda_sft * L_SFT"
                    + ((" + alpha * L_reward (policy gradient of the "
                        + ("batch" if cfg.loss.reward_advantage == "batch" else "group") + " advantage)")
                       if cfg.rewards else ""),
            "rewards": ({"functions": [{"name": r.name, "weight": r.weight, **({"path": r.path} if r.path else {}),
                                        **({"options": r.options} if r.options else {})} for r in cfg.rewards],
                         "alpha (loss.reward_weight)": cfg.loss.reward_weight,
                         "advantage": cfg.loss.reward_advantage,
                         "group_size": cfg.rollout.samples_per_prompt} if cfg.rewards else "none"),
            "length_normalization": f"per {cfg.loss.length_norm}" + (
                "; the policy-gradient terms (sampled mode, the reward) take the token mean"
                if cfg.loss.length_norm == "sequence" and (cfg.rewards or any(t.mode == "sampled"
                                                                              for t in cfg.merge.teachers)) else ""),
            "domain_weights": cfg.merge.domain_weights, "domain_normalization": cfg.merge.normalize,
            "sft_mix": (f"lambda_sft={cfg.merge.sft.lambda_sft} on {cfg.merge.sft.path} "
                        f"({cfg.merge.sft.batch_size} per step)") if cfg.merge.sft else "none",
            "fused_linear": cfg.loss.fused_linear,
            "entropy_bonus": (f"{cfg.terms.entropy_bonus:g} x the student's entropy per token, weighted as the "
                              f"policy-gradient terms (opd.spine.terms)" if cfg.terms.needs_entropy else "none"),
        },
        "data": {"ratios": {d.domain: d.ratio for d in cfg.merge.datasets}, "prompts": prompts,
                 "eval_prompts": eval_prompts,
                 "skipped_malformed_lines": skipped_lines or "none",
                 "routing_rules": [r.kind for r in cfg.merge.routing.rules] or ["single teacher"],
                 "teacher_weighting": cfg.merge.routing.weighting + (
                     f", pass rates measured by the run every {cfg.merge.routing.refresh_every} steps on "
                     f"{cfg.merge.routing.refresh_prompts} held-out prompts per domain and teacher, pooled"
                     if cfg.merge.routing.refresh_every else ""),
                 **({"teacher_weights_over_time": teacher_weights} if teacher_weights else {})},
        "run": {"steps": steps, "seed": cfg.run.seed, "lr": cfg.optim.lr, "schedule": cfg.optim.schedule,
                "omp_wait_policy": wait_policy(),
                "ranks": f"{ranks} (FSDP2, each rank {cfg.rollout.prompts_per_step // ranks} prompts a step)"
                if ranks > 1 else "1", **({"memory_per_rank_bytes": memory} if memory else {}),
                "prompts_per_step": cfg.rollout.prompts_per_step, "grad_accum": cfg.optim.grad_accum,
                "eval_kl_first": evals[0].get("eval/kl") if evals else None,
                "eval_kl_last": evals[-1].get("eval/kl") if evals else None,
                "warnings": warnings[-5:]},
    }
    write_card(out, "On-policy distillation run", facts)
