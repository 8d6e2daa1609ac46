#!/usr/bin/env bash
# .venv-bench: TRL for the side-by-side step benchmark, in a venv layered on .venv (a .pth
# file adds .venv's packages), so the test environment never carries TRL's dependencies
# and torch is not installed twice. Liger-Kernel (pure Python, no deps) is in .venv itself.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if [[ ! -x .venv-bench/bin/python ]]; then
  python3 -m venv .venv-bench
  base=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  own=$(.venv-bench/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$base" > "$own/_opd_base.pth"
fi
.venv-bench/bin/python -m pip install -q --disable-pip-version-check "trl==1.16.0"
