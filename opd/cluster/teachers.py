"""Teacher replicas as Ray actors: Ray places and supervises, ZeroMQ carries the data.

Each `TeacherReplica` actor starts one `opd serve-teacher` process with
`opd.teachers.launch.start_server_process` (the launch path local mode uses), reports the
server's ZeroMQ address and fingerprints, and supervises it: a background thread notices
the process exiting (crash, OOM kill, SIGKILL) and starts it again on the same port when
it can, on a fresh one otherwise. The actor never touches a request; clients connect to
the server directly (teachers/pool.py), so logits never enter Ray's object store.

A `TeacherGroup` is the N replicas of one teacher. Their resources (CPUs, GPUs) are
reserved together in one placement group (SPREAD across nodes by default), so a replica
never starts on a node that cannot hold it. Ray sets CUDA_VISIBLE_DEVICES in the actor,
and the server process inherits it.

Bind address: loopback when the cluster has one node; the node's IP otherwise, which
`opd serve-teacher` refuses without CURVE keys (or `--insecure` in `serve_args`).

Ray is imported inside the functions that use it (optional, about a second to import).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import threading
import time

from opd.cluster.config import TeacherReplicas
from opd.teachers.launch import start_server_process

log = logging.getLogger("opd.cluster.teachers")


class TeacherReplica:
    """One supervised `opd serve-teacher` process (used as a Ray actor)."""

    def __init__(self, spec: TeacherReplicas, index: int, bind: str, poll_s: float = 0.2):
        import ray

        self.spec, self.index, self.poll_s = spec, index, poll_s
        self.host = "127.0.0.1" if bind == "loopback" else ray.util.get_node_ip_address()
        self.restarts = 0
        self.gave_up: str | None = None
        self._port: str = "*"
        self._server = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        # Servers are started from this one thread, which lives as long as the actor: each gets
        # SIGTERM from Linux when its starting thread ends (die_with_parent), so an actor that
        # crashes (Ray runs no cleanup then) leaves no server holding its GPU behind.
        self._launcher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="teacher-launch")
        self._start()
        threading.Thread(target=self._supervise, name=f"supervise-{spec.name}-{index}", daemon=True).start()

    def _args(self, port: str) -> list[str]:
        return self.spec.server_args(f"tcp://{self.host}:{port}")

    def _start(self) -> None:
        threads = max(1, int(self.spec.num_cpus))

        def start(port: str):
            return self._launcher.submit(start_server_process, self._args(port), timeout_s=self.spec.startup_timeout_s,
                                         threads=threads, die_with_parent=True).result()

        try:
            server = start(self._port)
        except RuntimeError:
            if self._port == "*":
                raise
            log.warning("%s[%d]: port %s unavailable after restart; binding a fresh one",
                        self.spec.name, self.index, self._port)
            server = start("*")
        self._server = server
        self._port = server.address.rsplit(":", 1)[1]  # restarts come back on the same port when they can

    def _supervise(self) -> None:
        while not self._stopping.wait(self.poll_s):
            self.ensure_alive()

    def ensure_alive(self) -> dict:
        """Restart the server if its process has exited; return `info()`."""
        with self._lock:
            if self._stopping.is_set() or self.gave_up or self._server.proc.poll() is None:
                return self.info()
            code = self._server.proc.returncode
            if self.restarts >= self.spec.max_restarts:
                self.gave_up = f"exited with {code} after {self.restarts} restarts (max_restarts)"
                log.error("%s[%d]: server %s; not restarting", self.spec.name, self.index, self.gave_up)
                return self.info()
            self.restarts += 1
            log.warning("%s[%d]: server exited with %s; restart %d", self.spec.name, self.index, code, self.restarts)
            try:
                self._start()
            except RuntimeError as e:
                log.error("%s[%d]: restart failed: %s", self.spec.name, self.index, e)
            return self.info()

    def info(self) -> dict:
        """address (None while the server is down), fingerprints, pid, restarts."""
        s = self._server
        up = s is not None and s.proc.poll() is None
        return dict(name=self.spec.name, index=self.index, address=s.address if up else None,
                    model_fingerprint=s.model_fingerprint if s else None,
                    tokenizer_fingerprint=s.tokenizer_fingerprint if s else None,
                    pid=s.proc.pid if up else None, restarts=self.restarts, gave_up=self.gave_up,
                    node_ip=self.host)

    def address(self) -> str | None:
        return self.info()["address"]

    def output(self, last: int = 40) -> list[str]:
        """The server's last printed lines (for error messages)."""
        return list(self._server.output[-last:]) if self._server else []

    def kill_server(self) -> int:
        """SIGKILL the server process (fault tests); the supervisor restarts it."""
        pid = self._server.proc.pid
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            if self._server is not None:
                self._server.stop()


