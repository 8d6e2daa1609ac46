"""A vLLM rollout engine beside a sharded student (`cluster.student.num_workers > 1`,
`rollout.engine: vllm`), as the peers pair FSDP training with an inference engine.

Rank 0 holds the one engine (vLLM's own worker processes, on the devices vLLM is given: the
trainer's GPUs with `rollout.vllm_gpu_memory_utilization` below 1, or GPUs of their own via
CUDA_VISIBLE_DEVICES and `vllm_tensor_parallel_size`). Each step:

  generate        every rank hands rank 0 its share of the prompts (all_gather_object); rank 0
                  samples all of them in one engine call, so vLLM batches the whole step, and
                  each rank gets its own rollouts back (prompt_index counted in its share). The
                  prompts are numbered in rank order, as one process numbers them, so a seeded
                  run samples what one process samples.
  sync_weights    after each optimizer step every rank gathers the shards one tensor at a time
                  (DTensor.full_tensor, in state-dict order); rank 0 pushes them in buckets of
                  `bucket_bytes` as the one-process engine pushes its weights (a safetensors
                  file the engine's workers reload; vLLM keeps the weights a bucket leaves out),
                  a LoRA student's adapter as an adapter directory. No rank holds more of the
                  model than its shards, a bucket and one whole tensor.
"""

from __future__ import annotations

from dataclasses import replace

from torch.distributed.tensor import DTensor

from opd.rollout.base import Rollout, RolloutEngine, SamplingParams
from opd.spine.dist import World

BUCKET_BYTES = 256 << 20   # weights pushed into the engine at a time (a sharded student's sync)


class RankZeroEngine(RolloutEngine):
    """`engine` on rank 0 (None on the others) serving every rank of `world`."""

    def __init__(self, world: World, engine: RolloutEngine | None, bucket_bytes: int = BUCKET_BYTES):
        if world.main and engine is None:
            raise ValueError("rank 0 of a sharded student needs the rollout engine")
        self.world, self.engine, self.bucket_bytes = world, engine, bucket_bytes
        self.eos_token_id = world.broadcast(getattr(engine, "eos_token_id", None))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        shares = self.world.gather([list(p) for p in prompts])   # every rank's prompts, in rank order
        by_rank = None
        if self.world.main:
            flat = [p for share in shares for p in share]
            # `share` told the hf engine where a rank's prompts sit among the step's; here the
            # one call sees them all, numbered as one process numbers them.
            rollouts = self.engine.generate(flat, replace(params, share=None))
            starts = [0]
            for share in shares:
                starts.append(starts[-1] + len(share))
            by_rank = [[replace(r, prompt_index=r.prompt_index - starts[k]) for r in rollouts
                        if starts[k] <= r.prompt_index < starts[k + 1]] for k in range(len(shares))]
        return self.world.broadcast(by_rank)[self.world.rank]

    def sync_weights(self, model) -> None:
        """Every rank walks the state dict in one order; each sharded tensor is gathered whole
        (DTensor.full_tensor, a collective) and dropped at once except on rank 0, which pushes
        them in buckets of `bucket_bytes`: its host holds its shards, a bucket and one tensor
        beyond the engine. A LoRA student's adapter (its lora_ tensors alone) goes as one."""
        lora = hasattr(model, "peft_config")
        bucket, size = {}, 0
        for name, t in model.state_dict().items():
            if lora and "lora_" not in name:
                continue
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if not self.world.main:
                continue
            bucket[name] = full.detach().to("cpu")
            size += full.numel() * full.element_size()
            if not lora and size >= self.bucket_bytes:
                self.engine.push_bucket(bucket)
                bucket, size = {}, 0
        if self.world.main:
            if lora:
                self.engine.push_state(model, bucket)
            else:
                if bucket:
                    self.engine.push_bucket(bucket)
                self.engine.pushed()
        self.world.barrier()   # no rank samples before the engine holds the new weights

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
