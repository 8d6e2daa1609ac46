"""The vLLM backend: top-k answers at temperature 1 from vLLM's prompt log-probabilities.

How a request is scored. Every sequence becomes one `TokensPrompt` with
`SamplingParams(max_tokens=1, prompt_logprobs=k)`; all sequences of all requests in a
batch go to one `LLM.generate` call, which vLLM schedules as it likes. vLLM's prompt
log-probabilities at position p are the distribution of token p given tokens < p (entry
0 is empty), so sequence b's rows are positions s_b .. len_b - 1, exactly the row
convention of teachers/protocol.py. At every position vLLM returns k + 1 entries: the
token that stands in the sequence first, then the top k in descending order, so
`token_logprob` comes for free.

Speed. vLLM computes these as tensors in the worker (`LogprobsTensors`) and the
frontend turns them into Python objects per position. Most of that cost is
detokenizing k strings per position; `detokenize=False` skips it, and
`flat_logprobs=True` stores a request's entries in a few flat lists rather than one dict
of `Logprob` objects per position, which this backend reshapes into [rows, k + 1]
arrays without touching single entries. Measured figures: docs/vllm.md.

A student whose LM head has fewer padding rows than the teacher's (Qwen2.5: 151,936 rows at
0.5-3B, 152,064 from 7B up, one tokenizer) asks for the distribution over its first rows
(`vocab_limit`, protocol 2.2). vLLM's `LogitsProcessor` cuts the logits to its
`org_vocab_size` columns before anything reads them, prompt log-probabilities included; the
`HeadRows` extension below sets that number in the worker, so the answer is the softmax over
the first `vocab_limit` columns, as the hf backend computes it (protocol 2.3: before, this
backend refused such requests). The setting is the engine's, so a batch is scored one limit
at a time.

What it cannot answer exactly (reported as UNSUPPORTED by `unsupported`, never
approximated): full-vocabulary mode, temperature != 1 (vLLM does not apply the sampling
temperature to prompt log-probabilities, and log_softmax(z / T) cannot be recovered from
the top k of log_softmax(z)), and the log-sum-exp of the logits, which vLLM does not
expose: `lse` is NaN in every answer. The tail mass is computed from the top k
(`tail_logmass_from_topk`), which is exact up to fp32 rounding (a tail below 2**-24, which
fp32 does not resolve, is reported as 2**-24).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from opd.fingerprint import model_fingerprint, tokenizer_fingerprint_of_dir
from opd.vllm_args import engine_options
from opd.teachers.backend import (FullChunkAnswer, ScoreRequest, TeacherBackend, TopKAnswer,
                                  tail_logmass_from_topk)

HF_BACKEND_HINT = "use a teacher started with `opd serve-teacher --backend hf`, which answers it exactly"


class HeadRows:
    """Mixed into vLLM's worker (`LLM(worker_extension_cls=...)`); the backend calls it with
    `llm.collective_rpc("keep_head_rows", args=(rows,))`."""

    def keep_head_rows(self, rows: int) -> bool:
        """Keep the first `rows` columns of the logits (vLLM's `LogitsProcessor.org_vocab_size`,
        which slices them before sampling and log-probs). False: this model has no such step."""
        processor = getattr(self.model_runner.model, "logits_processor", None)
        if processor is None or not isinstance(getattr(processor, "org_vocab_size", None), int):
            return False
        processor.org_vocab_size = int(rows)
        return True


class VLLMBackend(TeacherBackend):
    name = "vllm"
    modes = ("topk",)
    supports_temperature = False  # prompt log-probs ignore the sampling temperature
    exact_lse = False             # vLLM does not expose the log-sum-exp: answers carry NaN
    dtypes = ()

    def __init__(self, model_dir: str | Path, *, name: str = "teacher", max_k: int = 64,
                 max_positions: int | None = None, dtype: str = "float32", device: str = "cpu",
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float | None = None,
                 enforce_eager: bool | None = None, **llm_kwargs):
        """`device` is informational: vLLM runs on the platform its build targets (the CPU
        build here, CUDA for the `vllm` wheel). `tensor_parallel_size`: ranks (GPUs) the model
        is split over; `gpu_memory_utilization`: vLLM's share of each GPU (None: vLLM's
        default; on the CPU build a share of RAM, unused when VLLM_CPU_KVCACHE_SPACE is set);
        `enforce_eager`: None means eager on the CPU build, CUDA graphs elsewhere
        (`engine_options`). Extra keyword arguments go to `vllm.LLM`."""
        from vllm import LLM   # lazy: vllm is optional and heavy (the module imports without it)

        self.teacher = name
        self.model_id = str(model_dir)
        # First: it refuses a path that is no model directory (or has no tokenizer) before the load.
        self.tokenizer_fingerprint = tokenizer_fingerprint_of_dir(model_dir)
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        cfg_positions = int(cfg.get("max_position_embeddings", 4096))
        # vLLM counts the one token it generates after the prompt against max_model_len.
        model_len = min((max_positions + 1) if max_positions else cfg_positions, cfg_positions)
        self.max_positions = model_len - 1
        self.vocab_size = int(cfg["vocab_size"])
        self.max_k = min(max_k, self.vocab_size)
        kwargs = dict(model=str(model_dir), dtype=dtype, max_model_len=model_len,
                      max_logprobs=self.max_k, logprobs_mode="raw_logprobs",
                      worker_extension_cls=f"{__name__}.HeadRows",
                      **engine_options(tensor_parallel_size, gpu_memory_utilization, enforce_eager))
        kwargs.update(llm_kwargs)
        self.llm = LLM(**kwargs)
        self.model_fingerprint = model_fingerprint(model_dir)
        # Whether vocab_limit can be served: every worker found the step that cuts the logits
        # (not asked when the caller put in a worker extension of its own).
        self._head_rows = self.vocab_size
        self.limits_vocab = (kwargs["worker_extension_cls"] == f"{__name__}.HeadRows"
                             and all(self.llm.collective_rpc("keep_head_rows", args=(self.vocab_size,))))

    def unsupported(self, req: ScoreRequest) -> str | None:
        if req.mode != "topk":
            return f"the vLLM backend answers top-k only; for full-vocabulary mode {HF_BACKEND_HINT}"
        if req.temperature != 1.0:
            return ("the vLLM backend answers at temperature 1 only (vLLM does not apply "
                    f"temperature to prompt log-probabilities); for temperature {req.temperature} "
                    f"{HF_BACKEND_HINT}")
        if req.candidates is not None:
            return ("the vLLM backend answers the teacher's own top k only (support 'teacher'); for the "
                    f"client's candidate ids {HF_BACKEND_HINT}")
        if 0 < req.vocab_limit < self.vocab_size and not self.limits_vocab:
            return (f"this vLLM engine cannot cut its logits to the first {req.vocab_limit} of its "
                    f"{self.vocab_size} columns (its model has no vLLM LogitsProcessor, or another "
                    f"worker_extension_cls was given); {HF_BACKEND_HINT}")
        return None

    def score_topk(self, reqs: list[ScoreRequest]) -> list[TopKAnswer]:
        for req in reqs:
            reason = self.unsupported(req)
            if reason:
                raise ValueError(reason)
        rows_of = [req.vocab_limit or self.vocab_size for req in reqs]
        parts: list = [None] * len(reqs)
        # One width at a time, the engine's current one first: a run's requests all ask for one.
        for rows in sorted(set(rows_of), key=lambda n: n != self._head_rows):
            if rows != self._head_rows:
                self.llm.collective_rpc("keep_head_rows", args=(rows,))
                self._head_rows = rows
            group = [r for r, n in enumerate(rows_of) if n == rows]
            for r, p in zip(group, self._prompt_logprobs([reqs[r] for r in group])):
                parts[r] = p
        return [self._answer(req, p, rows) for req, p, rows in zip(reqs, parts, rows_of)]

    def _prompt_logprobs(self, reqs: list[ScoreRequest]) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        """Per request, per sequence: (ids, log-probs) [scored rows, k + 1], from one generate call."""
        from vllm import SamplingParams   # lazy, as in __init__
        from vllm.inputs import TokensPrompt

        prompts, params, owner = [], [], []
        for r, req in enumerate(reqs):
            sp = SamplingParams(max_tokens=1, prompt_logprobs=req.k, detokenize=False, flat_logprobs=True)
            for b in range(req.num_sequences):
                prompts.append(TokensPrompt(prompt_token_ids=req.sequence(b).tolist()))
                params.append(sp)
                owner.append((r, b))
        outs = self.llm.generate(prompts, params, use_tqdm=False) if prompts else []
        parts: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in reqs]
        for (r, b), out in zip(owner, outs):
            ids, lps = _prompt_logprob_arrays(out.prompt_logprobs, len(out.prompt_token_ids), reqs[r].k)
            s = reqs[r].response_starts[b]
            parts[r].append((ids[s - 1:], lps[s - 1:]))  # array row p - 1 is position p
        return parts

    def _answer(self, req: ScoreRequest, parts: list[tuple[np.ndarray, np.ndarray]], rows: int) -> TopKAnswer:
        k = req.k
        ids = torch.from_numpy(np.concatenate([p[0] for p in parts])) if parts else torch.zeros(0, k + 1, dtype=torch.int64)
        lps = torch.from_numpy(np.concatenate([p[1] for p in parts])) if parts else torch.zeros(0, k + 1)
        top_lp = lps[:, 1:].float()
        return TopKAnswer(
            ids=ids[:, 1:].int().contiguous(),
            logprobs=top_lp.contiguous(),
            tail_logmass=tail_logmass_from_topk(top_lp, rows),
            token_logprob=lps[:, 0].float().contiguous(),
            lse=torch.full((len(lps),), float("nan")),   # vLLM does not expose it
        )

    def score_full(self, req: ScoreRequest) -> Iterator[FullChunkAnswer]:
        raise ValueError(self.unsupported(req) or "the vLLM backend has no full-vocabulary mode")

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()


def _prompt_logprob_arrays(flat, num_tokens: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's FlatLogprobs of one prompt as (ids int64, logprobs fp32), each [num_tokens - 1, k + 1].

    Column 0 is the token in the sequence, columns 1..k the top k, most likely first.
    Position 0 has no entries, and every other position has exactly k + 1 (the token is
    repeated when it is itself in the top k), so the flat lists reshape directly.
    """
    rows = num_tokens - 1
    if rows <= 0:
        return np.zeros((0, k + 1), np.int64), np.zeros((0, k + 1), np.float32)
    if len(flat.logprobs) != rows * (k + 1) or flat.start_indices[1] != 0:
        raise RuntimeError(f"unexpected vLLM prompt-logprob layout: {len(flat.logprobs)} entries "
                           f"for {rows} positions of k={k}")
    ids = np.asarray(flat.token_ids, dtype=np.int64).reshape(rows, k + 1)
    lps = np.asarray(flat.logprobs, dtype=np.float32).reshape(rows, k + 1)
    return ids, lps
