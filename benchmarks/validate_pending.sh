#!/bin/bash
# What has not run on a GPU yet, one device call on an nvidia-h200 (~4 minutes), logs under $OUT:
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh
# Now (session 6): the router top-k's "redux" rounds (both round variants), the mix-norm kernel's early norm-weight
# load, the fused KDA kernel's early output-gate / norm-weight loads: their GPU tests, then compute-sanitizer
# memcheck over the same kernels (CUDA-graph tests excluded under the sanitizer, as in sessions 2 and 5).
# Summary lines last.
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_router_topk_gpu.py tests/test_kda_kernel_gpu.py \
    tests/test_kernels_gpu.py -k "topk or kda or fused_residual_norm or router" > "$OUT/log_tests.txt" 2>&1
echo "tests rc=$?"
timeout 200 compute-sanitizer --tool memcheck --report-api-errors no --target-processes all \
    python3 -m pytest -q -p no:cacheprovider tests/test_router_topk_gpu.py tests/test_kda_kernel_gpu.py \
    tests/test_kernels_gpu.py -k "(matches_reference or weight_pair) and (topk or kda_decode or fused_residual_norm) and not graph" \
    > "$OUT/log_sanitizer.txt" 2>&1
echo "sanitizer rc=$?"
grep -E "^FAILED|passed|failed" "$OUT/log_tests.txt" | tail -5
grep -E "passed|failed|ERROR SUMMARY" "$OUT/log_sanitizer.txt" | tail -3
