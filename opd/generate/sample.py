"""`opd generate`'s work: a teacher's answers to prompts, filtered, deduplicated and written.

    open_source(teacher, base, sampling) -> a Source: answer(samples) -> per sample, n (text, tokens)
    generate(cfg, cfg_path, overwrite)   -> the card (also written as OUT.card.json / .card.md)

Sources: `LocalSource` samples a model with a rollout engine (hf or vLLM; the prompt rendered
with the tokenizer's chat template, as every loop renders it); `ServedSource` asks an `opd
serve-teacher` server (its SAMPLE message), the prompts rendered here with its tokenizer;
`HTTPSource` asks an OpenAI-compatible /chat/completions endpoint for n choices, a few prompts
at a time.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from opd.data import Sample, encode_prompt, load_jsonl, write_jsonl
from opd.fingerprint import tokenizer_fingerprint
from opd.generate.config import GenerateConfig, Sampling, TeacherSource
from opd.rewards import correct, verify_batch
from opd.rollout import SamplingParams
from opd.rollout.hf import HFRolloutEngine
from opd.rollout.vllm import VLLMRolloutEngine
from opd.spine.config import ModelConfig
from opd.spine.model import load_policy, load_tokenizer
from opd.teachers.client import TeacherClient, TeacherError


class EndpointError(RuntimeError):
    """The teacher endpoint cannot be used (unreachable, an error answer, no key); the message says which."""


class LocalSource:
    """A model on this machine behind a rollout engine (opd.rollout: hf or vLLM)."""

    def __init__(self, engine, tokenizer, sampling: Sampling):
        self.engine, self.tok, self.s, self.calls = engine, tokenizer, sampling, 0

    def answer(self, samples: list[Sample]) -> list[list[tuple[str, int]]]:
        s = self.s
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens, n=s.n,
                                seed=s.seed * 1_000_003 + self.calls)   # each batch its own numbers, reproducibly
        self.calls += 1
        out: list[list[tuple[str, int]]] = [[] for _ in samples]
        for r in self.engine.generate([encode_prompt(self.tok, x.chat) for x in samples], params):
            out[r.prompt_index].append((r.text(self.tok), len(r.response_ids)))
        return out

    def close(self) -> None:
        self.engine.close()


class ServedSource:
    """An `opd serve-teacher` server: each batch of prompts rendered with the teacher's chat
    template and tokenized here (its tokenizer, checked against the server's fingerprint), and
    sampled in the server's process (SAMPLE), n each, ending at the teacher's own EOS."""

    def __init__(self, teacher: TeacherSource, tokenizer, sampling: Sampling):
        self.tok, self.s, self.calls = tokenizer, sampling, 0
        self.client = TeacherClient(teacher.address, timeout_s=teacher.timeout_s, name="opd-generate")
        try:
            welcome = self.client.info()
        except TeacherError as e:
            self.client.close()
            raise EndpointError(f"teacher server {teacher.address} is unusable ({e}); start it with "
                                f"`opd serve-teacher` or fix teacher.address") from None
        if welcome.tokenizer_fingerprint != tokenizer_fingerprint(tokenizer):
            self.client.close()
            raise EndpointError(f"teacher.model {teacher.model} has another tokenizer than the server at "
                                f"{teacher.address} ({welcome.model_id}): its prompts would be read as other tokens")

    def answer(self, samples: list[Sample]) -> list[list[tuple[str, int]]]:
        s = self.s
        try:
            out = self.client.sample([encode_prompt(self.tok, x.chat) for x in samples], n=s.n,
                                     max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                     seed=s.seed * 1_000_003 + self.calls)
        except TeacherError as e:
            raise EndpointError(f"teacher server {self.client.address} failed: {e}") from None
        self.calls += 1
        texts = [(self.tok.decode(ids[:-1] if f == "stop" else ids, skip_special_tokens=True), len(ids))
                 for ids, f in zip(out.responses, out.finish)]
        return [texts[i * s.n:(i + 1) * s.n] for i in range(len(samples))]

    def close(self) -> None:
        self.client.close()


class HTTPSource:
    """An OpenAI-compatible endpoint: one /chat/completions request (n choices) per prompt,
    `batch_size` of them in flight at once."""

    def __init__(self, teacher: TeacherSource, sampling: Sampling):
        self.t, self.s = teacher, sampling
        key = os.environ.get(teacher.api_key_env) if teacher.api_key_env else None
        if teacher.api_key_env and not key:
            raise EndpointError(f"teacher.api_key_env: the environment variable {teacher.api_key_env} is not set")
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        self.pool = ThreadPoolExecutor(max_workers=sampling.batch_size)

    def _one(self, sample: Sample) -> list[tuple[str, int]]:
        t, s = self.t, self.s
        messages = sample.messages if sample.messages is not None else [{"role": "user", "content": sample.prompt}]
        body = {"model": t.api_model, "messages": messages, "n": s.n, "temperature": s.temperature, "top_p": s.top_p,
                "max_tokens": s.max_new_tokens, "seed": s.seed}
        url = t.url.rstrip("/") + "/chat/completions"
        req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=t.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise EndpointError(f"teacher endpoint {url} answered HTTP {e.code}: "
                                f"{e.read().decode(errors='replace')[:300]}") from None
        except TimeoutError:
            raise EndpointError(f"teacher endpoint {url} did not answer within teacher.timeout_s = "
                                f"{t.timeout_s} s") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise EndpointError(f"teacher endpoint {url} did not answer within teacher.timeout_s = "
                                    f"{t.timeout_s} s") from None
            raise EndpointError(f"teacher endpoint {url} is unreachable ({e.reason}); check teacher.url") from None
        try:
            answer = json.loads(raw)
            choices = answer["choices"]
            texts = [c["message"]["content"] or "" for c in choices]
            tokens = int((answer.get("usage") or {}).get("completion_tokens", 0))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise EndpointError(f"teacher endpoint {url} answered something that is not a chat completion: "
                                f"{raw[:200]!r}") from None
        if len(texts) != s.n:
            raise EndpointError(f"teacher endpoint {url} gave {len(texts)} choices for n = {s.n} (an endpoint that "
                                f"ignores `n` needs sampling.n: 1)")
        return [(text, tokens // s.n) for text in texts]

    def answer(self, samples: list[Sample]) -> list[list[tuple[str, int]]]:
        return list(self.pool.map(self._one, samples))

    def close(self) -> None:
        self.pool.shutdown()


def open_source(teacher: TeacherSource, base: Path, sampling: Sampling):
    """The config's teacher, ready to answer (a local model is loaded here)."""
    if teacher.engine == "http":
        return HTTPSource(teacher, sampling)
    path = str((base / teacher.model).resolve()) if not Path(teacher.model).is_absolute() else teacher.model
    tok = load_tokenizer(path, "teacher.model")
    if teacher.engine == "served":
        return ServedSource(teacher, tok, sampling)
    if teacher.engine == "vllm":
        engine = VLLMRolloutEngine(path, seed=sampling.seed, dtype=teacher.dtype,
                                   max_model_len=teacher.vllm_max_model_len)
        return LocalSource(engine, tok, sampling)
    model, tok = load_policy(ModelConfig(path=path, dtype=teacher.dtype, device=teacher.device), tokenizer=tok,
                             train=False, what="teacher.model")
    return LocalSource(HFRolloutEngine(model, tok, batch_size=sampling.batch_size * sampling.n), tok, sampling)


def row(sample: Sample, text: str, score: float | None, fmt: str) -> dict:
    """One output row, as `opd sft` reads it; the verifier's fields and score travel along."""
    extra = {k: v for k, v in (("domain", sample.domain), ("answer", sample.answer), ("tests", sample.tests))
             if v is not None}
    extra["score"] = score
    if sample.messages is None and fmt == "sft":
        return {"prompt": sample.prompt, "response": text, **extra}
    convo = sample.messages if sample.messages is not None else [{"role": "user", "content": sample.prompt}]
    return {"messages": [*convo, {"role": "assistant", "content": text}], **extra}


def select(sample: Sample, answers: list[tuple[str, float | None]], cfg: GenerateConfig, counts: Counter) -> list:
    """The (text, score) answers of one prompt that are kept, in sampled order; `counts` gets why
    the others were not (wrong, duplicate, capped) and how many were kept unverified."""
    f, kept, seen = cfg.filter, [], set()
    for text, score in answers:
        if score is None:
            counts["unverified"] += 1
        elif f.keep == "correct" and not correct(score):
            counts["wrong"] += 1
            continue
        norm = " ".join(text.split())
        if f.dedup and norm in seen:
            counts["duplicate"] += 1
            continue
        if f.max_per_prompt is not None and len(kept) >= f.max_per_prompt:
            counts["capped"] += 1
            continue
        seen.add(norm)
        kept.append((text, score))
    return kept


def generate(cfg: GenerateConfig, cfg_path: Path, *, overwrite: bool = False, source=None) -> dict:
    """Sample, filter and write; returns the card. `source`: an open one to use (and leave open)
    instead of the config's teacher."""
    base = cfg_path.parent
    out = (base / cfg.out).resolve()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists: pass --overwrite to replace it (nothing was sampled)")
    source_prompts = (base / cfg.prompts).resolve()
    samples, _ = load_jsonl(source_prompts)
    samples = samples[:cfg.max_prompts] if cfg.max_prompts else samples
    t0 = time.time()
    opened = source is None
    source = source or open_source(cfg.teacher, base, cfg.sampling)
    rows, counts, tokens = [], Counter(), 0
    passed: dict[str, list[int]] = {}   # domain -> [verified responses scoring 1, verified responses]
    none_kept = 0
    try:
        bar = tqdm(total=len(samples), desc="generate", unit="prompt", dynamic_ncols=True)
        for a in range(0, len(samples), cfg.sampling.batch_size):
            batch = samples[a:a + cfg.sampling.batch_size]
            answers = source.answer(batch)
            flat = [(s, text) for s, ans in zip(batch, answers) for text, _ in ans]
            scores = verify_batch([s for s, _ in flat], [t for _, t in flat], workers=cfg.code_workers)
            tokens += sum(n for ans in answers for _, n in ans)
            i = 0
            for s, ans in zip(batch, answers):
                scored = [(text, scores[i + j]) for j, (text, _) in enumerate(ans)]
                i += len(ans)
                for _, v in scored:
                    if v is not None:
                        p = passed.setdefault(s.domain or "all", [0, 0])
                        p[0], p[1] = p[0] + correct(v), p[1] + 1
                kept = select(s, scored, cfg, counts)
                none_kept += not kept
                rows.extend(row(s, text, v, cfg.format) for text, v in kept)
            counts["sampled"] += len(flat)
            bar.update(len(batch))
        bar.close()
    finally:
        if opened:
            source.close()
    write_jsonl(out, rows)
    card = {"out": str(out), "rows": len(rows), "format": cfg.format, "prompts": len(samples),
            "prompts_with_none_kept": none_kept, "responses_sampled": counts["sampled"],
            "dropped_wrong": counts["wrong"], "dropped_duplicate": counts["duplicate"],
            "dropped_capped": counts["capped"], "kept_unverified": counts["unverified"],
            "pass_rate": {d: p[0] / p[1] for d, p in sorted(passed.items())},
            "tokens_sampled": tokens, "wall_s": round(time.time() - t0, 2),
            "teacher": {k: v for k, v in vars(cfg.teacher).items() if v is not None},
            "sampling": vars(cfg.sampling), "filter": vars(cfg.filter), "source_prompts": str(source_prompts)}
    write_card(out, card)
    return card


def write_card(out: Path, card: dict) -> None:
    """OUT.card.json, and OUT.card.md for a person: where the rows came from and what was dropped."""
    stem = out.with_suffix("")
    Path(f"{stem}.card.json").write_text(json.dumps(card, indent=1))
    t = card["teacher"]
    who = (f"{t['api_model']} at {t['url']}" if t["engine"] == "http" else
           f"the server at {t['address']} (its tokenizer: {t['model']})" if t["engine"] == "served" else
           f"{t['model']} ({t['engine']})")
    s, f = card["sampling"], card["filter"]
    lines = [f"# Teacher samples: {out.name}", "",
             f"- teacher: {who}",
             f"- prompts: {card['prompts']} from {card['source_prompts']}; {s['n']} responses each at temperature "
             f"{s['temperature']}, top-p {s['top_p']}, at most {s['max_new_tokens']} tokens, seed {s['seed']}",
             f"- kept: {card['rows']} of {card['responses_sampled']} ({f['keep']}"
             f"{', deduplicated' if f['dedup'] else ''}"
             f"{', at most ' + str(f['max_per_prompt']) + ' per prompt' if f['max_per_prompt'] else ''}), "
             f"format {card['format']}",
             f"- dropped: {card['dropped_wrong']} wrong by the verifier, {card['dropped_duplicate']} duplicates, "
             f"{card['dropped_capped']} over the cap; {card['kept_unverified']} kept without a verifier",
             f"- prompts with no response kept: {card['prompts_with_none_kept']}",
             "- the teacher's pass rate (verified responses scoring 1): " +
             (", ".join(f"{d} {v:.3f}" for d, v in card["pass_rate"].items()) or "none verified"),
             f"- tokens sampled: {card['tokens_sampled']}; wall: {card['wall_s']} s", ""]
    Path(f"{stem}.card.md").write_text("\n".join(lines))
