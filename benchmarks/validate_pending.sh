#!/bin/bash
# What was written on a CPU and has not run on a GPU yet, one device call on an nvidia-h200, ~7 minutes, logs under
# $OUT:   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh
# Now: the router logits' fp32-output GEMV (codegen/router_topk.py, K3FUSE_ROUTER_GEMV): GPU tests, the layer table
# with it, the KDA TP16 M=1 layer without it (A/B), and the MLA split kernel's KV split counts.
# Multi-GPU work has its own script: benchmarks/multi_gpu.sh.
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
t() { echo "== $*"; local s=$(date +%s); "$@" > "$OUT/$(echo "$*" | tr -c 'a-zA-Z0-9' _ | cut -c1-60).log" 2>&1;
      local rc=$?; echo "   rc=$rc $(( $(date +%s) - s )) s"; return $rc; }
t timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_router_topk_gpu.py || export K3FUSE_ROUTER_GEMV=0
echo "K3FUSE_ROUTER_GEMV=${K3FUSE_ROUTER_GEMV:-1}"
t timeout 240 python3 benchmarks/layer_bench.py --out "$OUT" --kinds kda,mla --tp 16,8 --ms 1,8,64 --top 40
t env K3FUSE_ROUTER_GEMV=0 timeout 45 python3 benchmarks/layer_bench.py --out "$OUT" --kinds kda --tp 16 --ms 1 \
    --skip inductor --top 40 --tag _router_cublas
t timeout 70 python3 benchmarks/mla_splits.py --out "$OUT" --heads 6,12 --ms 1,8 --splits 16x32,8x8,4x4 \
    --kv-splits 0,8,32
for f in "$OUT"/*.log; do echo "--- $f"; grep -v DEBUG "$f" | grep -v "^{" | grep -v "^\s*$" | grep -v "arn\|softmax\|^Online\|split the red\|important use" | grep -v "^ \+[0-9.]\+ us  x" | tail -16; done
