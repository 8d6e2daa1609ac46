"""The student's ranks as Ray actors (opd/cluster/ranks.py) on a local Ray cluster: a rank that
fails is named, the others are stopped, and the actors and the placement group are gone
afterwards, whether the command finished or failed. (That 2 Ray ranks train as torchrun's 2
and as one process is tests/spine/test_sharded.py's.)"""

from __future__ import annotations

import re
import threading
import time

import psutil
import pytest

from opd.cluster.config import ClusterConfig
from opd.cluster.ranks import launch
from opd.config import from_dict
from opd.errors import TrainError

pytestmark = pytest.mark.timeout(180)
TWO = from_dict({"mode": "ray", "student": {"num_workers": 2}}, ClusterConfig)


def rank_pids(out: str) -> list[int] | None:
    """The ranks' process ids from the launcher's placement line, in rank order."""
    m = re.search(r"rank 0 pid (\d+) on \S+, rank 1 pid (\d+)", out)
    return [int(pid) for pid in m.groups()] if m else None


def assert_nothing_left(ray, pids: list[int]) -> None:
    """The ranks' processes are gone (ray.kill is asynchronous: a few seconds) and every
    placement group is removed."""
    deadline = time.monotonic() + 20
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if psutil.pid_exists(p)]
        time.sleep(0.1)
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_a_finished_command_returns_0_and_leaves_no_actor_or_placement_group(ray_cluster, capsys):
    assert launch(["--help"], TWO) == 0                   # `python -m opd.cli --help` on each rank
    out = capsys.readouterr().out
    assert "2 ranks on Ray (PACK, {'CPU': 1.0} each): rank 0 pid" in out
    assert ray_cluster.is_initialized()                   # a session it joined is left running
    assert_nothing_left(ray_cluster, rank_pids(out))


def test_a_rank_that_exits_non_zero_is_named(ray_cluster, capsys):
    # Every rank refuses the missing config (exit 2); the first to come back is named.
    with pytest.raises(TrainError, match=r"rank [01] of 2 failed \(exit code 2\); the other ranks were stopped"):
        launch(["train", "no_such_config.yaml"], TWO)
    assert_nothing_left(ray_cluster, rank_pids(capsys.readouterr().out))


def test_a_killed_rank_is_named_and_the_waiting_one_is_stopped(ray_cluster, capsys):
    # Both ranks sleep a minute (the stdlib's timeit run as `python -m` is the rank's command);
    # rank 1's process is SIGKILLed: rank 0 would wait for it for ever.
    failure = {}

    def run():
        try:
            launch(["-n", "1", "import time; time.sleep(60)"], TWO, module="timeit")
        except TrainError as e:
            failure["error"] = str(e)

    thread = threading.Thread(target=run)
    thread.start()
    deadline, out = time.monotonic() + 60, ""
    while (pids := rank_pids(out)) is None and time.monotonic() < deadline:
        time.sleep(0.1)
        out += capsys.readouterr().out
    assert pids, out
    time.sleep(1.0)   # both in their sleep
    psutil.Process(pids[1]).kill()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert failure["error"].startswith("rank 1 of 2 failed (its Ray actor's process died"), failure
    assert_nothing_left(ray_cluster, pids)   # rank 0 stopped, not left sleeping


def test_ranks_that_cannot_fit_the_local_cluster_the_run_starts_are_refused_at_once(without_ray_session):
    ray = without_ray_session
    cfg = from_dict({"mode": "ray", "num_cpus": 1, "student": {"num_workers": 2}}, ClusterConfig)
    t0 = time.monotonic()
    with pytest.raises(TrainError, match=r"2 ranks x \{'CPU': 1.0\} need more than the local Ray cluster this run "
                                         r"started has \(CPU 2 > 1\)"):
        launch(["--help"], cfg)
    assert time.monotonic() - t0 < 60            # not placement_timeout_s (600 s)
    assert not ray.is_initialized()              # the session it started is shut down
