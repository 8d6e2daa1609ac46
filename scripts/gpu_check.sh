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
#   6. `opd rl` sharded (FSDP2, world size 1) with vLLM rollouts in rank 0's process: the weights
#      gathered from the shards and reloaded into the engine after each step, when vLLM is there
# Logs and JSON go to $OUT (default runs/gpu). PROVIDERS (default: all four) narrows step 2;
# STEPS (default "1 2 3 4 5 6") picks steps; PY (default python3) is the interpreter.
# Without a CUDA device steps 1-4 say so and steps 5 and 6 run on the CPU (gloo, vLLM's CPU
# build): what this script does that a CPU can check, it checks here.
set -u
# Worst case 120+160+2*45+30+80+60+150 = 690 s: pick STEPS to fit one call of the device tool (600 s).
OUT=${OUT:-runs/gpu}
PY=${PY:-python3}
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY");; esac   # steps 5 and 6 cd elsewhere
STEPS=" ${STEPS:-1 2 3 4 5 6} "
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
step() { [[ "$STEPS" == *" $1 "* ]]; }
CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))")
DEVICE=$([ "$CUDA" = 1 ] && echo cuda || echo cpu)
if [ "$CUDA" = 1 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/machine.txt"
else
    echo "no CUDA device: steps 1-4 are skipped, 5 and 6 run on the CPU" | tee "$OUT/machine.txt"
fi
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/machine.txt"
$PY -c "import liger_kernel, importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))" 2>&1 | tail -1 | tee -a "$OUT/machine.txt"

if step 1 && [ "$CUDA" = 1 ]; then
    echo "== 1. Triton kernels on CUDA vs the reference"
    timeout 120 $PY -m pytest -q -p no:cacheprovider --noconftest tests/kernels/test_kernels_cuda.py 2>&1 | tail -25 | tee "$OUT/tests.txt"
elif step 1; then
    echo "== 1. skipped: no CUDA device"
fi

if step 2 && [ "$CUDA" = 1 ]; then
    echo "== 2. opd bench kernels, CUDA, bf16"
    timeout 160 $PY -m opd.benchmarks.kernels --device cuda --dtype bfloat16 --repeats 5 --timeout 40 \
        --providers ${PROVIDERS:-reference plain opd liger} --cases fused_jsd_llama kl_full jsd_full kl_topk fused_kl_full fused_kl_topk \
        --json "$OUT/kernels_bf16.json" 2>&1 | tee "$OUT/kernels_bf16.txt"
elif step 2; then
    echo "== 2. skipped: no CUDA device"
fi

if step 3 && [ "$CUDA" = 1 ]; then
    echo "== 3. fused_jsd_llama: launch configs (BN,BV,BH,warps,stages) and the matmul floor"
    for cfg in 64,128,64,8,3 64,64,32,8,4; do
        timeout 45 $PY -m opd.benchmarks.kernels --device cuda --dtype bfloat16 --repeats 5 --timeout 40 \
            --cases fused_jsd_llama --providers opd --fused-blocks $cfg --json "$OUT/sweep_${cfg//,/_}.json" 2>&1 | tail -1
    done | tee "$OUT/sweep.txt"
    timeout 30 $PY - <<'EOF' 2>&1 | tee "$OUT/matmul.txt"
import torch, triton.testing as tt
n, h, v = 8192, 4096, 128256
a = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
b = torch.randn(v, h, device="cuda", dtype=torch.bfloat16)
ms = tt.do_bench(lambda: a @ b.T, warmup=50, rep=300, return_mode="median")
print(f"cuBLAS bf16 [{n}x{h}] @ [{h}x{v}]: {ms:.2f} ms, {2 * n * h * v / ms / 1e9:.0f} TFLOP/s")
EOF
elif step 3; then
    echo "== 3. skipped: no CUDA device"
fi

if step 4 && [ "$CUDA" = 1 ]; then
    echo "== 4. GRPO's log-probs and entropy without [B, T, V] (rl/logprobs.py) on CUDA: opd bench grpo"
    timeout 80 $PY -m opd.benchmarks.grpo --device cuda --timeout 70 --json "$OUT/grpo.json" 2>&1 | tee "$OUT/grpo.txt"
elif step 4; then
    echo "== 4. skipped: no CUDA device"
fi

if step 5; then
    echo "== 5. the sharded trainer (FSDP2, NCCL on CUDA / gloo on the CPU, world size 1): opd sft on a tiny model, 3 steps"
    if $PY -c "import transformers, tokenizers, peft, yaml" 2>/dev/null; then
        rm -rf /tmp/gpu_sft && mkdir -p /tmp/gpu_sft && DEVICE=$DEVICE $PY - <<'PY'
import json, os
rows = [{"prompt": f"{a}+1=", "response": str(a + 1)} for a in range(10, 40)]
open("/tmp/gpu_sft/train.jsonl", "w").write("".join(json.dumps(r) + "\n" for r in rows))
open("/tmp/gpu_sft/sft.yaml", "w").write(
    "model: {tiny: {layers: 2, hidden: 64, heads: 2, kv_heads: 1, intermediate: 128}, device: %s}\n"
    "data: {train: [{path: train.jsonl}], batch_size: 4}\noptim: {lr: 0.01, warmup_steps: 0}\n"
    "run: {out_dir: run, steps: 3, log_every: 1, checkpoint_every: 3}\n" % os.environ["DEVICE"])
PY
        (cd /tmp/gpu_sft && timeout 60 $PY -m torch.distributed.run --nproc-per-node 1 -m opd.cli sft sft.yaml --overwrite 2>&1 | tail -5
         cat run/metrics.jsonl; ls run/checkpoints/step_000003) | tee "$OUT/sharded_sft.txt"
    else
        echo "skipped: transformers, tokenizers, peft or pyyaml missing here" | tee "$OUT/sharded_sft.txt"
    fi
fi

if step 6; then
    echo "== 6. vLLM rollouts beside the sharded student (FSDP2, world size 1): opd rl on a tiny model, 3 steps"
    if $PY -c "import vllm, transformers, peft, yaml" 2>/dev/null; then
        rm -rf /tmp/gpu_rl && mkdir -p /tmp/gpu_rl && DEVICE=$DEVICE $PY - <<'PY'
import json, os
from opd.tiny import build_tiny_model
build_tiny_model("/tmp/gpu_rl/model", heads=2, kv_heads=1, seed=0)   # head size 32: vLLM's CPU attention too
rows = [{"prompt": f"Number {i}:", "answer": str(i)} for i in range(10, 26)]
open("/tmp/gpu_rl/train.jsonl", "w").write("".join(json.dumps(r) + "\n" for r in rows))
open("/tmp/gpu_rl/digits.py", "w").write(
    "def digits(sample, text):\n    return sum(c.isdigit() for c in text) / max(len(text), 1)\n")
open("/tmp/gpu_rl/rl.yaml", "w").write(
    "model: {path: model, device: %s}\ndata: {train: train.jsonl}\n"
    "rollout: {prompts_per_step: 4, samples_per_prompt: 4, max_new_tokens: 8, engine: vllm, vllm_max_model_len: 128, vllm_enforce_eager: true,\n"
    "          vllm_gpu_memory_utilization: 0.2}\n"
    "algorithm: {epochs: 2, kl_beta: 0.01, advantage: batch_std}\n"
    "rewards: [{name: python, path: 'digits.py:digits'}]\noptim: {lr: 0.01}\n"
    "run: {steps: 3, checkpoint_every: 3, out_dir: run, progress: false, tensorboard: false}\n" % os.environ["DEVICE"])
PY
        (cd /tmp/gpu_rl && VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} timeout 150 \
            $PY -m torch.distributed.run --nproc-per-node 1 -m opd.cli rl rl.yaml --overwrite 2>&1 | tail -5
         cut -c1-300 run/metrics.jsonl) | tee "$OUT/sharded_vllm_rl.txt"
    else
        echo "skipped: vllm, transformers, peft or pyyaml missing here" | tee "$OUT/sharded_vllm_rl.txt"
    fi
fi
