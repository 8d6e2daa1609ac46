"""The transformers backend: exact top-k and full-vocabulary answers from a local causal LM.

Memory plan. Sequences are prefilled in micro-batches (right-padded, attention mask) up to
`batch_tokens` padded tokens, through the model's body only (`model.model`), which gives
hidden states [N, L, H]. Only the scored rows (positions `s_b - 1 .. len_b - 2`, see the
row convention in teachers/protocol.py; with a row mask, only the masked ones
among them) are gathered, and the LM head is applied to them
in chunks of `row_chunk` rows, so [tokens x vocab] logits never exist for a batch; the
largest logits tensor is [row_chunk, V].

Per chunk, with z = logits / T and S the k ids of each row (the top k of z, or the
candidates the request gave, support "given"):
    lse           = logsumexp(z)
    logprobs      = z[S] - lse
    tail_logmass  = logsumexp(z without S) - lse               (exact; -inf when k == V)
    token_logprob = z[target] - lse

Prompt cache (`prompt_cache_tokens` > 0; teachers/prompt_cache.py): a SCORE in
mode "prefill" stores its sequences' keys and values (prompts, or prompt + the response so
far; the first tokens of those announced together, a chat template's system prompt, computed
once); a later sequence is computed from the end of its longest stored first tokens on. The
answers are the same up to float rounding (tests/teachers/test_prompt_cache.py compares both).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import torch

from opd.fingerprint import model_fingerprint, tokenizer_fingerprint_of_dir
from opd.lm_head import head_form
from opd.rope import rope_groups
from opd.teachers.backend import (FullChunkAnswer, SampleAnswer, SampleRequest, ScoreRequest, TeacherBackend, TopKAnswer,
                                  cut_at_stop)
from opd.teachers.prompt_cache import Entry, PromptCache, batched_cache, key_of, why_not

MIN_SHARED = 8   # fewer shared first tokens than this in a prefill: each sequence computes its own

log = logging.getLogger("opd.teachers.server")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFBackend(TeacherBackend):
    name = "hf"
    modes = ("topk", "full", "sample")
    dtypes = ("float32", "bfloat16", "float16")

    def __init__(self, model_dir: str | Path, *, name: str = "teacher", max_k: int = 64,
                 max_positions: int | None = None, dtype: str = "float32", device: str = "cpu",
                 row_chunk: int = 1024, batch_tokens: int = 8192, device_map: str | None = None,
                 prompt_cache_tokens: int = 0):
        """`device_map` (with device="cuda"): transformers' placement of the layers over the visible
        GPUs ("auto", "balanced", "balanced_low_0", "sequential"), for a teacher larger than one
        GPU; None: the whole model on `device`. `prompt_cache_tokens` > 0: keep announced sequences'
        keys and values, up to that many tokens (0 where this model does not qualify)."""
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
        self.prompt_cache = None
        if prompt_cache_tokens > 0:
            why = why_not(self.model) or self._continuation_differs()
            if why:
                log.warning("%s: no prompt cache: %s", model_dir, why)
            else:
                self.prompt_cache = PromptCache(prompt_cache_tokens)
        self.prompt_cache_tokens = self.prompt_cache.max_tokens if self.prompt_cache is not None else 0

    # ---- prefill -------------------------------------------------------------------------

    def _micro_batches(self, lengths: list[int], indices: list[int]) -> list[list[int]]:
        """`indices` longest-first in micro-batches whose padded size (the longest's length x their
        number) stays within batch_tokens; a longrope model's never mix the two sides of its
        switch length (opd.rope)."""
        batches = []
        for group in rope_groups(self.model, [lengths[i] for i in indices]):
            order = sorted((indices[g] for g in group), key=lambda i: lengths[i])
            while order:
                batches.append([order.pop()])
                while order and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= self.batch_tokens:
                    batches[-1].append(order.pop())
        return batches

    def _body(self, seqs: list[torch.Tensor], cache=None):
        """The body over `seqs` right-padded: hidden states [n, L, H] (and `cache` filled, if given).
        Without a cache, use_cache=False: one would keep every layer's keys and values of the
        micro-batch alive until the pass ends (GBs at 8192 tokens of a 7B model)."""
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for j, seq in enumerate(seqs):
            ids[j, :len(seq)] = seq
            mask[j, :len(seq)] = 1
        return self.body(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         past_key_values=cache, use_cache=cache is not None).last_hidden_state

    @torch.no_grad()
    def _scored_hidden(self, seqs: list[torch.Tensor], starts: list[int], kept: list) -> list[torch.Tensor]:
        """For each sequence, hidden states [R_b, H] of the positions that score its rows: all
        len - start of them, or those of a row mask (kept[b], ScoreRequest.kept)."""
        out: list[torch.Tensor | None] = [None] * len(seqs)
        found = {}   # sequence -> the longest held entry of its first tokens
        if self.prompt_cache is not None:
            for i, (seq, s) in enumerate(zip(seqs, starts)):
                entry = self.prompt_cache.lookup(seq, s, len(seq))
                if entry is not None:
                    found[i] = entry
            # A SCORE consumes the entries of the sequences it scores, the one each read and its
            # prompt's (after every sequence has looked, so the samples of one prompt share it):
            # they hand one step's announced sequences over to its scoring, and a prompt seen
            # again is announced again. Kept, they would grow the server by the cache's whole
            # budget over a run (8192 tokens of SmolLM2-135M: ~380 MB).
            for i, (seq, s) in enumerate(zip(seqs, starts)):
                if i in found:
                    self.prompt_cache.drop(key_of(seq[:found[i].tokens], s))
                self.prompt_cache.drop(key_of(seq[:s], s))
        whole = [i for i in range(len(seqs)) if i not in found]
        for batch in self._micro_batches([len(s) for s in seqs], whole):
            hidden = self._body([seqs[i] for i in batch])
            for j, i in enumerate(batch):
                n, s = len(seqs[i]), starts[i]
                out[i] = hidden[j, s - 1:n - 1][kept[i]]   # a view, or a gather of the masked rows
        # After a held entry of P tokens: the tokens P .. len - 2 (the last one scores no row).
        rest = {i: seqs[i][found[i].tokens:-1] for i in found}
        padded = {i: found[i].tokens + len(rest[i]) for i in found}   # cache + suffix columns
        for batch in self._micro_batches([padded.get(i, 0) for i in range(len(seqs))], list(found)):
            hidden, _ = self._continue([found[i] for i in batch], [rest[i] for i in batch])
            for j, i in enumerate(batch):
                rows = torch.cat([found[i].hidden, hidden[j, :len(rest[i])]])[:len(seqs[i]) - starts[i]]
                out[i] = rows[kept[i]]
        return out  # type: ignore[return-value]

    def _continue(self, entries: list[Entry], suffixes: list[torch.Tensor]):
        """The body over `suffixes` (right-padded to S) after the entries' tokens (left-padded to
        P in the cache): (hidden states [n, S, H], the DynamicCache, [n, kv, P + S, d] a layer);
        positions count each entry's own tokens."""
        width = max(len(x) for x in suffixes)
        if width == 0:   # the entries hold every row's position already: nothing to compute
            hidden = entries[0].hidden
            return hidden.new_zeros(len(entries), 0, hidden.shape[-1]), None
        cache, prompt_mask = batched_cache(entries, self.model.config)
        ids = torch.zeros(len(entries), width, dtype=torch.long)
        mask = torch.zeros(len(entries), width, dtype=torch.long)
        pos = torch.zeros(len(entries), width, dtype=torch.long)
        for j, (e, x) in enumerate(zip(entries, suffixes)):
            ids[j, :len(x)] = x
            mask[j, :len(x)] = 1
            pos[j] = e.tokens + torch.arange(width)
        hidden = self.body(input_ids=ids.to(self.device), attention_mask=torch.cat([prompt_mask, mask], 1).to(self.device),
                           position_ids=pos.to(self.device), past_key_values=cache, use_cache=True).last_hidden_state
        return hidden, cache

    @torch.no_grad()
    def prefill(self, reqs: list[ScoreRequest]) -> list[int]:
        """Hold the requests' sequences (SCORE mode "prefill", 2.6: a prompt, s_b = len_b, or a
        prompt + the response so far) not held yet, each continuing the longest held entry of
        its first tokens, or else the first tokens all such sequences share (computed once);
        per request, the tokens now held."""
        if self.prompt_cache is None:
            return [0] * len(reqs)
        from transformers import DynamicCache

        todo: dict[bytes, tuple[torch.Tensor, int]] = {}
        asked = []   # per request, (key, tokens) of its sequences
        for req in reqs:
            asked.append([])
            for b in range(req.num_sequences):
                seq, s = req.sequence(b).long(), req.response_starts[b]
                key = key_of(seq, s)
                asked[-1].append((key, len(seq)))
                if key not in self.prompt_cache:
                    todo[key] = (seq, s)
        within = _continued_within(todo)
        for key in within:
            del todo[key]
        items = list(todo.values())
        base = [self.prompt_cache.lookup(seq, s, len(seq) - 1, count=False) for seq, s in items]
        lengths = [len(seq) for seq, _ in items]
        fresh = [i for i, e in enumerate(base) if e is None]
        shared = self._shared_prefix([items[i] for i in fresh])
        if shared is not None:   # they continue it, as a response continues its prompt
            for i in fresh:
                base[i] = shared
            fresh = []
        for batch in self._micro_batches(lengths, fresh):
            cache = DynamicCache(config=self.model.config)
            hidden = self._body([items[i][0] for i in batch], cache)
            for j, i in enumerate(batch):
                (seq, s), n = items[i], lengths[i]   # right padding: a sequence's keys are its first n columns
                self._keep(seq, s, [(layer.keys[j, :, :n], layer.values[j, :, :n]) for layer in cache.layers],
                           hidden[j, s - 1:n])
        grown = [i for i, e in enumerate(base) if e is not None]
        for batch in self._micro_batches(lengths, grown):
            entries = [base[i] for i in batch]
            hidden, cache = self._continue(entries, [items[i][0][e.tokens:] for i, e in zip(batch, entries)])
            width = max(e.tokens for e in entries)   # the entries are left-padded to it, the rest right-padded
            for j, (i, e) in enumerate(zip(batch, entries)):
                (seq, s), grow = items[i], lengths[i] - e.tokens
                cols = slice(width - e.tokens, width + grow)
                # hidden states from position e.start - 1 on; the entry keeps them from s - 1 on
                self._keep(seq, s, [(layer.keys[j, :, cols], layer.values[j, :, cols]) for layer in cache.layers],
                           torch.cat([e.hidden, hidden[j, :grow]])[s - e.start:])
                if e.tokens > e.start:   # a response's earlier part: the longer entry holds all it did
                    self.prompt_cache.drop(key_of(seq[:e.tokens], s))

        def held(key: bytes) -> bool:   # itself, or as the first tokens of a longer one of this call
            while key not in self.prompt_cache and key in within:
                key = within[key]
            return key in self.prompt_cache

        return [sum(n for key, n in mine if held(key)) for mine in asked]

    def _shared_prefix(self, items: list[tuple[torch.Tensor, int]]) -> Entry | None:
        """The keys and values of the first tokens every (sequence, start) of `items` shares, computed
        once: a chat template's system prompt and turn header (27 of the 65-76 tokens of the
        small-real bench's prompts), which each item then continues. Within its start and short of
        its last token; None for fewer than 2 items or MIN_SHARED tokens."""
        if len(items) < 2:
            return None
        first = items[0][0]
        n = min(min(s for _, s in items), min(len(seq) for seq, _ in items) - 1)
        for seq, _ in items[1:]:
            differ = (seq[:n] != first[:n]).nonzero()
            if len(differ):
                n = int(differ[0])
        if n < MIN_SHARED:
            return None
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        hidden = self._body([first[:n]], cache)
        return Entry([layer.keys[0] for layer in cache.layers], [layer.values[0] for layer in cache.layers],
                     hidden[0, n - 1:], n)

    def _keep(self, seq: torch.Tensor, start: int, kv: list[tuple[torch.Tensor, torch.Tensor]], hidden) -> None:
        """Hold seq (rows from `start`): its keys and values per layer, the hidden states [len - start + 1, H]."""
        entry = Entry([k.clone() for k, _ in kv], [v.clone() for _, v in kv], hidden.clone(), start)
        self.prompt_cache.put(key_of(seq, start), entry, key_of(seq[:start], start))

    @torch.no_grad()
    def _continuation_differs(self) -> str | None:
        """Whether a forward over cached keys and values gives what a whole one does, on 8 tokens
        of this model (an architecture whose cache carries more than keys and values fails)."""
        from transformers import DynamicCache

        ids = torch.arange(8) % self.vocab_size
        whole = self._body([ids[:7]])[0, 3:7]                     # [4, H]: positions 3..6
        cache = DynamicCache(config=self.model.config)
        head = self._body([ids[:4]], cache)[0, 3]                 # the prompt ids[:4], cached
        entry = Entry([layer.keys[0].clone() for layer in cache.layers],
                      [layer.values[0].clone() for layer in cache.layers], head[None], 4)
        cont = torch.cat([head[None], self._continue([entry], [ids[4:7]])[0][0]])
        err, scale = float((cont - whole).abs().max()), float(whole.abs().max()) or 1.0
        tol = 1e-4 if self.lm_head.weight.dtype == torch.float32 else 3e-2   # half precision: ulps of it
        return None if err <= tol * scale else f"a forward continued over cached keys and values differs by {err:.3g}"

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

    # ---- samples (SAMPLE) ------------------------------------------------------------------

    @torch.no_grad()
    def sample(self, reqs: list[SampleRequest]) -> list[SampleAnswer]:
        return [self._sample(req) for req in reqs]

    def _sample(self, req: SampleRequest) -> SampleAnswer:
        """transformers' `generate` over the prompts left-padded, each repeated n times (greedy
        allows no num_return_sequences > 1), from torch's generator seeded with req.seed (the
        caller's generator state left as it was). top_k off: a model's generation_config
        default (often 50) would sample another distribution."""
        prompts = [req.sequence(b) for b in range(req.num_sequences) for _ in range(req.n)]
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
        stop = list(req.stop_ids) or self._eos_ids()
        how = dict(do_sample=False) if req.temperature == 0 else \
            dict(do_sample=True, temperature=req.temperature, top_p=req.top_p, top_k=0)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(req.seed)
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      max_new_tokens=req.max_new_tokens,
                                      eos_token_id=stop or None, pad_token_id=stop[0] if stop else 0, **how)
        responses, finish = zip(*(cut_at_stop(row, stop, req.max_new_tokens) for row in out[:, width:].tolist()))
        return SampleAnswer(list(responses), list(finish))

    def _eos_ids(self) -> list[int]:
        """The model's own end-of-sequence ids (its generation config's, else its config's)."""
        for cfg in (getattr(self.model, "generation_config", None), self.model.config):
            eos = getattr(cfg, "eos_token_id", None)
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
        return []


def _continued_within(todo: dict[bytes, tuple[torch.Tensor, int]]) -> dict[bytes, bytes]:
    """{key: a longer sequence's key} for each sequence of one prefill that a longer one of the same
    call continues (same start, its first tokens). Hints queued behind a slow SCORE reach the
    server together (a prompt, then its response at a quarter and at a half) and are computed in
    one call; the shorter would be kept beside the longer, and since the SCORE reads and drops
    only the longest, left in the cache for good. The longer one holds all of it."""
    by_prompt: dict[bytes, list[bytes]] = {}
    for key, (seq, s) in todo.items():
        by_prompt.setdefault(key_of(seq[:s], s), []).append(key)
    out = {}
    for keys in by_prompt.values():   # one prompt's sequences: its samples at each length announced
        keys.sort(key=lambda k: len(todo[k][0]))
        for i, short in enumerate(keys):
            seq = todo[short][0]
            for long in keys[i + 1:]:
                if torch.equal(todo[long][0][:len(seq)], seq):   # one as long would be the same key: longer
                    out[short] = long
                    break
    return out
