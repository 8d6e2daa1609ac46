"""Each rank's resident memory while `load_policy` loads a model sharded over the ranks: the
measurement behind docs/multi_machine.md's "Loading" figures.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 scripts/sharded_load_memory.py MODEL_DIR

Prints one JSON line per rank: RSS after the imports, after the load, and the process's peak
(ru_maxrss), in MiB. Run it with PYTHONPATH=<another checkout> to measure that code instead.
"""

import json
import os
import resource
import sys

import psutil
import torch.distributed as dist

import opd
from opd.spine.config import ModelConfig
from opd.spine.dist import init_world
from opd.spine.model import load_policy

world = init_world("cpu")
proc = psutil.Process()
before = proc.memory_info().rss
model, _ = load_policy(ModelConfig(path=sys.argv[1], device="cpu"), seed=0, world=world)
after = proc.memory_info().rss
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # KiB on Linux
print(json.dumps({"rank": world.rank, "code": os.path.dirname(opd.__file__), "rss_after_imports_MiB": before / 2**20,
                  "rss_after_load_MiB": after / 2**20, "peak_rss_MiB": peak / 2**20}), flush=True)
dist.barrier()
dist.destroy_process_group()
