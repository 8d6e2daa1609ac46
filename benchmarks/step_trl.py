"""The TRL side of `opd bench step`: GKDTrainer and DistillationTrainer, each in its own process.

`trl_main` runs inside the TRL interpreter (.venv-bench, `make bench`), fully on-policy:
  trl-gkd      `trl.experimental.gkd.GKDTrainer`, lmbda=1 (every step samples from the
               student), beta=0 (forward KL), teacher in the trainer's process, gradient
               checkpointing off (see below)
  trl-distill  `trl.DistillationTrainer` (TRL >= 1.x, the trainer TRL maintains for this:
               a chunked loss over the vocabulary), beta=0, transformers generation (its vLLM
               generation is for GPUs), gradient checkpointing off (its default is on, which
               only trades time for memory)
Both print one TRL_RESULT line: per-step times, trained completion tokens, wall end times.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def trl_main(work: str, student: str, teacher: str, steps: int, threads: int, trainer: str, batch: int,
             new_tokens: int) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    torch.set_num_threads(threads)
    work_ = Path(work)
    prompts = [json.loads(line)["prompt"] for line in (work_ / "prompts.jsonl").read_text().splitlines() if line.strip()]
    tok = AutoTokenizer.from_pretrained(student)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    times, tokens, ends = [], [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)
            ends.append(time.time())

    common = dict(output_dir=str(work_ / f"trl-{trainer}"), per_device_train_batch_size=batch, max_steps=steps,
                  beta=0.0, temperature=1.0, learning_rate=1e-4, lr_scheduler_type="constant", logging_steps=1000,
                  save_strategy="no", report_to=[], use_cpu=True, bf16=False, dataloader_num_workers=0,
                  disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    if trainer == "gkd":
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        class Trainer(GKDTrainer):
            def training_step(self, model, inputs, num_items_in_batch=None):
                loss = super().training_step(model, inputs, num_items_in_batch)
                tokens.append(int((inputs["labels"] != -100).sum()))  # the on-policy completion tokens
                return loss

        ds = Dataset.from_list([{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": "0"}]}
                                for p in prompts])
        # GKDConfig is an SFTConfig, whose gradient checkpointing is on by default and sets
        # use_cache False, so generate recomputed every prefix: 9.8-11.2 s a step instead of ~3.
        args = GKDConfig(**common, lmbda=1.0, max_new_tokens=new_tokens, gradient_checkpointing=False)
    else:
        from trl import DistillationConfig, DistillationTrainer

        class Trainer(DistillationTrainer):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                if model.training:   # the generated batch (training_step gets the dataset's rows)
                    tokens.append(int(inputs["completion_mask"].sum()))
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        ds = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in prompts])
        args = DistillationConfig(**common, max_completion_length=new_tokens, gradient_checkpointing=False)
    t = Trainer(model=model, teacher_model=teacher_model, args=args, train_dataset=ds, processing_class=tok,
                callbacks=[Clock()])
    t.train()
    print("TRL_RESULT " + json.dumps({"times": times, "tokens": tokens, "ends": ends}), flush=True)


def has_distillation_trainer(python: str) -> bool:
    """Whether the TRL of interpreter `python` has `trl.DistillationTrainer` (TRL >= 1.x)."""
    import subprocess

    code = "import importlib.util, sys; import trl; sys.exit(0 if hasattr(trl, 'DistillationTrainer') else 1)"
    return subprocess.run([python, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
