"""opd/train_teachers.py: full-mode answers read as they stream in, and what they can take in
memory, refused before any compute when it cannot fit."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from opd.config import from_dict
from opd.teachers.client import FullChunk, TeacherError
from opd.teachers.protocol import default_chunk_rows
from opd.distill.config import TrainConfig
from opd.distill.memory import check_full_memory, full_logits_bytes
from opd.teachers.session import FULL_WINDOW, RowStream, TrainError


def _chunks(logits: torch.Tensor, rows_per_chunk: int, seen: list, *, skip: int = 0, extra: bool = False):
    """A teacher's stream: CHUNKs of consecutive rows; `seen` records each one sent."""
    for a in range(skip, len(logits), rows_per_chunk):
        seen.append(a)
        part = logits[a:a + rows_per_chunk]
        yield FullChunk(a, part, torch.zeros(len(part)), part[:, 0].clone())
    if extra:
        yield FullChunk(len(logits), logits[:1], torch.zeros(1), torch.zeros(1))


def _stream(logits, rows_per_chunk=3, **kw):
    seen = []
    fail = lambda e: TrainError(f"wrapped {e.code}")   # noqa: E731
    return RowStream(lambda: _chunks(logits, rows_per_chunk, seen, **kw), len(logits), fail, 0.0), seen


def test_rows_come_in_order_and_only_a_micro_batch_is_held():
    logits = torch.randn(20, 7)
    s, seen = _stream(logits)
    assert s.shape == (20, 7) and seen == [0]               # the vocabulary from the first chunk
    for a in range(0, 20, 5):                                # micro-batches of 5 rows, two reads each
        idx = torch.tensor([a, a + 1, a + 3])
        assert torch.equal(s[idx], logits[idx]) and torch.equal(s[idx], logits[idx])
        block = s[torch.arange(a, a + 5)]
        assert torch.equal(block, logits[a:a + 5])
        assert s[torch.arange(a, a + 5)].data_ptr() == block.data_ptr()   # read again: not gathered again
    assert s.peak_rows <= 5 + 3                              # never the 20 rows: a micro-batch and a chunk
    assert torch.equal(s.token_logprob, logits[:, 0])
    with pytest.raises(IndexError, match="below 15 are gone"):
        s[torch.tensor([3])]
    assert s.finish() >= 0 and seen == list(range(0, 20, 3))


def test_finish_drains_rows_nobody_read_and_checks_the_count():
    logits = torch.randn(10, 4)
    s, seen = _stream(logits)
    s[torch.tensor([1])]
    s.finish()
    assert seen == [0, 3, 6, 9] and torch.equal(s.token_logprob, logits[:, 0])
    with pytest.raises(TrainError, match="ended after 7 of 10 rows"):
        RowStream(lambda: [FullChunk(0, logits[:7], torch.zeros(7), torch.zeros(7))], 10, None, 0.0).finish()
    with pytest.raises(TrainError, match="more than the 10 rows"):
        _stream(logits, extra=True)[0].finish()
    with pytest.raises(TrainError, match=r"rows 3\.\.6 after 0 of 10"):
        _stream(logits, skip=3)[0][torch.tensor([0])]


def test_a_teacher_error_comes_out_as_the_trainers_error():
    def failing():
        yield FullChunk(0, torch.zeros(2, 3), torch.zeros(2), torch.zeros(2))
        raise TeacherError("TIMEOUT", "no answer")
    s = RowStream(failing, 4, lambda e: TrainError(f"teacher 't' failed: {e}"), 0.0)
    assert s[torch.tensor([0, 1])].shape == (2, 3)
    with pytest.raises(TrainError, match="teacher 't' failed: TIMEOUT: no answer"):
        s[torch.tensor([3])]


def _cfg(**over) -> TrainConfig:
    d = {"student": {"path": "s"}, "merge": {"teachers": [{"name": "t", "address": "tcp://h:1", "mode": "full"}],
                                             "datasets": [{"domain": "d", "path": "x.jsonl"}]},
         "rollout": {"prompts_per_step": 64, "samples_per_prompt": 4, "max_new_tokens": 1500},
         "optim": {"micro_batch_size": 8}, "loss": {"full_dtype": "bfloat16"}}
    for k, v in over.items():
        d[k].update(v)
    return from_dict(d, TrainConfig)


