#!/bin/bash
# What has not run on a GPU yet, one device call on an nvidia-h200 (~9 minutes), logs under $OUT:
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh
# Now (session 5, last call): the layer table with every session-5 change at its default (the model period; the
# routed up projection back on the plain GEMV, the block top-k): KDA / MLA + MoE x TP16, TP8 x M = 1, 8, 64, eager,
# Inductor, k3fuse. Rows are written as they finish; the call stops itself before the device limit.
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
timeout 540 python3 benchmarks/layer_bench.py --out "$OUT" --kinds kda,mla --tp 16,8 --ms 1,8,64 --tag _s5 \
    > "$OUT/log_bench.txt" 2>&1
echo "bench rc=$?"
python3 - "$OUT/layer_bench_s5.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["kind"], r["tp"], r["M"], "floor", r["floor_us"], "eager", r.get("eager_us"), "inductor",
          r.get("inductor_us"), r.get("inductor_kernels"), "k3fuse", r.get("k3fuse_us"), r.get("k3fuse_kernels"),
          "rel", r.get("k3fuse_rel_err"), r.get("k3fuse_error", ""))
PY
