#!/bin/bash
# What has not run on a GPU yet, one device call on an nvidia-h200, ~3 minutes, logs under $OUT:
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh
# Now (after session 4): compute-sanitizer memcheck over the kernels added in session 4, which passed their GPU
# tests but were not sanitized (no device time left): the fused KDA step (k3fuse::kda_decode), the fp32-output GEMV
# (router logits), the routed-expert down kernel's slot batches, the MLA split counts. CUDA-graph tests excluded
# (as in session 2's run). Multi-GPU work has its own script: benchmarks/multi_gpu.sh.
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
compute-sanitizer --tool memcheck --report-api-errors no --target-processes all \
    python3 -m pytest -q -p no:cacheprovider tests/test_kda_kernel_gpu.py tests/test_router_topk_gpu.py \
    tests/test_moe_kernel_gpu.py tests/test_mla_kernel_gpu.py -k "not graph" > "$OUT/sanitizer.txt" 2>&1
echo "rc=$?"; grep -E "passed|failed|ERROR SUMMARY" "$OUT/sanitizer.txt" | tail -5
