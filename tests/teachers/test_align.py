"""Cross-tokenizer alignment (opd.teachers.align), checked by hand on two tokenizers built here:
the tiny byte-level one (a token per byte) and a BPE one with a few merges, over the same text.

    text     "the cat sat. café"   (é is two UTF-8 bytes: C3 A9)
    student  t h e ␣ c a t ␣ s a t . ␣ c a f C3 A9      (18 tokens, one per byte)
    teacher  the | ␣cat | ␣s | at | . | ␣c | a | f | é  (9 tokens; merges th, the, ␣c, at, ␣cat, ␣s, é)

The teacher's tokens end at characters 3, 7, 9, 11, 12, 14, 15, 16, 17; the student's at every
character except inside é (after its byte C3 the decoded prefix ends in a replacement
character), so the spans are student 0-3 / teacher 0-1, 3-7 / 1-2, 7-9 / 2-3, 9-11 / 3-4,
11-12 / 4-5, 12-14 / 5-6, 14-15 / 6-7, 15-16 / 7-8, 16-18 / 8-9, and a final EOS is its own span.
"""

import random
from concurrent.futures import Future

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from opd.errors import TrainError
from opd.teachers.align import CrossTokenizers, VocabMap, char_ends, prefix_ends, spans
from opd.teachers.results import TopKResult
from opd.tiny import build_tokenizer
from opd.tiny.cross import build_bpe_tokenizer

TEXT = "the cat sat. café"
MERGES = [("t", "h"), ("th", "e"), ("Ġ", "c"), ("a", "t"), ("Ġc", "at"), ("Ġ", "s"), ("Ã", "©")]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("align")
    return build_tokenizer(root / "bytes"), build_bpe_tokenizer(root / "bpe", merges=MERGES)


def test_spans_by_hand(pair):
    student, teacher = pair
    s_ids = student(TEXT, add_special_tokens=False)["input_ids"]
    t_ids = teacher(TEXT, add_special_tokens=False)["input_ids"]
    assert len(s_ids) == 18
    assert teacher.convert_ids_to_tokens(t_ids) == ["the", "Ġcat", "Ġs", "at", ".", "Ġc", "a", "f", "Ã©"]
    assert char_ends(student, s_ids, TEXT) == list(range(1, 17)) + [None, 17]
    assert char_ends(teacher, t_ids, TEXT) == [3, 7, 9, 11, 12, 14, 15, 16, 17]
    expected = [(0, 3, 0, 1), (3, 7, 1, 2), (7, 9, 2, 3), (9, 11, 3, 4), (11, 12, 4, 5), (12, 14, 5, 6),
                (14, 15, 6, 7), (15, 16, 7, 8), (16, 18, 8, 9)]
    aligned = CrossTokenizers(student, teacher).align(s_ids + [student.eos_token_id])
    assert aligned.exact
    assert aligned.teacher_ids == t_ids + [teacher.eos_token_id]
    assert aligned.spans == expected + [(18, 19, 9, 10)]


def test_mapped_ids_exact(pair):
    student, teacher = pair
    table = VocabMap.build(student, teacher)
    t2s = table.teacher_to_student
    # Teacher ids: the 4 specials, then the 256 byte characters in the student's order, then merges;
    # the student's: the 256 bytes, then the 4 specials. Every ASCII byte is the same text on both
    # sides: teacher id 4 + s is student id s. A lone byte of a multi-byte character (128-255) is no
    # text at all on either side, and a merge ("the", " cat", "é") is a text only the teacher has.
    for b, ch in byte_chars().items():
        s_id = student.convert_tokens_to_ids(ch)
        assert teacher.convert_tokens_to_ids(ch) == 4 + s_id
        assert t2s[4 + s_id] == (s_id if b < 128 else -1), (b, ch)
    for merged in ("the", "Ġcat", "Ġs", "at", "Ã©", "Ġc", "th"):
        assert t2s[teacher.convert_tokens_to_ids(merged)] == -1
    assert t2s[teacher.eos_token_id] == student.eos_token_id            # the end is the end on both sides
    assert t2s[teacher.convert_tokens_to_ids("<|im_start|>")] == student.convert_tokens_to_ids("<|im_start|>")
    assert int((t2s >= 0).sum()) == 128 + 4
    # match prefix: a merge counts toward the student's first token of its text; "é" has none (its
    # first byte alone is no text), nor a special the student lacks
    first = table.teacher_to_first
    for merged, head in (("the", "t"), ("Ġcat", "Ġ"), ("Ġs", "Ġ"), ("at", "a"), ("th", "t")):
        assert first[teacher.convert_tokens_to_ids(merged)] == student.convert_tokens_to_ids(head)
    assert first[teacher.convert_tokens_to_ids("Ã©")] == -1
    assert bool(((first == t2s) | (t2s < 0)).all())   # the exact table within it
    assert table.unshared(260, "prefix").sum() == 128 and table.unshared(260).sum() == 128
    assert int(table.student_shared.sum()) == 128 + 4
    assert table.unshared(300).sum() == 128 + (300 - 260)              # high bytes + padding rows past 260


def byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte value -> the character a byte-level vocabulary spells it with."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in kept:
            out[b] = chr(b)
        else:
            out[b], extra = chr(256 + extra), extra + 1
    return out


