"""Scale-out on Ray: where teacher replicas and rollout actors run, and how to reach them.

Ray only places and supervises processes; it never carries logits. Each teacher replica is
an `opd serve-teacher` process started by a Ray actor (opd/cluster/teachers.py) and talked
to over ZeroMQ by a `ReplicaPool` (teachers/pool.py), which balances requests across a
teacher's replicas. `opd rl` samples with rollout actors (opd/cluster/rollout.py).

    cluster = RayCluster.start(cfg.cluster)       # connects to (or starts) Ray
    math = cluster.teacher_pool("math")           # drop-in for TeacherClient
    ...
    cluster.shutdown()

With `mode: local` nothing here is used: the trainer connects to the addresses in its
merge config as before. With `mode: fork` (one machine, no Ray) `opd train` starts each of
`teachers` itself, forked after its imports so both hold one copy of the Python and torch
runtime (opd.teachers.launch.fork_server), bound at its merge address.

Ray is imported inside the functions that use it: it is optional at run time (modes local
and fork never need it) and importing it takes about a second.
"""

from __future__ import annotations

from opd.cluster.config import ClusterConfig
from opd.cluster.connect import connect
from opd.teachers.pool import ReplicaPool
from opd.cluster.rollout import RolloutPool
from opd.cluster.teachers import TeacherGroup


class RayCluster:
    """One run's view of the cluster: its teacher groups (started lazily) and their pools."""

    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        self._groups: dict = {}
        self._pools: dict = {}

    @classmethod
    def start(cls, cfg: ClusterConfig, *, start_teachers: bool = True) -> "RayCluster":
        if cfg.mode != "ray":
            raise ValueError("RayCluster needs cluster.mode: ray")
        connect(cfg)
        self = cls(cfg)
        if start_teachers:
            for t in cfg.teachers:
                self.teacher_group(t.name)
        return self

    def teacher_group(self, name: str):
        """The supervised replicas of teacher `name` (started on first use)."""
        if name not in self._groups:
            self._groups[name] = TeacherGroup.start(self.cfg.teacher(name), bind=self.cfg.bind)
        return self._groups[name]

    def teacher_pool(self, name: str, **client_kwargs):
        """A client with TeacherClient's API that balances over the replicas of `name`.

        `client_kwargs` go to ReplicaPool (timeout_s, retries, backoff_s, heartbeat_s, curve, name);
        timeout_s and recheck_s default to this config's request_timeout_s and recheck_s.
        """
        if name not in self._pools:
            group = self.teacher_group(name)
            kwargs = {"timeout_s": self.cfg.request_timeout_s, "recheck_s": self.cfg.recheck_s, **client_kwargs}
            self._pools[name] = ReplicaPool(group.addresses, **kwargs)
        return self._pools[name]

    def rollout_pool(self, model_dir: str, num_workers: int, **kwargs):
        """Student sampling spread over `num_workers` rollout actors (opd/cluster/rollout.py)."""
        return RolloutPool.start(model_dir, num_workers, **kwargs)

    def shutdown(self, *, disconnect: bool = False) -> None:
        for pool in self._pools.values():
            pool.close()
        for group in self._groups.values():
            group.shutdown()
        self._pools.clear()
        self._groups.clear()
        if disconnect:
            import ray

            ray.shutdown()
