"""The teachers an `opd train` run starts itself, before it connects to them (`cluster.mode`).

  local  nothing: the teachers at the merge config's addresses are already serving;
  ray    join (or start) a Ray cluster and its teacher replicas (opd.cluster);
  fork   fork each of `cluster.teachers` from the trainer right after its imports, bound at
         its merge address (`tcp://127.0.0.1:*` picks a port). The child shares the trainer's
         imported runtime copy-on-write instead of loading its own (~260 MiB less per teacher,
         README), and gets SIGTERM if the trainer dies (opd.teachers.launch).

A forked child hangs in the first multi-threaded op if its parent has used OpenMP, so only a
process that has computed nothing yet may fork (`fork=True`, what `opd train` passes); other
callers (a notebook, a test) get subprocesses, which hold their own copy of the runtime.
"""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path

from opd.train_teachers import TrainError


class RunTeachers:
    """The teacher servers and Ray session this run started; `close()` stops what it started."""

    def __init__(self, out: Path, fork: bool):
        self.out = out                # the run's folder: forked servers log to OUT/teachers/NAME.log
        self.fork = fork
        self.servers: dict = {}       # mode fork: {teacher name: ServerProcess}
        self.cluster = None           # mode ray: the RayCluster
        self._ray_started = False     # a Ray session this run opened is closed by it

    def start(self, cfg):
        """Start what `cfg.cluster.mode` asks for; returns `cfg` with the addresses the forked
        servers bound (a port `*` becomes the one picked)."""
        if cfg.cluster.mode == "ray":
            self.cluster = self._start_ray(cfg.cluster)
        if cfg.cluster.mode != "fork":
            return cfg
        bound = {}
        for t in cfg.cluster.teachers:
            args = t.server_args(cfg.merge.teacher(t.name).address)
            if "--threads" not in args:
                args += ["--threads", str(max(1, int(t.num_cpus)))]
            log = self.out / "teachers" / f"{t.name}.log"
            try:
                server = self._start_server(t, args, log)
            except RuntimeError as e:
                self.stop_servers()
                raise TrainError(f"cluster.teachers {t.name!r} did not start: {e}") from None
            self.servers[t.name] = server
            bound[t.name] = server.address
            forked = not isinstance(server.proc, subprocess.Popen)  # a subprocess's output is in server.output
            print(f"teacher {t.name!r} serving at {server.address} (pid {server.proc.pid}"
                  f"{f', log {log}' if forked else ''})", flush=True)
        teachers = [replace(s, address=bound.get(s.name, s.address)) for s in cfg.merge.teachers]
        return replace(cfg, merge=replace(cfg.merge, teachers=teachers))

    def _start_ray(self, cluster_cfg):
        import ray

        from opd.cluster import RayCluster

        self._ray_started = not ray.is_initialized()
        try:
            return RayCluster.start(cluster_cfg)
        except Exception as e:
            if self._ray_started:
                ray.shutdown()
            raise TrainError(f"cluster.mode: ray: could not start the teacher replicas ({type(e).__name__}: {e})") \
                from None

    def _start_server(self, t, args: list[str], log: Path):
        from opd.teachers.launch import ForkUnsafe, fork_server, start_server_process

        try:
            if not self.fork:
                raise ForkUnsafe("Trainer(fork_teachers=False)")
            _preload(t.model)
            return fork_server(args, log_path=log, timeout_s=t.startup_timeout_s)
        except ForkUnsafe as e:
            print(f"teacher {t.name!r}: not forked ({e}); started as a subprocess, which holds its own copy "
                  f"of the runtime", flush=True)
            return start_server_process(args, timeout_s=t.startup_timeout_s, threads=None)

    def stop_servers(self) -> None:
        """SIGTERM to the servers this run started (they drain); the caller closes its clients first."""
        for name, server in self.servers.items():
            code = server.stop()
            if code != 0:
                print(f"teacher {name!r} (pid {server.proc.pid}) exited with {code}", flush=True)
        self.servers = {}

    def close(self) -> None:
        self.stop_servers()
        if self.cluster is not None:
            self.cluster.shutdown(disconnect=self._ray_started)
            self.cluster = None


def _preload(model_dir: str) -> None:
    """Import what loading this teacher imports (its architecture's module, the server), so the
    forked server finds it on pages it shares with the trainer; errors are the server's to report."""
    import opd.teachers.hf_backend  # noqa: F401
    import opd.teachers.server  # noqa: F401

    try:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model_dir))]
    except (KeyError, OSError, ValueError):
        pass
