#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
nvidia-smi topo -m > $OUT/topo.txt 2>&1; nvidia-smi -L >> $OUT/topo.txt
t() { echo "== $*"; local s=$(date +%s); "$@" > "$OUT/$(echo "$*" | tr -c 'a-zA-Z0-9' _ | cut -c1-60).log" 2>&1;
      echo "   rc=$? $(( $(date +%s) - s )) s"; }
t timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_allreduce_gpu.py tests/test_allgather_gpu.py -k multi_process
t timeout 150 python3 benchmarks/allreduce_bench.py --out "$OUT" --what ar,ag --worlds 2 --ms 1,2,4,8,16,32,64 --skip-emulated
t timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_router_topk_gpu.py tests/test_runtime_gpu.py
for f in "$OUT"/*.log; do echo "--- $f"; tail -15 "$f"; done
