"""opd rl's held-out evaluation: greedy answers to the eval prompts, scored as training scores
them and as `opd validate` counts accuracy, and, where the prompts carry `hidden_tests`, the
tests no reward sees beside the visible ones.

    evaluate(trainer) -> {"eval/reward", "eval/accuracy", "eval/verifier_score",
                          "eval/visible_accuracy", "eval/hidden_accuracy", "warning"?, "eval/agent/..."}
"""

from __future__ import annotations

from opd.agent.trajectory import trajectory
from opd.rewards import accuracy, hidden_gap, hidden_pass, verify_batch
from opd.rl import agentic
from opd.rollout import SamplingParams


def evaluate(tr, step: int = 0) -> dict:
    """Greedy responses to the held-out prompts: the mean combined reward, the accuracy (the
    share the verifier scores 1, as `opd validate` counts) and the mean verifier score
    (partial credit for code: the share of tests passed); with hidden tests, the visible and
    hidden pass rates over those prompts and a warning when they part (rewards.hidden_gap). The
    first run.dump_samples answers go to RUN/samples/step_N.md."""
    # Each rank answers its share (the last padded with repeats, which are dropped: `padded_share`).
    world, cfg = tr.world, tr.cfg
    mine, real = world.padded_share(tr.eval_samples)
    prompts = [tr.encode(s) for s in mine]
    rollouts = tr.engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens,
                                                          n=1))
    texts = [tr.decode(r) for r in rollouts][:real]
    trajs = [trajectory(r, tr.tokenizer) for r in rollouts[:real]] if cfg.agent else None
    total, _ = agentic.shaped(cfg, tr.reward(mine[:real], texts, trajs), rollouts[:real]) if texts else ([], {})
    # The code reward's own limits (timeout, memory, workers), as in training: with the
    # defaults, a solution that needs more would fail here only.
    code = next((r.options for r in cfg.rewards if r.name == "code"), {})
    scores = verify_batch(mine[:real], texts, **code) if texts else []
    hidden = hidden_pass(mine[:real], texts, **code) if texts else []
    ranks = world.gather((total, scores, hidden))
    total, scores, hidden = ([x for part in ranks for x in part[i]] for i in range(3))
    out = {"eval/reward": sum(total) / len(total), **agentic.step_metrics(rollouts[:real], "eval/")}
    verified = [v for v in scores if v is not None]
    if verified:   # the mean score was logged as accuracy: code's partial credit counted
        out["eval/accuracy"] = accuracy(verified)
        out["eval/verifier_score"] = sum(verified) / len(verified)
    if world.main:
        tr.run_dir.write_samples(step, [{"prompt": s.prompt, "answer": t, "score": v, "domain": s.domain}
                                        for s, t, v in zip(mine, texts, scores)], cfg.run.dump_samples)
    pairs = [(v, h) for v, h in zip(scores, hidden) if h is not None]
    if pairs:
        gap = hidden_gap([v for v, _ in pairs], [h for _, h in pairs])
        out.update({f"eval/{k}": v for k, v in gap.items() if k != "warning"},
                   **({"warning": gap["warning"]} if "warning" in gap else {}))
    return out
