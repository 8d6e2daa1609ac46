"""`opd train` end to end against a real `opd serve-teacher` process on tiny models.

The teacher is the student with a rank-4 change of its LM head (logit changes of about
2 nats), so their distributions differ clearly while staying reachable for full
fine-tuning and for a LoRA adapter. Every run is a few seconds: 4 prompts per step,
responses of at most 12 tokens.
"""

import json
import math
import os
import shutil
from concurrent.futures import Future
from dataclasses import replace

import pytest
import torch

from opd.checkpoint import CheckpointError, latest_checkpoint
from opd.config import from_dict
from opd.data import write_jsonl
from opd.metrics import read_metrics
from opd.tiny import lm_head_teacher
from opd.distill.config import TrainConfig
from opd.distill.trainer import Trainer, TrainError

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    from opd.teachers.launch import start_server_process

    root = tmp_path_factory.mktemp("opd_train")
    teacher = lm_head_teacher(tiny_model_dir, root / "teacher")
    write_jsonl(root / "train.jsonl", [{"prompt": f"q{i}: what is {i}+{i}?"} for i in range(16)])
    write_jsonl(root / "eval.jsonl", [{"prompt": f"q{i}: what is {i}+{i}?", "answer": str(2 * i)} for i in range(100, 108)])
    write_jsonl(root / "sft.jsonl", [{"prompt": f"say {i}", "response": f"{i}"} for i in range(4)])
    server = start_server_process(["--model", str(teacher), "--max-k", "16", "--name", "t"])
    try:
        yield {"root": root, "student": tiny_model_dir, "address": server.address, "server": server}
    finally:
        server.stop()


def _cfg(s, name, *, mode="topk", lora=False, lr=3e-3, steps=20, **over):
    d = {
        "student": {"path": str(s["student"]),
                    # The teacher differs in its LM head, so that is where the adapter goes.
                    **({"lora": {"rank": 8, "alpha": 32, "target_modules": ["lm_head"]}} if lora else {})},
        "merge": {"teachers": [{"name": "t", "address": s["address"], "mode": mode, "k": 8}],
                  "datasets": [{"domain": "gen", "path": str(s["root"] / "train.jsonl"),
                                "eval_path": str(s["root"] / "eval.jsonl")}]},
        "rollout": {"prompts_per_step": 4, "max_new_tokens": 12},
        "optim": {"lr": lr, "micro_batch_size": 4},
        "teacher_client": {"connect_timeout_s": 5.0},
        "run": {"steps": steps, "out_dir": str(s["root"] / name), "progress": False, "tensorboard": False},
    }
    for path, value in over.items():  # "run.pipeline": False
        node = d
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return from_dict(d, TrainConfig)


@pytest.mark.parametrize("lora,mode,lr,steps,prompts", [
    (False, "topk", 3e-3, 28, 8),
    (True, "topk", 3e-2, 16, 4),
    (False, "full", 5e-3, 80, 8),
    (True, "full", 3e-2, 20, 4),
], ids=["full_ft-topk", "lora-topk", "full_ft-full", "lora-full"])
def test_heldout_kl_halves(setup, lora, mode, lr, steps, prompts):
    cfg = _cfg(setup, f"kl_{lora}_{mode}", mode=mode, lora=lora, lr=lr, steps=steps,
               **{"rollout.prompts_per_step": prompts})
    result = Trainer(cfg).run()
    first, last = result["evals"][0]["eval/kl"], result["evals"][-1]["eval/kl"]
    assert first > 0.5, first                      # the teacher really differs
    assert last <= 0.5 * first, (first, last)

    out = setup["root"] / f"kl_{lora}_{mode}"
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["staleness"] == (0 if r["step"] == 1 else 1) for r in rows)   # pipelined: one step old
    assert all(r["tokens_per_s"] > 0 and r["teacher_latency_s"] > 0 for r in rows)
    assert 0 <= rows[-1]["diag/gen/topk_overlap"] <= 1 and "diag/gen/eos_rate" in rows[-1]
    # The in-run signals: the sampled tokens' mean surprise, the divergence from the response's start.
    assert rows[-1]["entropy"] > 0 and rows[-1]["diag/gen/kl@0-15"] > 0
    assert rows[-1].get("diag/gen/teacher_entropy", 0) > 0 if mode == "topk" else "diag/gen/teacher_entropy" not in rows[-1]
    assert result["evals"][-1]["eval/gen/kl@0-15"] > 0
    dump = (out / "samples" / f"step_{steps:06d}.md").read_text()   # the last evaluation's answers, to read
    assert dump.startswith(f"# Held-out answers at step {steps}") and dump.count("\nprompt:") == 4
    card = json.loads((out / "card.json").read_text())
    assert card["teacher t"]["model_fingerprint"] == setup["server"].model_fingerprint
    assert card["teacher t"]["divergence"].startswith("forward KL")
    if mode == "topk":
        assert 0 < card["teacher t"]["mean_teacher_tail_mass"] < 1
    assert "mean 0.9" in card["trajectories"]["staleness"]
    assert (out / "plots" / "kl.png").is_file() and (out / "card.md").is_file()
    assert 0 <= result["evals"][-1]["eval/accuracy"] <= 1          # math verifier on `answer`
    assert (out / "plots" / "eval_accuracy.png").is_file()
    ckpt = out / "checkpoints" / f"step_{steps:06d}"
    if lora:   # the adapter alone
        assert (ckpt / "model" / "adapter_config.json").is_file()
    # RUN/model: a plain loadable model (LoRA merged) equal to the last checkpoint's weights.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = AutoModelForCausalLM.from_pretrained(str(out / "model"), dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(str(out / "model")).eos_token_id is not None
    if lora:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(cfg.student.path, dtype=torch.float32)
        last = PeftModel.from_pretrained(base, str(ckpt / "model"))
    else:
        last = AutoModelForCausalLM.from_pretrained(str(ckpt / "model"), dtype=torch.float32)
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        assert torch.allclose(final(ids).logits, last(ids).logits, atol=1e-4)