def resolve_bind(bind: str) -> str:
    """'loopback' or 'node_ip'; auto picks loopback on a one-node cluster."""
    import ray

    if bind != "auto":
        return bind
    return "loopback" if sum(1 for n in ray.nodes() if n.get("Alive")) <= 1 else "node_ip"


class TeacherGroup:
    """The N supervised replicas of one teacher, in one placement group."""

    def __init__(self, spec: TeacherReplicas, actors: list, placement_group):
        self.spec, self.actors, self.placement_group = spec, actors, placement_group

    @classmethod
    def start(cls, spec: TeacherReplicas, *, bind: str = "auto") -> "TeacherGroup":
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {k: v for k, v in {"CPU": spec.num_cpus, "GPU": spec.num_gpus}.items() if v}
        pg = None
        if bundle:  # Ray refuses all-zero bundles
            pg = placement_group([dict(bundle)] * spec.replicas, strategy=spec.strategy)
            ready, _ = ray.wait([pg.ready()], timeout=spec.startup_timeout_s)
            if not ready:
                ray.util.remove_placement_group(pg)
                raise TimeoutError(f"teacher {spec.name!r}: the cluster could not reserve {spec.replicas} x {bundle} "
                                   f"({spec.strategy}) within {spec.startup_timeout_s:.0f}s; lower "
                                   f"cluster.teachers[{spec.name}].replicas or its num_cpus/num_gpus, or add nodes")
        where = resolve_bind(bind)
        actor_cls = ray.remote(TeacherReplica)
        actors = []
        for i in range(spec.replicas):
            opts = dict(num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, max_concurrency=4,
                        max_restarts=spec.max_restarts)  # a dead actor process is restarted by Ray itself
            if pg is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
            actors.append(actor_cls.options(**opts).remote(spec, i, where))
        group = cls(spec, actors, pg)
        try:
            infos = ray.get([a.info.remote() for a in actors], timeout=spec.startup_timeout_s + 60)
        except Exception:
            group.shutdown()
            raise
        prints = {(i["model_fingerprint"], i["tokenizer_fingerprint"]) for i in infos}
        if len(prints) != 1:
            group.shutdown()
            raise RuntimeError(f"teacher {spec.name!r}: replicas report different fingerprints {sorted(prints)}; "
                               f"every node must hold the same model at {spec.model}")
        return group

    def infos(self, timeout_s: float = 10.0) -> list[dict | None]:
        """Each replica's info; None for a replica whose actor does not answer."""
        import ray

        out = []
        for ref in [a.info.remote() for a in self.actors]:
            try:
                out.append(ray.get(ref, timeout=timeout_s))
            except Exception:
                out.append(None)
        return out

    def addresses(self) -> list[str]:
        """ZeroMQ addresses of the replicas whose server is up now (ReplicaPool's resolver)."""
        return [i["address"] for i in self.infos() if i and i["address"]]

    def kill_server(self, index: int) -> int:
        import ray

        return ray.get(self.actors[index].kill_server.remote())

    def wait_until_up(self, timeout_s: float | None = None) -> list[dict]:
        """Block until every replica's server is up (e.g. after a restart)."""
        deadline = time.monotonic() + (timeout_s or self.spec.startup_timeout_s)
        while True:
            infos = self.infos()
            if all(i and i["address"] for i in infos):
                return infos
            if time.monotonic() > deadline:
                raise TimeoutError(f"teacher {self.spec.name!r}: replicas not all up: {infos}")
            time.sleep(0.2)

    def shutdown(self) -> None:
        import ray

        stops = [a.stop.remote() for a in self.actors]
        try:
            ray.get(stops, timeout=60)
        except Exception as e:  # an actor already gone: its server went with it
            log.warning("teacher %s: stopping replicas: %s", self.spec.name, e)
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
