"""The student's ranks as Ray actors: `cluster.mode: ray` with `cluster.student.num_workers: N > 1`.

torchrun's launcher (opd.spine.dist.launch) starts N processes on this machine, each running
`python -m opd.cli ARGV` with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set.
Here Ray places the N processes instead, on any nodes of the cluster, and each runs that same
module with the same arguments and the same variables:

    1. a placement group reserves one bundle per rank ({CPU: num_cpus_per_worker, GPU:
       num_gpus_per_worker}, `strategy` PACK by default), so that all ranks start together or
       none does;
    2. one `RankActor` per bundle reports its node and GPUs; rank 0's actor picks a free port
       on its node: MASTER_ADDR is that node's IP, MASTER_PORT the port;
    3. every actor runs `opd.cli` as `python -m` would (runpy), with RANK = its bundle index,
       LOCAL_RANK its place on its node and, with GPUs, CUDA_VISIBLE_DEVICES = all the GPUs of
       its node's ranks (as torchrun's processes see them; NCCL's peer-to-peer paths need the
       peers visible) so that cuda:LOCAL_RANK is its own. init_world then joins the process
       group exactly as under torchrun: NCCL on GPUs, gloo on the CPU;
    4. the launcher waits for all of them; the first rank to fail (an error, a non-zero exit,
       its actor process dying) is named, and the others are killed rather than left waiting
       for a collective until its timeout;
    5. the actors and the placement group are removed at the end, after a failure too, and a
       Ray session this process started is shut down.

Ray carries only the arguments and the exit codes; the ranks talk to each other through
torch.distributed, and rank 0 writes the run directory (which must be on a filesystem every
node shares when the ranks span nodes). This module imports neither torch nor Ray at the top:
the training CLIs import it before their config is known to need either.
"""

from __future__ import annotations

import os
import runpy
import socket
import sys

from opd.cluster.config import ClusterConfig
from opd.cluster.connect import connect
from opd.errors import TrainError


