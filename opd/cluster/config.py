"""The `cluster:` section of `opd train` and `opd rl`: where teacher replicas, rollout actors
and the student's ranks run.

    ClusterConfig    mode local | fork | ray, the Ray address, and the lists below
    TeacherReplicas  one teacher's `opd serve-teacher` processes: model, backend, replicas,
                     resources, placement strategy, supervision
    StudentWorkers   the student's ranks: how many the model is sharded over (FSDP2), in
                     which precision, offloaded or not, and with mode ray where Ray places them
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
    model: str = field(help="model directory (the same on every node, e.g. a shared filesystem); `self`: the "
                            "student's start (student.path), frozen: a teacher for self-distillation")
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
    # --- how many ranks, in which precision
    num_workers: int = field(1, help="ranks the student (or policy) is sharded over with FSDP2; more than 1 "
                                     "starts them (torchrun's launcher on this machine, or Ray actors with "
                                     "cluster.mode ray; or run the command under torchrun), each rank sampling "
                                     "and training on its share of every step", min=1)
    mixed_precision: Literal["auto", "bf16", "none"] = field(
        "auto", help="sharded: bf16: compute in bf16 with fp32 master shards and fp32 gradient reduction; none: "
                     "in the weights' dtype; auto: bf16 on CUDA, none on the CPU")
    cpu_offload: bool = field(False, help="sharded: keep the shards and their optimizer state in CPU memory")
    backend: Literal["auto", "gloo", "nccl"] = field(
        "auto", help="torch.distributed backend; auto: nccl with GPUs, gloo without")
    collective_timeout_s: float = field(300.0, help="a collective waiting longer than this fails the step",
                                        min=1.0)
    # --- cluster.mode ray: where Ray places the ranks (one placement-group bundle per rank)
    num_cpus_per_worker: float = field(1.0, help="cluster.mode ray: CPUs reserved per rank", min=0.0)
    num_gpus_per_worker: float | None = field(
        None, help="cluster.mode ray: GPUs reserved per rank; null: 1 when the Ray cluster has GPUs and the "
                   "student's device is not cpu, else 0", min=0.0)
    strategy: Strategy = field("PACK", help="cluster.mode ray: placement-group strategy across the ranks; PACK "
                                            "fills a node before the next, STRICT_PACK keeps them on one node")
    placement_timeout_s: float = field(600.0, help="cluster.mode ray: how long to wait for the cluster to "
                                                   "reserve every rank's bundle", min=1.0)

    def __post_init__(self):
        if self.num_cpus_per_worker == 0 and self.num_gpus_per_worker == 0:
            raise ValueError("num_cpus_per_worker and num_gpus_per_worker are both 0: a rank's placement-group "
                             "bundle must reserve something (Ray refuses an empty bundle)")

    def precision(self) -> bool | None:
        """load_policy's mixed_precision: None (auto) decides by the device."""
        return None if self.mixed_precision == "auto" else self.mixed_precision == "bf16"


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
    student: StudentWorkers = field(default_factory=StudentWorkers,
                                    help="the ranks the student is sharded over (FSDP2)")
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
        if self.ranks_on_ray and self.teachers:
            # Only rank 0 starts what cluster.mode starts (the trainer's main_first); the other
            # ranks would have no pool of these replicas.
            raise ValueError(f"cluster.teachers {names} with the student's ranks on Ray (mode ray, "
                             f"student.num_workers {self.student.num_workers}) is not supported yet: serve those "
                             f"teachers yourself (opd serve-teacher, or a run of their own) and give their "
                             f"addresses in merge.teachers")
        if self.mode == "fork":
            many = [t.name for t in self.teachers if t.replicas != 1]
            if many:
                raise ValueError(f"cluster.mode fork starts one server per teacher; set replicas: 1 for {many} "
                                 f"(several replicas need cluster.mode ray)")

    @property
    def ranks_on_ray(self) -> bool:
        """The student's ranks run as Ray actors (opd/cluster/ranks.py), not under torchrun."""
        return self.mode == "ray" and self.student.num_workers > 1

    def teacher(self, name: str) -> TeacherReplicas:
        for t in self.teachers:
            if t.name == name:
                return t
        raise KeyError(f"no teacher {name!r} in cluster.teachers (have {[t.name for t in self.teachers]})")
