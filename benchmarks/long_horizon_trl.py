"""`opd bench long`'s TRL arm: `trl.DistillationTrainer` on the chain prompts, run by the TRL
interpreter (.venv-bench) as a script; checkpoints every `save_steps` for the evaluation.

    .venv-bench/bin/python -P benchmarks/long_horizon_trl.py JOB_JSON

Settings, each TRL's best for this run (docs/benchmarks.md says why): fully on-policy (TRL's
DistillationTrainer samples every batch from the student), the teacher in the trainer's
process, one torch thread (as every process of the bench), transformers generation with its
KV cache, gradient checkpointing off (TRL's default is on, which only trades time for memory),
the same learning rate, batch, temperature and divergence (beta) as the opd arms, a constant
rate after 5 warm-up steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(job: dict) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer

    torch.set_num_threads(1)
    torch.manual_seed(job["seed"])
    prompts = [json.loads(line)["prompt"] for line in Path(job["prompts"]).read_text().splitlines() if line.strip()]
    tok = AutoTokenizer.from_pretrained(job["student"])
    args = DistillationConfig(
        output_dir=job["out"], per_device_train_batch_size=job["batch"], max_steps=100000, learning_rate=job["lr"],
        lr_scheduler_type="constant_with_warmup", warmup_steps=5, beta=job["beta"], temperature=1.0,
        max_completion_length=job["new_tokens"], gradient_checkpointing=False, seed=job["seed"],
        save_strategy="steps", save_steps=job["save_steps"], save_total_limit=None, logging_steps=10,
        report_to=[], use_cpu=True, bf16=False, dataloader_num_workers=0, disable_tqdm=True)
    trainer = DistillationTrainer(
        model=AutoModelForCausalLM.from_pretrained(job["student"], dtype=torch.float32),
        teacher_model=AutoModelForCausalLM.from_pretrained(job["teacher"], dtype=torch.float32),
        args=args, train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), processing_class=tok)
    trainer.train()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
