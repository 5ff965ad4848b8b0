#!/bin/bash
# What has not run on a GPU yet, one device call on an nvidia-h200 (~7 minutes), logs under $OUT:
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh
# Now (session 5, call 3): the routed-expert down kernel's slot groups (KS): its GPU tests (every KS / WD against
# the reference), the A/B sweep of KS and WD from the table's configs at M = 1 (both routings; the winners come back
# as moe_sweep.json for `moe_sweep.py --from-json ... --write-table` here), ncu of the down kernel at the new
# default, and the layer (k3fuse only, TP16 M = 1, 8).
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
python3 -m pytest -q -p no:cacheprovider tests/test_moe_kernel_gpu.py > "$OUT/log_tests.txt" 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|E  )|passed|failed" "$OUT/log_tests.txt" | head -20
python3 benchmarks/moe_sweep.py --out "$OUT" --tp 16,8 --ms 1 --from-table --knobs KS,WD --budget-s 150 \
    > "$OUT/log_sweep.txt" 2>&1
echo "sweep rc=$?"; tail -12 "$OUT/log_sweep.txt"
ncu --kernel-name regex:"down_kernel" --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy \
    python3 benchmarks/ncu_moe.py --tp 16 --m 1 > "$OUT/log_ncu_moe.txt" 2>&1
grep -E "config|Duration|DRAM Throughput|Achieved Occupancy|Block Size|Grid Size" "$OUT/log_ncu_moe.txt" | head
python3 benchmarks/layer_bench.py --out "$OUT" --kinds kda,mla --tp 16 --ms 1,8 --skip inductor --tag _ks \
    > "$OUT/log_bench.txt" 2>&1
grep -A 5 "^kind" "$OUT/log_bench.txt"; grep -E "down_kernel" "$OUT/log_bench.txt"
