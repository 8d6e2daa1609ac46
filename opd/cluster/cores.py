"""OpenMP's wait policy when `opd train` forks its teachers onto the cores it trains on.

libgomp, torch's OpenMP runtime on Linux, lets a thread that waits for work spin (by default
up to GOMP_SPINCOUNT turns, about 300,000) before it sleeps. A process alone loses nothing by
it. A trainer and the teacher server it forked onto the same cores do: the spinning threads of
one hold the cores the other computes on. With `cluster.mode: fork` and no OMP_WAIT_POLICY of
the user's, opd sets PASSIVE (a waiting thread sleeps at once), for the trainer and, inherited,
for its teachers. docs/benchmarks.md ("each system at its defaults, real weights") has the
measurement.

libgomp reads the variable once, when torch loads it: this must run before torch is imported.
"""

from __future__ import annotations

import os

VARIABLE = "OMP_WAIT_POLICY"


def share_cores(cluster) -> str:
    """Set OMP_WAIT_POLICY=PASSIVE when `cluster` forks teachers here and the user set none; the
    policy in effect (`wait_policy`)."""
    if cluster.mode == "fork" and cluster.teachers and VARIABLE not in os.environ:
        os.environ[VARIABLE] = "PASSIVE"
    return wait_policy()


def wait_policy() -> str:
    """This process's OpenMP wait policy, as the card states it."""
    return os.environ.get(VARIABLE, "unset (libgomp's default: a waiting thread spins, then sleeps)")
