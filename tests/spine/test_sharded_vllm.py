"""A sharded student (2 gloo ranks, FSDP2) beside rank 0's vLLM engine (opd.spine.engine), run
under torchrun by tests/spine/sharded_vllm_worker.py. Apart from test_sharded.py: a vLLM file
shares the xdist worker of the session's vLLM engines, the Ray-mode commands of that file the
Ray tests' worker (tests/conftest.py)."""

from __future__ import annotations

import pytest

from sharded_runs import both, worker_reports   # tests/spine/sharded_runs.py

pytestmark = pytest.mark.timeout(600)


@pytest.mark.vllm
@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_sharded_student_samples_with_rank_0s_vllm_engine_and_pushes_its_weights(tmp_path, vllm_model_dir, lora):
    # 2 ranks, one vLLM engine (rank 0's): after 3 optimizer steps, each followed by the sync of
    # the gathered shards, the engine's log-probs of its samples are the trained weights' own,
    # and each rank got the rollouts of its own prompts.
    r0, r1 = worker_reports("sharded_vllm_worker.py", vllm_model_dir, "lora" if lora else "full",
                            out=tmp_path / "report", timeout=400)
    assert r0["prompts"] == [[5, 6, 7]] * 2 + [[8, 9]] * 2 and r1["prompts"] == [[10, 11, 12, 13]] * 2 + [[14]] * 2
    assert r0["index"] == r1["index"] == [0, 0, 1, 1]
    for r in (r0, r1):
        for engine, forward in zip(r["engine"], r["forward"]):
            assert len(engine) == len(forward) > 0
            assert max(abs(a - b) for a, b in zip(engine, forward)) < 1e-4, (engine, forward)
    assert r0["vllm_children"] > 0 and r1["vllm_children"] == 0   # the engine is rank 0's alone


@pytest.mark.vllm
@pytest.mark.slow   # two vLLM engines (~40 s each here) and two runs
def test_opd_rl_on_two_ranks_with_vllm_rollouts_is_one_process_with_vllm(tmp_path, vllm_model_dir):
    # Rank 0's engine samples the step's prompts in rank order, as one process's engine does,
    # so the two runs see the same rollouts and take the same steps.
    from opd.data import write_jsonl
    from opd.metrics import read_metrics

    write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"Number {i}:", "answer": str(i)} for i in range(10, 26)])
    (tmp_path / "digits.py").write_text("def digits(sample, text):\n    return sum(c.isdigit() for c in text) / "
                                        "max(len(text), 1)\n")
    runs = both("rl", tmp_path, (
        f"model: {{{{path: {vllm_model_dir}, device: cpu}}}}\n"
        "data: {{train: train.jsonl}}\n"
        "rollout: {{prompts_per_step: 4, samples_per_prompt: 4, max_new_tokens: 4, temperature: 1.0, engine: vllm, "
        "vllm_max_model_len: 128}}\n"
        "algorithm: {{epochs: 2, kl_beta: 0.01, advantage: batch_std}}\n"
        "rewards: [{{name: python, path: 'digits.py:digits'}}]\noptim: {{lr: 0.01}}\n"
        "run: {{steps: 3, checkpoint_every: 3, out_dir: {out}, progress: false, tensorboard: false}}\n"
        "cluster: {cluster}\n"), timeout=400)
    rows = {n: read_metrics(runs[n] / "metrics.jsonl") for n in runs}
    for key in ("reward/mean", "loss", "kl", "ratio/mean"):
        assert [r[key] for r in rows[2]] == pytest.approx([r[key] for r in rows[1]], rel=1e-4, abs=1e-6), key
    assert len(rows[2]) == 3   # steps 2 and 3 sample the pushed weights: unsynced, they would part from one process's


@pytest.mark.vllm
@pytest.mark.slow   # two vLLM engines and a teacher server
def test_opd_train_on_two_ranks_with_vllm_rollouts_is_one_process_with_vllm(tmp_path, vllm_model_dir):
    from opd.data import write_jsonl
    from opd.metrics import read_metrics
    from opd.teachers.launch import start_server_process
    from opd.tiny import lm_head_teacher

    write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"q{i}: what is {i}+{i}?"} for i in range(16)])
    with start_server_process(["--model", str(lm_head_teacher(vllm_model_dir, tmp_path / "teacher")), "--max-k", "16",
                               "--name", "t"]) as server:
        runs = both("train", tmp_path, (
            f"student: {{{{path: {vllm_model_dir}, device: cpu}}}}\n"
            f"merge: {{{{teachers: [{{{{name: t, address: '{server.address}', k: 8}}}}], "
            "datasets: [{{domain: gen, path: train.jsonl}}]}}\n"
            "rollout: {{prompts_per_step: 4, max_new_tokens: 8, engine: vllm, vllm_max_model_len: 128}}\n"
            "optim: {{lr: 0.003}}\n"
            "run: {{steps: 3, out_dir: {out}, progress: false, tensorboard: false, pipeline: false}}\n"
            "cluster: {cluster}\n"), timeout=400)
    rows = {n: read_metrics(runs[n] / "metrics.jsonl") for n in runs}
    steps = [r for r in rows[2] if "loss" in r]
    assert len(steps) == 3
    for key in ("loss", "kl"):
        assert [r[key] for r in steps] == pytest.approx([r[key] for r in rows[1] if "loss" in r], rel=1e-4), key
