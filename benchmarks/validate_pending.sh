#!/bin/bash
# What has not run on a GPU yet, one device call on an nvidia-h200 (~6 minutes), logs under $OUT:
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh
# Now (after session 5): compute-sanitizer memcheck over the session-5 kernels, which passed their GPU tests but were
# not sanitized (device time ran out): the in-place KDA step (kda_decode_), the mix-norm's weight pair (WM_PAIR),
# rms_norm_linear (the norm-prologue GEMV, and its split above 16 MB), the down kernel's slot groups (KS);
# then the GPU suite's files that the last session-5 run did not reach before the device limit (router, runtime,
# streams). Summary lines last. CUDA-graph tests excluded under the sanitizer (as in sessions 2 and 5).
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
compute-sanitizer --tool memcheck --report-api-errors no --target-processes all \
    python3 -m pytest -q -p no:cacheprovider tests/test_kda_kernel_gpu.py tests/test_kernels_gpu.py \
    tests/test_moe_kernel_gpu.py -k "(in_place or weight_pair or rms_norm_linear or fusions or slot_groups) and not graph" \
    > "$OUT/log_sanitizer.txt" 2>&1
echo "sanitizer rc=$?"
python3 -m pytest -q -p no:cacheprovider tests/test_router_topk_gpu.py tests/test_runtime_gpu.py tests/test_streams_gpu.py \
    > "$OUT/log_tests.txt" 2>&1
echo "tests rc=$?"
grep -E "passed|failed|ERROR SUMMARY" "$OUT/log_sanitizer.txt" | tail -3
grep -E "^FAILED|passed|failed" "$OUT/log_tests.txt" | tail -5
