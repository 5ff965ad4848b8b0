#!/bin/bash
# What has not run on a GPU yet, one device call on an nvidia-h200 (~8 minutes), logs under $OUT:
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh
# Now (session 5): the in-place KDA state write (k3fuse::kda_decode_, pass write_kda_state_in_place), the mix-norm
# kernel taking AttnRes's two weight factors (WM_PAIR), the RMSNorm-prologue GEMV as a registered op (pass
# fuse_rms_norm_into_linear), each against its reference (the runtime test replays the compiled model in CUDA
# graphs, states in place); then, k3fuse only, KDA / MLA + MoE at TP16 M = 1, 8 in one machine: all passes
# (--period model), without the two new passes (A/B), and with sessions 1-4's layer boundary (--period layer).
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
python3 -m pytest -q -p no:cacheprovider tests/test_kda_kernel_gpu.py tests/test_kernels_gpu.py \
    tests/test_runtime_gpu.py -k "in_place or weight_pair or rms_norm_linear or residual or runtime or graph" \
    > "$OUT/tests.txt" 2>&1
echo "tests rc=$?"; tail -3 "$OUT/tests.txt"
B="python3 benchmarks/layer_bench.py --out $OUT --kinds kda,mla --tp 16 --ms 1,8 --skip inductor"
$B --tag _all > "$OUT/bench_all.txt" 2>&1
$B --tag _without_s5 --without-passes write_kda_state_in_place,fuse_rms_norm_into_linear > "$OUT/bench_without.txt" 2>&1
$B --tag _layer_period --period layer > "$OUT/bench_layer.txt" 2>&1
for f in all without layer; do echo "== $f"; grep -A 6 "^kind" "$OUT/bench_$f.txt"; done
