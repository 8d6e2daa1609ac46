"""Rollouts with vLLM: the fast engine, kept on-policy by pushing weights after each step.

The engine runs in vLLM's own worker processes, so it holds a copy of the student. After
every optimizer step the trainer calls `sync_weights(model)`:

- full student: the state dict is written to one safetensors file in a private temp dir
  and the workers reload it in place (`opd.rollout.vllm_worker.WeightSync`); the prefix
  cache is then reset, since cached KV blocks were computed with the old weights;
- peft LoRA student: the adapter is saved with `save_pretrained` into a fresh dir and the
  next `generate` uses a LoRARequest with a NEW integer id (vLLM caches adapters by id,
  so reusing one would keep serving the old adapter).

Log-probabilities are vLLM's `logprobs_mode="raw_logprobs"`: log_softmax of the model's
logits before temperature, top-p or any other processor, the same quantity as a
transformers forward pass (see opd/rollout/base.py). vLLM's construction spawns worker
processes, so create the engine only under `if __name__ == "__main__":` in scripts.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from pathlib import Path

from opd.lora import vllm_max_lora_rank
from opd.rollout.base import Rollout, RolloutEngine, SamplingParams, prompt_seed
from opd.vllm_args import engine_options

WORKER_EXTENSION = "opd.rollout.vllm_worker.WeightSync"


class VLLMRolloutEngine(RolloutEngine):
    def __init__(self, model_dir: str | Path, *, lora: dict | None = None, max_model_len: int = 1024,
                 seed: int = 0, dtype: str = "float32", max_num_seqs: int = 256,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float | None = None,
                 enforce_eager: bool | None = None, **llm_kwargs):
        """`lora`: None for a full-weight student, else {"rank": R} for a peft LoRA student
        (R = the adapter's rank; vLLM sizes its LoRA buffers from it). `tensor_parallel_size`:
        ranks (GPUs) the model is split over; `gpu_memory_utilization`: vLLM's share of each
        GPU (None: vLLM's default); `enforce_eager`: None means eager on the CPU build, CUDA
        graphs elsewhere (`engine_options`). Extra keyword arguments go to `vllm.LLM` unchanged."""
        from vllm import LLM

        kwargs = dict(model=str(model_dir), dtype=dtype, max_model_len=max_model_len, seed=seed,
                      max_num_seqs=max_num_seqs, logprobs_mode="raw_logprobs",
                      worker_extension_cls=WORKER_EXTENSION,
                      **engine_options(tensor_parallel_size, gpu_memory_utilization, enforce_eager))
        if lora is not None:
            kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(int(lora["rank"])), max_loras=1)
        kwargs.update(llm_kwargs)
        self.llm = LLM(**kwargs)
        self.lora = lora
        self.eos_token_id = self.llm.get_tokenizer().eos_token_id
        self._tmp = Path(tempfile.mkdtemp(prefix="opd-vllm-sync-"))
        self._versions = itertools.count(1)      # LoRARequest ids must be >= 1 and never reused
        self._lora_request = None
        self._lora_dirs: list[Path] = []
        self._buckets: list[Path] = []           # weight files of the sync in progress (push_bucket)

    # ---- weights -------------------------------------------------------------------------

    def sync_weights(self, model) -> None:
        self.push_state(model, None)

    def push_state(self, model, state: dict | None) -> None:
        """`model`'s weights into the engine: `state` its whole state dict when the caller has
        gathered it (a sharded student, opd.spine.engine), None to read it from `model`."""
        if self.lora is not None:
            self._sync_lora(model, state)
        else:
            self._sync_full(model, state)

    def _sync_full(self, model, state: dict | None) -> None:
        if hasattr(model, "peft_config"):
            raise ValueError("a peft model was pushed into a full-weight vLLM engine; "
                             "build VLLMRolloutEngine(..., lora={'rank': R}) for LoRA students")
        self.push_bucket(model.state_dict() if state is None else state)
        self.pushed()

    def push_bucket(self, state: dict) -> None:
        """Some of the model's weights (checkpoint names), written to a file of their own; the
        engine's workers read every bucket of a sync in one reload at `pushed()`: vLLM reloads
        a model whole (a weight no reload brings came back as NaN), so the buckets wait on disk,
        not in memory."""
        from safetensors.torch import save_file

        # clone: tied weights share storage, which safetensors refuses to save twice
        state = {k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}
        path = self._tmp / f"weights-{len(self._buckets)}.safetensors"
        save_file(state, str(path))
        self._buckets.append(path)

    def pushed(self) -> None:
        """The buckets pushed since the last sync, read one tensor at a time by one reload."""
        paths, self._buckets = self._buckets, []
        try:
            self.llm.collective_rpc("load_weights_from_files", args=([str(p) for p in paths],))
        finally:
            for p in paths:
                p.unlink(missing_ok=True)
        self.llm.reset_prefix_cache()  # cached KV blocks hold the old weights' keys/values

    def _sync_lora(self, model, state: dict | None) -> None:
        from vllm.lora.request import LoRARequest

        if not hasattr(model, "peft_config"):
            raise ValueError("this engine serves a LoRA student: pass the peft model, not a plain one")
        version = next(self._versions)
        out = self._tmp / f"lora-{version}"
        # peft picks the adapter's weights out of `state` (a sharded model's gathered one) itself.
        model.save_pretrained(str(out), **({} if state is None else {"state_dict": state}))
        self._lora_request = LoRARequest(f"student-{version}", version, str(out))
        # vLLM reads an adapter dir when the request first uses it; keep the live one only.
        self._lora_dirs.append(out)
        while len(self._lora_dirs) > 2:
            shutil.rmtree(self._lora_dirs.pop(0), ignore_errors=True)

    # ---- sampling ------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        def sampling(seed: int | None):
            return VSamplingParams(
                n=params.n,
                temperature=params.temperature,
                top_p=params.top_p if params.temperature > 0 else 1.0,
                max_tokens=params.max_new_tokens,
                stop_token_ids=list(params.stop_token_ids),
                seed=seed,
                logprobs=params.topk,    # the sampled token's log-prob, then the top k (0: none)
                detokenize=False,
                flat_logprobs=True,      # a few flat lists instead of one dict per token
            )

        sp = sampling(None) if params.seed is None else [sampling(prompt_seed(params.seed, i))
                                                         for i in range(len(prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp,
                                 use_tqdm=False, lora_request=self._lora_request)
        rollouts = []
        for i, (prompt, out) in enumerate(zip(prompts, outs)):
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                rollouts.append(Rollout(
                    prompt_ids=list(prompt),
                    response_ids=ids,
                    logprobs=_sampled_logprobs(c.logprobs, ids),
                    finish_reason="length" if c.finish_reason == "length" else "eos",
                    prompt_index=i,
                    topk_ids=_top_ids(c.logprobs, params.topk) if params.topk else None,
                ))
        return rollouts

    def close(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()


def _sampled_logprobs(logprobs, ids: list[int]) -> list[float]:
    """The sampled token's log-prob per position (vLLM puts it first at each position)."""
    from vllm.logprobs import FlatLogprobs

    if isinstance(logprobs, FlatLogprobs):
        return [logprobs.logprobs[s] for s in logprobs.start_indices]
    return [pos[t].logprob for pos, t in zip(logprobs, ids)]


def _top_ids(logprobs, k: int) -> list[list[int]]:
    """Each position's top-k ids, most likely first, from the FlatLogprobs this engine asks for:
    vLLM lists the sampled token, then the top k (k + 1 entries per position even when the
    sampled token is among them)."""
    return [list(logprobs.token_ids[s + 1:s + 1 + k]) for s in logprobs.start_indices]
