#!/bin/bash
# What has not run on a GPU yet, for one device call each on an nvidia-h200 (each part < 10 minutes):
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh ab      # layer / GEMV A/Bs of the opt-in knobs
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh tests   # GPU suite + compute-sanitizer
# Session 7 (ab): the SiTU-GLU prologue of the down projections (pass fuse_situ_glu_into_down_proj): its GPU tests
# and memcheck, the PDL residency probe (benchmarks/pdl_probe.py), and the layer A/B with / without the pass, arms
# interleaved twice. Logs go to /tmp/k3v and come back as one tarball ($OUT takes at most 8 files);
# $OUT/summary.txt grows after every step.
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"; L=/tmp/k3v; mkdir -p "$L"
S="$OUT/summary.txt"
part=${1:-ab}
summarize() {
    python3 - "$L" <<'PY' | tee -a "$S"
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "layer_bench_*.json"))):
    for r in json.load(open(f)):
        top = r.get("k3fuse_top_kernels", [])
        print(os.path.basename(f)[12:-5], r["kind"], r["tp"], r["M"], "floor", r.get("floor_us"), "graph",
              r.get("k3fuse_us"), "kernels", r.get("k3fuse_kernels"), r.get("k3fuse_kernel_us"), "err",
              r.get("k3fuse_rel_err"), r.get("k3fuse_error", ""))
        print("   ", "; ".join(f"{n.split('(')[0][-38:]} {t}" for n, t, _ in top[:12]))
PY
}
if [ "$part" = ab ]; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_runtime_gpu.py \
        -k "situ or fused_residual or graph" > "$L/log_tests_ab.txt" 2>&1
    echo "tests (situ prologue, fused_residual_norm, graphs) rc=$? $(tail -1 "$L/log_tests_ab.txt")" | tee -a "$S"
    grep -E "^FAILED|^ERROR" "$L/log_tests_ab.txt" | head -5 | tee -a "$S"
    timeout 100 compute-sanitizer --tool memcheck --report-api-errors no --target-processes all \
        python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py -k "situ" > "$L/log_sanitizer_ab.txt" 2>&1
    echo "sanitizer (situ prologue) rc=$? $(grep -E 'ERROR SUMMARY|passed|failed' "$L/log_sanitizer_ab.txt" | tr '\n' ' ')" | tee -a "$S"
    timeout 40 python3 benchmarks/pdl_probe.py > "$L/pdl_probe.txt" 2>&1
    echo "pdl_probe rc=$?" | tee -a "$S"; cat "$L/pdl_probe.txt" | tee -a "$S"
    for a in on_1 off_1 on_2 off_2; do
        wo=""; [ "${a%_*}" = off ] && wo="--without-passes fuse_situ_glu_into_down_proj"
        timeout 90 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16 --ms 1,8 --skip inductor \
            --top 16 --tag "_situ_$a" $wo > "$L/lb_$a.txt" 2>&1
        echo "layer situ prologue $a rc=$? $(grep -E '^(kda|mla) +16 +(1|8) ' "$L/lb_$a.txt" | tr -s ' ' | tr '\n' '|')" | tee -a "$S"
    done
    summarize
    tar czf "$OUT/logs_ab.tgz" -C "$L" .
elif [ "$part" = tests ]; then
    timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_moe_kernel_gpu.py \
        tests/test_mla_kernel_gpu.py tests/test_kda_kernel_gpu.py tests/test_runtime_gpu.py > "$L/log_tests.txt" 2>&1
    echo "tests rc=$? $(tail -1 "$L/log_tests.txt")" | tee -a "$S"
    timeout 200 compute-sanitizer --tool memcheck --report-api-errors no --target-processes all \
        python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_kda_kernel_gpu.py \
        tests/test_router_topk_gpu.py -k "(matches_reference or weight_pair or weight_prefetch) and not graph" \
        > "$L/log_sanitizer.txt" 2>&1
    echo "sanitizer rc=$?" | tee -a "$S"
    grep -E "^FAILED|^ERROR|passed|failed" "$L/log_tests.txt" | tail -8 | tee -a "$S"
    grep -E "passed|failed|ERROR SUMMARY" "$L/log_sanitizer.txt" | tail -3 | tee -a "$S"
    tar czf "$OUT/logs_tests.tgz" -C "$L" .
fi
