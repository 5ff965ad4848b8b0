#!/bin/bash
# The multi-GPU checks and benchmarks in one device call on an nvidia-h200-x2 / -x4 / -x8 (logs under $OUT):
#   bash benchmarks/on_device.sh bash benchmarks/multi_gpu.sh
# Multi-process in-kernel all-reduce / all-gather tests at every batch bucket vs NCCL (TP = every power of two the
# machine has, up to 8), the collectives alone vs NCCL, then one K3 layer under real TP (tp_layer_bench.py).
# NVLink multicast stays off here and in every process these start.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
# TPS=4 (say) limits the worlds: a device call is at most 10 min, and TP = 2 alone takes ~4.5 min of it
TPS=${TPS:-$(python3 -c "print(','.join(str(t) for t in (2, 4, 8) if t <= $N))")}
[ -n "$TPS" ] || { echo "needs >= 2 GPUs (have $N)"; exit 1; }
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
t() { echo "== $*"; local s=$(date +%s); "$@" > "$OUT/$(echo "$*" | tr -c 'a-zA-Z0-9' _ | cut -c1-60).log" 2>&1;
      echo "   rc=$? $(( $(date +%s) - s )) s"; }
t timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_allreduce_gpu.py tests/test_allgather_gpu.py -k multi_process
t timeout 200 python3 benchmarks/allreduce_bench.py --out "$OUT" --what ar,ag --worlds "$TPS" --ms 1,2,4,8,16,32,64 --skip-emulated
t timeout 480 python3 benchmarks/tp_layer_bench.py --out "$OUT" --tp "$TPS" --kinds kda,mla --ms 1,8,64
for f in "$OUT"/*.log; do echo "--- $f"; grep -v DEBUG "$f" | grep -v "^\s*$" | tail -25; done
