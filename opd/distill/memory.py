"""Full mode's memory bound: what a run's full-vocabulary teacher answers hold at once, checked
against the machine before the first step (it reads opd train's whole config: rows per
micro-batch, response lengths, pipelining)."""

from __future__ import annotations

from opd.spine.optim import TrainError
from opd.teachers.protocol import default_chunk_rows
from opd.teachers.session import FULL_WINDOW


def full_logits_bytes(cfg, vocab_size: int, teachers: int = 1) -> int:
    """About the most bytes of full-mode teacher logits the trainer holds at once (an upper
    bound): one micro-batch's rows, every response at max_new_tokens (a trajectory: the most its
    turns sample, `AgentConfig.max_sampled`), held as received, gathered
    and cast to fp32 for the loss (a copy only for bf16/fp16 rows); plus, per full-mode teacher
    and stream alive (the current batch's, and the next one's with run.pipeline), the chunks in
    flight (FULL_WINDOW + 1)."""
    r, dtype = cfg.rollout, cfg.loss.full_dtype
    item = 4 if dtype == "float32" else 2
    per_response = r.max_new_tokens if cfg.agent is None else cfg.agent.max_sampled(r.max_new_tokens)
    rows = min(cfg.optim.micro_batch_size, r.prompts_per_step * r.samples_per_prompt) * per_response
    chunk = default_chunk_rows(vocab_size, dtype) * vocab_size * item
    streams = teachers * (2 if cfg.run.pipeline else 1)
    per_row = 2 * item + (4 if item < 4 else 0)
    return rows * vocab_size * per_row + streams * (FULL_WINDOW + 1) * chunk


def check_full_memory(cfg, vocab_size: int, available: int | None, teachers: int = 1) -> str | None:
    """Refuse a full-mode run whose teacher logits cannot fit in `available` bytes (None:
    unknown); a note when they may take over half of it."""
    need = full_logits_bytes(cfg, vocab_size, teachers)
    if available is None or need <= available // 2:
        return None
    what = (f"mode full holds up to {_size(need)} of teacher logits (optim.micro_batch_size "
            f"{cfg.optim.micro_batch_size} x rollout.max_new_tokens {cfg.rollout.max_new_tokens} rows x "
            f"V={vocab_size} in {cfg.loss.full_dtype}, and the chunks in flight)")
    if need > available:
        raise TrainError(f"{what}, and this machine has {_size(available)} available; use mode: topk, a smaller "
                         f"optim.micro_batch_size or rollout.max_new_tokens, or loss.full_dtype: bfloat16")
    return f"{what}: over half of the {_size(available)} available"


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
