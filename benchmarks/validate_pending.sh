#!/bin/bash
# GPU checks and A/Bs still to run, one device call each on an nvidia-h200 (each part < 10 minutes):
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh PART
# A part that has run is removed once its results are in RESULTS.md; that section names the commit it ran at, where
# this file still has it (git show COMMIT:benchmarks/validate_pending.sh). Parts, in the order of the device plan
# (PERF_NOTES.md, the latest session):
#   tests  the GPU kernel test files, one process each at once
#   tests2 compute-sanitizer memcheck, the runtime's graphs
#   s182   layer_bench's recheck after every step of a TP8 M = 64 row (--recheck-steps), KDA and MLA
#   ab     NAME=A,B [MS]: a paired A/B of one variable in one process (layer_ab.py)
#   s149   session 37's MLA defaults summed (layer_ab --arms); split counts
#   s139   wgmma clusters of 14-16: tests, memcheck, shapes, A/B
#   s140   why 3216x7168's wgmma entry at bucket 16 lost in the layer
# Logs go to /tmp/k3v/PART and come back as a tarball; $OUT/summary.txt grows after every step, so a cut call still
# returns what ran.
part=${1:-tests}
# a folder per part: a warm machine keeps /tmp between calls, and a part's tarball is to hold its own logs only
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"; L=/tmp/k3v/$part; mkdir -p "$L"
S="$OUT/summary.txt"
# ncu_layer's metrics: stall reasons per issued instruction, DRAM bytes and throughput, occupancy limits
NCU_BASE="regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,dram__bytes_read.sum,gpu__time_duration.sum"
NCU_BASE="$NCU_BASE,sm__warps_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_registers,launch__grid_size"
NCU_BASE="$NCU_BASE,launch__registers_per_thread,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum"
NCU_BASE="$NCU_BASE,lts__t_sectors_srcunit_tex_op_read.sum"
pytests() {     # pytests NAME TIMEOUT PYTEST_ARGS...: rc, last line and failures into the summary
    local name=$1 t=$2; shift 2
    timeout "$t" python3 -m pytest -q -p no:cacheprovider "$@" > "$L/log_$name.txt" 2>&1
    echo "$name rc=$? $(tail -1 "$L/log_$name.txt")" | tee -a "$S"
    grep -E "^FAILED|^ERROR" "$L/log_$name.txt" | head -8 | tee -a "$S"
    cp "$L/log_$name.txt" "$OUT/" 2>/dev/null   # each log as it ends: a call cut later still returns it
}
memcheck() {    # memcheck NAME TIMEOUT PYTEST_ARGS...: the same tests under compute-sanitizer memcheck
    local name=$1 t=$2; shift 2
    timeout "$t" compute-sanitizer --tool memcheck --report-api-errors no --target-processes all \
        python3 -m pytest -q -p no:cacheprovider "$@" > "$L/log_$name.txt" 2>&1
    echo "$name rc=$? $(grep -E 'ERROR SUMMARY' "$L/log_$name.txt" | tail -1)" | tee -a "$S"
}
ncu_layer() {   # ncu_layer TAG KIND REGEX N EXTRA_METRICS: ncu of N launches of the kernels matching REGEX (after N
    # skipped: the first layer call) in layer_bench.py's KIND layer at M = 64, TP16 and TP8, no PDL chain
    local tag=$1 kind=$2 re=$3 n=$4 extra=$5 tp
    for tp in 16 8; do
        K3FUSE_PDL_CHAIN=0 timeout 200 ncu --kernel-name regex:"$re" --launch-skip "$n" --launch-count "$n" \
            --metrics "$NCU_BASE$extra" python3 benchmarks/layer_bench.py --out "$L" --kinds "$kind" --tp $tp --ms 64 \
            --skip eager,inductor --tag "_ncu$tp" > "$L/ncu_${tag}_tp$tp.txt" 2>&1
        echo "ncu $tag tp$tp rc=$?" | tee -a "$S"; grep -E "^  [a-z_]+kernel|^    [a-z]|ERR" "$L/ncu_${tag}_tp$tp.txt" | tee -a "$S"
    done
}
smoke_or_stop() {   # smoke_or_stop PART NAME TIMEOUT PYTEST_ARGS...: pytests NAME; unless it passed, the part stops
    # there (its logs into $OUT): a variant that hangs or mismatches would otherwise eat the call's other timeouts
    local part=$1 name=$2; shift 2
    pytests "$name" "$@"
    if ! grep -q "passed" "$L/log_$name.txt" || grep -qE "^FAILED|^ERROR" "$L/log_$name.txt"; then
        echo "$part: the smoke case $name failed; stopping" | tee -a "$S"; tail -30 "$L/log_$name.txt"
        tar czf "$OUT/logs_$part.tgz" -C "$L" .; exit 1
    fi
}
ab_run() {      # ab_run TAG TIMEOUT LAYER_AB_ARGS...: one layer_ab.py A/B, its table into the summary, its JSON into $OUT
    local tag=$1 t=$2; shift 2
    timeout "$t" python3 benchmarks/layer_ab.py --out "$L" --tag "_$tag" "$@" > "$L/ab_$tag.txt" 2>&1
    echo "layer_ab $tag ($*) rc=$?" | tee -a "$S"; sed -n '/: A = .*medians/,$p' "$L/ab_$tag.txt" | tee -a "$S"
    cp "$L/layer_ab_$tag.json" "$OUT/" 2>/dev/null
}
smi_start() {   # smi_start NAME: SM / memory clocks, power, temperature and clock-event reasons every 200 ms into
    # $OUT/smi_NAME.csv, until smi_stop: a slowdown of the clocks tells itself from a slower kernel (session 45, s166:
    # 1980 MHz throughout, no throttle reason but idle)
    local r=clocks_event_reasons.active    # the older drivers' name is clocks_throttle_reasons.active
    nvidia-smi --query-gpu=$r --format=csv,noheader > /dev/null 2>&1 || r=clocks_throttle_reasons.active
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,$r --format=csv,noheader,nounits \
        -lms 200 > "$OUT/smi_$1.csv" 2>&1 &
    SMI_PID=$!
}
smi_stop() {    # smi_stop NAME: by pid (a pkill -f of the sampler's command line also matched the call's shell: s166)
    kill "$SMI_PID" 2>/dev/null; python3 benchmarks/smi_summary.py "$OUT/smi_$1.csv" | tee -a "$S"
}
if [ "$part" = tests ]; then
    # the GPU kernel tests, one pytest process per file at once: they are bound by the CPU's compiles (a fresh H100
    # ran 233 of 663 tests in 250 s serially, session 43), and correctness tests share the GPU without harm
    pytests kernels 500 tests/test_kernels_gpu.py & pytests mla 500 tests/test_mla_kernel_gpu.py &
    pytests mla_heads 500 tests/test_mla_heads_gpu.py & pytests moe 500 tests/test_moe_kernel_gpu.py &
    pytests kda_streams_topk 500 tests/test_kda_kernel_gpu.py tests/test_streams_gpu.py tests/test_router_topk_gpu.py &
    wait
    tar czf "$OUT/logs_tests.tgz" -C "$L" .
