"""What the sharded tests share: commands run as subprocesses with one OpenMP thread, a command
run on 1 and on 2 ranks, and a worker script run under torchrun that reports per rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
LABEL = {1: "1 process", 2: "2 torchrun ranks", "ray": "2 Ray actors"}


def opd(*args, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opd.cli", *map(str, args)], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def both(command: str, cwd: Path, yaml_text: str, ray_cluster: str | None = None,
         timeout: float = 300) -> dict[int | str, Path]:
    """Run `opd COMMAND` on 1 and on 2 ranks (torchrun's launcher) and, given `ray_cluster` (a
    cluster section with mode ray), on 2 Ray actors ("ray"); {ranks: run directory}. The
    template's {out} is the run directory, {ranks} the rank count, {cluster} the cluster section."""
    out = {}
    for ranks in (1, 2) + (("ray",) if ray_cluster else ()):
        path = cwd / f"run{ranks}.yaml"
        cluster = ray_cluster if ranks == "ray" else f"{{student: {{num_workers: {ranks}}}}}"
        path.write_text(yaml_text.format(out=f"out{ranks}", ranks=2 if ranks == "ray" else ranks, cluster=cluster))
        t0 = time.monotonic()
        r = opd(command, path, cwd=cwd, timeout=timeout)
        assert r.returncode == 0, r.stderr[-3000:]
        assert ("2 ranks on Ray" in r.stdout) == (ranks == "ray"), r.stdout[-3000:]   # not torchrun's, and back
        print(f"\n{cwd.name}: opd {command}, {LABEL[ranks]}: {time.monotonic() - t0:.1f} s")
        out[ranks] = cwd / f"out{ranks}"
    return out


def worker_reports(script: str, *args, out: Path, timeout: float = 300) -> list[dict]:
    """Run tests/spine/SCRIPT under torchrun on 2 ranks (its last argument is `out`); each rank's
    JSON report, written to OUT.RANK, in rank order."""
    worker = Path(__file__).with_name(script)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(worker),
                          *map(str, args), str(out)], env=ENV, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
