"""The checks a practitioner reads before leaving a stage (the seeds' SFT-exit table), per model
and domain, from the answers `opd validate` sampled: can the verifier read the answer, does the
code run and end, how many answers hit the length cap, are empty or loop, and (an agent's
trajectories) do its tool calls parse and run, does it stop before the turn limit; each with a
verdict, and a few examples of each failure for a person to read.

    exit_checks(samples, texts, rollouts, details, dump) -> {"rows": {...}, "examples": {...}}
    perturbed(sample, kind)                              -> the sample with its prompt reworded
                                                            (spaces, prefix, suffix): same task
    format_drop(name, plain, perturbed)                  -> a warning when accuracy falls with the format
"""

from __future__ import annotations

import dataclasses
import re

from opd.diagnostics import repeated_ngram_ratio

# name -> (what it measures, the better direction, ok up to / from, warn up to / from)
CHECKS = {
    "answer_extracted": ("math: answers the verifier could read an answer from", "high", 0.95, 0.80),
    "code_ran": ("code: answers whose tests ran to the end (passed or not)", "high", 0.95, 0.80),
    "timeouts": ("code: answers stopped by the sandbox's time limit (does the code end?)", "low", 0.05, 0.20),
    "errors": ("code: answers that raised before the tests or crashed the sandbox", "low", 0.05, 0.20),
    "length_capped": ("answers cut by max_new_tokens", "low", 0.05, 0.20),
    "empty": ("answers with no text", "low", 0.01, 0.05),
    "repeated": ("answers that loop (over half their 4-grams repeats)", "low", 0.01, 0.05),
    "tool_calls_valid": ("agent: tool calls that parsed and ran, of all its calls", "high", 0.95, 0.80),
    "turn_limit": ("agent: trajectories stopped by agent.max_turns before an answer", "low", 0.05, 0.20),
}
LOOP_NGRAM, LOOP_SHARE = 4, 0.5


def verdict(name: str, value: float) -> str:
    _, better, ok, warn = CHECKS[name]
    if better == "high":
        return "ok" if value >= ok else "warn" if value >= warn else "fail"
    return "ok" if value <= ok else "warn" if value <= warn else "fail"


def failures(text: str, rollout, status: str | None) -> list[str]:
    """The checks one answer fails."""
    out = []
    if status == "no_answer":
        out.append("answer_extracted")
    if status is not None and status not in ("answer", "ok", "no_answer", "no_tests"):
        out.append("code_ran")
        out.append("timeouts" if status == "timeout" else "errors")
    if rollout.finish_reason == "length":
        out.append("length_capped")
    if not text.strip():
        out.append("empty")
    if repeated_ngram_ratio(rollout.response_ids, LOOP_NGRAM) > LOOP_SHARE:
        out.append("repeated")
    if rollout.meta.get("tool_failures"):   # an agent's trajectory (opd.agent.loop's meta)
        out.append("tool_calls_valid")
    if rollout.meta.get("turn_limit"):
        out.append("turn_limit")
    return out


def exit_checks(samples: list, texts: list[str], rollouts: list, details: list[tuple[float | None, str | None]],
                dump: int) -> dict:
    """The checks over one domain's answers (samples[i] answered by texts[i] / rollouts[i], read
    by the verifier as details[i] = (score, status), opd.rewards.verify_details): each row's
    share and verdict, and up to `dump` examples per failed check."""
    n = len(texts)
    statuses = [st for _, st in details]
    math = sum(st in ("answer", "no_answer") for st in statuses)
    code = sum(st in ("ok", "error", "timeout", "crash") for st in statuses)
    counts = {name: 0 for name in CHECKS}
    examples: dict[str, list[dict]] = {}
    for s, text, ro, (score, status) in zip(samples, texts, rollouts, details):
        for name in failures(text, ro, status):
            counts[name] += 1
            if len(examples.setdefault(name, [])) < dump:
                examples[name].append({"prompt": s.prompt[:500], "response": text[:1000], "score": score,
                                       "verifier": status, "finish": ro.finish_reason})
    of = {"answer_extracted": math, "code_ran": code, "timeouts": code, "errors": code,
          "turn_limit": sum("turns" in ro.meta for ro in rollouts),
          "tool_calls_valid": sum(ro.meta.get("tool_calls", 0) for ro in rollouts)}
    # a share of the calls, not of the answers (an answer may call several times and fail one);
    # the examples above are still the answers with a failed call
    counts["tool_calls_valid"] = sum(ro.meta.get("tool_failures", 0) for ro in rollouts)
    rows = {}
    for name, (what, better, _, _) in CHECKS.items():
        total = of.get(name, n)
        if not total:
            continue   # no math answers for answer_extracted, no code for the sandbox rows, no agent
        bad = counts[name] / total
        value = 1.0 - bad if better == "high" else bad
        rows[name] = {"value": value, "verdict": verdict(name, value), "of": total, "what": what}
    return {"rows": rows, "examples": {k: v for k, v in examples.items() if k in rows}}


