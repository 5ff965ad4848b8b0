#!/bin/bash
# What was written on a CPU and has not run on a GPU yet (RESULTS.md, "Session 3": pending), one device call on an
# nvidia-h200, ~6 minutes, logs under $OUT:
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh
# Multi-GPU work has its own script: benchmarks/multi_gpu.sh.
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
t() { echo "== $*"; local s=$(date +%s); "$@" > "$OUT/$(echo "$*" | tr -c 'a-zA-Z0-9' _ | cut -c1-60).log" 2>&1;
      echo "   rc=$? $(( $(date +%s) - s )) s"; }
# MLA qabsorb / combine splits: correctness, then the timing of every candidate (DEFAULT_SPLITS should follow)
t timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_mla_kernel_gpu.py -k splits
t timeout 150 python3 benchmarks/mla_splits.py --out "$OUT" --heads 6,12 --ms 1,8,64
# routed-expert configs on both routings: bucket 1 (never tuned) and 64 (heuristic until this has run)
t timeout 240 python3 benchmarks/moe_sweep.py --out "$OUT" --tp 16,8 --ms 1,64 --budget-s 200
for f in "$OUT"/*.log; do echo "--- $f"; grep -v DEBUG "$f" | grep -v "^{" | grep -v "^\s*$" | tail -14; done
