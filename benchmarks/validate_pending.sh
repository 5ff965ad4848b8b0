#!/bin/bash
# What was written on a CPU and has not run on a GPU yet, one device call on an nvidia-h200, ~8 minutes, logs under
# $OUT:   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh
# Now: the routed-expert down kernel's slot batches (SB, codegen/moe_experts.default_sb): GPU tests, the SB A/B
# from the table configs, then the layer table (KDA and MLA) with everything on.
# Multi-GPU work has its own script: benchmarks/multi_gpu.sh.
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
t() { echo "== $*"; local s=$(date +%s); "$@" > "$OUT/$(echo "$*" | tr -c 'a-zA-Z0-9' _ | cut -c1-60).log" 2>&1;
      local rc=$?; echo "   rc=$rc $(( $(date +%s) - s )) s"; return $rc; }
t timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_moe_kernel_gpu.py
t timeout 150 python3 benchmarks/moe_sweep.py --out "$OUT" --tp 16,8 --ms 1,8,64 --from-table --knobs SB --budget-s 120
t timeout 290 python3 benchmarks/layer_bench.py --out "$OUT" --kinds kda,mla --tp 16,8 --ms 1,8,64 --top 40
for f in "$OUT"/*.log; do echo "--- $f"; grep -v DEBUG "$f" | grep -v "^{" | grep -v "^\s*$" | grep -v "arn\|softmax\|^Online\|split the red\|important use" | tail -22; done
