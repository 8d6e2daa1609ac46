"""Where one opd step's time goes at given shapes: each phase alone, in one process, timed.

    python -m opd.benchmarks.step_profile STUDENT_DIR TEACHER_DIR [--threads N] [--repeats R]

(`opd bench step --preset small-real` builds the two directories.) Phases, each the median of
--repeats runs after one warm-up: the rollout (4 prompts x 32 tokens with the hf engine) and
inside it the student's decode forwards and the per-token sampling on the full logits
(`pick_tokens` + the log-prob); the teacher's forward over prompt + response with top-k on the
response rows (what `opd serve-teacher` computes); the student's forward to its response
rows' logits; the top-k distillation loss; backward; gradient clipping + AdamW.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from opd.kernels import TopKTeacher, distill_loss
from opd.rollout.base import SamplingParams
from opd.rollout.hf import HFRolloutEngine, pick_tokens
from opd.spine.rows import pack, student_rows


def _time(fn, repeats: int) -> tuple[float, object]:
    fn()   # warm-up
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def profile(student_dir: Path, teacher_dir: Path, data: Path | None, batch: int = 4, new_tokens: int = 32,
            k: int = 64, repeats: int = 3) -> dict:
    tok = AutoTokenizer.from_pretrained(str(student_dir))
    texts = ([json.loads(l)["prompt"] for l in data.read_text().splitlines() if l.strip()] if data else
             ["Explain in two sentences how a rainbow forms."] * batch)[:batch]
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                            return_dict=True)["input_ids"]) for t in texts]
    student = AutoModelForCausalLM.from_pretrained(str(student_dir), dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.float32).eval()
    engine = HFRolloutEngine(student, tok)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0)
    out: dict[str, float] = {}
    out["rollout"], rollouts = _time(lambda: engine.generate(prompts, params), repeats)
    responses = [r.response_ids for r in rollouts]
    V = student.config.vocab_size
    # The sampling alone: what the loop does per token on [B, V] logits.
    logits = torch.randn(batch, V)

    def sample():
        with torch.inference_mode():
            for _ in range(new_tokens):
                t = pick_tokens(logits, 1.0, 1.0)
                torch.log_softmax(logits, -1).gather(1, t[:, None])
    out["rollout.sampling"], _ = _time(sample, repeats)
    out["rollout.forwards"] = out["rollout"] - out["rollout.sampling"]
    packed = pack(prompts, responses, tok.pad_token_id)

    def teacher_forward():
        with torch.no_grad():   # its tensors go into the student's graph
            rows = student_rows(teacher, packed, fused=False)
            lp = torch.log_softmax(rows.float(), -1)
            top = lp.topk(k, -1)
            tail = torch.log1p(-top.values.exp().sum(-1).clamp(max=1 - 1e-6))
            return TopKTeacher(top.indices, top.values, tail)
    out["teacher_forward"], answer = _time(teacher_forward, repeats)
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-4)
    student.train()
    phases: dict[str, list[float]] = {k_: [] for k_ in ("student_forward", "loss", "backward", "optimizer")}
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        rows = student_rows(student, packed, fused=False)
        t1 = time.perf_counter()
        loss = distill_loss(rows, answer, beta=0.0, reduction="none").sum() / len(rows)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(list(student.parameters()), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        if i:
            for k_, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                phases[k_].append(v)
    out.update({k_: statistics.median(v) for k_, v in phases.items()})
    out["positions"] = int(packed.attention_B_L.sum())
    out["response_rows"] = len(packed.targets_N)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("student", type=Path)
    p.add_argument("teacher", type=Path)
    p.add_argument("--data", type=Path, default=None, help="prompts.jsonl (default: one prompt repeated)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    res = profile(a.student, a.teacher, a.data, repeats=a.repeats)
    for k_, v in res.items():
        print(f"{k_:<18} {v:.3f}" if isinstance(v, float) else f"{k_:<18} {v}")


if __name__ == "__main__":
    main()
