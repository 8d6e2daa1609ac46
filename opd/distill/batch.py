"""One step batch of on-policy distillation, and the look-ahead that samples the next one early.

A `Batch` is prompts drawn from the mixture with their routes (routing.router.Route), the
student's rollouts of them (`samples_per_prompt` per prompt), how much of each response is
kept after trimming, which kept tokens are rows (multi-turn trajectories: the model's own
tokens, not the tool observations between its turns), and the teachers' answers on their
way (futures). A checkpoint saves
the look-ahead batch without its futures; a resumed run sends it again.

`Prefetcher` is `run.pipeline`: the next batch is sampled, and sent to its teachers, before
the current one trains, so the teachers score while the student computes. Its rollouts then
come from weights one optimizer step old (staleness 1, measured per step and in the card).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Callable

from opd.data import Sample
from opd.rollout.base import Rollout
from opd.routing.router import Route
from opd.spine.rows import trim_turns


def trimmed(rollouts: list[Rollout], trim) -> tuple[list[int], list[list[bool] | None] | None]:
    """(keep, masks) of a batch's rollouts, each trimmed per assistant turn by trim(ids) -> kept
    length (opd.spine.rows.trim_turns); masks None when no rollout has a mask (single turns)."""
    both = [trim_turns(ro, trim) for ro in rollouts]
    masks = [m for _, m in both]
    return [k for k, _ in both], masks if any(m is not None for m in masks) else None


@dataclass
class Batch:
    index: int                      # batches drawn before this one (the data position)
    samples: list[Sample]
    routes: list[Route]             # per prompt
    rollouts: list[Rollout]         # per sequence, samples_per_prompt per prompt
    keep: list[int]                 # trimmed response length per sequence
    policy_version: int             # optimizer steps the sampling weights had taken
    advantages: list[float] | None = None   # per sequence: the reward's group advantage (with `rewards`)
    rewards: list[float] | None = None      # per sequence: the combined reward
    futures: dict[str, Future] = field(default_factory=dict)     # teacher -> Future of its Answer
    members: dict[str, list[int]] = field(default_factory=dict)  # teacher -> sequences it scores
    # per sequence, over its kept tokens: which are rows (None: all; the whole list None: single turns)
    masks: list[list[bool] | None] | None = None

    def route_of(self, seq: int) -> Route:
        return self.routes[self.rollouts[seq].prompt_index]

    def row_mask(self, seq: int) -> list[bool] | None:
        """Which of sequence `seq`'s kept response tokens are rows (None: every one)."""
        return None if self.masks is None else self.masks[seq]

    def rows(self, seq: int) -> int:
        """Sequence `seq`'s rows: its kept tokens the model sampled (trained and scored)."""
        m = self.row_mask(seq)
        return self.keep[seq] if m is None else sum(m)

    def sampler_logprobs(self, seq: int) -> list[float]:
        """The sampling weights' raw log-probs of sequence `seq`'s rows."""
        lp, m = self.rollouts[seq].logprobs[:self.keep[seq]], self.row_mask(seq)
        return lp if m is None else [x for x, row in zip(lp, m) if row]

    def responses(self) -> list[list[int]]:
        """The trimmed response of each sequence: what the teachers score and the loss trains."""
        return [ro.response_ids[:k] for ro, k in zip(self.rollouts, self.keep)]

    def requests(self) -> dict[str, tuple[list[list[int]], list[int], list[list[bool]] | None]]:
        """{teacher: (its sequences as prompt + trimmed response, where each response starts,
        the row masks over each trimmed response or None: every token is a row)}; fills
        `members`, the sequences routed to each teacher, in request order. Masks only when a
        sequence has one (multi-turn): a single-turn request is what a server without row masks reads too."""
        self.members = {}
        for seq in range(len(self.rollouts)):
            for t in self.route_of(seq).weights:
                self.members.setdefault(t, []).append(seq)
        kept = self.responses()
        return {t: ([self.rollouts[s].prompt_ids + kept[s] for s in seqs],
                    [len(self.rollouts[s].prompt_ids) for s in seqs],
                    None if self.masks is None else [self.row_mask(s) or [True] * self.keep[s] for s in seqs])
                for t, seqs in self.members.items()}

    def to_state(self) -> dict:
        return {"index": self.index, "policy_version": self.policy_version, "keep": self.keep, "masks": self.masks,
                "samples": [asdict(s) for s in self.samples], "routes": [asdict(r) for r in self.routes],
                "rollouts": [asdict(r) for r in self.rollouts]}

    @staticmethod
    def from_state(d: dict) -> "Batch":
        # A checkpoint from before routes kept their teacher: the one of highest weight.
        routes = [Route(**{"teacher": max(r["weights"], key=r["weights"].get), **r}) for r in d["routes"]]
        return Batch(index=d["index"], samples=[Sample(**s) for s in d["samples"]], routes=routes,
                     rollouts=[Rollout(**r) for r in d["rollouts"]], keep=list(d["keep"]),
                     policy_version=d["policy_version"], masks=d.get("masks"))


class Prefetcher:
    """The batch to train now, and with `enabled` (run.pipeline) the next one, sampled and sent
    to its teachers ahead. `sample()` draws, routes and rolls out a batch; `submit(batch)` sends
    it to its teachers and returns it."""

    def __init__(self, sample: Callable[[], Batch], submit: Callable[[Batch], Batch], enabled: bool):
        self.sample, self.submit, self.enabled = sample, submit, enabled
        self.pending: Batch | None = None

    def take(self) -> Batch:
        """The look-ahead batch (sent now if it was held back), or a fresh one."""
        batch, self.pending = self.pending, None
        if batch is None:
            return self.submit(self.sample())
        return batch if batch.futures else self.submit(batch)

    def look_ahead(self, send: bool) -> None:
        """With run.pipeline, sample the next batch now, and send it unless `send` is False: an
        evaluation comes first (a full-vocabulary stream holds its tokens in the teacher's budget
        until it is read, and the evaluation's request could meet BUSY for as long), or it is past
        the run's last batch (sampled all the same, so that a run extended with --resume draws
        what an uninterrupted run would have)."""
        if self.enabled:
            self.pending = self.sample()
            if send:
                self.submit(self.pending)

    def send_held(self) -> None:
        """Send the look-ahead batch held back for an evaluation."""
        if self.pending is not None and not self.pending.futures:
            self.submit(self.pending)

    def state(self) -> dict | None:
        return self.pending.to_state() if self.pending is not None else None

    def load_state(self, state: dict | None) -> None:
        self.pending = Batch.from_state(state) if state else None
