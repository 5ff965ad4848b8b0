#!/bin/bash
# What has not run on a GPU yet, for one device call each on an nvidia-h200 (each part < 10 minutes):
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh ab      # layer / GEMV A/Bs of the opt-in knobs
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh tests   # GPU suite + compute-sanitizer
# Session 7: K3FUSE_WEIGHT_PREFETCH (GEMV weights prefetched into L2 before the chain's wait: 1 = every CTA,
# N = the first N CTAs) and session 6's opt-in K3FUSE_KDA_FA_SMEM=1, each against the defaults, arms interleaved
# twice inside the call; the 11 MB GEMVs (issue 4) under the chain with and without the prefetch, and without the
# chain. Logs go to /tmp/k3v and come back as one tarball ($OUT takes at most 8 files); summary lines last.
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"; L=/tmp/k3v; mkdir -p "$L"
part=${1:-ab}
if [ "$part" = ab ]; then
    arms="wpf0_fa0 wpf1_fa0 wpf528_fa0 wpf0_fa1"
    for i in 1 2; do for a in $arms; do
        w=${a#wpf}; w=${w%_fa*}; f=${a#*_fa}
        K3FUSE_WEIGHT_PREFETCH=$w K3FUSE_KDA_FA_SMEM=$f timeout 75 python3 benchmarks/layer_bench.py --out "$L" \
            --kinds kda,mla --tp 16 --ms 1 --skip inductor --top 16 --tag "_${a}_$i" > "$L/lb_${a}_$i.txt" 2>&1
        echo "layer $a run $i rc=$?"
    done; done
    for arm in "1 0" "1 1" "0 0"; do set -- $arm
        K3FUSE_PDL_CHAIN=$1 K3FUSE_WEIGHT_PREFETCH=$2 timeout 60 python3 benchmarks/gpu_kernels.py --out "$L/gk_c$1w$2" \
            --shapes 7168x768,768x7168,896x7168 --ms 1,8 > "$L/gk_c$1w$2.txt" 2>&1
        echo "gemv small shapes chain=$1 prefetch=$2 rc=$?"
    done
    tar czf "$OUT/logs_ab.tgz" -C "$L" .
    for f in "$L"/lb_*.txt; do
        echo "$(basename "$f") $(grep -E '^(kda|mla) +16 +1 ' "$f" | tr -s ' ' | tr '\n' '|')"
    done
    grep -h -E "^ *(7168x768|768x7168|896x7168)" "$L"/gk_c*.txt
    python3 - "$L" <<'EOF'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "layer_bench_*.json"))):
    for r in json.load(open(f)):
        top = {n.split("(")[0][:40]: t for n, t, _ in r.get("k3fuse_top_kernels", [])}
        print(os.path.basename(f)[12:-5], r["kind"], r.get("k3fuse_us"), r.get("k3fuse_kernel_us"),
              "err", r.get("k3fuse_rel_err"), r.get("k3fuse_error", ""))
EOF
elif [ "$part" = tests ]; then
    timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_moe_kernel_gpu.py \
        tests/test_mla_kernel_gpu.py tests/test_kda_kernel_gpu.py tests/test_runtime_gpu.py > "$L/log_tests.txt" 2>&1
    echo "tests rc=$?"
    timeout 200 compute-sanitizer --tool memcheck --report-api-errors no --target-processes all \
        python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_kda_kernel_gpu.py \
        tests/test_router_topk_gpu.py -k "(matches_reference or weight_pair) and not graph" > "$L/log_sanitizer.txt" 2>&1
    echo "sanitizer rc=$?"
    tar czf "$OUT/logs_tests.tgz" -C "$L" .
    grep -E "^FAILED|^ERROR|passed|failed" "$L/log_tests.txt" | tail -8
    grep -E "passed|failed|ERROR SUMMARY" "$L/log_sanitizer.txt" | tail -3
fi
