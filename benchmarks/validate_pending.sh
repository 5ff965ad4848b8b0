#!/bin/bash
# GPU checks and A/Bs still to run, one device call each on an nvidia-h200 (each part < 10 minutes):
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh PART
# A part that has run is removed once its results are in RESULTS.md; that section names the commit it ran at, where
# this file still has it (git show COMMIT:benchmarks/validate_pending.sh). Parts, in the order of the device plan
# (PERF_NOTES.md, the latest session):
#   tests  the GPU kernel test files, one process each at once
#   tests2 compute-sanitizer memcheck, the runtime's graphs
#   s177   q_b inside the three launches' first kernel (qb_absorb, K3FUSE_MLA_QB3): tests, memcheck, A/B TP8 M = 1
#   s179   s177's kernels in the profile per arm, then qb_absorb with clusters of 16
#   s180   qb_absorb's op alone and behind a 52 MB GEMV against the q_b GEMV + qabsorb (qb3_probe.py)
#   s178   the same A/B at TP8 M = 2, 4
#   s176   with EARLY on, all of a lane's W2 slots before the wait (AXB = 0) against one batch (AXB = 1), TP8 M = 1
#   s173   the TP8 M = 1 rows with max-autotune and the EARLY default (session 42's are the latest)
#   s168   order_probe.py, then layer_bench's M = 64 rows timed first and again after (a process per kind); layer_ab optional
#   s167   the M = 64 rows at 16 layers per graph with each copy's own floor
#   s169   the TP16 M = 1 rows with max-autotune (session 29's are the latest)
#   ab     NAME=A,B [MS]: a paired A/B of one variable in one process (layer_ab.py)
#   s164   the wgmma reference test that failed once on an H100 (s161): synccheck, racecheck, then repeats
#   s149   session 37's MLA defaults summed (layer_ab --arms); split counts
#   s139   wgmma clusters of 14-16: tests, memcheck, shapes, A/B
#   s150   ncu of the M = 64 MLA split / combine with session 37's defaults
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
elif [ "$part" = s167 ]; then     # session 45. The M = 64 rows with 16 layers per graph (--graph-rounds 8) and
    # the floor of each copy's own routing: s166 (H200) found each replay's kernels span 785 / 798 us per layer where the
    # graph timed 822 / 880 (not explained: s168; at 16 layers per graph a per-replay cost shrinks), and copy 1's MLA layer 56 us longer
    # than copy 0's
    timeout 200 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16,8 --ms 64 --skip eager,inductor \
        --top 16 --graph-rounds 8 --tag _m64r8 > "$L/lb_m64r8.txt" 2>&1
    echo "layer M=64 graph-rounds 8 rc=$?" | tee -a "$S"; grep -v '^{' "$L/lb_m64r8.txt" | sed -n '/^kind/,/^$/p' | tee -a "$S"
    cp "$L"/layer_bench_m64r8.json "$L/lb_m64r8.txt" "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s167.tgz" -C "$L" .
elif [ "$part" = s177 ]; then     # session 48: MLA TP8 M = 1 launches the q_b GEMV (7 MB) and then qabsorb; qb_absorb
    # computes q in clusters of 8 per (head, row) from W_qb rows bulk-copied before the chain's wait, then absorbs:
    # one launch fewer (11 -> 10). Predicted -1..-2.5 us per MLA layer (the q_b GEMV's ~1.7 us over its bytes and a
    # boundary), or a loss if 96 CTAs pull 7 MB slower than the GEMV's full grid
    smoke_or_stop s177 qb3 300 tests/test_mla_heads_gpu.py -k "qb_three or qb_op_falls_back"
    memcheck qb3_memcheck 200 tests/test_mla_heads_gpu.py -k "qb_three and 12-1-1024"
    ab_run qb3_m1 330 --var K3FUSE_MLA_QB3=0,1 --kinds mla --tp 8 --ms 1 --pairs 12
    tar czf "$OUT/logs_s177.tgz" -C "$L" .