class RankActor:
    """One rank's process (a Ray actor). It runs one command and is then killed by the launcher."""

    def place(self) -> dict:
        """Where Ray put this actor: its node, that node's IP and the GPUs it was given."""
        import ray

        ctx = ray.get_runtime_context()
        return {"node": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "gpus": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]}

    def free_port(self) -> int:
        """A TCP port free on this node now: rank 0's TCPStore (the rendezvous) binds it."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def run(self, module: str, argv: list[str], env: dict[str, str], cwd: str) -> int:
        """`python -m MODULE ARGV` in this process with `env` added, from `cwd`; its exit code. An
        exception the command does not turn into an exit code reaches the launcher as Ray's
        RayTaskError, with its traceback."""
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = [module, *argv]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return 0


def launcher(cluster: ClusterConfig, device: str):
    """What starts a command's ranks for opd.spine.dist.ranks_for: these Ray actors when the
    student's ranks are on Ray, else None (torchrun's launcher)."""
    if not cluster.ranks_on_ray:
        return None
    return lambda argv, n: launch(argv, cluster, device)


def launch(argv: list[str], cluster: ClusterConfig, device: str = "auto", module: str = "opd.cli") -> int:
    """`python -m MODULE ARGV` on cluster.student.num_workers ranks placed by Ray (module
    docstring). Returns 0 once every rank exited 0, or raises TrainError naming the first rank
    that failed and how; the other ranks have then been stopped."""
    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    spec, n = cluster.student, cluster.student.num_workers
    try:
        started = connect(cluster)
    except (ConnectionError, RuntimeError) as e:
        raise TrainError(f"cluster.mode ray: could not join or start Ray (cluster.address "
                         f"{cluster.address!r}): {e}") from None
    pg, actors = None, []
    try:
        bundle, pg = _reserve(ray, spec, device, fixed_size=started)
        actor_cls = ray.remote(RankActor)
        actors = [actor_cls.options(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_restarts=0,
                                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                                        pg, placement_group_bundle_index=i)).remote() for i in range(n)]
        places = ray.get([a.place.remote() for a in actors])
        port = ray.get(actors[0].free_port.remote())
        envs = rank_envs(places, master=(places[0]["ip"], port))
        print(f"{n} ranks on Ray ({spec.strategy}, {bundle} each): "
              + ", ".join(f"rank {r} pid {p['pid']} on {p['ip']}{' GPU ' + ','.join(p['gpus']) if p['gpus'] else ''}"
                          for r, p in enumerate(places)), flush=True)
        cwd = os.getcwd()   # the command's relative paths: the same directory on every node
        runs = {actors[r].run.remote(module, list(argv), envs[r], cwd): r for r in range(n)}
        failed = _first_failure(ray, runs)
        if failed is not None:
            rank, how = failed
            raise TrainError(f"rank {rank} of {n} failed ({how}); the other ranks were stopped. Its output is "
                             f"above; --resume continues from the last checkpoint")
        return 0
    finally:
        # A rank still running is waiting for a collective the failed one will never join.
        for a in actors:
            ray.kill(a, no_restart=True)
        if pg is not None:
            remove_placement_group(pg)
        if started:
            ray.shutdown()


def _reserve(ray, spec, device: str, fixed_size: bool):
    """(bundle, placement group) of one bundle per rank, once Ray has reserved them all. A
    cluster of `fixed_size` (the local one this run started) that cannot hold them is refused
    at once: waiting would not grow it."""
    from ray.util.placement_group import placement_group, remove_placement_group

    n, gpus = spec.num_workers, spec.num_gpus_per_worker
    if gpus is None:   # auto: a GPU per rank where there are GPUs and the student may use them
        gpus = 1.0 if not device.startswith("cpu") and ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
    bundle = {k: v for k, v in {"CPU": spec.num_cpus_per_worker, "GPU": gpus}.items() if v}
    have = ray.cluster_resources()
    short = {k: (n * v, have.get(k, 0)) for k, v in bundle.items() if n * v > have.get(k, 0)}
    if short and fixed_size:
        raise TrainError(f"cluster.mode ray: {n} ranks x {bundle} need more than the local Ray cluster this run "
                         f"started has ({', '.join(f'{k} {need:g} > {got:g}' for k, (need, got) in short.items())}): "
                         f"raise cluster.num_cpus, or lower cluster.student.num_workers or its num_cpus_per_worker / "
                         f"num_gpus_per_worker")
    pg = placement_group([dict(bundle)] * n, strategy=spec.strategy)
    ready, _ = ray.wait([pg.ready()], timeout=spec.placement_timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise TrainError(f"cluster.mode ray: the cluster could not reserve {n} x {bundle} ({spec.strategy}) for the "
                         f"student's ranks within {spec.placement_timeout_s:.0f} s (placement_timeout_s); lower "
                         f"cluster.student.num_workers, num_cpus_per_worker or num_gpus_per_worker, or add nodes")
    return bundle, pg


def rank_envs(places: list[dict], master: tuple[str, int]) -> list[dict[str, str]]:
    """The variables torchrun would give each rank, from where Ray placed it (RankActor.place,
    in rank order): RANK is the bundle index, LOCAL_RANK its place among its node's ranks or,
    with GPUs, the index of its first GPU among the GPUs of its node's ranks, which become
    every one of those ranks' CUDA_VISIBLE_DEVICES."""
    by_node: dict[str, list[int]] = {}
    for r, p in enumerate(places):
        by_node.setdefault(p["node"], []).append(r)
    envs = []
    for r, p in enumerate(places):
        peers = by_node[p["node"]]
        env = {"RANK": str(r), "WORLD_SIZE": str(len(places)), "LOCAL_RANK": str(peers.index(r)),
               "LOCAL_WORLD_SIZE": str(len(peers)), "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])}
        if p["gpus"]:
            visible = sorted({g for q in peers for g in places[q]["gpus"]}, key=lambda g: (len(g), g))
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
            env["LOCAL_RANK"] = str(visible.index(p["gpus"][0]))
        envs.append(env)
    return envs


def _first_failure(ray, runs: dict, grace_s: float = 5.0) -> tuple[int, str] | None:
    """Wait for every rank of `runs` ({ObjectRef: rank}); None when all exited 0, else (rank, how)
    of the rank that failed first. A rank whose peer died fails too, in its next collective (gloo:
    "connection closed by peer"), possibly before Ray reports the death: so once one rank has
    failed, the others have `grace_s` to come back, and a rank whose process died is named before
    one that raised, and one that raised before one that exited non-zero."""
    pending, failures = list(runs), []
    while pending and not failures:
        done, pending = ray.wait(pending, num_returns=1)
        failures = [f for f in [_failure(ray, runs[done[0]], done[0])] if f]
    if failures and pending:
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s)
        failures += [f for f in (_failure(ray, runs[ref], ref) for ref in done) if f]
    if not failures:
        return None
    _, rank, how = min(failures, key=lambda f: f[0])   # stable: the earliest of the gravest kind
    return rank, how


def _failure(ray, rank: int, ref) -> tuple[int, int, str] | None:
    """(gravity, rank, how) of the rank behind `ref`, or None when it exited 0: 0 its actor's
    process died (killed, out of memory, a crash), 1 it raised (the traceback is printed here,
    as a torchrun rank prints its own), 2 it exited non-zero."""
    try:
        code = ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        print(str(e), file=sys.stderr, flush=True)
        cause = e.cause if getattr(e, "cause", None) is not None else e
        last = str(cause).strip().splitlines()
        return 1, rank, f"{type(cause).__name__}: {last[-1] if last else ''}"
    except ray.exceptions.RayActorError as e:
        return 0, rank, f"its Ray actor's process died: {str(e).strip().splitlines()[0]}"
    return None if code == 0 else (2, rank, f"exit code {code}")
