"""The teachers an `opd train` run starts itself, before it connects to them (`cluster.mode`).

  local  nothing: the teachers at the merge config's addresses are already serving;
  ray    join (or start) a Ray cluster and its teacher replicas (opd.cluster.session);
  fork   fork each of `cluster.teachers` from the trainer right after its imports, bound at
         its merge address (`tcp://127.0.0.1:*` picks a port), seeing only its `gpus` when
         they are given (CUDA_VISIBLE_DEVICES). The child shares the trainer's
         imported runtime copy-on-write instead of loading its own (measured in docs/train.md),
         and gets SIGTERM if the trainer dies (opd.teachers.launch).

A forked child hangs in the first multi-threaded op if its parent has used OpenMP, so only a
process that has computed nothing yet may fork (`fork=True`, what `opd train` passes); other
callers (a notebook, a test) get subprocesses, which hold their own copy of the runtime.

A watchdog thread restarts a server that dies (up to the teacher's `max_restarts`), at the
address it had and as a subprocess: by then the trainer has computed, so forking is unsafe.
The clients meanwhile reconnect, check the new server's fingerprints in its WELCOME and
resend what was outstanding (opd.teachers.client), within `teacher_client.timeout_s`.
"""

from __future__ import annotations

import subprocess
import threading
from dataclasses import replace
from pathlib import Path

from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

# The teacher server's modules, imported before the fork so that a forked server finds them on
# pages it shares with the trainer (`_preload`).
import opd.teachers.serve  # noqa: F401
from opd.cluster.session import RayCluster
from opd.spine.optim import TrainError
from opd.teachers import launch


class RunTeachers:
    """The teacher servers and Ray session this run started; `close()` stops what it started."""

    def __init__(self, out: Path, fork: bool):
        self.out = out                # the run's folder: forked servers log to OUT/teachers/NAME.log
        self.fork = fork
        self.servers: dict = {}       # mode fork: {teacher name: ServerProcess}
        self.cluster = None           # mode ray: the RayCluster
        self._ray_started = False     # a Ray session this run opened is closed by it
        self.restarts: dict[str, int] = {}   # mode fork: restarts per teacher
        self.events: list[str] = []          # what the watchdog did, for the training card
        self._specs: dict = {}               # teacher name -> its cluster.teachers entry
        self._lock = threading.Lock()        # the watchdog's polls and restarts vs stop_servers
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None

    def start(self, cfg):
        """Start what `cfg.cluster.mode` asks for; returns `cfg` with the addresses the forked
        servers bound (a port `*` becomes the one picked)."""
        if cfg.cluster.mode == "ray":
            self.cluster = self._start_ray(cfg.cluster)
        if cfg.cluster.mode != "fork":
            return cfg
        bound = {}
        for t in cfg.cluster.teachers:
            self._specs[t.name] = t
            log = self.out / "teachers" / f"{t.name}.log"
            try:
                server = self._start_server(t, _args(t, cfg.merge.teacher(t.name).address), log)
            except RuntimeError as e:
                self.stop_servers()
                raise TrainError(f"cluster.teachers {t.name!r} did not start: {e}") from None
            self.servers[t.name] = server
            bound[t.name] = server.address
            forked = not isinstance(server.proc, subprocess.Popen)  # a subprocess's output is in server.output
            print(f"teacher {t.name!r} serving at {server.address} (pid {server.proc.pid}"
                  f"{f', GPUs {t.gpus}' if t.gpus else ''}{f', log {log}' if forked else ''})", flush=True)
        teachers = [replace(s, address=bound.get(s.name, s.address)) for s in cfg.merge.teachers]
        # Started after the forks: a process with threads running refuses to fork (ForkUnsafe).
        self._watchdog = threading.Thread(target=self._watch, name="teacher-watchdog", daemon=True)
        self._watchdog.start()
        return replace(cfg, merge=replace(cfg.merge, teachers=teachers))

    def _watch(self, interval_s: float = 1.0) -> None:
        # The thread lives until stop_servers: the servers it restarts die with it (die_with_parent).
        while not self._stopping.wait(interval_s):
            with self._lock:
                for name, server in list(self.servers.items()):
                    try:
                        code = server.proc.poll()
                        if code is not None and not self._stopping.is_set() \
                                and self.restarts.get(name, 0) < self._specs[name].max_restarts:
                            self._restart(name, server, code)
                    except Exception as e:  # noqa: BLE001 - keep watching the others
                        self._event(f"teacher {name!r}: watchdog error {type(e).__name__}: {e}")

    def _restart(self, name: str, dead, code: int) -> None:
        t = self._specs[name]
        self.restarts[name] = self.restarts.get(name, 0) + 1
        what = f"teacher {name!r} (pid {dead.proc.pid}) exited with {code}"
        try:
            server = launch.start_server_process(_args(t, dead.address), timeout_s=t.startup_timeout_s, threads=None,
                                          die_with_parent=True, env=t.server_env())
        except RuntimeError as e:
            self._event(f"{what}; restart {self.restarts[name]} of {t.max_restarts} failed: {str(e)[-500:]}")
            return
        self.servers[name] = server
        self._event(f"{what}; restarted at {server.address} as pid {server.proc.pid}, a subprocess (restart "
                    f"{self.restarts[name]} of {t.max_restarts})")

    def _event(self, msg: str) -> None:
        self.events.append(msg)
        print(msg, flush=True)

    def _start_ray(self, cluster_cfg):
        import ray   # optional, and about a second to import: only mode ray needs it

        self._ray_started = not ray.is_initialized()
        try:
            return RayCluster.start(cluster_cfg)
        except Exception as e:
            if self._ray_started:
                ray.shutdown()
            raise TrainError(f"cluster.mode: ray: could not start the teacher replicas ({type(e).__name__}: {e})") \
                from None

    def _start_server(self, t, args: list[str], log: Path):
        try:
            if not self.fork:
                raise launch.ForkUnsafe("Trainer(fork_teachers=False)")
            _preload(t.model)
            return launch.fork_server(args, log_path=log, timeout_s=t.startup_timeout_s, env=t.server_env())
        except launch.ForkUnsafe as e:
            print(f"teacher {t.name!r}: not forked ({e}); started as a subprocess, which holds its own copy "
                  f"of the runtime", flush=True)
            return launch.start_server_process(args, timeout_s=t.startup_timeout_s, threads=None, die_with_parent=True,
                                        env=t.server_env())

    def stop_servers(self) -> None:
        """SIGTERM to the servers this run started (they drain); the caller closes its clients first."""
        self._stopping.set()
        with self._lock:   # a restart under way finishes first, and is stopped with the others
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


def _args(t, bind: str) -> list[str]:
    """`opd serve-teacher` arguments of teacher `t` (a cluster.teachers entry) bound at `bind`."""
    args = t.server_args(bind)
    return args if "--threads" in args else args + ["--threads", str(max(1, int(t.num_cpus)))]


def _preload(model_dir: str) -> None:
    """Import what loading this teacher imports (its architecture's module; the server's modules,
    opd.teachers.serve and its backends, are imported with this one), so the forked server finds it on pages it shares with the
    trainer; errors are the server's to report."""
    try:
        MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model_dir))]
    except (KeyError, OSError, ValueError):
        pass