elif [ "$part" = tests2 ]; then   # compute-sanitizer memcheck on the kernel families, the runtime's graphs
    memcheck sanitizer 250 tests/test_kernels_gpu.py tests/test_kda_kernel_gpu.py tests/test_router_topk_gpu.py \
        -k "(matches_reference or weight_pair) and not graph and not 64"
    pytests runtime_graphs 250 tests/test_runtime_gpu.py
    tar czf "$OUT/logs_tests2.tgz" -C "$L" .
elif [ "$part" = s182 ]; then     # session 48: on the H200 layer_bench's recheck at a row's end read +10% at TP8 M = 64
    # (769.5 -> 842.4 KDA, 807.2 -> 890.5 MLA) while order_probe's steps moved nothing. k3fuse timed again after every
    # step of the row (--recheck-steps): which one leaves the next timing slow
    for k in kda mla; do
        timeout 240 python3 benchmarks/layer_bench.py --out "$L" --kinds $k --tp 8 --ms 64 --skip inductor --top 16 \
            --k3fuse-first --recheck --recheck-steps --tag "_steps_$k" > "$L/lb_steps_$k.txt" 2>&1
        echo "layer $k recheck steps rc=$?" | tee -a "$S"; grep -v '^{' "$L/lb_steps_$k.txt" | sed -n '/^kind/,/^$/p' \
            | tee -a "$S"
    done
    tar czf "$OUT/logs_s182.tgz" -C "$L" .
elif [ "$part" = ab ]; then       # validate_pending.sh ab NAME=A,B [MS]: one knob, both arms in one process, ABBA replays
    timeout 300 python3 benchmarks/layer_ab.py --out "$L" --var "$2" --kinds kda,mla --tp 16 --ms "${3:-1}" --pairs 40 \
        > "$L/ab.txt" 2>&1
    echo "layer_ab $2 rc=$?" | tee -a "$S"; sed -n '/: A = .*medians/,$p' "$L/ab.txt" | tee -a "$S"
    cp "$L"/layer_ab.json "$OUT/" 2>/dev/null
elif [ "$part" = s149 ]; then     # session 37 (not run): the sum of session 37's MLA defaults in one process (layer_ab --arms:
    # arm A = session 36's settings, B = the defaults). s148's single layer_bench rows showed less than the A/Bs' sum
    # (-15 us at TP16 M = 64). At TP8 M = 64 only the 4-token combine differs; at TP16 M = 16 only the ring
    ab_run s36_m64 150 --arms "K3FUSE_MLA_ASYNC=0 K3FUSE_MLA_CMMA_TOK=8 K3FUSE_MLA_CTAS_PER_SM=8; -" --kinds mla \
        --tp 16,8 --ms 64 --pairs 8
    ab_run s36_tp16 120 --arms "K3FUSE_MLA_ASYNC=0 K3FUSE_MLA_CMMA=0; -" --kinds mla --tp 16 --ms 32,16 --pairs 8
    # the split counts not yet A/B'd: TP8 M = 64 at 4 CTAs per SM (without the ring; 16 was +30 in session 32), and
    # with the ring at TP16 M = 16, 32 (2 -> 1 CTA per SM: NS 16 -> 9 and 9 -> 5, longer splits)
    ab_run tp8_ns 80 --var K3FUSE_MLA_CTAS_PER_SM=8,4 --kinds mla --tp 8 --ms 64 --pairs 8
    ab_run ring_ns_mid 90 --var K3FUSE_MLA_CTAS_PER_SM=2,1 --kinds mla --tp 16 --ms 32,16 --pairs 8
    tar czf "$OUT/logs_s149.tgz" -C "$L" .
