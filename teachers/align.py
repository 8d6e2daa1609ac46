"""Cross-tokenizer teachers (`tokenizer: cross`): the student's response in the teacher's own
tokens, and the teacher's answer brought back to the student's rows over character spans.

    text        the student's sampled response, detokenized (a final stop token kept apart:
                it becomes the teacher's EOS)
    teacher     its prompt rendered with its own chat template (opd.distill.context), then
                teacher_tok(text) [+ its EOS]; a plain SCORE of those ids: no protocol change
    spans       both sides' token ends in characters of `text`, from decoding each prefix
                (a prefix that ends inside a character, e.g. one byte of a 3-byte UTF-8
                character, is no boundary); a span runs between two consecutive ends both
                sides share, so its student tokens and its teacher tokens cover the same text
    rows        a student row whose span starts there has the same context as the teacher
                row that starts the span: its next-token distributions are compared (the
                mapped ids exactly, the rest by sorted probabilities; opd.kernels.cross);
                every row also takes its span's log-prob difference (the sampled-token form)

`VocabMap` is the mapped-id table, built once from the two vocabularies: a teacher id maps to
the student id whose text is the same (each text unique on both sides), the EOS to the EOS;
with `cross.match: prefix` (the default) a teacher id with no such student id maps to the
student's first token of its text, so the teacher's next-token distribution is compared as the
distribution of the student's next token (exact for a byte-level student at a word boundary).
A response the teacher's tokenizer does not give back unchanged (a normalizer that rewrites
text) is one span: its first rows still share their context, its other rows only the
sequence's log-prob difference (counted: `signal/cross/<teacher>/unaligned`, and in the card).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from opd.errors import TrainError
from opd.kernels import TopKTeacher

REPLACEMENT = "\ufffd"   # what decoding writes for bytes that end inside a character


def token_texts(tok) -> list[str | None]:
    """Each id's text as it reads after other text (decoding it alone would drop a
    SentencePiece word's leading space): decode([anchor, id]) less decode([anchor]). None: no
    whole character (one byte of a multi-byte character) or no text at all."""
    anchor = tok.encode("a", add_special_tokens=False)[:1]
    head = tok.decode(anchor, clean_up_tokenization_spaces=False)
    both = tok.batch_decode([anchor + [i] for i in range(len(tok))], clean_up_tokenization_spaces=False)
    out: list[str | None] = []
    for text in both:
        piece = text[len(head):] if text.startswith(head) else None
        out.append(piece if piece and REPLACEMENT not in piece else None)
    return out


@dataclass(frozen=True)
class VocabMap:
    """teacher_to_student [V_t] long: the student id with the teacher id's text, -1 where there is
    none (or the text is not unique on one side); student_shared [V_s] bool: the student ids
    some teacher id maps to. teacher_to_first [V_t] long: the same, and where no student token
    has the whole text, the student's first token of that text when its text begins it (" cat"
    -> " " for a byte-level student; specials map only exactly). Sizes are the tokenizers'
    (len(tok)): an LM head padded past its tokenizer has more rows, which map to nothing."""
    teacher_to_student: torch.Tensor
    student_shared: torch.Tensor
    teacher_to_first: torch.Tensor

    @classmethod
    def build(cls, student_tok, teacher_tok) -> "VocabMap":
        s_texts, t_texts = token_texts(student_tok), token_texts(teacher_tok)

        def unique(texts):
            seen: dict[str, int] = {}
            for i, x in enumerate(texts):
                if x is not None:
                    seen[x] = -1 if x in seen else i   # a text two ids share maps to neither
            return {x: i for x, i in seen.items() if i >= 0}

        s_ids, t_ids = unique(s_texts), unique(t_texts)
        t2s = torch.full((len(t_texts),), -1, dtype=torch.long)
        for text, t in t_ids.items():
            if text in s_ids:
                t2s[t] = s_ids[text]
        if student_tok.eos_token_id is not None and teacher_tok.eos_token_id is not None:
            t2s[t2s == student_tok.eos_token_id] = -1   # the end of a response is the end on both sides
            t2s[teacher_tok.eos_token_id] = student_tok.eos_token_id
        shared = torch.zeros(len(s_texts), dtype=torch.bool)
        shared[t2s[t2s >= 0]] = True
        first = t2s.clone()
        special = set(teacher_tok.all_special_ids) | set(getattr(teacher_tok, "added_tokens_decoder", {}))
        rest = [t for t, x in enumerate(t_texts) if x is not None and first[t] < 0 and t not in special]
        encoded = student_tok([t_texts[t] for t in rest], add_special_tokens=False)["input_ids"] if rest else []
        for t, ids in zip(rest, encoded):
            head = s_texts[ids[0]] if ids else None
            if head is not None and t_texts[t].startswith(head) and ids[0] not in student_tok.all_special_ids:
                first[t] = ids[0]
        return cls(t2s, shared, first)

    def student_ids(self, teacher_ids: torch.Tensor, match: str = "exact") -> torch.Tensor:
        """teacher_ids [...] -> student ids [...] (-1: none); ids past the table: -1. match: exact
        (teacher_to_student) or prefix (teacher_to_first)."""
        table = self.teacher_to_student if match == "exact" else self.teacher_to_first
        inside = (teacher_ids >= 0) & (teacher_ids < len(table))
        return torch.where(inside, table[teacher_ids.clamp(0, len(table) - 1)], torch.full_like(teacher_ids, -1))

    def unshared(self, vocab: int, match: str = "exact") -> torch.Tensor:
        """[vocab] bool: the student ids no teacher id maps to (padding rows past the tokenizer too)."""
        shared = self.student_shared.clone()
        if match != "exact":
            shared[self.teacher_to_first[self.teacher_to_first >= 0]] = True
        out = torch.ones(vocab, dtype=torch.bool)
        n = min(vocab, len(shared))
        out[:n] = ~shared[:n]
        return out


def char_ends(tok, ids: list[int], text: str) -> list[int | None]:
    """Where each token of `ids` ends, in characters of `text` (their decoding): the length of
    the prefix's decoding, None where that is no prefix of `text` (it ends inside a character).

    Decoded piece by piece from the last clean end, after one token of context (a piece decoded
    alone may lose a leading space, as SentencePiece's first word does), so a response costs
    O(tokens), not O(tokens^2); when the pieces do not add up to `text` (a decoder that is not
    local), every prefix is decoded whole instead (`prefix_ends`)."""
    out: list[int | None] = []
    start, chars = 0, 0   # tokens before `start` end cleanly at `chars`
    for i in range(len(ids)):
        ctx = ids[start - 1:start] if start else []
        head = tok.decode(ctx, clean_up_tokenization_spaces=False)
        full = tok.decode(ctx + ids[start:i + 1], clean_up_tokenization_spaces=False)
        piece = full[len(head):] if full.startswith(head) else None
        if piece and not piece.endswith(REPLACEMENT) and text.startswith(piece, chars):
            start, chars = i + 1, chars + len(piece)
            out.append(chars)
        else:
            out.append(None)
    return out if not ids or out[-1] == len(text) else prefix_ends(tok, ids, text)


def prefix_ends(tok, ids: list[int], text: str) -> list[int | None]:
    """char_ends by decoding every prefix whole: O(tokens^2) decoding, for any decoder."""
    out: list[int | None] = []
    for i in range(1, len(ids) + 1):
        head = tok.decode(ids[:i], clean_up_tokenization_spaces=False)
        clean = text.startswith(head) and not head.endswith(REPLACEMENT) or head == text
        out.append(len(head) if head and clean else None)   # a token of no text ends nothing
    return out


def spans(student_ends: list[int | None], teacher_ends: list[int | None]) -> list[tuple[int, int, int, int]]:
    """(s_lo, s_hi, t_lo, t_hi) per span: student tokens s_lo..s_hi and teacher tokens t_lo..t_hi
    cover the same characters. A span closes where both sides end a token at the same
    character; tokens after the last shared end join the last span (or make the only one)."""
    out: list[tuple[int, int, int, int]] = []
    i = j = s_lo = t_lo = 0
    while i < len(student_ends) and j < len(teacher_ends):
        a, b = student_ends[i], teacher_ends[j]
        if a is None or (b is not None and a < b):
            i += 1
        elif b is None or b < a:
            j += 1
        else:
            i, j = i + 1, j + 1
            out.append((s_lo, i, t_lo, j))
            s_lo, t_lo = i, j
    if s_lo < len(student_ends) or t_lo < len(teacher_ends):
        if out and (s_lo == len(student_ends) or t_lo == len(teacher_ends)):
            a, _, c, _ = out.pop()   # one side has nothing left: the rest is the last span's
            s_lo, t_lo = a, c
        out.append((s_lo, len(student_ends), t_lo, len(teacher_ends)))
    return out


@dataclass
class Aligned:
    """One response on both sides: the teacher's ids and the spans (student rows, teacher rows)."""
    teacher_ids: list[int]
    spans: list[tuple[int, int, int, int]]
    exact: bool   # the teacher's tokens decode back to the student's text (else one span)


class CrossTokenizers:
    """The student's and a teacher's tokenizers, and the mapped-id table between them.
    stop_ids: the student ids that end a response (its EOS): one kept last becomes the teacher's EOS."""

    def __init__(self, student_tok, teacher_tok, stop_ids=None, match: str = "prefix"):
        self.student, self.teacher, self.match = student_tok, teacher_tok, match
        self.map = VocabMap.build(student_tok, teacher_tok)
        self.stop_ids = set(stop_ids or ()) | ({student_tok.eos_token_id} - {None})

    def align(self, response: list[int]) -> Aligned:
        """The student's response ids in the teacher's tokens, and their spans."""
        ends_with_stop = bool(response) and response[-1] in self.stop_ids and self.teacher.eos_token_id is not None
        body = response[:-1] if ends_with_stop else list(response)
        text = self.student.decode(body, clean_up_tokenization_spaces=False)
        t_ids = list(self.teacher(text, add_special_tokens=False)["input_ids"]) if text else []
        exact = self.teacher.decode(t_ids, clean_up_tokenization_spaces=False) == text
        if exact:
            pieces = spans(char_ends(self.student, body, text), char_ends(self.teacher, t_ids, text))
        else:
            pieces = [(0, len(body), 0, len(t_ids))] if body or t_ids else []
        pieces = [p for p in pieces if p[1] > p[0]] if t_ids else []   # no teacher token: nothing to compare
        if ends_with_stop:
            pieces.append((len(body), len(body) + 1, len(t_ids), len(t_ids) + 1))
            t_ids = t_ids + [self.teacher.eos_token_id]
        if not pieces and response:   # a response whose text the teacher reads as nothing
            pieces = [(0, len(response), 0, len(t_ids))] if t_ids else []
        return Aligned(t_ids, pieces, exact)

    def request(self, submit, sequences: list[list[int]], starts: list[int], contexts) -> Future:
        """Future of a CrossAnswer. sequences/starts: the student's prompt + response ids;
        contexts [B]: the teacher's prompts in its own tokens (opd.distill.context); submit(
        sequences, starts) -> Future of the teacher's TopKResult over its own ids."""
        if contexts is None:
            raise ValueError("a cross-tokenizer teacher needs its prompts in its own tokens (contexts: "
                             "opd.distill.context.teacher_inputs with the teacher's tokenizer)")
        t0 = time.perf_counter()
        aligned = [self.align(list(seq[start:])) for seq, start in zip(sequences, starts)]
        t_seqs = [list(ctx) + a.teacher_ids for ctx, a in zip(contexts, aligned)]
        inner = submit(t_seqs, [len(ctx) for ctx in contexts])
        outer: Future = Future()
        lengths = [len(seq) - start for seq, start in zip(sequences, starts)]

        def done(f: Future) -> None:
            try:
                outer.set_result(self.answer(f.result(), aligned, lengths, time.perf_counter() - t0))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting trainer
                outer.set_exception(e)
        inner.add_done_callback(done)
        return outer

    def answer(self, r, aligned: list[Aligned], lengths: list[int], latency_s: float) -> "CrossAnswer":
        """The teacher's TopKResult `r` (rows over its own tokens) as a CrossAnswer over the
        student's rows (lengths [B]: each response's student rows)."""
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        start_row = torch.full((offsets[-1],), -1, dtype=torch.long)
        span_of = torch.full((offsets[-1],), -1, dtype=torch.long)
        token_lp = torch.as_tensor(r.token_logprob, dtype=torch.float32)
        span_lp: list[float] = []
        for b, a in enumerate(aligned):
            so, to = offsets[b], int(r.row_offsets[b])
            if int(r.row_offsets[b + 1]) - to != len(a.teacher_ids):
                raise TrainError(f"cross-tokenizer teacher answered {int(r.row_offsets[b + 1]) - to} rows for a response of "
                                 f"{len(a.teacher_ids)} teacher tokens")
            for s_lo, s_hi, t_lo, t_hi in a.spans:
                start_row[so + s_lo] = to + t_lo
                span_of[so + s_lo:so + s_hi] = len(span_lp)
                span_lp.append(float(token_lp[to + t_lo:to + t_hi].sum()))
        teacher = TopKTeacher(*(torch.as_tensor(x) for x in (r.ids, r.logprobs, r.tail_logmass)))
        span_lp_S = torch.tensor(span_lp, dtype=torch.float32)
        per_row = torch.zeros(offsets[-1])   # the span's teacher log-prob on its first row
        first = start_row >= 0
        per_row[first] = span_lp_S[span_of[first]]
        return CrossAnswer(token_logprob=per_row, row_offsets=offsets, latency_s=latency_s, teacher=teacher,
                           mapped=self.map.student_ids(teacher.ids.long(), self.match), start_row=start_row,
                           span_of=span_of, span_teacher_lp=span_lp_S,
                           unshared=lambda vocab: self.map.unshared(vocab, self.match),
                           parts={"unaligned": [float(sum(not a.exact for a in aligned)), len(aligned)]})


@dataclass
class CrossAnswer:
    """A cross-tokenizer teacher's answer over the student's rows (R_s in all, request order).

    teacher      TopKTeacher [R_t, k] over the teacher's vocabulary, its own rows
    mapped       [R_t, k] the student ids of teacher.ids (-1: none; VocabMap, by cross.match: the
                 same text, or with prefix the first student token of its text: may repeat)
    start_row    [R_s] the teacher row with the same context as this student row (a span's
                 first row), -1 inside a span
    span_of      [R_s] the span each student row belongs to (-1: none: the teacher read no text)
    span_teacher_lp [S] the teacher's log-prob of each span's tokens
    token_logprob [R_s] span_teacher_lp on each span's first row, 0 elsewhere (sums to the
                 teacher's log-prob of the response)
    parts        what the loss measured of each part: {part: [sum, rows]} (opd.distill.cross), and
                 "unaligned": [responses the teacher's tokenizer did not give back unchanged, responses]
    """
    token_logprob: torch.Tensor
    row_offsets: list[int]
    latency_s: float
    teacher: TopKTeacher
    mapped: torch.Tensor
    start_row: torch.Tensor
    span_of: torch.Tensor
    span_teacher_lp: torch.Tensor
    unshared: object   # unshared(V) -> [V] bool: the student ids no teacher id maps to
    parts: dict = field(default_factory=dict)
    topk = None      # the answer's top k is over another vocabulary: no per-row top-k diagnostics
    logits = None

    def teacher_rows(self, idx, device):
        raise TypeError("a cross-tokenizer answer has no rows over the student's vocabulary: use "
                        "opd.distill.cross.cross_loss")


def load_cross(specs, student_tok) -> dict[str, CrossTokenizers]:
    """{name: CrossTokenizers} for the `tokenizer: cross` specs, each teacher's tokenizer loaded from
    its cross.tokenizer_path (ValueError naming the teacher when it cannot be)."""
    from transformers import AutoTokenizer

    out = {}
    for spec in specs:
        if getattr(spec, "tokenizer", "same") != "cross":
            continue
        path = spec.cross.tokenizer_path
        try:
            teacher_tok = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"teacher {spec.name!r}: cannot load its tokenizer from cross.tokenizer_path {path} "
                             f"({e})") from None
        out[spec.name] = CrossTokenizers(student_tok, teacher_tok, match=spec.cross.match)
    return out
