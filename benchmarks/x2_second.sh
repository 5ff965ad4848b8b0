#!/bin/bash
# Session-3 device call: the grouped GEMV + router top-k now on by default; regression tests, then the layer table.
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
t() { echo "== $*"; local s=$(date +%s); "$@" > "$OUT/$(echo "$*" | tr -c 'a-zA-Z0-9' _ | cut -c1-60).log" 2>&1;
      echo "   rc=$? $(( $(date +%s) - s )) s"; }
t timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py -k group tests/test_router_topk_gpu.py tests/test_runtime_gpu.py
t timeout 390 python3 benchmarks/layer_bench.py --out $OUT --kinds kda,mla --tp 16,8 --ms 1,8,64 --top 12
for f in "$OUT"/*.log; do echo "--- $f"; grep -v DEBUG "$f" | grep -v "^{" | grep -v "^\s*$" | tail -40; done