elif [ "$part" = s139 ]; then     # session 36 (not run): the wgmma GEMM with clusters of 14-16 splits (the tuner's
    # candidates where 8 splits leave fewer than 112 CTAs: 768x7168, 1536x7168 at BN = 128, 1152x1536 at BN = 128).
    # Predicted: 768x7168 from 40-44% of copy (96 CTAs) toward 55% with 168-192; -0.5..-1 us per such GEMM standalone
    pytests wgmma_wide 150 tests/test_kernels_gpu.py -k "wgmma_matches_reference and (768-7168 or 3216-7168)"
    memcheck memcheck_wgmma_wide 90 tests/test_kernels_gpu.py -k "wgmma_matches_reference and 768-7168-17"
    timeout 200 python3 benchmarks/gpu_kernels.py --out "$L/gk_wide" --shapes 768x7168,1536x7168,1152x1536 \
        --ms 16,32,64 --tune --variants wgmma > "$L/gk_wide.txt" 2>&1
    echo "gpu_kernels wide rc=$?" | tee -a "$S"
    cp "$L/gk_wide/results.json" "$OUT/gk_wide_results.json" 2>/dev/null
    # the overlay: where the best wgmma config is a cluster of > 8 and beats the table's current entry
    python3 - "$L/gk_wide/results.json" "$OUT/wgmma_wide_overlay.json" <<'PY' 2>&1 | tee -a "$S"
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["results"] if r.get("family") == "gemv" and r.get("ok")]
keep = {}
for key in sorted({(r["N"], r["K"], r["bucket"]) for r in rows}):
    rs = [r for r in rows if (r["N"], r["K"], r["bucket"]) == key]
    tab = min((r for r in rs if r.get("tabled")), key=lambda r: r["us"], default=None)
    ref = min([rs[0]["cublas_us"]] + ([tab["us"]] if tab else []))
    b = min(rs, key=lambda r: r["us"])
    print(f"{key}: cuBLAS {rs[0]['cublas_us']:.2f} tabled {tab['us'] if tab else float('nan'):.2f} best {b['us']:.2f} "
          f"{b['config']} {b['pct_copy']:.0f}% of copy")
    if b["config"]["variant"] == "wgmma" and b["config"]["KS"] > 8 and b["us"] < 0.97 * ref:
        keep.setdefault(f"gemv:{key[0]}x{key[1]}", {})[str(key[2])] = {x: b["config"][x] for x in ("variant", "KS", "ST", "BN")}
json.dump({"entries": keep}, open(sys.argv[2], "w"), indent=1, sort_keys=True)
print("wide overlay:", sum(len(e) for e in keep.values()), "entries ->", sys.argv[2])
PY
    if grep -q '"gemv' "$OUT/wgmma_wide_overlay.json" 2>/dev/null; then
        ab_run wgmma_wide 170 --var K3FUSE_TUNING_OVERLAY=none,$OUT/wgmma_wide_overlay.json --kinds kda,mla --tp 16,8 \
            --ms 64,32 --pairs 8
    fi
    tar czf "$OUT/logs_s139.tgz" -C "$L" .
elif [ "$part" = s140 ]; then     # session 36 (not run): why s136's whole overlay lost +8.4 us at KDA TP16 M = 16.
    # Suspect (by elimination): 3216x7168's wgmma entry at bucket 16 (8% faster standalone). The A/B of that one entry
    # over the table (16 pairs), then the op ledger of the row with and without it (which kernels move)
    OV=benchmarks/overlays/wgmma_in_proj16.json
    ab_run in_proj16 150 --var K3FUSE_TUNING_OVERLAY=none,$OV --kinds kda --tp 16 --ms 16 --pairs 16
    for v in none $OV; do
        t=$(basename "$v" .json)
        K3FUSE_TUNING_OVERLAY=$v timeout 150 python3 benchmarks/layer_bench.py --out "$L" --kinds kda --tp 16 --ms 16 \
            --skip eager,inductor --top 24 --tag "_m16_$t" > "$L/lb_m16_$t.txt" 2>&1
        echo "ledger $t rc=$?" | tee -a "$S"; grep -v '^{' "$L/lb_m16_$t.txt" | sed -n '/^kind/,$p' | cut -c1-110 \
            | tee -a "$S"
    done
    tar czf "$OUT/logs_s140.tgz" -C "$L" .
else
    echo "unknown part '$part' (tests, tests2, s182, ab, s149, s139, s140)" >&2
    exit 2
fi