def test_resume_continues_exactly(setup):
    root = setup["root"]
    full = _cfg(setup, "resume_full", steps=4, **{"run.checkpoint_every": 2})
    whole = Trainer(full).run()
    part = _cfg(setup, "resume_part", steps=2)
    Trainer(part).run()
    resumed = Trainer(replace(part, run=replace(part.run, steps=4)), resume=True).run()
    a = {r["step"]: r["loss"] for r in read_metrics(root / "resume_full" / "metrics.jsonl") if "loss" in r}
    b = {r["step"]: r["loss"] for r in read_metrics(root / "resume_part" / "metrics.jsonl") if "loss" in r}
    assert sorted(b) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert abs(a[step] - b[step]) <= 1e-6, (step, a[step], b[step])
    # The card keeps the history from before the resume: the held-out KL before training, and
    # the teacher's tail mass over all rows trained on (each run read the same rows).
    assert [e["step"] for e in resumed["evals"]] == [0, 2, 4]
    assert resumed["evals"][0]["eval/kl"] == pytest.approx(whole["evals"][0]["eval/kl"], abs=1e-6)
    cards = [json.loads((root / name / "card.json").read_text()) for name in ("resume_full", "resume_part")]
    assert cards[1]["run"]["eval_kl_first"] == pytest.approx(cards[0]["run"]["eval_kl_first"], abs=1e-6)
    tails = [c["teacher t"]["mean_teacher_tail_mass"] for c in cards]
    assert 0 < tails[0] < 1 and tails[1] == pytest.approx(tails[0], rel=1e-5)


def test_fused_and_micro_batches_give_the_same_loss(setup):
    """The same two steps with logits in one micro-batch and fused linear in four: same losses."""
    losses = []
    for i, (fused, mb) in enumerate([(False, 4), (True, 1)]):
        cfg = _cfg(setup, f"fused_{i}", steps=2, **{"loss.fused_linear": fused, "optim.micro_batch_size": mb,
                                                   "run.pipeline": False, "run.eval_prompts": 1})
        Trainer(cfg).run()
        losses.append([r["loss"] for r in read_metrics(setup["root"] / f"fused_{i}" / "metrics.jsonl") if "loss" in r])
    for other in losses[1:]:
        assert other == pytest.approx(losses[0], rel=1e-4, abs=1e-6)


def test_fused_loss_with_a_lora_adapter_on_the_lm_head_is_refused(setup):
    # The fused loss sees hidden @ lm_head.weight.T: the adapter would get no gradient at all.
    cfg = _cfg(setup, "fused_lora_head", lora=True, steps=1, **{"loss.fused_linear": True})
    with pytest.raises(TrainError, match="loss.fused_linear: student .* a LoRA adapter on it"):
        Trainer(cfg).run()
    assert not (setup["root"] / "fused_lora_head" / "metrics.jsonl").exists()


def test_full_mode_evaluates_mid_run_against_a_tight_teacher_budget(setup, monkeypatch):
    # With pipelining, the look-ahead's full-vocabulary stream stays open (holding its tokens
    # in the server's budget) until the next step reads it. An evaluation in between needs the
    # budget too: before, its request met BUSY until teacher_client.timeout_s and the run died.
    from opd.teachers import streams as client_module   # score_full's half of the client
    from opd.teachers.launch import start_server_process

    monkeypatch.setattr(client_module, "default_chunk_rows", lambda vocab, dtype: 2)   # as at V = 152k
    server = start_server_process(["--model", str(setup["root"] / "teacher"), "--max-k", "16", "--name", "t",
                                   "--max-tokens-per-request", "64", "--max-inflight-tokens", "64"])
    try:
        cfg = _cfg(setup, "full_tight", mode="full", steps=3, **{
            "merge.teachers": [{"name": "t", "address": server.address, "mode": "full"}],
            "run.eval_every": 1, "run.eval_prompts": 2, "teacher_client.timeout_s": 3.0})
        result = Trainer(cfg).run()
    finally:
        server.stop()
    assert [e["step"] for e in result["evals"]] == [0, 1, 2, 3]
    rows = [r for r in read_metrics(setup["root"] / "full_tight" / "metrics.jsonl") if "loss" in r]
    assert [r["staleness"] for r in rows] == [0, 1, 1]                # still pipelined


def test_full_mode_in_bfloat16_scores_like_float32(setup):
    """loss.full_dtype bfloat16 (half the bytes on the wire and in memory): the first step's
    loss (same rollouts: same seed, no update yet) within bf16's rounding of the fp32 run's,
    and not equal to it, so the rows really travelled in bf16."""
    first = {}
    for dt in ("float32", "bfloat16"):
        cfg = _cfg(setup, f"full_{dt}", mode="full", steps=1, **{"loss.full_dtype": dt, "run.pipeline": False,
                                                                 "run.eval_prompts": 1})
        Trainer(cfg).run()
        out = setup["root"] / f"full_{dt}"
        [row] = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
        first[dt] = row["loss"]
        assert f"({dt} logits)" in json.loads((out / "card.json").read_text())["teacher t"]["scoring"]
    assert first["bfloat16"] == pytest.approx(first["float32"], rel=5e-3)   # measured: 1.2467 against 1.24682
    assert first["bfloat16"] != first["float32"]


