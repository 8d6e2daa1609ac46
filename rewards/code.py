"""Code reward: the fraction of the sample's unit tests the response's code passes.

The code is the last ```python fenced block of the response (or the last fenced block,
or an unclosed one cut off by the length limit), else the raw response. It runs in
the sandbox (opd.agent.sandbox) with a time and memory limit, no network and a temporary
working directory; a hang or a crash scores 0 and never blocks the caller longer than
the time limit.
"""

from __future__ import annotations

import re

from opd.agent.sandbox import SandboxLimits, SandboxResult, run_many, run_tests

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(response: str) -> str:
    blocks = _FENCE.findall(response)
    if not blocks:
        return response
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    return (python or [body for _, body in blocks])[-1]


# What each option must be. A value of another kind failed late or silently: a float
# memory_mb made the sandbox child's setrlimit raise, so every answer scored 0 as a crash.
_COUNTS = ("memory_mb", "max_file_mb", "max_processes", "workers")
DEFAULT_WORKERS = 2


def check_code_options(options: dict) -> None:
    """ValueError naming the option whose value the sandbox cannot use."""
    import math

    for key in _COUNTS:
        v = options.get(key, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"option {key}: expected a whole number >= 1, got {v!r}")
    t = options.get("timeout_s", 1.0)
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t <= 0:
        raise ValueError(f"option timeout_s: expected a number of seconds > 0, got {t!r}")
    a = options.get("allow_subprocess", False)
    if not isinstance(a, bool):
        raise ValueError(f"option allow_subprocess: expected true or false, got {a!r}")


def limits_from(options: dict) -> SandboxLimits:
    known = {"timeout_s", "memory_mb", "max_file_mb", "max_processes", "allow_subprocess"}
    unknown = set(options) - known - {"workers"}
    if unknown:
        raise ValueError(f"unknown code reward option(s) {sorted(unknown)}; expected {sorted(known | {'workers'})}")
    check_code_options(options)
    return SandboxLimits(**{k: v for k, v in options.items() if k in known})


def code_options_used(options: dict) -> dict:
    """Every option of the code reward with the value it runs with (the defaults filled in)."""
    import dataclasses

    return {**dataclasses.asdict(limits_from(options)), "workers": options.get("workers", DEFAULT_WORKERS)}


def code_reward(sample, response: str, **options) -> float:
    if not sample.tests:
        return 0.0
    return run_tests(extract_code(response), sample.tests, limits_from(options)).reward


def code_results_batch(samples, responses: list[str], **options) -> list[SandboxResult | None]:
    """Run many responses' code against their samples' tests, `workers` sandboxes at a time
    (default 2): each one's SandboxResult (tests passed, ok / error / timeout / crash), None
    for a sample without tests."""
    limits = limits_from(options)
    jobs = [(i, extract_code(r), s.tests) for i, (s, r) in enumerate(zip(samples, responses)) if s.tests]
    results = run_many([(c, t) for _, c, t in jobs], limits, workers=int(options.get("workers", DEFAULT_WORKERS)))
    out: list[SandboxResult | None] = [None] * len(responses)
    for (i, _, _), res in zip(jobs, results):
        out[i] = res
    return out


def code_reward_batch(samples, responses: list[str], **options) -> list[float]:
    """Score many responses (the share of tests passed), `workers` sandboxes at a time."""
    return [r.reward if r is not None else 0.0 for r in code_results_batch(samples, responses, **options)]
