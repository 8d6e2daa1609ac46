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
(`vocab_limit`). vLLM's `LogitsProcessor` cuts the logits to its
`org_vocab_size` columns before anything reads them, prompt log-probabilities included; the
`HeadRows` extension below sets that number in the worker, so the answer is the softmax over
the first `vocab_limit` columns, as the hf backend computes it. The setting is the engine's, so a batch is scored one limit
at a time.

Given candidates (support "given"): the log-probs at the client's k ids per row,
echoed in their order, and the exact tail logsumexp(z without them) - lse. vLLM's V1 model
runner (the CPU build's) has no such request, so `HeadRows.given_route` replaces its
prompt-logprob step in the worker for requests whose `SamplingParams.extra_args` carry the
ids (`GIVEN`); that step computes, per scored row, from the fp32 logits, what the hf backend
computes, in k + 2 columns (the token, the k ids, the tail), which travel back as ordinary
prompt log-probs (`prompt_logprobs=k + 1`). Other requests in the same step go through
vLLM's own code; chunked prefill is followed as vLLM follows it, and prefix caching skips
no row (vLLM reads no cache for requests with prompt log-probs). The V2 model runner (CUDA's
default in 0.32, it needs Triton) has vLLM's own `prompt_logprob_token_ids`, used there with
the k ids and the token; its tail comes from the k log-probs (`tail_logmass_from_topk`). That
route is not exercised by the tests (the CPU build runs V1). The answer is checked to be at
the given ids before it is returned.

A row mask (the rows a multi-turn trajectory trains on) changes nothing in what
vLLM computes, since it scores every prompt position anyway: the masked rows are selected from
its answer (with given candidates, the unmasked rows are scored at placeholder ids first), and
a sequence with no rows is not sent at all.

What it cannot answer exactly (reported as UNSUPPORTED by `unsupported`, never
approximated): full-vocabulary mode, temperature != 1 (vLLM does not apply the sampling
temperature to prompt log-probabilities, and log_softmax(z / T) cannot be recovered from
the top k of log_softmax(z)), given candidates on an engine with neither route above, and
the log-sum-exp of the logits, which vLLM does not expose: `lse` is NaN in every answer.
The teacher-top-k tail mass is computed from the top k (`tail_logmass_from_topk`), which
is exact up to fp32 rounding (a tail below 2**-24, which fp32 does not resolve, is reported
as 2**-24).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from opd.fingerprint import model_fingerprint, tokenizer_fingerprint_of_dir
from opd.vllm_args import engine_options
from opd.teachers.backend import (FullChunkAnswer, SampleAnswer, SampleRequest, ScoreRequest, TeacherBackend,
                                  TopKAnswer, tail_logmass_from_topk)

HF_BACKEND_HINT = "use a teacher started with `opd serve-teacher --backend hf`, which answers it exactly"
# SamplingParams.extra_args key of a sequence scored at given ids: (first array row, k, int32
# bytes [rows, k]). Plain msgpack types: vLLM's transport decodes extra_args untyped.
GIVEN = "opd_given"
GIVEN_CHUNK = 1024   # rows per [rows, V] logits block in the worker


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

    def given_route(self) -> str:
        """How this worker answers given candidates: "v1" (its prompt-logprob step now scores
        GIVEN requests at their ids, `_given_prompt_logprobs`), "v2" (model runner V2:
        vLLM's own `prompt_logprob_token_ids`), "" (neither)."""
        runner = self.model_runner
        if getattr(runner, "prompt_logprobs_worker", None) is not None:
            return "v2"
        step = getattr(type(runner), "_get_prompt_logprobs_dict", None)
        if step is None or not isinstance(getattr(runner, "num_prompt_logprobs", None), dict):
            return ""
        # An instance attribute: the runner calls self._get_prompt_logprobs_dict(...).
        runner._get_prompt_logprobs_dict = lambda hidden, scheduled: _given_prompt_logprobs(
            runner, step, hidden, scheduled)
        return "v1"


def _given_of(request):
    sp = getattr(request, "sampling_params", None)
    return (sp.extra_args or {}).get(GIVEN) if sp is not None else None


def _given_prompt_logprobs(runner, step, hidden_states, num_scheduled_tokens):
    """vLLM's V1 `_get_prompt_logprobs_dict` (vllm/v1/worker/gpu_model_runner.py), except that a
    request carrying GIVEN gets, per array row j >= first (the distribution of prompt token
    j + 1), k + 2 columns: the token j + 1, the k given ids, and id -1 holding the exact tail
    logsumexp(z without the ids) - lse, all from the fp32 logits z as the hf backend computes
    them. The other requests go through vLLM's own step. Chunked prefill is followed as vLLM
    does: rows are written as their chunk is computed, the tensors sent with the last chunk.
    Prefix caching skips nothing: vLLM reads no cache for requests with prompt_logprobs."""
    from vllm.v1.outputs import LogprobsTensors

    pending = runner.num_prompt_logprobs
    given = {r: n for r, n in pending.items() if _given_of(runner.requests.get(r)) is not None}
    for r in given:
        del pending[r]
    try:
        out = step(runner, hidden_states, num_scheduled_tokens)
    finally:
        pending.update(given)
    for req_id in given:
        num_tokens = num_scheduled_tokens.get(req_id)
        if num_tokens is None:        # not in this step (preempted in prefill): as vLLM, skip
            continue
        request = runner.requests[req_id]
        first, k, blob = _given_of(request)
        prompt = request.prompt_token_ids
        rows = len(prompt) - 1 - first
        cands = np.frombuffer(blob, dtype=np.int32).reshape(rows, k)
        t = request.in_progress_prompt_logprobs_cpu
        if t is None:
            t = LogprobsTensors.empty_cpu(rows, k + 2)
            request.in_progress_prompt_logprobs_cpu = t
        start = request.num_computed_tokens           # first position of this chunk
        remaining = len(prompt) - start - 1
        num_logits = min(num_tokens, remaining)
        if num_tokens > remaining:                    # the last chunk (vLLM's own test)
            out[req_id] = t
            del pending[req_id]
            request.in_progress_prompt_logprobs_cpu = None
        base = runner.query_start_loc.np[runner.input_batch.req_id_to_index[req_id]].item() - start
        for a in range(max(start, first), start + num_logits, GIVEN_CHUNK):
            b = min(a + GIVEN_CHUNK, start + num_logits)
            z = runner.model.compute_logits(hidden_states[base + a:base + b]).float()
            ids = torch.from_numpy(cands[a - first:b - first].astype(np.int64)).to(z.device)
            target = torch.tensor(prompt[a + 1:b + 1], dtype=torch.int64, device=z.device)
            lse = torch.logsumexp(z, dim=-1)
            lps = torch.cat([z.gather(1, target[:, None]), z.gather(1, ids),
                             torch.logsumexp(z.scatter(1, ids, -math.inf), dim=-1)[:, None]], 1) - lse[:, None]
            tail_id = torch.full_like(target[:, None], -1)
            t.logprobs[a - first:b - first] = lps.cpu()
            t.logprob_token_ids[a - first:b - first] = torch.cat([target[:, None], ids, tail_id], 1).cpu()
            t.selected_token_ranks[a - first:b - first] = 0
    return out


class VLLMBackend(TeacherBackend):
    name = "vllm"
    modes = ("topk", "sample")
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
        # max_k + 1: a given-candidates sequence asks for k + 1 entries per position.
        kwargs = dict(model=str(model_dir), dtype=dtype, max_model_len=model_len,
                      max_logprobs=self.max_k + 1, logprobs_mode="raw_logprobs",
                      worker_extension_cls=f"{__name__}.HeadRows",
                      **engine_options(tensor_parallel_size, gpu_memory_utilization, enforce_eager))
        kwargs.update(llm_kwargs)
        self.llm = LLM(**kwargs)
        self.model_fingerprint = model_fingerprint(model_dir)
        # Whether vocab_limit can be served: every worker found the step that cuts the logits
        # (not asked when the caller put in a worker extension of its own).
        self._head_rows = self.vocab_size
        ours = kwargs["worker_extension_cls"] == f"{__name__}.HeadRows"
        self.limits_vocab = ours and all(self.llm.collective_rpc("keep_head_rows", args=(self.vocab_size,)))
        # How given candidates are answered: "v1", "v2" (HeadRows.given_route) or "" (refused).
        routes = set(self.llm.collective_rpc("given_route")) if ours else {""}
        self.given_route = routes.pop() if len(routes) == 1 and routes <= {"v1", "v2"} else ""

    def unsupported(self, req: ScoreRequest) -> str | None:
        if req.mode != "topk":
            return f"the vLLM backend answers top-k only; for full-vocabulary mode {HF_BACKEND_HINT}"
        if req.temperature != 1.0:
            return ("the vLLM backend answers at temperature 1 only (vLLM does not apply "
                    f"temperature to prompt log-probabilities); for temperature {req.temperature} "
                    f"{HF_BACKEND_HINT}")
        if req.candidates is not None and not self.given_route:
            return ("this vLLM engine cannot score the client's candidate ids (support 'given'): its "
                    "model runner has no prompt-logprob step the HeadRows extension knows, or another "
                    f"worker_extension_cls was given; {HF_BACKEND_HINT}")
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
        """Per request, per sequence: (ids, log-probs) [scored rows, k + 1] (given candidates:
        k + 2, `_given_arrays`), from one generate call."""
        from vllm import SamplingParams   # lazy, as in __init__
        from vllm.inputs import TokensPrompt

        prompts, params, owner = [], [], []
        parts: list[list] = [[None] * req.num_sequences for req in reqs]
        row_offsets = [req.row_offsets() for req in reqs]
        for r, req in enumerate(reqs):
            sp = SamplingParams(max_tokens=1, prompt_logprobs=req.k, detokenize=False, flat_logprobs=True)
            rows, cols = row_offsets[r], req.k + 1 + (req.candidates is not None)
            for b in range(req.num_sequences):
                seq, s, cands = req.sequence(b), req.response_starts[b], None
                if rows[b] == rows[b + 1]:    # no rows (s == len, or a row mask of zeros): nothing to ask vLLM
                    parts[r][b] = (np.zeros((0, cols), np.int64), np.zeros((0, cols), np.float32))
                    continue
                if req.candidates is not None:
                    cands = self._row_candidates(req, b, req.candidates[rows[b]:rows[b + 1]])
                    sp = self._given_params(seq, s, cands)
                prompts.append(TokensPrompt(prompt_token_ids=seq.tolist()))
                params.append(sp)
                owner.append((r, b, cands))
        outs = self.llm.generate(prompts, params, use_tqdm=False) if prompts else []
        for (r, b, cands), out in zip(owner, outs):
            req, s = reqs[r], reqs[r].response_starts[b]
            if req.candidates is None:
                ids, lps = _prompt_logprob_arrays(out.prompt_logprobs, len(out.prompt_token_ids), req.k)
                ids, lps = ids[s - 1:], lps[s - 1:]   # array row p - 1 is position p: [len - s, k + 1]
            else:
                ids, lps = self._given_arrays(out, req.sequence(b)[s:], cands, req.vocab_limit or self.vocab_size)
            kept = req.kept(b)                        # vLLM scored every row; a row mask keeps its own
            parts[r][b] = (ids, lps) if isinstance(kept, slice) else (ids[kept.numpy()], lps[kept.numpy()])
        return parts

    @staticmethod
    def _row_candidates(req: ScoreRequest, b: int, cands: torch.Tensor) -> torch.Tensor:
        """Sequence b's candidates for every one of its len - s rows, [len - s, k]: both given
        routes score all rows from s - 1 on, so with a row mask (cands [R_b, k], its rows only)
        the others get ids 0..k-1 (distinct, below any vocab_limit >= k) and are dropped after."""
        if req.kept_rows is None:
            return cands
        full = torch.arange(req.k).repeat(len(req.sequence(b)) - req.response_starts[b], 1)
        full[req.kept(b)] = cands
        return full

    def _given_params(self, seq: torch.Tensor, s: int, cands: torch.Tensor):
        """The SamplingParams of a sequence scored at `cands` [len - s, k] (its rows)."""
        from vllm import SamplingParams

        k = cands.shape[1]
        if self.given_route == "v2":   # vLLM's own fixed-id scoring: the k ids, then the token
            ids = torch.cat([cands, seq[s:, None]], 1).numpy().astype(np.int32)
            return SamplingParams(max_tokens=1, prompt_logprob_token_ids=ids, prompt_logprob_start=s - 1,
                                  detokenize=False)
        blob = cands.numpy().astype("<i4").tobytes()
        return SamplingParams(max_tokens=1, prompt_logprobs=k + 1, detokenize=False, flat_logprobs=True,
                              extra_args={GIVEN: [s - 1, k, blob]})

    def _given_arrays(self, out, targets: torch.Tensor, cands: torch.Tensor,
                      width: int) -> tuple[np.ndarray, np.ndarray]:
        """One sequence's answer at given ids as (ids, log-probs) [rows, k + 2]: the token, the
        k ids, the tail (id -1); refused loudly when the worker's step did not run."""
        rows, k = cands.shape
        want = np.concatenate([targets.numpy()[:, None], cands.numpy(), np.full((rows, 1), -1)], 1)
        if self.given_route == "v2":
            scores = np.asarray(out.prompt_token_id_logprobs, dtype=np.float32)
            if scores.shape != (rows, k + 1):
                raise RuntimeError(f"vLLM scored {list(scores.shape)} at the given ids, not [{rows}, {k + 1}]")
            tail = tail_logmass_from_topk(torch.from_numpy(scores[:, :k]), width).numpy()
            return want, np.concatenate([scores[:, k:], scores[:, :k], tail[:, None]], 1)
        flat = out.prompt_logprobs
        got = np.asarray(flat.token_ids, dtype=np.int64)
        if got.shape != (rows * (k + 2),) or not np.array_equal(got.reshape(rows, k + 2), want):
            raise RuntimeError("vLLM's prompt log-probs are not at the given ids: the worker's "
                               "given-candidates step (HeadRows.given_route) did not run")
        return want, np.asarray(flat.logprobs, dtype=np.float32).reshape(rows, k + 2)

    def _answer(self, req: ScoreRequest, parts: list[tuple[np.ndarray, np.ndarray]], rows: int) -> TopKAnswer:
        k = req.k
        cols = k + 1 + (req.candidates is not None)   # given: + the tail column
        ids = torch.from_numpy(np.concatenate([p[0] for p in parts])) if parts else torch.zeros(0, cols, dtype=torch.int64)
        lps = torch.from_numpy(np.concatenate([p[1] for p in parts])) if parts else torch.zeros(0, cols)
        top_lp = lps[:, 1:k + 1].float()
        return TopKAnswer(
            ids=ids[:, 1:k + 1].int().contiguous(),
            logprobs=top_lp.contiguous(),
            tail_logmass=(tail_logmass_from_topk(top_lp, rows) if req.candidates is None
                          else lps[:, k + 1].float().contiguous()),
            token_logprob=lps[:, 0].float().contiguous(),
            lse=torch.full((len(lps),), float("nan")),   # vLLM does not expose it
        )

    def score_full(self, req: ScoreRequest) -> Iterator[FullChunkAnswer]:
        raise ValueError(self.unsupported(req) or "the vLLM backend has no full-vocabulary mode")

    def sample(self, reqs: list[SampleRequest]) -> list[SampleAnswer]:
        """Every prompt of every request in one `LLM.generate` call, each with its request's
        SamplingParams (n, seed: vLLM's per-request generator), over the whole vocabulary."""
        from vllm import SamplingParams   # lazy, as in __init__
        from vllm.inputs import TokensPrompt

        if self._head_rows != self.vocab_size:   # a vocab_limit request cut the head: sample from all of it
            self.llm.collective_rpc("keep_head_rows", args=(self.vocab_size,))
            self._head_rows = self.vocab_size
        prompts, params = [], []
        for req in reqs:
            # Greedy takes n = 1 in vLLM: a prompt is then asked n times (the same answer n times).
            greedy = req.temperature == 0
            sp = SamplingParams(n=1 if greedy else req.n, temperature=req.temperature, top_p=req.top_p,
                                max_tokens=req.max_new_tokens, seed=req.seed,
                                stop_token_ids=list(req.stop_ids) or None, detokenize=False)
            for b in range(req.num_sequences):
                for _ in range(req.n if greedy else 1):
                    prompts.append(TokensPrompt(prompt_token_ids=req.sequence(b).tolist()))
                    params.append(sp)
        outs = iter(self.llm.generate(prompts, params, use_tqdm=False))
        answers = []
        for req in reqs:   # vLLM's finish_reason: "stop" (a stop id or the model's EOS, kept) or "length"
            done = [c for _ in range(req.num_sequences * (req.n if req.temperature == 0 else 1))
                    for c in next(outs).outputs]
            answers.append(SampleAnswer([list(c.token_ids) for c in done],
                                        ["stop" if c.finish_reason == "stop" else "length" for c in done]))
        return answers

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
