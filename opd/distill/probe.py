"""`opd probe`: will this teacher distill into this student? Measured before a run.

The student samples responses to a few prompts; the teacher scores every position the
student visited (top-k mode, temperature 1). Reported, per response token, averaged:

    forward_kl_topk   KL(teacher || student) over the partition {teacher's top-k, tail}
                      (a lower bound of the full-vocabulary forward KL)
    reverse_kl_topk   KL(student || teacher) over the same partition (a lower bound)
    reverse_kl_sampled  log p_student(x) - log p_teacher(x) at the sampled tokens x: an
                      unbiased estimate of the full-vocabulary reverse KL (n/a unless the
                      responses are sampled at temperature 1, the distribution it scores)
    topk_overlap      |student's top-k ∩ teacher's top-k| / k (1: same k most likely tokens)
    teacher_tail_mass 1 - the teacher's top-k probability mass (what top-k mode cuts off)
    teacher_token_prob  mean teacher probability of the tokens the student sampled

The report also gives the settings that change these numbers: the student's sampling
temperature, seed and max_new_tokens, the k asked for and the k used (a teacher answers at
most its max_k: a larger --k is lowered, with a notice), and the teacher's temperature (1).

Low overlap predicts failure: the teacher puts its mass where the student does not look,
so on-policy states carry little signal the student can follow. The verdict is plain text
built from overlap and tail mass (thresholds in `verdict`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from opd.config import number_arg, positive_int
from opd.data import DataError, encode_prompt, load_jsonl
from opd.diagnostics import topk_overlap
from opd.fingerprint import load_model_tokenizer, tokenizer_fingerprint
from opd.kernels import TopKTeacher, distill_loss
from opd.rollout.base import SamplingParams
from opd.rollout.hf import HFRolloutEngine
from opd.spine.config import ModelConfig
from opd.spine.model import load_policy
from opd.spine.rows import pack, student_rows
from opd.teachers.client import TeacherClient, TeacherError

# The teacher scores at temperature 1: the distribution it would be distilled from in top-k mode.
TEACHER_TEMPERATURE = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--student", required=True, type=Path, help="student model directory")
    p.add_argument("--teacher", required=True, help="teacher server address, e.g. tcp://127.0.0.1:5601")
    p.add_argument("--prompts", required=True, type=Path, help="JSONL prompts (field `prompt`)")
    p.add_argument("--num-prompts", type=positive_int, default=16, help="prompts used (the first N)")
    p.add_argument("--k", type=positive_int, default=16, help="top-k of overlap and tail mass")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="length limit of the student's responses")
    p.add_argument("--temperature", type=number_arg(float, 0, note=" (0: greedy)"), default=1.0,
                   help="student sampling temperature (0: greedy; the sampled reverse-KL estimate needs 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--device", default="cpu", help="device of the student")
    p.add_argument("--timeout-s", type=number_arg(float, 0, strict=True), default=30.0,
                   help="teacher answer timeout in seconds")
    p.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")


def verdict(overlap: float, tail_mass: float, k: int) -> str:
    if overlap >= 0.5:
        v = "compatible: the student already ranks most of the teacher's top tokens highly; distillation should work"
    elif overlap >= 0.2:
        v = ("partial overlap: expect slower progress; a short SFT on teacher samples first, or a closer "
             "teacher, makes on-policy distillation more reliable")
    else:
        v = ("low overlap: the teacher's likely tokens are mostly outside the student's; on-policy distillation "
             "is likely to fail (an incompatible style). Start with SFT on teacher outputs or pick another teacher")
    if tail_mass > 0.1:
        v += f". Top-{k} leaves {tail_mass:.0%} of the teacher's mass in the tail: raise k or use full mode"
    return v


def probe(student_dir: str | Path, teacher: str, prompts: list[str], *, k: int = 16, max_new_tokens: int = 64,
          temperature: float = 1.0, seed: int = 0, device: str = "cpu", timeout_s: float = 30.0) -> dict:
    tok = load_model_tokenizer(student_dir, "--student")
    client = TeacherClient(teacher, timeout_s=timeout_s, retries=1)
    try:
        welcome = client.info()
        fp = tokenizer_fingerprint(tok)
        if welcome.tokenizer_fingerprint != fp:
            raise ValueError(f"teacher at {teacher} uses tokenizer fingerprint {welcome.tokenizer_fingerprint}, "
                             f"the student ({student_dir}) {fp}: they cannot be distilled token by token")
        k_requested, k = k, min(k, welcome.max_k)
        if k < k_requested:
            print(f"note: the teacher at {teacher} answers top-k for k up to {welcome.max_k} (its --max-k): "
                  f"k {k_requested} lowered to {k}", file=sys.stderr, flush=True)
        model, _ = load_policy(ModelConfig(path=str(student_dir), device=device), tokenizer=tok, train=False)
        engine = HFRolloutEngine(model, tok)
        ids = [encode_prompt(tok, p) for p in prompts]
        rollouts = engine.generate(ids, SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                                                       seed=seed))
        rollouts = [r for r in rollouts if r.response_ids]
        if not rollouts:
            raise ValueError("the student produced only empty responses")
        answer = client.score_topk([r.ids for r in rollouts], [len(r.prompt_ids) for r in rollouts], k,
                                   temperature=TEACHER_TEMPERATURE)
        with torch.no_grad():
            packed = pack([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts],
                          tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
            logits = student_rows(model, packed, fused=False).float().cpu()
        t = TopKTeacher(answer.ids, answer.logprobs, answer.tail_logmass)
        student_lp = torch.tensor([lp for r in rollouts for lp in r.logprobs])
        report = {
            "student": str(student_dir), "teacher": welcome.teacher, "teacher_model": welcome.model_id,
            "teacher_model_fingerprint": welcome.model_fingerprint, "tokenizer_fingerprint": fp,
            "student_temperature": temperature, "seed": seed, "max_new_tokens": max_new_tokens,
            "teacher_temperature": TEACHER_TEMPERATURE, "k_requested": k_requested, "k": k,
            "responses": len(rollouts), "tokens": int(logits.shape[0]),
            "forward_kl_topk": float(distill_loss(logits, t, beta=0.0)),
            "reverse_kl_topk": float(distill_loss(logits, t, beta=1.0)),
            # mean of log S(x) - log T(x) is reverse KL only for x drawn from the S it scores (T = 1)
            "reverse_kl_sampled": (float((student_lp - answer.token_logprob).mean()) if temperature == 1.0 else
                                   f"n/a: responses sampled at temperature {temperature:g}, the estimate needs 1"),
            "topk_overlap": float(topk_overlap(logits, answer.ids).mean()),
            "teacher_tail_mass": float(answer.tail_logmass.exp().mean()),
            "teacher_token_prob": float(answer.token_logprob.exp().mean()),
            "mean_response_len": sum(len(r.response_ids) for r in rollouts) / len(rollouts),
        }
        report["verdict"] = verdict(report["topk_overlap"], report["teacher_tail_mass"], k)
        return report
    finally:
        client.close()


def run(args: argparse.Namespace) -> int:
    try:
        samples, _ = load_jsonl(args.prompts)
        report = probe(args.student, args.teacher, [s.prompt for s in samples[:args.num_prompts]], k=args.k,
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                       device=args.device, timeout_s=args.timeout_s)
    except (DataError, ValueError, TeacherError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    width = max(len(k) for k in report)
    for key, value in report.items():
        measured = isinstance(value, float) and math.isfinite(value) and not key.endswith("_temperature")
        shown = f"{value:.4f}" if measured else f"{value:g}" if isinstance(value, float) else value
        print(f"{key:<{width}}  {shown}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0
