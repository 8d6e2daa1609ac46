"""What a teacher sees, and where it looks, per sequence (SCORE's context and support, docs/protocol.md).

    context:       a teacher's own prompt, rendered from the sample's fields by the teacher's
                   `context:` template (e.g. "{prompt}\\nReference answer: {answer}"): the teacher
                   scores the student's response after it. With `cluster.teachers[].model: self`
                   this is on-policy self-distillation: the student's start, seeing the answer,
                   teaches the student, who does not.
    student_topk:  the student's own k most likely ids at each response position, as its
                   rollout engine saw them when it sampled; the teacher answers its
                   log-probabilities there and the mass of everything else (one tail bucket),
                   so the divergence is exact where the student puts its mass.

`teacher_inputs` builds both for the sequences a teacher scores; `check_contexts` renders every
context once when the prompts load, so a missing field or a context too long for the teacher
stops the run before its first step, not hours in.
"""

from __future__ import annotations

import torch

from opd.data import Sample, encode_prompt
from opd.spine.optim import TrainError


def fields(sample: Sample) -> dict:
    """The names a context template may use: the sample's fields and any other key of its row."""
    known = {"prompt": sample.prompt, "domain": sample.domain, "answer": sample.answer,
             "tests": sample.tests, "response": sample.response}
    return {**sample.meta, **{k: v for k, v in known.items() if v is not None}}


def render(spec, sample: Sample) -> str:
    """Teacher `spec`'s context for `sample`; TrainError naming the field a sample lacks."""
    values = fields(sample)
    try:
        return spec.context.format_map(values)
    except KeyError as e:
        raise TrainError(f"teacher {spec.name!r}: its context {spec.context!r} needs the field {e.args[0]!r}, which "
                         f"the sample {sample.prompt[:60]!r} has not (it has {sorted(values)})") from None
    except (IndexError, ValueError, AttributeError) as e:
        raise TrainError(f"teacher {spec.name!r}: its context {spec.context!r} cannot be rendered ({e})") from None


def support_k(specs) -> int:
    """The top-k ids the rollout engine must return per position (SamplingParams.topk): the largest
    k of the student_topk teachers, each of which takes its first k (most likely first); 0: none."""
    return max([t.k for t in specs if t.mode == "student_topk"], default=0)


def teacher_prompts(spec, tokenizer, samples: list[Sample], prompts: list[list[int]],
                    tools: list[dict] | None = None) -> list[list[int]]:
    """What teacher `spec` sees before each sample's response: its context (a context teacher),
    else the student's prompt (`prompts`, token ids); a `tokenizer: cross` teacher either in its
    own tokens and chat template (`tokenizer` is then the teacher's)."""
    cross = getattr(spec, "tokenizer", "same") == "cross"
    if spec.context is None and not cross:
        return prompts
    return [encode_prompt(tokenizer, render(spec, s) if spec.context is not None else s.chat, tools=tools)
            for s in samples]


def teacher_inputs(spec, tokenizer, samples: list[Sample], rollouts: list, keep: list[int],
                   masks: list | None = None, tools: list[dict] | None = None) -> dict:
    """Keyword arguments of TeacherSet.request for sequences i = (samples[i], rollouts[i], keep[i]
    response tokens kept, masks[i] which of them are rows, None: all): `contexts` [B] token ids (a
    context teacher; rendered with the agent's tool schemas `tools`, as the student's prompt is),
    `candidates` int32 [rows, k] (mode student_topk; rows in request order)."""
    out: dict = {}
    if spec.context is not None or getattr(spec, "tokenizer", "same") == "cross":
        out["contexts"] = teacher_prompts(spec, tokenizer, samples, [], tools)
    if spec.mode == "student_topk":
        masks = masks or [None] * len(rollouts)
        rows = [row[:spec.k] for ro, n, m in zip(rollouts, keep, masks)
                for i, row in enumerate((ro.topk_ids or [])[:n]) if m is None or m[i]]
        if len(rows) != sum(n if m is None else sum(m) for n, m in zip(keep, masks)) \
                or any(len(r) != spec.k for r in rows):
            raise TrainError(f"teacher {spec.name!r} (mode student_topk, k={spec.k}): the rollouts carry no top-{spec.k} "
                             f"ids for every response token (the engine was asked for {len(rows[0]) if rows else 0})")
        out["candidates"] = torch.tensor(rows, dtype=torch.int32).reshape(-1, spec.k)
    return out


def check_contexts(specs: dict, tokenizer, samples: list[Sample], routes: list, path: str,
                   teacher_positions: dict[str, int], budget: tuple[str, int], tools: list[dict] | None = None) -> None:
    """Render each context teacher's context for every sample routed to it: a missing field, or
    a context that leaves no room for the response budget (its key, its tokens: rollout.max_new_tokens,
    or agent.max_tokens for a trajectory) within the teacher's positions, is refused."""
    key, max_new_tokens = budget
    for sample, route in zip(samples, routes):
        for name in route.weights:
            spec = specs[name]
            if spec.context is None:
                continue
            try:
                n = len(encode_prompt(tokenizer, render(spec, sample), tools=tools))
            except TrainError as e:
                raise TrainError(f"{path}: {e}") from None
            limit = teacher_positions.get(name, 0)
            if limit and n + max_new_tokens > limit:
                raise TrainError(f"{path}: teacher {name!r}'s context for {sample.prompt[:60]!r} has {n} tokens, and "
                                 f"with {key} ({max_new_tokens}) exceeds the {limit} positions it "
                                 f"takes; shorten the context template or the samples' fields")
