#!/bin/bash
# What has not run on a GPU yet, one device call on an nvidia-h200 (~8 minutes), logs under $OUT:
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh
# Now (session 5, call 2): the RMSNorm-prologue GEMV with x staged in shared memory and the tuned simt config
# (its kernel tests, then the layer A/B with and without pass fuse_rms_norm_into_linear, k3fuse only, TP16 M = 1),
# the weight-pair test fixed; then Nsight Compute on the routed-expert kernels at TP16 M = 1 (where ncu runs).
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py -k "weight_pair or rms_norm_linear or fusions" \
    > "$OUT/log_tests.txt" 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|E  )|passed|failed" "$OUT/log_tests.txt" | head -20
B="python3 benchmarks/layer_bench.py --out $OUT --kinds kda,mla --tp 16 --ms 1 --skip inductor"
$B --tag _all > "$OUT/log_bench_all.txt" 2>&1
$B --tag _without_norm_prologue --without-passes fuse_rms_norm_into_linear > "$OUT/log_bench_without.txt" 2>&1
for f in all without; do echo "== $f"; grep -A 3 "^kind" "$OUT/log_bench_$f.txt"; grep -E "gemv_kernel.*358435841" "$OUT/log_bench_$f.txt"; done
if command -v ncu >/dev/null; then
    ncu --kernel-name regex:"down_kernel|up_kernel" --launch-skip 2 --launch-count 2 --section SpeedOfLight \
        --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
        python3 benchmarks/ncu_moe.py --tp 16 --m 1 > "$OUT/log_ncu_moe.txt" 2>&1
    echo "ncu rc=$?"; grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Warp Cycles Per Issued|Stall|Registers Per|Block Size|Grid Size|Theoretical Occ" "$OUT/log_ncu_moe.txt" | head -40
else
    echo "no ncu on this machine"; ls /usr/local/cuda*/bin 2>/dev/null | head -30
fi
