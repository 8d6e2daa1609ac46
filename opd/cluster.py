"""Scale-out on Ray: where teacher replicas and student workers run, and how to reach them.

Ray only places and supervises processes; it never carries logits. Each teacher replica is
an `opd serve-teacher` process started by a Ray actor (opd/cluster_teachers.py) and talked
to over ZeroMQ by a `ReplicaPool` (opd/cluster_pool.py), which balances requests across a
teacher's replicas. The student trains data-parallel in Ray actors running
torch.distributed (opd/cluster_dp.py).

    cluster = RayCluster.start(cfg.cluster)       # connects to (or starts) Ray
    math = cluster.teacher_pool("math")           # drop-in for TeacherClient
    ...
    cluster.shutdown()

With `mode: local` nothing here is used: the trainer connects to the addresses in its
merge config as before. With `mode: fork` (one machine, no Ray) `opd train` starts each of
`teachers` itself, forked after its imports so both hold one copy of the Python and torch
runtime (opd.teachers.launch.fork_server), bound at its merge address.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from opd.config import field

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


@dataclass(frozen=True)
class TeacherReplicas:
    # --- what to serve
    name: str = field(help="teacher name; must match a teacher of the merge config")
    model: str = field(help="model directory (the same on every node, e.g. a shared filesystem)")
    backend: Literal["hf", "vllm"] = field("hf", help="teacher backend of `opd serve-teacher`")
    serve_args: list[str] = field(default_factory=list,
                                  help="extra `opd serve-teacher` arguments, e.g. ['--max-k', '64']")
    # --- where and how many
    replicas: int = field(1, help="number of server processes of this teacher", min=1)
    num_cpus: float = field(1.0, help="CPUs reserved per replica", min=0.0)
    num_gpus: float = field(0.0, help="GPUs reserved per replica (the server sees only these)", min=0.0)
    gpus: list[int] = field(default_factory=list,
                            help="mode fork: the GPUs of this machine the server sees (its CUDA_VISIBLE_DEVICES), "
                                 "e.g. [1] to keep it off the student's GPU 0; implies --device cuda. Empty: "
                                 "all of them (mode ray assigns GPUs from num_gpus)")
    strategy: Strategy = field("SPREAD", help="placement group strategy across the replicas")
    # --- supervision
    startup_timeout_s: float = field(600.0, help="time a replica may take to print its startup line", min=1.0)
    max_restarts: int = field(10, help="restarts of one replica before its supervisor (Ray's, or mode fork's "
                                       "watchdog) gives up", min=0)

    def server_args(self, bind: str) -> list[str]:
        """`opd serve-teacher` arguments of one replica bound at `bind` (torch threads not included)."""
        args = ["--model", self.model, "--backend", self.backend, "--name", self.name, "--bind", bind]
        if (self.num_gpus > 0 or self.gpus) and "--device" not in self.serve_args:
            args += ["--device", "cuda"]
        return args + list(self.serve_args)

    def server_env(self) -> dict[str, str]:
        """Environment of a server this machine starts (mode fork): the GPUs it may see."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.gpus))} if self.gpus else {}


@dataclass(frozen=True)
class StudentWorkers:
    num_workers: int = field(1, help="data-parallel student workers (1: train in the driver process)", min=1)
    num_cpus_per_worker: float = field(1.0, help="CPUs reserved per worker", min=0.0)
    num_gpus_per_worker: float = field(0.0, help="GPUs reserved per worker (one for NCCL)", min=0.0)
    backend: Literal["auto", "gloo", "nccl"] = field(
        "auto", help="torch.distributed backend; auto: nccl with GPUs, gloo without")
    strategy: Strategy = field("PACK", help="placement group strategy across the workers")
    collective_timeout_s: float = field(300.0, help="an all_reduce waiting longer than this fails the step",
                                        min=1.0)