def markdown(results: dict, models: list[str], domains: list[str]) -> list[str]:
    """The report's table: a row per model and domain, a column per check, `value (verdict)`."""
    names = [c for c in CHECKS if any(c in results[m][d]["checks"]["rows"] for m in models for d in domains)]
    lines = ["## Checks before leaving this stage", "",
             "Shares of the sampled answers; ok / warn / fail against the thresholds in `rl/checks.py`. "
             "`samples.md` has examples of each failure.", "",
             "| model | domain | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for m in models:
        for d in domains:
            rows = results[m][d]["checks"]["rows"]
            lines.append(f"| {m} | {d} | " + " | ".join(
                f"{rows[c]['value']:.2f} ({rows[c]['verdict']})" if c in rows else "" for c in names) + " |")
    lines += ["", *(f"- `{c}`: {CHECKS[c][0]}" for c in names), ""]
    return lines


def samples_markdown(results: dict, models: list[str], domains: list[str]) -> str:
    """OUT/samples.md: the examples of each failed check, for a person to read."""
    lines = ["# Failed checks: examples", ""]
    for m in models:
        for d in domains:
            for name, items in results[m][d]["checks"]["examples"].items():
                lines += [f"## {m}, {d}: {name}", ""]
                for e in items:
                    lines += [f"- score {e['score']}, verifier {e['verifier']}, finished by {e['finish']}",
                              "", "  prompt:", "", "  ```", *("  " + x for x in e["prompt"].splitlines()), "  ```",
                              "", "  response:", "", "  ```", *("  " + x for x in e["response"].splitlines()),
                              "  ```", ""]
    if len(lines) == 2:
        lines.append("No answer failed a check.")
    return "\n".join(lines) + "\n"


# Rewordings that keep the task: a model that solved it answers them as it answers the plain
# prompt; one that learned the prompt's exact form (the verifier's format) does not.
PERTURBATIONS = {
    "spaces": lambda p: re.sub(r" {2,}", " ", re.sub(r"\s*([-+*/=<>])\s*", r" \1 ", p)).strip(),
    "prefix": lambda p: "Question: " + p,
    "suffix": lambda p: p + "\n",
}
FORMAT_DROP = 0.1   # a fall in greedy accuracy larger than this is warned about


def perturbed(sample, kind: str):
    """`sample` with its prompt (a conversation: its last user message) reworded by `kind`."""
    new = PERTURBATIONS[kind](sample.prompt)
    if sample.messages is None:
        return dataclasses.replace(sample, prompt=new)
    last = max(i for i, m in enumerate(sample.messages) if m["role"] == "user")
    msgs = [dict(m, content=new) if i == last else m for i, m in enumerate(sample.messages)]
    return dataclasses.replace(sample, prompt=new, messages=msgs)


def format_drop(kind: str, plain: float, reworded: float) -> str | None:
    """A warning when greedy accuracy falls by more than FORMAT_DROP under rewording `kind`."""
    if plain - reworded <= FORMAT_DROP:
        return None
    return (f"greedy accuracy falls from {plain:.3f} to {reworded:.3f} when the prompts are reworded ({kind}): the "
            f"model may rely on the prompt's exact form rather than the task")
