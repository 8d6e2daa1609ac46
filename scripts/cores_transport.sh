#!/usr/bin/env bash
# Issue 11's transport target (top-64 over tcp at >= 70 % of a bare ZeroMQ PUSH/PULL) on a
# machine with more cores than the 2-core box it was measured on, and the same machine pinned
# to 2 of its cores, in one go. On the 2-core box the teacher server, the client and their
# ZeroMQ I/O threads (7 threads) share 2 cores, and the gap to the bare socket is per-message
# work on cold caches plus thread hand-offs (README, "Transport"); this separates what the
# code costs from what 2 shared cores cost, on one machine, in one run.
# For a box that has torch, numpy, PyYAML and tqdm but not this project's venv (the device
# image): wheels in .whl/ (pyzmq, msgspec) are installed to /tmp/site first.
# Run from the repository root: `bash scripts/cores_transport.sh`. Logs and JSON go to $OUT
# (default runs/cores); PY picks the interpreter (default python3). About 3 minutes.
set -u
OUT=${OUT:-runs/cores}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
echo "$(nproc) cores; $(grep -m1 'model name' /proc/cpuinfo)" | tee "$OUT/machine.txt"
CASES=(--transports tcp --ks 64 --positions 4096 16384 --vocabs 32768 --dtypes bfloat16 --rounds 5)
echo "== all cores"
timeout 200 "$PY" -m opd.cli bench transport "${CASES[@]}" --json "$OUT/transport_all.json" 2>&1 | tee "$OUT/transport_all.txt"
echo "== pinned to 2 cores (taskset -c 0,1; the spawned servers inherit it)"
timeout 200 taskset -c 0,1 "$PY" -m opd.cli bench transport "${CASES[@]}" --json "$OUT/transport_2.json" 2>&1 \
    | tee "$OUT/transport_2.txt"