elif [ "$part" = s179 ]; then     # session 48: s177 lost (+1.94 us, 0 / 12). Where: each arm's kernels in the profile;
    # then clusters of 16 (12 + 4 rows of W_qb per CTA, 192 CTAs: half the bytes per SM)
    K3FUSE_MLA_QB3_CL=16 smoke_or_stop s179 qb3_cl16 200 tests/test_mla_heads_gpu.py -k "qb_three and 12-1"
    for a in 0 1; do
        K3FUSE_MLA_QB3=$a timeout 150 python3 benchmarks/layer_bench.py --out "$L" --kinds mla --tp 8 --ms 1 \
            --skip eager,inductor --top 16 --tag "_qb3_$a" > "$L/lb_qb3_$a.txt" 2>&1
        echo "profile QB3=$a rc=$?" | tee -a "$S"; grep -v '^{' "$L/lb_qb3_$a.txt" | sed -n '/^kind/,$p' | cut -c1-130 \
            | tee -a "$S"
    done
    ab_run qb3_cl16 240 --arms "-; K3FUSE_MLA_QB3=1 K3FUSE_MLA_QB3_CL=16" --kinds mla --tp 8 --ms 1 --pairs 12
    tar czf "$OUT/logs_s179.tgz" -C "$L" .
elif [ "$part" = s180 ]; then     # session 48: qb_absorb's op alone and behind a 52 MB GEMV, QB3 = 0 / 1 (qb3_probe.py)
    timeout 300 python3 benchmarks/qb3_probe.py --out "$L" > "$L/qb3_probe.txt" 2>&1
    echo "qb3_probe rc=$?" | tee -a "$S"; tail -6 "$L/qb3_probe.txt" | tee -a "$S"; cp "$L/qb3_probe.json" "$OUT/" 2>/dev/null
elif [ "$part" = s178 ]; then     # session 48: s177's A/B at TP8 M = 2 and 4 (QS = 8 there too; W_qb re-read per row)
    ab_run qb3_m24 540 --var K3FUSE_MLA_QB3=0,1 --kinds mla --tp 8 --ms 2,4 --pairs 10
elif [ "$part" = s176 ]; then     # session 47: session 41 chose AXB = 1 over all slots at once (-1.50 / -1.90 us per KDA /
    # MLA layer) when every W2 load came after the wait; with EARLY the first batch is what streams during the up's
    # tail, and AXB = 0 makes that batch all four slots (24 LDG.128 per lane, more registers: one 512-thread CTA per SM
    # fewer). Predicted: within +-1 us; a loss if the register cost still dominates
    ab_run early_axb 200 --var K3FUSE_MOE_DOWN_AXB=1,0 --kinds kda,mla --tp 8 --ms 1 --pairs 12
elif [ "$part" = s173 ]; then     # the TP8 M = 1 rows with max-autotune, with the EARLY default (session 42's predate it)
    timeout 420 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 8 --ms 1 --top 16 --max-autotune \
        --tag _m1tp8 > "$L/lb_m1tp8.txt" 2>&1
    echo "layer TP8 M=1 rc=$?" | tee -a "$S"; grep -v '^{' "$L/lb_m1tp8.txt" | sed -n '/^kind/,/^$/p' | tee -a "$S"
    cp "$L"/layer_bench_m1tp8.json "$L"/layer_bench_m1tp8.png "$L/lb_m1tp8.txt" "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s173.tgz" -C "$L" .
elif [ "$part" = s169 ]; then     # the TP16 M = 1 rows with max-autotune, last run in session 29 (s83)
    timeout 330 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16 --ms 1 --top 16 --max-autotune \
        --tag _m1tp16 > "$L/lb_m1tp16.txt" 2>&1
    echo "layer TP16 M=1 rc=$?" | tee -a "$S"; grep -v '^{' "$L/lb_m1tp16.txt" | sed -n '/^kind/,/^$/p' | tee -a "$S"
    cp "$L"/layer_bench_m1tp16.json "$L"/layer_bench_m1tp16.png "$L/lb_m1tp16.txt" "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s169.tgz" -C "$L" .
