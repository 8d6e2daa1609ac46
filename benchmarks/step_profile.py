"""Where one opd step's time goes at given shapes: each phase alone, in one process, timed.

    python -m opd.benchmarks.step_profile STUDENT_DIR TEACHER_DIR [--threads N] [--repeats R]

(`opd bench step --preset small-real` builds the two directories.) Phases, each the median of
--repeats runs after one warm-up: the rollout (4 prompts x 32 tokens with the hf engine) and
inside it the student's decode forwards and the per-token sampling on the full logits
(`pick_tokens` + the log-prob); the teacher's forward over prompt + response with top-k on the
response rows (what `opd serve-teacher` computes); the student's forward to its response
rows' logits; the top-k distillation loss; backward; gradient clipping + AdamW.

    python -m opd.benchmarks.step_profile STUDENT_DIR TEACHER_DIR --overlap

asks whether the rollout leaves a core idle: the rollout at 2 threads and at 1, the teacher's
prefill of the prompts alone (the part of its forward known before the rollout ends) at 1
thread in a second process, and the two at once, each on one thread.

    python -m opd.benchmarks.step_profile STUDENT_DIR TEACHER_DIR --linears

times one decode step's worth of the student body's nn.Linear layers (each weight once, in
model order, so the weights as a whole are out of cache as in a rollout) at 1 to 64 rows, as
F.linear and as the transposed product `opd.rollout.hf.few_row_linears` uses below 8 rows.
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
from opd.rollout.hf import HFRolloutEngine, pick_tokens, transposed_linear
from opd.spine.rows import pack, student_rows


def _time(fn, repeats: int) -> tuple[float, object]:
    fn()   # warm-up
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def _prompts(tok, data: Path | None, batch: int) -> list[list[int]]:
    texts = ([json.loads(l)["prompt"] for l in data.read_text().splitlines() if l.strip()] if data else
             ["Explain in two sentences how a rainbow forms."] * batch)[:batch]
    return [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]) for t in texts]


def profile(student_dir: Path, teacher_dir: Path, data: Path | None, batch: int = 4, new_tokens: int = 32,
            k: int = 64, repeats: int = 3) -> dict:
    tok = AutoTokenizer.from_pretrained(str(student_dir))
    prompts = _prompts(tok, data, batch)
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


def _left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, attention mask and positions [B, P] of the prompts left-padded to the longest, as
    the hf rollout engine lays them out (positions count real tokens only)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def prefill_loop(teacher_dir: Path, data: Path | None, seconds: float, batch: int = 4) -> list[float]:
    """The teacher's body over the prompts (left-padded to the longest), again and again for
    `seconds`: the seconds of each pass, the first (warm-up) dropped."""
    tok = AutoTokenizer.from_pretrained(str(teacher_dir))
    ids, mask, pos = _left_padded(_prompts(tok, data, batch), tok.pad_token_id)
    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.float32).eval()
    times, end = [], time.monotonic() + seconds
    with torch.inference_mode():
        while time.monotonic() < end or len(times) < 2:
            t = time.perf_counter()
            teacher.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
            times.append(time.perf_counter() - t)
    return times[1:]


def overlap(student_dir: Path, teacher_dir: Path, data: Path | None, batch: int = 4, new_tokens: int = 32,
            repeats: int = 4) -> dict:
    """Medians (s): the rollout at 2 and 1 threads; the teacher's prompt prefill at 1 thread in
    a second process, alone; both at once, one thread each; the teacher's body over prompt +
    response, and over the response alone given the prompts' KV cache (2 threads)."""
    import subprocess
    import sys

    tok = AutoTokenizer.from_pretrained(str(student_dir))
    prompts = _prompts(tok, data, batch)
    engine = HFRolloutEngine(AutoModelForCausalLM.from_pretrained(str(student_dir), dtype=torch.float32), tok)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0)
    out: dict[str, float] = {}
    for threads, name in ((2, "rollout_2_threads"), (1, "rollout_1_thread")):
        torch.set_num_threads(threads)
        out[name], _ = _time(lambda: engine.generate(prompts, params), repeats)

    def prefill(seconds: float) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "opd.benchmarks.step_profile", str(student_dir), str(teacher_dir),
               "--prefill-loop", str(seconds), "--threads", "1"] + (["--data", str(data)] if data else [])
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)

    alone = prefill(10.0)
    out["prefill_1_thread_alone"] = statistics.median(json.loads(alone.communicate()[0].splitlines()[-1]))
    engine.generate(prompts, params)   # warm at 1 thread before the other process starts
    rollout_s = out["rollout_1_thread"] * (repeats + 1)
    both = prefill(rollout_s + 8.0)   # its model loads first (~5 s), then it runs through every rollout
    time.sleep(6.0)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        engine.generate(prompts, params)
        times.append(time.perf_counter() - t)
    out["rollout_1_thread_beside_prefill"] = statistics.median(times)
    out["prefill_1_thread_beside_rollout"] = statistics.median(json.loads(both.communicate()[0].splitlines()[-1]))
    # What would be left of the teacher's forward after the rollout, the prompts prefilled
    # during it: the responses' positions over the prompts' KV cache (2 threads, the top-k
    # head left out of both figures).
    torch.set_num_threads(2)
    responses = [r.response_ids for r in engine.generate(prompts, params)]
    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.float32).eval()
    ids, mask, _ = _left_padded(prompts, tok.pad_token_id)
    width = ids.shape[1]
    suffix = torch.tensor(responses)   # [B, new_tokens]: random weights never sample EOS, all full length
    full_mask = torch.cat([mask, torch.ones_like(suffix)], dim=1)
    pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        out["teacher_body_prompt_and_response"], _ = _time(
            lambda: teacher.model(input_ids=torch.cat([ids, suffix], 1), attention_mask=full_mask, position_ids=pos),
            repeats)
        times = []
        for _ in range(repeats + 1):
            cache = teacher.model(input_ids=ids, attention_mask=mask, position_ids=pos[:, :width],
                                  use_cache=True).past_key_values
            t = time.perf_counter()
            teacher.model(input_ids=suffix, attention_mask=full_mask, position_ids=pos[:, width:],
                          past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t)
        out["teacher_body_response_over_prompt_cache"] = statistics.median(times[1:])
    return out


