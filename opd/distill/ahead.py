"""`run.max_staleness: K`: rollouts that run ahead of training, at most K optimizer steps.

A thread samples batches with a rollout engine that holds its own copy of the weights (the hf
engine over a copy of the student, or the vLLM engine, whose workers always hold their own),
while the trainer trains on the batches before them. After each optimizer step the trainer
hands over a snapshot of its weights (`step_done`); the thread loads it between two batches.
Batch i, trained at optimizer step i // grad_accum, is sampled only once the weights of step
i // grad_accum - K are loaded, so no batch is more than K steps stale; its `policy_version`
says which weights sampled it, and the trainer corrects its rows by importance weights
(opd.spine.objective). K = 0 is fully on-policy (each batch waits for the newest weights),
which makes the thread pointless but keeps the check of the rule honest.

Which batch is how stale depends on timing, so a run with K > 0 is not reproducible step for
step (the data, seeds and order are). Torch releases the GIL in its kernels, so the thread's
sampling and the trainer's forward and backward do overlap; on two cores they share them.
"""

from __future__ import annotations

import copy
import threading
from collections import deque
from contextlib import contextmanager
from typing import Callable

import torch

from opd.distill.batch import Batch


class _Weights:
    """A state-dict snapshot in the shape `sync_weights(model)` reads."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state


class RunAhead:
    def __init__(self, sample: Callable[[object, int], Batch], engine, *, max_staleness: int, grad_accum: int,
                 next_batch: int, steps_done: int, last_batch: int, version: int,
                 load: Callable[[dict], None] | None = None):
        """sample(engine, version) -> the next batch, sampled by `engine` holding weights `version`.
        load(state): loads a snapshot into the engine's weights (hf: its copy of the student);
        None: engine.sync_weights (vLLM). next_batch / steps_done / version: where the run is
        (a resumed run's position); last_batch: no batch at or past it is sampled."""
        self.sample, self.engine, self.load = sample, engine, load
        self.k, self.accum, self.last_batch = max_staleness, grad_accum, last_batch
        self.next_batch, self.steps_done, self.engine_version = next_batch, steps_done, version
        self.queue: deque[Batch] = deque()
        self.pending: tuple[dict, int] | None = None   # (snapshot, version) not yet loaded
        self.cv = threading.Condition()
        self.busy = False          # the thread is sampling
        self.pauses = 0
        self.stopped = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="opd-run-ahead", daemon=True)

    def start(self) -> "RunAhead":
        self.thread.start()
        return self

    # -- the thread ------------------------------------------------------------------------------
    def _may_sample(self) -> bool:
        return (self.next_batch < self.last_batch and not self.pauses
                and self.next_batch // self.accum - self.k <= self.steps_done_loaded)

    @property
    def steps_done_loaded(self) -> int:
        """Optimizer steps whose weights the engine holds (a snapshot not yet loaded: not counted)."""
        return self.steps_done - (1 if self.pending is not None else 0)

    def _loop(self) -> None:
        try:
            while True:
                with self.cv:
                    while not self.stopped and not (self.pending is not None and not self.pauses) \
                            and not self._may_sample():
                        self.cv.wait()
                    if self.stopped:
                        return
                    self.busy = True
                    pending, self.pending = self.pending, None
                if pending is not None:
                    self._load(*pending)
                    with self.cv:
                        self.busy = False
                        self.cv.notify_all()
                    continue
                batch = self.sample(self.engine, self.engine_version)
                with self.cv:
                    self.queue.append(batch)
                    self.next_batch += 1
                    self.busy = False
                    self.cv.notify_all()
        except BaseException as e:   # said by the trainer's next take()
            with self.cv:
                self.error, self.busy = e, False
                self.cv.notify_all()

    def _load(self, state: dict, version: int) -> None:
        if self.load is not None:
            self.load(state)
        else:
            self.engine.sync_weights(_Weights(state))
        self.engine_version = version

    # -- the trainer's side ----------------------------------------------------------------------
    def take(self) -> Batch:
        """The next batch in order (waits for the thread when it is not sampled yet)."""
        with self.cv:
            while not self.queue and self.error is None:
                self.cv.wait()
            if self.error is not None:
                raise self.error
            return self.queue.popleft()

    def queued(self) -> list[Batch]:
        with self.cv:
            return list(self.queue)

    def step_done(self, model, version: int, applied: bool) -> None:
        """An optimizer step ended; `applied`: the weights changed (their snapshot is handed over)."""
        # a copy where the weights are (the hf copy loads it there; vLLM's sync moves it to CPU)
        snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()} if applied else None
        with self.cv:
            self.steps_done += 1
            if snapshot is not None:
                self.pending = (snapshot, version)
            self.cv.notify_all()

    @contextmanager
    def paused(self):
        """The thread idle, and the newest weights loaded (an evaluation on the shared vLLM engine,
        a checkpoint of the queue and the data position)."""
        with self.cv:
            self.pauses += 1
            while self.busy and self.error is None:
                self.cv.wait()
            pending, self.pending = self.pending, None
        try:
            if pending is not None:
                self._load(*pending)
            yield self
        finally:
            with self.cv:
                self.pauses -= 1
                self.cv.notify_all()

    def load_queue(self, batches: list[Batch]) -> None:
        """A checkpoint's queued batches, trained before any sampled now."""
        with self.cv:
            self.queue.extendleft(reversed(batches))

    def close(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout=600)


def own_copy(model):
    """A frozen copy of the student for the hf engine of the thread (the trainer keeps updating its own)."""
    clone = copy.deepcopy(model)
    clone.requires_grad_(False)
    return clone


def load_into(model) -> Callable[[dict], None]:
    def load(state: dict) -> None:
        with torch.no_grad():
            model.load_state_dict(state, strict=True)
    return load
