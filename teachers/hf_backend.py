"""The transformers backend: exact top-k and full-vocabulary answers from a local causal LM.

Memory plan. Sequences are prefilled in micro-batches (right-padded, attention mask) up to
`batch_tokens` padded tokens, through the model's body only (`model.model`), which gives
hidden states [N, L, H]. Only the scored rows (positions `s_b - 1 .. len_b - 2`, see the
row convention in teachers/protocol.py; with a row mask, protocol 2.5, only the masked ones
among them) are gathered, and the LM head is applied to them
in chunks of `row_chunk` rows, so [tokens x vocab] logits never exist for a batch; the
largest logits tensor is [row_chunk, V].

Per chunk, with z = logits / T and S the k ids of each row (the top k of z, or the
candidates the request gave, support "given"):
    lse           = logsumexp(z)
    logprobs      = z[S] - lse
    tail_logmass  = logsumexp(z without S) - lse               (exact; -inf when k == V)
    token_logprob = z[target] - lse
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from opd.fingerprint import model_fingerprint, tokenizer_fingerprint_of_dir
from opd.lm_head import head_form
from opd.rope import rope_groups
from opd.teachers.backend import FullChunkAnswer, ScoreRequest, TeacherBackend, TopKAnswer

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFBackend(TeacherBackend):
    name = "hf"
    modes = ("topk", "full")
    dtypes = ("float32", "bfloat16", "float16")

    def __init__(self, model_dir: str | Path, *, name: str = "teacher", max_k: int = 64,
                 max_positions: int | None = None, dtype: str = "float32", device: str = "cpu",
                 row_chunk: int = 1024, batch_tokens: int = 8192, device_map: str | None = None):
        """`device_map` (with device="cuda"): transformers' placement of the layers over the visible
        GPUs ("auto", "balanced", "balanced_low_0", "sequential"), for a teacher larger than one
        GPU; None: the whole model on `device`."""
        from transformers import AutoModelForCausalLM   # lazy: seconds to import; only a model load needs it

        if device_map is not None and device != "cuda":
            raise ValueError(f"device_map={device_map!r} spreads the model over GPUs: it needs device='cuda', "
                             f"not {device!r}")
        self.teacher = name
        self.model_id = str(model_dir)
        # First: it refuses a path that is no model directory (or has no tokenizer) before the load.
        self.tokenizer_fingerprint = tokenizer_fingerprint_of_dir(model_dir)
        placement = {} if device_map is None else {"device_map": device_map}
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=TORCH_DTYPES[dtype], **placement)
        if device_map is None:
            self.model.to(device)
        self.model.eval().requires_grad_(False)
        # Where the token ids go: the input embeddings' device (with a device_map, accelerate's
        # hooks move each layer's input to that layer's GPU, and the logits come out on the head's).
        self.device = self.model.get_input_embeddings().weight.device
        self.body = self.model.get_decoder()          # hidden states without the LM head
        self.lm_head = self.model.get_output_embeddings()
        # What the model applies after its head (Gemma 2's soft-cap, Cohere's and Granite's
        # scales): logits = post_head(lm_head(hidden)), checked against the model's forward.
        self.post_head = head_form(self.model).post
        if self.post_head is None:
            raise ValueError(f"{model_dir}: this model's logits are not its LM head's output, or a soft-cap or "
                             f"scale of it (checked against its own forward): the hf backend would serve "
                             f"another distribution")
        self.vocab_size = int(self.lm_head.weight.shape[0])
        cfg_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.max_positions = min(max_positions or cfg_positions, cfg_positions)
        self.max_k = min(max_k, self.vocab_size)
        self.row_chunk = row_chunk
        self.batch_tokens = batch_tokens
        self.model_fingerprint = model_fingerprint(model_dir)

    # ---- prefill -------------------------------------------------------------------------

    @torch.no_grad()
    def _scored_hidden(self, seqs: list[torch.Tensor], starts: list[int], kept: list) -> list[torch.Tensor]:
        """For each sequence, hidden states [R_b, H] of the positions that score its rows: all
        len - start of them, or those of a row mask (kept[b], ScoreRequest.kept)."""
        out: list[torch.Tensor | None] = [None] * len(seqs)
        # Longest-first micro-batches whose padded size stays within batch_tokens; a longrope
        # model's never mix the two sides of its switch length (opd.rope).
        batches = []
        for group in rope_groups(self.model, [len(s) for s in seqs]):
            order = sorted(group, key=lambda i: len(seqs[i]))
            while order:
                batches.append([order.pop()])
                while order and len(seqs[batches[-1][0]]) * (len(batches[-1]) + 1) <= self.batch_tokens:
                    batches[-1].append(order.pop())
        for batch in batches:
            width = len(seqs[batch[0]])
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for j, i in enumerate(batch):
                ids[j, :len(seqs[i])] = seqs[i]
                mask[j, :len(seqs[i])] = 1
            # use_cache=False: a KV cache would keep every layer's keys and values of the
            # micro-batch alive until the pass ends (GBs at 8192 tokens of a 7B model).
            hidden = self.body(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                               use_cache=False).last_hidden_state
            for j, i in enumerate(batch):
                n, s = len(seqs[i]), starts[i]
                out[i] = hidden[j, s - 1:n - 1][kept[i]]   # a view, or a gather of the masked rows
        return out  # type: ignore[return-value]

    def _request_rows(self, reqs: list[ScoreRequest]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per request: (hidden [R, H], target ids [R]) of all its rows, one prefill for all."""
        seqs, starts, kept, owner = [], [], [], []
        for r, req in enumerate(reqs):
            for b in range(req.num_sequences):
                seqs.append(req.sequence(b).long())
                starts.append(req.response_starts[b])
                kept.append(req.kept(b))
                owner.append(r)
        hidden = self._scored_hidden(seqs, starts, kept)
        rows: list[tuple[list, list]] = [([], []) for _ in reqs]
        for h, seq, s, sel, r in zip(hidden, seqs, starts, kept, owner):
            rows[r][0].append(h)
            rows[r][1].append(seq[s:][sel])
        width = self.lm_head.weight.shape[1]
        return [(torch.cat(hs) if hs else torch.zeros(0, width, device=self.device, dtype=self.lm_head.weight.dtype),
                 torch.cat(ts).to(self.device) if ts else torch.zeros(0, dtype=torch.long, device=self.device))
                for hs, ts in rows]

    # ---- answers -------------------------------------------------------------------------

    @torch.no_grad()
    def score_topk(self, reqs: list[ScoreRequest]) -> list[TopKAnswer]:
        answers = []
        for req, (hidden, targets) in zip(reqs, self._request_rows(reqs)):
            given, n = req.candidates, self.row_chunk   # given [R, k], or None: the teacher's own top k
            parts = [self._topk_chunk(hidden[a:a + n], targets[a:a + n], req, None if given is None else given[a:a + n])
                     for a in range(0, len(hidden), n)]
            if not parts:
                parts = [self._topk_chunk(hidden, targets, req, given)]
            answers.append(TopKAnswer(*(torch.cat(p).cpu() for p in zip(*parts))))
        return answers

    def _logits(self, hidden, req: ScoreRequest) -> torch.Tensor:
        """[rows, V] fp32, or its first req.vocab_limit columns: the distribution over the
        vocabulary the student's LM head has (the rows past it are padding)."""
        logits = self.post_head(self.lm_head(hidden)).float()
        return logits[:, :req.vocab_limit] if req.vocab_limit else logits

    def _topk_chunk(self, hidden, targets, req: ScoreRequest, given: torch.Tensor | None = None):
        """given [rows, k]: the ids to answer (support "given"), else the teacher's top k."""
        z = self._logits(hidden, req) / req.temperature                        # [rows, V]
        lse = torch.logsumexp(z, dim=-1)
        if given is None:
            top_z, top_ids = z.topk(req.k, dim=-1)
        else:
            top_ids = given.to(z.device)
            top_z = z.gather(1, top_ids)
        token_lp = z.gather(1, targets.to(z.device)[:, None]).squeeze(1) - lse
        # The tail in place: z is not needed after this, and a copy is [rows, V] fp32 again.
        tail = torch.logsumexp(z.scatter_(1, top_ids, float("-inf")), dim=-1) - lse  # -inf when k == V
        return top_ids.int(), top_z - lse[:, None], tail, token_lp, lse

    @torch.no_grad()
    def score_full(self, req: ScoreRequest) -> Iterator[FullChunkAnswer]:
        hidden, targets = self._request_rows([req])[0]
        out_dtype = TORCH_DTYPES[req.dtype]
        for a in range(0, len(hidden), req.chunk_rows):
            logits = self._logits(hidden[a:a + req.chunk_rows], req)
            z = logits / req.temperature
            lse = torch.logsumexp(z, dim=-1)
            token_lp = z.gather(1, targets[a:a + req.chunk_rows, None].to(z.device)).squeeze(1) - lse
            yield FullChunkAnswer(a, logits.to(out_dtype).cpu(), lse.cpu(), token_lp.cpu())