def linears(student_dir: Path, rows: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64),
            repeats: int = 30) -> dict:
    """Per rows M: ms per pass over every body nn.Linear of the student (one decode step's
    weights), as F.linear and as transposed_linear, the mean of `repeats` passes after one."""
    model = AutoModelForCausalLM.from_pretrained(str(student_dir), dtype=torch.float32)
    weights = [(m.weight, m.bias) for m in model.get_decoder().modules() if type(m) is torch.nn.Linear]
    out = {}
    with torch.inference_mode():
        for M in rows:
            xs = {w.shape[1]: torch.randn(M, w.shape[1]) for w, _ in weights}
            for name, form in (("linear", torch.nn.functional.linear), ("transposed", transposed_linear)):
                for i in range(repeats + 1):
                    if i == 1:
                        t = time.perf_counter()
                    for w, b in weights:
                        form(xs[w.shape[1]], w, b)
                out[f"rows_{M}_{name}_ms"] = (time.perf_counter() - t) / repeats * 1e3
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("student", type=Path)
    p.add_argument("teacher", type=Path)
    p.add_argument("--data", type=Path, default=None, help="prompts.jsonl (default: one prompt repeated)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--overlap", action="store_true", help="whether the rollout leaves a core idle (see above)")
    p.add_argument("--linears", action="store_true", help="the body's linears at 1-64 rows, two forms (see above)")
    p.add_argument("--prefill-loop", type=float, default=None, metavar="SECONDS",
                   help="(what --overlap runs in its second process) the teacher's prompt prefill for SECONDS")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.prefill_loop is not None:
        print(json.dumps(prefill_loop(a.teacher, a.data, a.prefill_loop)))
        return
    if a.linears:
        res = linears(a.student)
    else:
        res = overlap(a.student, a.teacher, a.data, repeats=a.repeats) if a.overlap else \
            profile(a.student, a.teacher, a.data, repeats=a.repeats)
    for k_, v in res.items():
        print(f"{k_:<18} {v:.3f}" if isinstance(v, float) else f"{k_:<18} {v}")


if __name__ == "__main__":
    main()