elif [ "$part" = s168 ]; then     # session 45: s166's paired A/B (layer_ab, no profiler, no eager graph in the process)
    # timed the KDA TP8 M = 64 layer at 749.7 us where layer_bench's rows of the same call gave 815.3 / 822.5. Is it
    # what layer_bench runs before k3fuse (eager's graph and its profiler session)? k3fuse timed first, then eager
    # (timed, profiled), k3fuse profiled, and k3fuse's graph timed again (k3fuse_us_recheck)
    # session 46 ran the KDA row's three orders on an H100 (RESULTS.md): no consistent effect there; this part is for
    # an H200, where session 45 saw the 8% gap. S168_KINDS="kda mla" for both rows, S168_AB=1 for layer_ab beside them
    # session 47: on one H100 the recheck read +10% / +15% (KDA / MLA), on another order_probe.py found no step of
    # the row that moves a later timing (RESULTS.md). First order_probe at TP8 M = 64 on the H200, then the rows
    smi_start s168
    timeout 200 python3 benchmarks/order_probe.py --out "$OUT" --kinds kda,mla --tp 8 --ms 64 > "$OUT/order_probe.txt" 2>&1
    echo "order_probe rc=$?" | tee -a "$S"; grep -v '^{' "$OUT/order_probe.txt" | grep -v Warn | tail -16 | tee -a "$S"
    # one process per kind: in one process the second kind's "first" timing would follow the first kind's profiler
    # sessions. Output straight into $OUT: the JSON is rewritten after each row, so a cut call returns the rows done
    for k in ${S168_KINDS:-kda}; do
        timeout 170 python3 benchmarks/layer_bench.py --out "$OUT" --kinds $k --tp 8 --ms 64 --skip inductor \
            --top 16 --k3fuse-first --recheck --tag _order_$k > "$OUT/lb_order_$k.txt" 2>&1
        echo "layer $k k3fuse-first + recheck rc=$?" | tee -a "$S"
        grep -v '^{' "$OUT/lb_order_$k.txt" | sed -n '/^kind/,/^$/p' | tee -a "$S"
    done
    # layer_ab's timing of the same KDA layer in the same call, both arms alike (s166: 749.7 us)
    if [ "${S168_AB:-0}" = 1 ]; then ab_run null_kda 150 --var K3FUSE_PDL_CHAIN=1,1 --kinds kda --tp 8 --ms 64 --pairs 6; fi
    smi_stop s168
    tar czf "$OUT/logs_s168.tgz" -C "$L" .
elif [ "$part" = s164 ]; then     # session 42's one failure of test_gemv_wgmma_matches_reference[768-7168-40] on an H100
    # (s161, log lost) passed five times on an H100 since (session 43: three; session 44: the tests part and memcheck).
    # The sanitizers first (a cluster-sum race would show there), then repeats, each logged as it ends, until the
    # call's time runs out
    for tool in synccheck racecheck; do
        timeout 170 compute-sanitizer --tool $tool python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py \
            -k "wgmma_matches_reference and 768-7168-40" > "$L/log_$tool.txt" 2>&1
        echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$L/log_$tool.txt" | tail -1) $(grep -E 'passed|failed' "$L/log_$tool.txt" | tail -1)" | tee -a "$S"
        cp "$L/log_$tool.txt" "$OUT/" 2>/dev/null
    done
    for i in $(seq 20); do pytests "wgmma_rep$i" 40 tests/test_kernels_gpu.py -k "wgmma_matches_reference and 768-7168"; done
    tar czf "$OUT/logs_s164.tgz" -C "$L" .
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
elif [ "$part" = s150 ]; then     # session 37 (not run): the M = 64 MLA kernels under ncu with session 37's defaults (s128's
    # lines): what is left of the split kernel's latency-bound profile with the ring (TP16) and without (TP8). First
    # the routed down's load groups once more: at TP16 M = 64 it ran at 71% of copy in session 36's ncu (373.9 MB in
    # 125.7 us), the up at 90%; UD = 6 (one load group per row block at I = 192) was +8.7 us in session 18, before the
    # ballot scans, the member lists and the per-warp epilogue
    ab_run down_ud 80 --var K3FUSE_MOE_DOWN_UD=3,6 --kinds kda --tp 16 --ms 64,32 --pairs 8
    ncu_layer m64 mla "split_kernel|combine_mma_kernel" 4 \
        ",sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
    tar czf "$OUT/logs_s150.tgz" -C "$L" .
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
    echo "unknown part '$part' (tests, tests2, s177, s179, s180, s178, s176, s173, s168, s167, s169, ab, s164, s149, s139, s150, s140)" >&2
    exit 2
fi
