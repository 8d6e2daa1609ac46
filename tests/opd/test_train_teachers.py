"""opd/train_teachers.py: what a full-mode run's teacher logits can take, refused before any compute."""

from __future__ import annotations

import pytest

from opd.config import from_dict
from opd.train_config import TrainConfig
from opd.train_teachers import TrainError, check_full_memory, full_logits_bytes


def _cfg(**rollout) -> TrainConfig:
    return from_dict({"student": {"path": "s"}, "merge": {"teachers": [{"name": "t", "address": "tcp://h:1",
                                                                         "mode": "full"}],
                                                        "datasets": [{"domain": "d", "path": "x.jsonl"}]},
                      "rollout": {"prompts_per_step": 8, "samples_per_prompt": 2, "max_new_tokens": 64, **rollout},
                      "loss": {"full_dtype": "bfloat16"}}, TrainConfig)


def test_full_logits_bytes_counts_rows_vocab_dtype_and_the_pipelined_batch():
    cfg = _cfg()
    assert cfg.run.pipeline                                       # the default: two batches alive
    assert full_logits_bytes(cfg, 152064) == 8 * 2 * 64 * 152064 * 2 * 2
    from dataclasses import replace
    one = replace(cfg, run=replace(cfg.run, pipeline=False), loss=replace(cfg.loss, full_dtype="float32"))
    assert full_logits_bytes(one, 152064) == 8 * 2 * 64 * 152064 * 4


def test_check_full_memory_refuses_what_cannot_fit_and_notes_what_is_close():
    cfg = _cfg(max_new_tokens=1500, prompts_per_step=64, samples_per_prompt=4)   # a real batch
    need = full_logits_bytes(cfg, 152064)                                         # 217.5 GiB
    assert check_full_memory(cfg, 152064, None) is None                           # unknown: no check
    assert check_full_memory(cfg, 152064, 2 * need) is None
    note = check_full_memory(cfg, 152064, need + 1)
    assert "217.5 GiB of teacher logits" in note and "over half" in note
    with pytest.raises(TrainError, match=r"217\.5 GiB .* 24\.0 GiB available; use mode: topk"):
        check_full_memory(cfg, 152064, 24 << 30)