def test_sampled_mode_sft_mix_and_accumulation_run(setup):
    cfg = _cfg(setup, "sampled", mode="sampled", steps=2, **{
        "merge.sft": {"path": str(setup["root"] / "sft.jsonl"), "lambda_sft": 0.5, "batch_size": 2},
        "optim.grad_accum": 2, "optim.schedule": "cosine", "optim.warmup_steps": 2,
        "loss.length_norm": "sequence", "run.pipeline": False})
    Trainer(cfg).run()
    rows = [r for r in read_metrics(setup["root"] / "sampled" / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 2 and all("sft_loss" in r and r["sft_loss"] > 0 for r in rows)
    assert [r["lr"] for r in rows] == pytest.approx([1.5e-3, 3e-3])   # the rates the steps used (warm-up)
    assert all(r["staleness"] == 0 for r in rows)      # not pipelined: always the current weights
    card = json.loads((setup["root"] / "sampled" / "card.json").read_text())
    assert "lambda_sft=0.5" in card["objective"]["sft_mix"]
    # Sampled mode trains reverse KL whatever `beta` (default 0) says; the card said forward KL.
    assert card["teacher t"]["divergence"].startswith("reverse KL") and card["teacher t"]["beta"] == 1.0


def test_the_share_trimmed_after_the_answer_is_measured_per_step_and_for_the_run(setup):
    # Only the mode was reported: how much of what the student sampled was cut went unsaid.
    import re

    cfg = _cfg(setup, "trimmed", steps=3, **{"loss.trim": "marker", "loss.answer_end_marker": "1"})
    trainer = Trainer(cfg)
    # The tiny random student seldom writes the marker; an answer "ending" after 5 tokens
    # makes the counts certain (the cut itself: tests/spine/test_rows.py).
    trainer.trim = lambda response: min(len(response), 5)
    trainer.run()
    rows = [r for r in read_metrics(setup["root"] / "trimmed" / "metrics.jsonl") if "loss" in r]
    sampled = [round(r["response_len"] * cfg.rollout.prompts_per_step) for r in rows]   # 1 sample per prompt
    assert [r["trimmed_share"] for r in rows] == pytest.approx([1 - r["tokens"] / n for r, n in zip(rows, sampled)])
    trimmed = sum(n - r["tokens"] for r, n in zip(rows, sampled))
    assert 0 < trimmed < sum(sampled)
    card = json.loads((setup["root"] / "trimmed" / "card.json").read_text())["trajectories"]["trimming"]
    share, total = re.search(r"; ([\d.]+)% of the (\d+) response tokens sampled were trimmed", card).groups()
    assert card.startswith("marker (marker '1')") and int(total) == sum(sampled)
    assert float(share) == pytest.approx(100 * trimmed / sum(sampled), abs=0.05)


def test_eval_accuracy_counts_fully_correct_answers_and_the_score_is_its_own_metric(setup):
    # eval/accuracy was the mean verifier score: a code answer passing 1 of 3 tests counted 1/3.
    trainer = Trainer(_cfg(setup, "accuracy", steps=1, **{"run.eval_prompts": 4}))
    scores = [1.0, 1 / 3, 0.0, 1.0]
    trainer.setup()
    trainer.verify = lambda samples, texts: scores[:len(texts)]
    try:
        trainer.evaluate()
    finally:
        trainer.close()
    row = trainer.history.evals[-1]
    assert row["eval/accuracy"] == pytest.approx(0.5) and row["eval/verifier_score"] == pytest.approx(7 / 12)
    assert row["eval/accuracy/gen"] == pytest.approx(0.5)


@pytest.mark.parametrize("mode", ["topk", "full"])
def test_a_teacher_with_a_larger_padded_head_scores_over_the_students_rows(setup, tmp_path, mode):
    # Same tokenizer, LM head padded to 300 rows against the student's 260: top-k answers named
    # padding rows (the kernels refuse those ids, mid-run) and full answers were 300 wide.
    from opd.teachers.hf_backend import HFBackend
    from opd.teachers.server import serving_in_thread
    from opd.tiny import build_tiny_model

    padded = build_tiny_model(tmp_path / "padded", vocab_size=300, init_std=0.5, seed=4)
    with serving_in_thread(HFBackend(padded, name="t", max_k=16)) as server:
        teacher = {"name": "t", "address": server.address, "mode": mode, "k": 8}
        out = root = setup["root"] / f"padded_{mode}"
        Trainer(_cfg(setup, f"padded_{mode}", mode=mode, steps=2, **{"merge.teachers": [teacher],
                                                                    "loss.fused_linear": mode == "full"})).run()
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    warnings = json.loads((root / "card.json").read_text())["run"]["warnings"]
    assert "teacher 't' has 300 LM-head rows, the student 260: it scores over the first 260 (the rest are " \
           "padding)" in warnings


def test_the_teacher_prefills_each_prompt_while_the_student_samples(setup):
    # Protocol 2.6: the trainer announces a batch's prompts before its rollout; the teacher's
    # SCORE then reads every prompt from its cache, and answers as a teacher without one.
    from opd.teachers.hf_backend import HFBackend
    from opd.teachers.server import serving_in_thread

    teacher_dir = setup["root"] / "teacher"
    losses = {}
    for tokens in (0, 4096):
        backend = HFBackend(teacher_dir, name="t", max_k=16, prompt_cache_tokens=tokens)
        grown = []   # per announced sequence, its tokens past the prompt

        def recorded(reqs, prefill=backend.prefill):
            grown.extend(len(r.sequence(b)) - r.response_starts[b] for r in reqs for b in range(r.num_sequences))
            return prefill(reqs)
        backend.prefill = recorded
        with serving_in_thread(backend) as server:
            teacher = {"name": "t", "address": server.address, "mode": "topk", "k": 8}
            out = setup["root"] / f"prefill_{tokens}"
            Trainer(_cfg(setup, f"prefill_{tokens}", steps=2, **{"merge.teachers": [teacher],
                                                                 "rollout.samples_per_prompt": 2,
                                                                 "run.pipeline": False})).run()
        losses[tokens] = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
        if tokens:   # 2 steps x 4 prompts x 2 samples, and 2 evaluations of 8: each prompt before its SCORE
            assert (backend.prompt_cache.hits, backend.prompt_cache.misses) == (2 * 4 * 2 + 2 * 8, 0)
            # ... and each response as it grew (12 new tokens: announced at 3, 6 and 9)
            assert {3, 6, 9} <= set(grown) and 0 in grown
            # Each SCORE consumed the entries of what it scored: none is left to hold memory.
            assert len(backend.prompt_cache) == 0
    assert losses[4096][0] == pytest.approx(losses[0][0], rel=1e-5, abs=1e-6)


@pytest.mark.vllm
@pytest.mark.slow   # ~37 s: in make test-all (the suite's 20-min budget); the hf case above stays in make test
def test_a_vllm_teacher_with_a_larger_padded_head_scores_over_the_students_rows(setup, tmp_path):
    # The same with a vLLM teacher, which refused vocab_limit before protocol 2.3 (the run then
    # stopped at the first answer naming a padding row). Its own engine: ~20 s.
    from opd.teachers.server import serving_in_thread
    from opd.teachers.vllm_backend import VLLMBackend
    from opd.tiny import build_tiny_model

    padded = build_tiny_model(tmp_path / "padded", vocab_size=300, init_std=0.5, seed=4)
    backend = VLLMBackend(padded, name="t", max_k=16, max_positions=256)
    try:
        with serving_in_thread(backend) as server:
            teacher = {"name": "t", "address": server.address, "mode": "topk", "k": 8}
            Trainer(_cfg(setup, "padded_vllm", steps=2, **{"merge.teachers": [teacher]})).run()
        assert backend._head_rows == 260                                 # it was asked for 260 columns
    finally:
        backend.close()
    out = setup["root"] / "padded_vllm"
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    warnings = json.loads((out / "card.json").read_text())["run"]["warnings"]
    assert "teacher 't' has 300 LM-head rows, the student 260: it scores over the first 260 (the rest are " \
           "padding)" in warnings


def test_tokenizer_mismatch_is_refused(setup, tmp_path):
    from transformers import AutoTokenizer

    other = tmp_path / "other_student"
    shutil.copytree(setup["student"], other)
    tok = AutoTokenizer.from_pretrained(str(other))
    tok.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    tok.save_pretrained(str(other))
    cfg = _cfg(setup, "mismatch", steps=1)
    cfg = replace(cfg, student=replace(cfg.student, path=str(other)))
    from opd.fingerprint import tokenizer_fingerprint

    with pytest.raises(TrainError) as e:
        Trainer(cfg).run()
    msg = str(e.value)
    assert setup["server"].tokenizer_fingerprint in msg and tokenizer_fingerprint(tok) in msg
    assert not (setup["root"] / "mismatch" / "metrics.jsonl").exists()   # refused before any compute


def test_unreachable_teacher_is_refused_before_compute(setup, free_tcp_address):
    import time

    cfg = _cfg(setup, "unreachable", steps=1, **{"teacher_client.connect_timeout_s": 1.0})
    dead = free_tcp_address
    cfg = replace(cfg, merge=replace(cfg.merge, teachers=[replace(cfg.merge.teachers[0], address=dead)]))
    t0 = time.monotonic()
    with pytest.raises(TrainError, match=f"teacher 't' at {dead} is unreachable"):
        Trainer(cfg).run()
    assert time.monotonic() - t0 < 30
    assert not (setup["root"] / "unreachable" / "metrics.jsonl").exists()


def test_fork_mode_starts_and_stops_its_teacher(setup, capsys, monkeypatch):
    from opd.teachers import launch

    # In this process (pytest runs threads) the teacher is started as a subprocess, the path a
    # notebook takes; `opd train` forks it (tests/bench/test_step_bench.py runs that path).
    cfg = _cfg(setup, "fork_mode", steps=2, **{"merge.teachers": [{"name": "t", "address": "tcp://127.0.0.1:*",
                                                                      "k": 8}],
                                               "cluster": {"mode": "fork", "teachers": [
                                                   {"name": "t", "model": str(setup["root"] / "teacher"),
                                                    # 4 sequences of ~30 tokens a step: split
                                                    # into requests of at most 64 tokens
                                                    "serve_args": ["--max-k", "16", "--max-tokens-per-request",
                                                                   "64", "--max-inflight-tokens", "64",
                                                                   "--device", "cpu"],
                                                    "gpus": [3]}]}})   # its own GPUs (here seen, not used)
    started = []
    start = launch.start_server_process
    monkeypatch.setattr(launch, "start_server_process", lambda *a, **kw: started.append(start(*a, **kw)) or started[-1])
    trainer = Trainer(cfg)
    trainer.run()
    said = capsys.readouterr().out
    [ready] = [line for line in started[0].output if line.startswith("opd-teacher ready")]
    assert ready.endswith("device=cpu cuda_visible_devices=3") and "GPUs [3]" in said
    assert "teacher 't': not forked (Trainer(fork_teachers=False))" in said
    bound = trainer.cfg.merge.teachers[0].address      # the port the server picked
    assert bound.startswith("tcp://127.0.0.1:") and not bound.endswith("*")
    assert f"teacher 't' serving at {bound}" in said
    pid = int(said.split(f"serving at {bound} (pid ", 1)[1].split(",", 1)[0])
    assert trainer.launched.servers == {} and not os.path.exists(f"/proc/{pid}")   # stopped (and reaped) by the run
    card = json.loads((setup["root"] / "fork_mode" / "card.json").read_text())
    assert bound in json.dumps(card)


def test_fingerprint_change_stops_with_both_names():
    from opd.routing.config import TeacherSpec
    from opd.teachers.client import TeacherError
    from opd.teachers.session import TeacherSet

    teachers = TeacherSet.__new__(TeacherSet)   # no connection: only the answer handling is tested
    teachers.specs = {"t": TeacherSpec(name="t", address="tcp://127.0.0.1:1")}
    fut = Future()
    fut.set_exception(TeacherError("FINGERPRINT_CHANGED", "teacher at tcp://127.0.0.1:1 changed: model aaaa -> bbbb"))
    with pytest.raises(TrainError, match="restarted with a different model.*aaaa -> bbbb"):
        teachers.answers({"t": fut})


def test_probe_measures_student_teacher_gap(setup, capsys):
    from opd.cli import main
    from opd.distill.probe import probe

    prompts = [f"held out {i}" for i in range(4)]
    teacher_dir = setup["root"] / "teacher"
    same = probe(teacher_dir, setup["address"], prompts, k=8, max_new_tokens=8)
    # The teacher probed against itself: no gap at all.
    assert same["topk_overlap"] == pytest.approx(1.0)
    assert abs(same["forward_kl_topk"]) < 1e-4 and abs(same["reverse_kl_sampled"]) < 1e-4
    assert same["verdict"].startswith("compatible")
    # At another sampling temperature the responses do not come from the distribution the
    # sampled estimate scores: it is not reported as one.
    warm = probe(teacher_dir, setup["address"], prompts[:2], k=8, max_new_tokens=4, temperature=0.7)
    assert warm["reverse_kl_sampled"].startswith("n/a: responses sampled at temperature 0.7")
    diff = probe(setup["student"], setup["address"], prompts, k=8, max_new_tokens=8)
    assert diff["forward_kl_topk"] > 0.3 and diff["reverse_kl_sampled"] > 0.3
    assert diff["topk_overlap"] < same["topk_overlap"]
    assert 0 < diff["teacher_tail_mass"] < 1
    out = setup["root"] / "probe.json"
    assert main(["probe", "--student", str(setup["student"]), "--teacher", setup["address"], "--prompts",
                 str(setup["root"] / "eval.jsonl"), "--k", "8", "--max-new-tokens", "8", "--json", str(out)]) == 0
    assert "verdict" in capsys.readouterr().out
    assert json.loads(out.read_text())["k"] == 8


def test_a_run_extended_with_resume_follows_the_new_schedule_from_its_first_new_step(setup):
    # A finished 2-step cosine run ends at lr 0; extended to 4 steps its step 3 must take the
    # 4-step schedule's rate, as steps 4 and on do (it took the old schedule's 0 before).
    import math

    cfg = _cfg(setup, "extend_cosine", lr=1e-2, steps=2, **{"optim.schedule": "cosine"})
    Trainer(cfg).run()
    Trainer(replace(cfg, run=replace(cfg.run, steps=4)), resume=True).run()
    lrs = {r["step"]: r["lr"] for r in read_metrics(setup["root"] / "extend_cosine" / "metrics.jsonl") if "loss" in r}
    cosine4 = [1e-2 * 0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(4)]
    assert [lrs[s] for s in (1, 2)] == pytest.approx([1e-2, 1e-2 * 0.5 * (1 + math.cos(math.pi / 2))])
    assert [lrs[s] for s in (3, 4)] == pytest.approx(cosine4[2:])
    warnings = json.loads((setup["root"] / "extend_cosine" / "card.json").read_text())["run"]["warnings"]
    assert "resumed from step_000002; changed since that checkpoint: run.steps: 2 -> 4" in warnings

    # A key that defines the objective cannot change on resume: the card, one description of
    # the run, said k=4 and reverse KL for steps trained with k=8 and forward KL.
    teacher = replace(cfg.merge.teachers[0], k=4, beta=1.0, address="tcp://127.0.0.1:9")
    moved = replace(cfg, run=replace(cfg.run, steps=5), merge=replace(cfg.merge, teachers=[teacher]))
    with pytest.raises(CheckpointError, match=r"trained with other settings that define the run "
                                              r"\(merge.teachers.t.beta: 0.0 -> 1.0, merge.teachers.t.k: 8 -> 4\)"):
        Trainer(moved, resume=True).run()   # refused before any load; the new address alone is fine


def test_prompts_too_long_for_the_teacher_are_refused_or_left_out_at_load(setup):
    # The teacher (max_positions 512, said in its WELCOME) answered such a prompt's batch with
    # TOO_LONG when it came, which stopped the run there, possibly hours in.
    root = setup["root"]
    write_jsonl(root / "long.jsonl", [{"prompt": f"q{i}: what is {i}+{i}?"} for i in range(6)] + [{"prompt": "x" * 600}])
    datasets = [{"domain": "gen", "path": str(root / "long.jsonl")}]
    said = (r"long.jsonl: 1 of 7 prompts leave no room for rollout.max_new_tokens \(12\) within the positions their "
            r"teacher or the student takes \(first: 'xxxx.*', 600 tokens; teacher 't' takes 512\)")
    with pytest.raises(TrainError, match=said):
        Trainer(_cfg(setup, "too_long", steps=1, **{"merge.datasets": datasets})).run()
    skipping = Trainer(_cfg(setup, "too_long_skip", steps=1, **{"merge.datasets": datasets, "run.on_data_error": "skip"}))
    skipping.run()
    assert [len(s.prompt) < 600 for s in skipping.prompts.datasets["gen"]] == [True] * 6   # left out, not only said
    warnings = json.loads((root / "too_long_skip" / "card.json").read_text())["run"]["warnings"]
    assert any("1 of 7 prompts leave no room" in w and w.endswith("left out") for w in warnings)


def test_each_prompt_is_held_to_the_teacher_it_is_routed_to_and_unrouted_prompts_are_found_at_load(setup):
    # With two teachers of different context lengths, a long prompt of the long teacher's domain
    # was refused by the short teacher's limit, which never sees it.
    from opd.teachers.launch import start_server_process

    root = setup["root"]
    write_jsonl(root / "gen_long.jsonl", [{"prompt": f"q{i}: what is {i}+{i}?"} for i in range(4)] + [{"prompt": "y" * 300}])
    write_jsonl(root / "math_short.jsonl", [{"prompt": f"{i}+{i}="} for i in range(4)])
    with start_server_process(["--model", str(setup["student"]), "--max-k", "16", "--name", "short",
                               "--max-positions", "128"]) as short:
        teachers = [{"name": "t", "address": setup["address"], "k": 8, "domains": ["gen"]},
                    {"name": "short", "address": short.address, "k": 8, "domains": ["math"]}]
        datasets = [{"domain": "gen", "path": str(root / "gen_long.jsonl")},
                    {"domain": "math", "path": str(root / "math_short.jsonl")}]
        rules = [{"kind": "domain_field"}]
        over = {"merge.teachers": teachers, "merge.datasets": datasets, "merge.routing.rules": rules}
        trainer = Trainer(_cfg(setup, "two_limits", steps=1, **over))
        trainer.run()
        prompts = trainer.prompts
        assert len(prompts.datasets["gen"]) == 5 and len(prompts.datasets["math"]) == 4
        assert {prompts.routes[id(s)].domain for s in prompts.datasets["math"]} == {"math"}

        # The same long prompt in the short teacher's domain is refused, naming that teacher.
        write_jsonl(root / "math_long.jsonl", [{"prompt": f"{i}+{i}="} for i in range(4)] + [{"prompt": "y" * 300}])
        over["merge.datasets"] = [datasets[0], {"domain": "math", "path": str(root / "math_long.jsonl")}]
        with pytest.raises(TrainError, match=r"math_long.jsonl: 1 of 5 .*300 tokens; teacher 'short' takes 128\)"):
            Trainer(_cfg(setup, "two_limits_refused", steps=1, **over)).run()

        # A prompt that no rule routes stopped the run when its batch came; now before any step.
        over["merge.datasets"] = datasets
        over["merge.routing.rules"] = [{"kind": "pattern", "patterns": ["^q", "^y"], "teacher": "t"},
                                       {"kind": "pattern", "patterns": ["=$"], "teacher": "short"}]
        write_jsonl(root / "math_short.jsonl", [{"prompt": f"{i}+{i}="} for i in range(4)] + [{"prompt": "hello"}])
        with pytest.raises(TrainError, match=r"math_short.jsonl: no routing rule decided sample .*'hello'"):
            Trainer(_cfg(setup, "unrouted", steps=1, **over)).run()
        assert not (root / "unrouted" / "metrics.jsonl").exists()


def test_a_step_with_a_nonfinite_gradient_is_skipped_and_three_in_a_row_stop_the_run(setup):
    # AdamW wrote the NaN of one bad step into every weight; the run then trained on, or died in
    # the loss normaliser a step later, with the weights already lost.
    trainer = Trainer(_cfg(setup, "nonfinite", steps=4))
    trainer.setup()
    real, calls = trainer._train_batch, []

    def poisoned(*args, **kwargs):    # step 2's gradient is NaN, the others are real
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            next(p for p in trainer.model.parameters() if p.requires_grad).grad.fill_(float("nan"))
        return out

    trainer._train_batch = poisoned
    before = {}

    def snapshot_after_step_1(step, row, log=trainer.metrics.log):
        log(step, row)
        if step == 1:
            before.update({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        if step == 2:  # skipped: the weights are those of step 1, all finite
            assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())

    trainer.metrics.log = snapshot_after_step_1
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = {r["step"]: r for r in read_metrics(setup["root"] / "nonfinite" / "metrics.jsonl") if "loss" in r}
    assert sorted(rows) == [1, 2, 3, 4] and rows[2]["grad_norm"] is None and rows[3]["grad_norm"] is not None
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters()) and trainer.version == 3
    warnings = json.loads((setup["root"] / "nonfinite" / "card.json").read_text())["run"]["warnings"]
    assert [w for w in warnings if "not finite" in w] == [
        "step 2: the gradient is not finite (loss " + f"{rows[2]['loss']:.4g}" + "); the step was skipped, "
        "the weights are unchanged"]

    always = Trainer(_cfg(setup, "nonfinite_always", steps=5))
    always.setup()
    real_always = always._train_batch

    def nan_every_step(*args, **kwargs):
        out = real_always(*args, **kwargs)
        next(p for p in always.model.parameters() if p.requires_grad).grad.fill_(float("inf"))
        return out

    always._train_batch = nan_every_step
    with pytest.raises(TrainError, match="3 steps in a row had a gradient that is not finite"):
        try:
            always.train()
        finally:
            always.close()


def test_a_misspelt_domain_in_domain_weights_is_refused(setup):
    # `.get(domain, 1.0)` made {mathh: 5} weigh nothing, while the card printed it as applied.
    cfg = _cfg(setup, "weights_typo", steps=1, **{"merge.domain_weights": {"gen": 2.0, "mathh": 5.0}})
    with pytest.raises(TrainError, match=r"merge.domain_weights: \['mathh'\] is not a domain of this run "
                                         r"\(its domains: \['gen', 't'\]\)"):
        Trainer(cfg).run()
    assert not (setup["root"] / "weights_typo" / "metrics.jsonl").exists()


def test_cli_runs_a_yaml_config_with_relative_paths_and_resumes(setup, tmp_path, capsys):
    from opd.cli import main

    shutil.copy(setup["root"] / "train.jsonl", tmp_path / "train.jsonl")
    (tmp_path / "run.yaml").write_text(
        f"student:\n  path: {setup['student']}\n"
        f"merge:\n  teachers:\n    - {{name: t, address: '{setup['address']}', k: 4}}\n"
        f"  datasets:\n    - {{domain: gen, path: train.jsonl}}\n"
        f"rollout: {{prompts_per_step: 2, max_new_tokens: 4}}\n"
        f"teacher_client: {{connect_timeout_s: 1.0}}\n"
        f"run: {{steps: 1, out_dir: out, progress: false, tensorboard: false}}\n")
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    assert (tmp_path / "out" / "checkpoints" / "step_000001" / "trainable.safetensors").is_file()
    assert main(["train", str(tmp_path / "run.yaml"), "--resume", "--steps", "2"]) == 0
    steps = [r["step"] for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2]
    # Forgetting --resume is refused before anything starts, and the run stays as it was.
    capsys.readouterr()
    assert main(["train", str(tmp_path / "run.yaml")]) == 1
    assert "already holds a run (checkpoint step_000002, metrics.jsonl, model/)" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r] == [1, 2]
    assert main(["train", str(tmp_path / "run.yaml"), "--resume", "--overwrite"]) == 2
    assert main(["train", str(tmp_path / "run.yaml"), "--overwrite"]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r] == [1]
    assert latest_checkpoint(tmp_path / "out" / "checkpoints").name == "step_000001"
    (tmp_path / "dead.yaml").write_text((tmp_path / "run.yaml").read_text()
                                      .replace(setup["address"], "tcp://127.0.0.1:9").replace("out_dir: out", "out_dir: dead"))
    capsys.readouterr()
    assert main(["train", str(tmp_path / "dead.yaml")]) == 1
    assert "unreachable" in capsys.readouterr().err


def test_full_mode_that_cannot_fit_is_refused_before_training(setup, monkeypatch):
    # 4 sequences x 12 rows x V=260 x (4 + 4 + 4) B, and 2 streams x 5 chunks of 1 MiB in flight:
    # 10.3 MiB of teacher logits at most; say 64 KiB are free.
    import opd.distill.memory

    monkeypatch.setattr(opd.distill.memory, "mem_available", lambda: 64 << 10)
    trainer = Trainer(_cfg(setup, "full_too_big", mode="full", steps=2))
    with pytest.raises(TrainError, match=r"mode full holds up to 10\.3 MiB of teacher logits \(optim.micro_batch_size 4 x "
                                         r"rollout.max_new_tokens 12 rows x V=260 in float32"):
        trainer.run()
    assert not hasattr(trainer, "model") and not (setup["root"] / "full_too_big" / "metrics.jsonl").exists()


def test_rewards_beside_a_teacher_with_rollouts_two_steps_ahead(setup):
    """run.max_staleness 2: batches sampled up to 2 steps ahead, corrected by TIS, with a
    verifier's reward beside the teacher; the card states the staleness and the ratios; a
    checkpoint taken mid-run (its queue saved) resumes."""
    name = "reward_ahead"
    cfg = _cfg(setup, name, mode="sampled", steps=4, **{
        "rollout.samples_per_prompt": 2, "run.max_staleness": 2, "run.checkpoint_every": 2,
        "loss.reward_weight": 0.5, "rewards": [{"name": "format", "options": {"pattern": "[0-9]"}}]})
    Trainer(cfg).run()
    rows = [r for r in read_metrics(setup["root"] / name / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 4
    assert all(0 <= r["staleness"] <= 2 for r in rows) and any(r["staleness"] > 0 for r in rows)
    assert all("reward/mean" in r and "signal/reward" in r and "signal/teacher" in r for r in rows)
    stale = [r for r in rows if r["staleness"] > 0]
    assert all(r["is/ratio_max"] >= r["is/ratio_mean"] > 0 and 0 <= r["is/cut_share"] <= 1 for r in stale)
    card = json.loads((setup["root"] / name / "card.json").read_text())
    traj = card["trajectories"]
    assert "at most 2 optimizer steps" in traj["pipelined"] and "batches per staleness" in traj["staleness"]
    assert card["trajectories"]["off_policy_correction"]["rows"] > 0
    assert "truncated importance sampling" in traj["off_policy_correction"]["method"]
    assert card["objective"]["rewards"]["alpha (loss.reward_weight)"] == 0.5
    # extended from the step-2 checkpoint's queue
    shutil.rmtree(latest_checkpoint(setup["root"] / name / "checkpoints"))
    assert Trainer(replace(cfg, run=replace(cfg.run, steps=5)), resume=True).run()["step"] == 5


def test_staleness_zero_ahead_is_on_policy(setup):
    cfg = _cfg(setup, "ahead0", steps=2, **{"run.max_staleness": 0})
    Trainer(cfg).run()
    rows = [r for r in read_metrics(setup["root"] / "ahead0" / "metrics.jsonl") if "loss" in r]
    assert [r["staleness"] for r in rows] == [0, 0] and not any("is/ratio_mean" in r for r in rows)


def test_opd_rl_takes_a_teacher_into_its_advantage(setup):
    """opd rl with `teachers:`: the teacher's sampled-token term joins GRPO's advantage."""
    from opd.rl.config import RLConfig
    from opd.rl.trainer import GRPOTrainer

    out = setup["root"] / "rl_teacher"
    cfg = from_dict({"model": {"path": str(setup["student"])},
                     "data": {"train": str(setup["root"] / "train.jsonl")},
                     "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 8},
                     "rewards": [{"name": "format", "options": {"pattern": "[0-9]"}}],
                     "teachers": [{"name": "t", "address": setup["address"], "mode": "sampled", "k": 8, "weight": 0.5,
                                   "gamma": 0.9}],
                     "teacher_client": {"connect_timeout_s": 5.0},
                     "optim": {"lr": 1e-3},
                     "run": {"steps": 2, "out_dir": str(out), "progress": False, "tensorboard": False}}, RLConfig)
    # a teacher it cannot use is refused by its place in opd rl's config
    with pytest.raises(TrainError, match=r"^teachers\[0\] \(t\).*k=32 exceeds the server's max_k=16"):
        GRPOTrainer(replace(cfg, teachers=[replace(cfg.teachers[0], k=32)]))
    GRPOTrainer(cfg).train()
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 2 and all(r["signal/teacher"] > 0 for r in rows)
    card = json.loads((out / "card.json").read_text())
    assert card["objective"]["teachers"][0]["gamma"] == 0.9 and card["objective"]["teachers"][0]["lambda (weight)"] == 0.5


def test_a_batch_reward_advantage_needs_no_groups(setup):
    """loss.reward_advantage batch: one sample per prompt, each response's reward against the
    step's others; a group advantage with one sample per prompt is refused, naming batch."""
    reward = {"rewards": [{"name": "format", "options": {"pattern": "[0-9]"}}], "run.pipeline": False}
    with pytest.raises(ValueError, match="reward_advantage to batch"):
        _cfg(setup, "reward_groups", steps=2, **reward)
    cfg = _cfg(setup, "reward_batch", steps=3, **{**reward, "loss.reward_advantage": "batch",
                                                  "rollout.prompts_per_step": 8})
    Trainer(cfg).run()
    rows = [r for r in read_metrics(setup["root"] / "reward_batch" / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 3 and all("reward/mean" in r for r in rows)
    mixed = [r for r in rows if 0 < r["reward/mean"] < 1]   # a step whose rewards differ carries signal
    assert mixed and all(r["signal/reward"] > 0 for r in mixed)


def test_a_whole_run_warns_when_heldout_kl_falls_while_accuracy_falls(setup):
    # The verifier is scripted (every answer right at the first evaluation, wrong after it);
    # the held-out KL is the run's own, which training towards the teacher lowers.
    class Worsening(Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.evaluations = 0

            def verify(samples, texts):
                self.evaluations += 1
                return [1.0 if self.evaluations == 1 else 0.0] * len(texts)
            self.verify = verify

    out = setup["root"] / "kl_down_accuracy_down"
    result = Worsening(_cfg(setup, "kl_down_accuracy_down", steps=8, **{"run.eval_every": 4})).run()
    (e0, e4, e8) = result["evals"]
    assert (e0["step"], e4["step"], e8["step"]) == (0, 4, 8)
    assert e4["eval/kl"] < e0["eval/kl"] and (e0["eval/accuracy"], e4["eval/accuracy"]) == (1.0, 0.0)
    warnings = json.loads((out / "card.json").read_text())["run"]["warnings"]
    said = [w for w in warnings if "held-out KL fell" in w]
    assert len(said) == 1 and said[0].startswith("step 4: held-out KL fell") and "since step 0" in said[0]