def test_spans_rest_and_disagreeing_ends():
    # ends that never meet after the first: the rest is one span; a side with nothing left joins the last
    assert spans([1, 2, 4], [1, 3]) == [(0, 1, 0, 1), (1, 3, 1, 2)]
    assert spans([2, 4], [2, 4, 4]) == [(0, 1, 0, 1), (1, 2, 1, 3)]
    assert spans([None, 2], [2]) == [(0, 2, 0, 1)]


def test_answer_rows_back_on_student_rows(pair):
    """A teacher's answer over its 10 rows lands on the student's 19: a span's first student row
    points at the teacher row that starts it, the span's teacher log-prob is the sum of its rows',
    and the mapped ids are the student's ids of the teacher's top k."""
    student, teacher = pair
    cross = CrossTokenizers(student, teacher)
    s_ids = student(TEXT, add_special_tokens=False)["input_ids"] + [student.eos_token_id]
    prompt_s, prompt_t = [1, 2, 3], [5, 6]
    sent = {}

    def submit(seqs, starts):
        sent["seqs"], sent["starts"] = seqs, starts
        n = len(seqs[0]) - starts[0]
        f = Future()
        ids = torch.tensor([[teacher.convert_tokens_to_ids("a"), teacher.convert_tokens_to_ids("the")]] * n, dtype=torch.int32)
        f.set_result(TopKResult(ids=ids, logprobs=torch.full((n, 2), -1.0), tail_logmass=torch.full((n,), -0.5),
                                token_logprob=-torch.arange(1, n + 1, dtype=torch.float32), lse=torch.zeros(n),
                                row_offsets=[0, n]))
        return f

    ans = cross.request(submit, [prompt_s + s_ids], [3], [prompt_t]).result()
    t_ids = teacher(TEXT, add_special_tokens=False)["input_ids"] + [teacher.eos_token_id]
    assert sent["seqs"] == [prompt_t + t_ids] and sent["starts"] == [2]
    assert ans.row_offsets == [0, 19]
    assert ans.start_row.tolist() == [0, -1, -1, 1, -1, -1, -1, 2, -1, 3, -1, 4, 5, -1, 6, 7, 8, -1, 9]
    assert ans.span_of.tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 4, 5, 5, 6, 7, 8, 8, 9]
    assert ans.span_teacher_lp.tolist() == [-float(k) for k in range(1, 11)]   # one teacher token per span
    assert float(ans.token_logprob.sum()) == -55.0
    a, t = student.convert_tokens_to_ids("a"), student.convert_tokens_to_ids("t")
    assert ans.mapped[0].tolist() == [a, t]   # match prefix (the default): "the" counts toward "t"
    exact = CrossTokenizers(student, teacher, match="exact").request(submit, [prompt_s + s_ids], [3], [prompt_t])
    assert exact.result().mapped[0].tolist() == [a, -1]
    with pytest.raises(ValueError, match="contexts"):
        cross.request(submit, [prompt_s + s_ids], [3], None)


def test_empty_and_eos_only_responses(pair):
    student, teacher = pair
    cross = CrossTokenizers(student, teacher)
    only_eos = cross.align([student.eos_token_id])
    assert only_eos.teacher_ids == [teacher.eos_token_id] and only_eos.spans == [(0, 1, 0, 1)]
    assert cross.align([]).spans == [] and cross.align([]).teacher_ids == []


def test_teacher_answering_other_rows_is_an_error(pair):
    student, teacher = pair
    cross = CrossTokenizers(student, teacher)
    aligned = cross.align(student("the cat", add_special_tokens=False)["input_ids"])
    n = len(aligned.teacher_ids) + 1
    r = TopKResult(ids=torch.zeros(n, 1, dtype=torch.int32), logprobs=torch.zeros(n, 1), tail_logmass=torch.zeros(n),
                   token_logprob=torch.zeros(n), lse=torch.zeros(n), row_offsets=[0, n])
    with pytest.raises(TrainError, match="answered 3 rows for a response of 2 teacher tokens"):
        cross.answer(r, [aligned], [7], 0.0)


def test_piecewise_ends_equal_whole_prefix_decoding(pair, tmp_path):
    """char_ends decodes piece by piece from the last clean end (O(tokens)); it must give what
    decoding every prefix whole gives, for byte-level, BPE and SentencePiece-style (Metaspace:
    a word's leading space is dropped at the start of a decoding) tokenizers, on text with
    multi-byte characters and on random bytes (invalid UTF-8)."""
    student, teacher = pair
    corpus = ["the cat sat on the mat. café crème brûlée, naïve coöperation 42 + 17 = 59"] * 20
    sp = Tokenizer(models.BPE(unk_token="<unk>"))
    sp.pre_tokenizer, sp.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    sp.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False))
    sentencepiece = PreTrainedTokenizerFast(tokenizer_object=sp, unk_token="<unk>")
    learned = build_bpe_tokenizer(tmp_path / "learned", corpus=corpus, vocab_size=330)
    for tok in (student, teacher, learned, sentencepiece):
        for text in (corpus[0], TEXT, "  two  spaces\nand a newline", "é"):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            decoded = tok.decode(ids, clean_up_tokenization_spaces=False)
            assert char_ends(tok, ids, decoded) == prefix_ends(tok, ids, decoded), (text, tok.convert_ids_to_tokens(ids))
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(256) for _ in range(40)]
        decoded = student.decode(ids, clean_up_tokenization_spaces=False)
        assert char_ends(student, ids, decoded) == prefix_ends(student, ids, decoded), ids