def test_full_logits_bytes_is_a_micro_batch_and_the_chunks_in_flight():
    cfg, v = _cfg(), 152064
    chunk = default_chunk_rows(v, "bfloat16") * v * 2                        # ~64 MiB
    assert cfg.run.pipeline                                                   # two streams per teacher
    assert full_logits_bytes(cfg, v) == 8 * 1500 * v * (2 + 2 + 4) + 2 * (FULL_WINDOW + 1) * chunk
    one = replace(cfg, run=replace(cfg.run, pipeline=False), loss=replace(cfg.loss, full_dtype="float32"))
    chunk32 = default_chunk_rows(v, "float32") * v * 4
    assert full_logits_bytes(one, v, teachers=3) == 8 * 1500 * v * (4 + 4) + 3 * (FULL_WINDOW + 1) * chunk32  # no cast
    small = _cfg(rollout={"prompts_per_step": 2, "samples_per_prompt": 1})  # fewer sequences than a micro-batch
    assert full_logits_bytes(small, v) == 2 * 1500 * v * 8 + 2 * (FULL_WINDOW + 1) * chunk
    # A trajectory's rows: its turns' limits (3 x 1500) within agent.max_tokens (4000), not one turn's.
    from opd.agent.config import AgentConfig, ToolSpec
    agentic = replace(cfg, agent=AgentConfig(tools=[ToolSpec("calculator")], max_turns=3, max_tokens=4000))
    assert full_logits_bytes(agentic, v) == 8 * 4000 * v * (2 + 2 + 4) + 2 * (FULL_WINDOW + 1) * chunk


def test_check_full_memory_refuses_what_cannot_fit_and_notes_what_is_close():
    cfg = _cfg()
    need = full_logits_bytes(cfg, 152064)                                     # 14.2 GiB
    assert check_full_memory(cfg, 152064, None) is None                       # unknown: no check
    assert check_full_memory(cfg, 152064, 2 * need) is None
    note = check_full_memory(cfg, 152064, need + 1)
    assert "up to 14.2 GiB of teacher logits (optim.micro_batch_size 8 x rollout.max_new_tokens 1500" in note
    assert "over half" in note
    with pytest.raises(TrainError, match=r"14\.2 GiB .* 8\.0 GiB available; use mode: topk, a smaller "
                                         r"optim.micro_batch_size"):
        check_full_memory(cfg, 152064, 8 << 30)


class _FakeClient:
    """score_full records when each request went out and streams rows of a known tensor."""

    def __init__(self):
        self.sent: list[int] = []          # number of sequences of each request, in sending order

    def score_full(self, sequences, starts, **kw):
        self.sent.append(len(sequences))
        rows = sum(len(s) - st for s, st in zip(sequences, starts))
        return _chunks(torch.arange(rows * 2.0).reshape(rows, 2), 3, [])


def test_a_stream_that_would_overflow_the_teachers_budget_waits_for_the_open_ones():
    from types import SimpleNamespace

    from opd.teachers.session import TeacherSet

    ts = object.__new__(TeacherSet)                 # the request logic alone, no connections
    client = _FakeClient()
    welcome = SimpleNamespace(max_tokens_per_request=100, max_inflight_tokens=30)
    ts.full_dtype = _cfg().loss.full_dtype
    ts.specs = {"t": SimpleNamespace(mode="full", temperature=1.0)}
    ts.clients = {"t": (client, welcome)}
    ts._open_tokens = {"t": 0}
    ts.vocab_limit = {}
    first = ts.request("t", [[1] * 10, [1] * 10], [5, 5]).result()     # 20 tokens: sent at once
    second = ts.request("t", [[1] * 12], [2]).result()                 # 20 + 12 > 30: waits
    assert client.sent == [2]
    assert torch.equal(first.logits[torch.arange(0, 10)], torch.arange(20.0).reshape(10, 2))
    assert client.sent == [2] and ts._open_tokens["t"] == 20
    TeacherSet.finish({"t": first})                                    # ended: its 20 tokens are free
    assert ts._open_tokens["t"] == 0
    assert second.logits[torch.tensor([9])].tolist() == [[18.0, 19.0]] and client.sent == [2, 1]
    TeacherSet.finish({"t": second})
    assert ts._open_tokens["t"] == 0 and second.latency_s >= 0


def test_vocab_limits_are_asked_of_servers_that_answer_them(tiny_model_dir):
    """A teacher head padded past the student's 260 rows is asked for the first 260 by hf servers
    from protocol 2.2 and vLLM servers from 2.3; older servers are named in the card instead."""
    from types import SimpleNamespace

    from opd.teachers.session import _vocab_limits

    welcomes = {"hf22": ("hf", (2, 2), 300), "vllm22": ("vllm", (2, 2), 300), "vllm23": ("vllm", (2, 3), 300),
                "hf21": ("hf", (2, 1), 300), "same": ("vllm", (2, 3), 260)}
    welcome = {n: SimpleNamespace(backend=b, version=v, vocab_size=rows) for n, (b, v, rows) in welcomes.items()}
    limits, notes = _vocab_limits(dict.fromkeys(welcomes), welcome.__getitem__, str(tiny_model_dir))
    assert limits == {"hf22": 260, "vllm23": 260}
    assert len(notes) == 4 and sum("cannot leave out the rest" in n for n in notes) == 2
    assert any("'vllm22'" in n and "vllm server (protocol (2, 2))" in n for n in notes)
