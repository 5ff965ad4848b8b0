#!/bin/bash
# Session-3 device call (issue 5 opt-in features on one GPU of the x2 machine); logs under $OUT.
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
t() { echo "== $*"; local s=$(date +%s); "$@" > "$OUT/$(echo "$*" | tr -c 'a-zA-Z0-9' _ | cut -c1-60).log" 2>&1;
      echo "   rc=$? $(( $(date +%s) - s )) s"; }
t timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py -k group
t timeout 100 python3 benchmarks/group_gemv_bench.py --out "$OUT" --tp 16 --ms 1,8
mkdir -p $OUT/on $OUT/off
t env K3FUSE_GROUPED_GEMV=1 K3FUSE_ROUTER_TOPK=1 timeout 200 python3 benchmarks/layer_bench.py --out $OUT/on --kinds kda,mla --tp 16 --ms 1,8 --skip inductor --top 16
t timeout 150 python3 benchmarks/layer_bench.py --out $OUT/off --kinds kda,mla --tp 16 --ms 1,8 --skip inductor --top 4
for f in "$OUT"/*.log; do echo "--- $f"; grep -v DEBUG "$f" | grep -v "^{" | tail -30; done
