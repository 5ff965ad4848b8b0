#!/bin/bash
# One device call that validates everything written on a CPU and not yet run on a GPU (see benchmarks/RESULTS.md,
# "NOT yet run on a GPU"), cheapest and most informative first; logs under $OUT. About 8 minutes on one H200:
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh
# On a multi-GPU machine the symmetric-memory tests run as well (NVLink multicast stays off).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
t() { echo "== $*"; local s=$(date +%s); "$@" > "$OUT/$(echo "$*" | tr -c 'a-zA-Z0-9' _ | cut -c1-60).log" 2>&1;
      echo "   rc=$? $(( $(date +%s) - s )) s"; }
t timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_router_topk_gpu.py tests/test_runtime_gpu.py
t timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py -k group
t timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_allgather_gpu.py tests/test_allreduce_gpu.py
t timeout 120 python3 benchmarks/group_gemv_bench.py --out "$OUT" --tp 16 --ms 1,8
t timeout 60 python3 benchmarks/gpu_kernels.py --out "$OUT/topk" --families router_topk
for f in "$OUT"/*.log; do echo "--- $f"; tail -4 "$f"; done
