#!/usr/bin/env bash
# The GPU checks, in one go, on a CUDA machine that has torch and
# triton but not this project's venv: run from the repository root, `bash scripts/gpu_check.sh`.
#   1. the Triton kernels compiled for the GPU vs the fp64 reference (tests/kernels/test_kernels_cuda.py)
#   2. `opd bench kernels` on CUDA in bf16, this project beside Liger-Kernel when importable
#      (wheels in .whl/ are installed to /tmp/site first: the box may have no network)
#   3. the fused case at Llama-3-8B's head over a few launch configs, and one cuBLAS matmul of
#      the same shape as the floor
#   4. `opd bench grpo` on CUDA: GRPO log-probs from the hidden states (the Triton fused path)
#   5. `opd sft` sharded with FSDP2 over NCCL at world size 1 (torchrun), when transformers is there
# Logs and JSON go to $OUT (default runs/gpu). PROVIDERS (default: all four) narrows step 2.
set -u
# Worst case 120+160+2*45+30+80+60 = 540 s: one call of the device tool (600 s at most).
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/machine.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/machine.txt"
python3 -c "import liger_kernel, importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))" 2>&1 | tail -1 | tee -a "$OUT/machine.txt"

echo "== 1. Triton kernels on CUDA vs the reference"
timeout 120 python3 -m pytest -q -p no:cacheprovider --noconftest tests/kernels/test_kernels_cuda.py 2>&1 | tail -25 | tee "$OUT/tests.txt"

echo "== 2. opd bench kernels, CUDA, bf16"
timeout 160 python3 -m opd.benchmarks.kernels --device cuda --dtype bfloat16 --repeats 5 --timeout 40 \
    --providers ${PROVIDERS:-reference plain opd liger} --cases fused_jsd_llama kl_full jsd_full kl_topk fused_kl_full fused_kl_topk \
    --json "$OUT/kernels_bf16.json" 2>&1 | tee "$OUT/kernels_bf16.txt"

echo "== 3. fused_jsd_llama: launch configs (BN,BV,BH,warps,stages) and the matmul floor"
for cfg in 64,128,64,8,3 64,64,32,8,4; do
    timeout 45 python3 -m opd.benchmarks.kernels --device cuda --dtype bfloat16 --repeats 5 --timeout 40 \
        --cases fused_jsd_llama --providers opd --fused-blocks $cfg --json "$OUT/sweep_${cfg//,/_}.json" 2>&1 | tail -1
done | tee "$OUT/sweep.txt"
timeout 30 python3 - <<'EOF' 2>&1 | tee "$OUT/matmul.txt"
import torch, triton.testing as tt
n, h, v = 8192, 4096, 128256
a = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
b = torch.randn(v, h, device="cuda", dtype=torch.bfloat16)
ms = tt.do_bench(lambda: a @ b.T, warmup=50, rep=300, return_mode="median")
print(f"cuBLAS bf16 [{n}x{h}] @ [{h}x{v}]: {ms:.2f} ms, {2 * n * h * v / ms / 1e9:.0f} TFLOP/s")
EOF

echo "== 4. GRPO's log-probs and entropy without [B, T, V] (rl/logprobs.py) on CUDA: opd bench grpo"
timeout 80 python3 -m opd.benchmarks.grpo --device cuda --timeout 70 --json "$OUT/grpo.json" 2>&1 | tee "$OUT/grpo.txt"

echo "== 5. the sharded trainer (FSDP2 over NCCL, world size 1): opd sft on a tiny model, 3 steps"
if python3 -c "import transformers, tokenizers, peft, yaml" 2>/dev/null; then
    mkdir -p /tmp/gpu_sft && python3 - <<'PY'
import json
rows = [{"prompt": f"{a}+1=", "response": str(a + 1)} for a in range(10, 40)]
open("/tmp/gpu_sft/train.jsonl", "w").write("".join(json.dumps(r) + "\n" for r in rows))
open("/tmp/gpu_sft/sft.yaml", "w").write(
    "model: {tiny: {layers: 2, hidden: 64, heads: 2, kv_heads: 1, intermediate: 128}, device: cuda}\n"
    "data: {train: [{path: train.jsonl}], batch_size: 4}\noptim: {lr: 0.01, warmup_steps: 0}\n"
    "run: {out_dir: run, steps: 3, log_every: 1, checkpoint_every: 3}\n")
PY
    (cd /tmp/gpu_sft && timeout 60 python3 -m torch.distributed.run --nproc-per-node 1 -m opd.cli sft sft.yaml --overwrite 2>&1 | tail -5
     cat run/metrics.jsonl; ls run/checkpoints/step_000003) | tee "$OUT/sharded_sft.txt"
else
    echo "skipped: transformers, tokenizers, peft or pyyaml missing here" | tee "$OUT/sharded_sft.txt"
fi
