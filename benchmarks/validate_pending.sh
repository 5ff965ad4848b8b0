#!/bin/bash
# What was written on a CPU and has not run on a GPU yet, one device call on an nvidia-h200, ~8 minutes, logs under
# $OUT:   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh
# Now: the fused KDA kernel (k3fuse::kda_decode, pass fuse_kda_conv_gated_norm): GPU tests, then the KDA layer
# table with it, and the same layer without the pass (A/B). If the kernel tests fail, the table runs without the
# pass. Multi-GPU work has its own script: benchmarks/multi_gpu.sh.
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
t() { echo "== $*"; local s=$(date +%s); "$@" > "$OUT/$(echo "$*" | tr -c 'a-zA-Z0-9' _ | cut -c1-60).log" 2>&1;
      local rc=$?; echo "   rc=$rc $(( $(date +%s) - s )) s"; return $rc; }
WITHOUT=""
t timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kda_kernel_gpu.py || WITHOUT="--without-passes fuse_kda_conv_gated_norm"
echo "layer table: ${WITHOUT:-all passes}"
t timeout 330 python3 benchmarks/layer_bench.py --out "$OUT" --kinds kda --tp 16,8 --ms 1,8,64 --top 40 $WITHOUT
t timeout 60 python3 benchmarks/layer_bench.py --out "$OUT" --kinds kda --tp 16 --ms 1 --skip inductor --top 40 \
    --without-passes fuse_kda_conv_gated_norm --tag _without_kda_fusion
for f in "$OUT"/*.log; do echo "--- $f"; grep -v DEBUG "$f" | grep -v "^{" | grep -v "^\s*$" | tail -25; done
