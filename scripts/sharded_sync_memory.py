"""Each process's resident memory while a sharded student pushes its weights into rank 0's vLLM
engine (opd.spine.engine): the measurement behind docs/multi_machine.md's "vLLM rollouts beside
a sharded student" figures.

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 torchrun --nproc-per-node 2 \\
        scripts/sharded_sync_memory.py MODEL_DIR [BUCKET_MIB]

A sampler thread reads the RSS of this rank (and on rank 0 of the engine's processes) every
10 ms through the second of two syncs; one JSON line per rank: RSS just before it and its peak
during it, in MiB, the model's size, and the sync's seconds.
"""

import json
import sys
import threading
import time

import psutil
import torch.distributed as dist

from opd.spine.config import ModelConfig, RolloutConfig
from opd.spine.dist import init_world
from opd.spine.model import load_policy, make_engine


def rss(procs) -> float:
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def main() -> None:
    world = init_world("cpu")
    cfg = ModelConfig(path=sys.argv[1], device="cpu")
    model, tok = load_policy(cfg, seed=0, world=world)
    engine = make_engine(RolloutConfig(engine="vllm", vllm_max_model_len=256), cfg, model, tok, seed=0, world=world)
    if len(sys.argv) > 2:
        engine.bucket_bytes = int(float(sys.argv[2]) * 2**20)
    me = psutil.Process()
    children = me.children(recursive=True) if world.main else []
    engine.sync_weights(model)        # the first sync after the engine's start: caches warm
    before = {"rank": rss([me]), "engine": rss(children)}
    peak = dict(before)
    done = threading.Event()


    def sample() -> None:
        while not done.is_set():
            peak["rank"] = max(peak["rank"], rss([me]))
            peak["engine"] = max(peak["engine"], rss(children))
            time.sleep(0.01)


    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    engine.sync_weights(model)
    seconds = time.perf_counter() - t0
    done.set()
    thread.join()
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20   # the whole model (a DTensor's numel)
    print(json.dumps({"rank": world.rank, "bucket_MiB": engine.bucket_bytes / 2**20, "sync_s": round(seconds, 2),
                      "model_MiB": round(size, 1), "rss_before_MiB": round(before["rank"]),
                      "rss_peak_MiB": round(peak["rank"]), "engine_rss_before_MiB": round(before["engine"]),
                      "engine_rss_peak_MiB": round(peak["engine"])}), flush=True)
    engine.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":   # vLLM's workers spawn and import this file again
    main()
