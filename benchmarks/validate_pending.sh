#!/bin/bash
# What has not run on a GPU yet, for one device call on an nvidia-h200 (~8 minutes), logs under $OUT:
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh
# After session 6: the PDL chain (templates/_pdl_chain.jinja, on by default) passed 121 + 58 GPU tests (calls 6-7) and
# four layer runs, but the rest of the GPU suite has not run with it (the -k-deselected GEMV, grouped-GEMV,
# rms_norm_linear, MoE slot-group, MLA split tests), nor compute-sanitizer. Then the issue-4 small shapes (11 MB
# GEMVs) re-timed as the layer launches them (the chain on) and off, the opt-in K3FUSE_KDA_FA_SMEM=1 KDA kernel
# (GPU test in tests/test_kda_kernel_gpu.py; layer A/B, arms interleaved), and the layer rows not rerun (M = 64).
# Summary lines last.
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_moe_kernel_gpu.py \
    tests/test_mla_kernel_gpu.py tests/test_kda_kernel_gpu.py > "$OUT/log_tests.txt" 2>&1
echo "tests rc=$?"
timeout 120 compute-sanitizer --tool memcheck --report-api-errors no --target-processes all \
    python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_kda_kernel_gpu.py \
    tests/test_router_topk_gpu.py -k "(matches_reference or weight_pair) and not graph" > "$OUT/log_sanitizer.txt" 2>&1
echo "sanitizer rc=$?"
for p in 1 0; do
    K3FUSE_PDL_CHAIN=$p timeout 60 python3 benchmarks/gpu_kernels.py --out "$OUT/gk_pdl$p" --shapes 7168x768,768x7168 \
        --ms 1,8 > "$OUT/gk_pdl$p.txt" 2>&1
    echo "gemv small shapes, K3FUSE_PDL_CHAIN=$p rc=$?"
done
for i in 1 2; do for f in 0 1; do
    K3FUSE_KDA_FA_SMEM=$f timeout 60 python3 benchmarks/layer_bench.py --out "$OUT" --kinds kda --tp 16 --ms 1 \
        --skip inductor --top 16 --tag _fa${f}_$i > "$OUT/lb_fa${f}_$i.txt" 2>&1
done; done
timeout 150 python3 benchmarks/layer_bench.py --out "$OUT" --kinds kda,mla --tp 16,8 --ms 64 --tag _m64 > "$OUT/lb_m64.txt" 2>&1
echo "layer M=64 rc=$?"
grep -E "^FAILED|passed|failed" "$OUT/log_tests.txt" | tail -5
grep -E "passed|failed|ERROR SUMMARY" "$OUT/log_sanitizer.txt" | tail -3
grep -h -E "^ +(7168x768|768x7168)" "$OUT"/gk_pdl1.txt "$OUT"/gk_pdl0.txt
grep -E "^(kda|mla) +(16|8) +64" "$OUT/lb_m64.txt"
for f in "$OUT"/lb_fa*.txt; do echo "$f $(grep -E '^kda +16 +1 ' "$f") $(grep -m1 kda_kernel "$f")"; done
