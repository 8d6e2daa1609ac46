"""TRL's DistillationTrainer run plainly, outside `opd bench step`: the check that the bench's TRL
arm runs as fast as TRL does on its own.

    .venv-bench/bin/python -m opd.benchmarks.trl_plain STUDENT TEACHER PROMPTS.jsonl [--steps 6]

The settings are the bench's TRL arm's (benchmarks/step_trl.py): 4 prompts a step, 32 new
tokens, fully on-policy, forward KL, fp32 and gradient checkpointing off (TRL's defaults are
bf16 autocast, 40-48 tokens/s against 56-62 in fp32 on the 2-core box, and checkpointing, which
only trades time for memory), torch's default threads and OpenMP's default wait policy. It
prints, after the first (warm-up) step, tokens per second two ways: trained completion tokens
(TRL's completion mask) and batch x new tokens, each over the trainer's own step times and over
the wall time between step ends.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("student", type=Path)
    p.add_argument("teacher", type=Path)
    p.add_argument("prompts", type=Path, help="JSONL with a `prompt` per line (opd bench step writes one)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--bf16", action="store_true", help="TRL's own default: bf16 autocast, slower on this CPU")
    args = p.parse_args()
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()]
    rows: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            rows[-1].update(step_s=time.perf_counter() - self.t, end=time.perf_counter())

    class Trainer(DistillationTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if model.training:   # the generated batch
                rows.append({"tokens": int(inputs["completion_mask"].sum())})
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    config = DistillationConfig(output_dir="/tmp/trl_plain", per_device_train_batch_size=args.batch,
                                max_steps=args.steps, beta=0.0, temperature=1.0, learning_rate=1e-4,
                                lr_scheduler_type="constant", save_strategy="no", report_to=[], use_cpu=True,
                                max_completion_length=args.new_tokens, gradient_checkpointing=False, bf16=args.bf16,
                                logging_steps=1000, disable_tqdm=True)
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32),
                      teacher_model=AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32),
                      args=config, train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": q}]}
                                                                    for q in prompts]),
                      processing_class=AutoTokenizer.from_pretrained(args.student), callbacks=[Clock()])
    trainer.train()
    timed = rows[1:]
    step_s = sum(r["step_s"] for r in timed)
    between = rows[-1]["end"] - rows[0]["end"]
    nominal = args.batch * args.new_tokens * len(timed)
    trained = sum(r["tokens"] for r in timed)
    print(json.dumps({"threads": torch.get_num_threads(), "steps": len(timed), "trained_tokens": trained,
                      "tokens_per_s": {"trained/step time": trained / step_s, "nominal/step time": nominal / step_s,
                                       "trained/between step ends": trained / between,
                                       "nominal/between step ends": nominal / between},
                      "step_s": [round(r["step_s"], 2) for r in rows]}))


if __name__ == "__main__":
    main()