@dataclass(frozen=True)
class ClusterConfig:
    # --- core
    mode: Literal["local", "fork", "ray"] = field(
        "local", help="local: teachers at the merge config's addresses, one training process; fork: opd train "
                      "starts `teachers` on this machine at their merge addresses, forked from it (the runtime "
                      "held once); ray: place everything on Ray")
    address: str | None = field(None, help="Ray cluster: 'auto' (the one started by `ray start` on this "
                                           "node), 'HOST:PORT' of a head, or null to start a local one")
    num_cpus: int | None = field(None, help="CPUs of a started local cluster (null: all)", min=1)
    namespace: str = field("opd", help="Ray namespace of this run's actors")
    bind: Literal["auto", "loopback", "node_ip"] = field(
        "auto", help="address teacher servers bind: auto: loopback on a one-node cluster, the node IP otherwise")
    # --- teachers and student
    teachers: list[TeacherReplicas] = field(default_factory=list,
                                            help="teacher replicas to place on Ray (mode ray) or to fork (mode "
                                                 "fork: one replica each)")
    student: StudentWorkers = field(default_factory=StudentWorkers, help="data-parallel student workers")
    # --- replica pool (client side)
    request_timeout_s: float = field(120.0, help="a replica silent this long is taken as dead and the request "
                                                 "goes to another", min=0.1)
    recheck_s: float = field(2.0, help="how often a pool re-resolves addresses and probes dead replicas",
                             min=0.05)

    def __post_init__(self):
        names = [t.name for t in self.teachers]
        if len(set(names)) != len(names):
            raise ValueError(f"teacher names must be unique, got {names}")
        pinned = [t.name for t in self.teachers if t.gpus]
        if pinned and self.mode != "fork":
            raise ValueError(f"cluster.teachers gpus is for mode fork (a server started on this machine); with mode "
                             f"{self.mode} set num_gpus instead (Ray assigns the GPUs): {pinned}")
        bad = [(t.name, g) for t in self.teachers for g in t.gpus if g < 0]
        if bad:
            raise ValueError(f"cluster.teachers gpus are CUDA device indices (0, 1, ...), got {bad}")
        if self.mode == "fork":
            many = [t.name for t in self.teachers if t.replicas != 1]
            if many:
                raise ValueError(f"cluster.mode fork starts one server per teacher; set replicas: 1 for {many} "
                                 f"(several replicas need cluster.mode ray)")

    def teacher(self, name: str) -> TeacherReplicas:
        for t in self.teachers:
            if t.name == name:
                return t
        raise KeyError(f"no teacher {name!r} in cluster.teachers (have {[t.name for t in self.teachers]})")


def connect(cfg: ClusterConfig) -> None:
    """Connect this process to Ray as `cfg` says (idempotent)."""
    import ray

    if ray.is_initialized():
        return
    if cfg.address is None:
        ray.init(num_cpus=cfg.num_cpus, namespace=cfg.namespace, include_dashboard=False)
    else:
        ray.init(address=cfg.address, namespace=cfg.namespace)


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
        from opd.cluster_teachers import TeacherGroup

        if name not in self._groups:
            self._groups[name] = TeacherGroup.start(self.cfg.teacher(name), bind=self.cfg.bind)
        return self._groups[name]

    def teacher_pool(self, name: str, **client_kwargs):
        """A client with TeacherClient's API that balances over the replicas of `name`.

        `client_kwargs` go to ReplicaPool (timeout_s, retries, backoff_s, heartbeat_s, curve, name);
        timeout_s and recheck_s default to this config's request_timeout_s and recheck_s.
        """
        from opd.cluster_pool import ReplicaPool

        if name not in self._pools:
            group = self.teacher_group(name)
            kwargs = {"timeout_s": self.cfg.request_timeout_s, "recheck_s": self.cfg.recheck_s, **client_kwargs}
            self._pools[name] = ReplicaPool(group.addresses, **kwargs)
        return self._pools[name]

    def data_parallel(self, model_dir: str, **kwargs):
        """Data-parallel student workers as configured in `cluster.student`."""
        from opd.cluster_dp import DataParallelGroup

        return DataParallelGroup.start(model_dir, self.cfg.student, **kwargs)

    def rollout_pool(self, model_dir: str, num_workers: int, **kwargs):
        """Student sampling spread over `num_workers` rollout actors (opd/cluster_rollout.py)."""
        from opd.cluster_rollout import RolloutPool

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
