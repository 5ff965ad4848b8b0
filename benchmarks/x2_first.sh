#!/bin/bash
# Session-3 device call on nvidia-h200-x2 (through benchmarks/on_device.sh); logs under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
t() { echo "== $*"; local s=$(date +%s); "$@" > "$OUT/$(echo "$*" | tr -c 'a-zA-Z0-9' _ | cut -c1-60).log" 2>&1;
      echo "   rc=$? $(( $(date +%s) - s )) s"; }

t timeout 520 python3 benchmarks/tp_layer_bench.py --out "$OUT" --tp 2 --kinds kda,mla --ms 1,8,64
for f in "$OUT"/*.log; do echo "--- $f"; grep -v DEBUG "$f" | tail -22; done
