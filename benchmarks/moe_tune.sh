#!/bin/bash
# Tune the routed-expert kernels on the GPU and measure the layer with the tuned table, one device call:
#   bash benchmarks/on_device.sh bash benchmarks/moe_tune.sh        (the table written here comes back under $OUT)
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
t() { echo "== $*"; local s=$(date +%s); "$@" > "$OUT/$(echo "$*" | tr -c 'a-zA-Z0-9' _ | cut -c1-60).log" 2>&1;
      echo "   rc=$? $(( $(date +%s) - s )) s"; }
t timeout 230 python3 benchmarks/moe_sweep.py --out "$OUT" --tp 16,8 --ms 64,8 --budget-s 190 --write-table
cp codegen/tuning/nvidia_h200.json "$OUT/"
t timeout 100 python3 benchmarks/layer_bench.py --out "$OUT" --kinds kda --tp 16,8 --ms 64,8 --skip inductor --top 6
for f in "$OUT"/*.log; do echo "--- $f"; grep -v DEBUG "$f" | grep -v "^{" | grep -v "^\s*$" | tail -14; done
