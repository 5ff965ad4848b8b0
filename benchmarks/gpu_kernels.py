"""Build, check and time the k3fuse kernels on a GPU, in one call (see benchmarks/RESULTS.md for how it is run).

  python3 benchmarks/gpu_kernels.py --out $OUT [--shapes tp8,tp16] [--ms 1,8,64] [--tune] [--families gemv,frn,prefetch]
  python3 benchmarks/gpu_kernels.py --out $OUT --only-small    # PDL on/off on the 11 MB shapes (family pdl), ~1-2 min

Per (shape, M): every candidate config is compiled (in a process pool, into the disk cache), checked against an
fp64 reference on fresh random bf16 inputs with the output poisoned (NaN) before the run, and timed as a CUDA graph
of L launches over weight copies rotated beyond L2 (events, median of replays). cuBLAS (F.linear) is timed the same
way, and the device-to-device copy bandwidth is measured in the same run. Writes results.json, a tuning table and a
log under --out; prints a short table last.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F

TP8 = [(6288, 7168), (1536, 128), (2112, 7168), (2304, 1536), (1536, 7168), (7168, 768), (7168, 1536),
       (3584, 7168), (7168, 3584), (8448, 7168), (7168, 4224), (20480, 7168)]
TP16 = [(3216, 7168), (1152, 1536), (768, 7168), (768, 128), (7168, 384), (7168, 768), (4224, 7168), (10240, 7168)]
L2_BYTES = 60 * 2**20
SMALL = [(7168, 768), (768, 7168)]    # the 11 MB K3 shapes, where the fixed launch cost dominates at M = 1
SMALL_MS = (1, 8)
LOG = None


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    if LOG:
        LOG.write(s + "\n")
        LOG.flush()


def _compile_job(job):
    family, args, cfg, arch = job
    try:
        t = time.time()
        if family == "gemv":
            from k3fuse.codegen import gemv
            k = gemv.build(*args, cfg=cfg, arch=arch, load=False)
        elif family == "frn":
            from k3fuse.codegen import fused_residual_norm as frn
            k = frn.build_mix_norm(*args, arch=arch, load=False)
        return (job, True, round(time.time() - t, 2), k.compile_s)
    except Exception as e:
        return (job, False, repr(e)[:300], 0)


def precompile(jobs, workers):
    t = time.time()
    bad = []
    import multiprocessing as mp
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for job, ok, dt, cs in ex.map(_compile_job, jobs):
            if not ok:
                bad.append((job, dt))
                log("COMPILE FAIL", job, dt)
    log(f"precompiled {len(jobs)} kernels in {time.time() - t:.1f} s with {workers} workers; {len(bad)} failed")
    return bad


def capture_graph(fn, iters_per_graph):
    """fn(0), ..., fn(iters_per_graph - 1) (i = launch index) captured as one CUDA graph, after 3 warm calls on a
    side stream; replayed once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(iters_per_graph):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    return g


def replay_us(g, n) -> float:
    """Microseconds per call of one replay of graph g holding n calls, timed with events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1000 / n


def graph_time(fn, iters_per_graph=20, replays=15, before_replay=None):
    """Median microseconds per call of fn(i) (i = launch index), from CUDA-graph replays timed with events.
    before_replay(): host work between timed replays (refill inputs, a barrier across ranks), outside the timing."""
    g = capture_graph(fn, iters_per_graph)
    ts = []
    for _ in range(replays):
        if before_replay is not None:
            before_replay()
        ts.append(replay_us(g, iters_per_graph))
    return statistics.median(ts), (min(ts), max(ts))


def copy_bandwidth():
    n = 1 << 30
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1000)
    bw = 2 * n / statistics.median(ts)
    del src, dst
    return bw


def rel_err(out, ref):
    out = out.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def gemv_err(k, M, N, K, trials=2):
    """Worst rel err of a GEMV launch k(x, w, y) (a compiled kernel or a launcher) over fresh random inputs, output
    NaN-poisoned each time."""
    errs = []
    for _ in range(trials):
        xt = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        wt = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        yt = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        k(xt, wt, yt)
        torch.cuda.synchronize()
        errs.append(rel_err(yt, xt.double() @ wt.double().t()))
    return max(errs)


def tune_candidates(N, K, b, arch, variants=None):
    """The configs --tune times for one (shape, bucket): gemv.candidates, plus the wgmma variant's on an sm_90a
    device; only the variants in `variants` where given (--variants)."""
    from k3fuse.codegen import gemv
    cands = gemv.candidates(N, K, b)
    if gemv.wg_arch_supports(arch) is None:
        cands += gemv.wg_candidates(N, K, b)
    return [c for c in cands if not variants or c["variant"] in variants]


def bench_gemv(shapes, ms, tune_ms, copy_bw, results, arch, variants=None):
    from k3fuse.codegen import gemv
    from k3fuse.codegen.buckets import bucket_for
    table = {}
    for (N, K) in shapes:
        wbytes = N * K * 2
        nrot = max(2, math.ceil(3 * L2_BYTES / wbytes))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(nrot)]
        for M in ms:
            b = bucket_for(M)
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            bytes_moved = wbytes + M * K * 2 + M * N * 2
            floor_us = bytes_moved / copy_bw * 1e6
            t_cublas, _ = graph_time(lambda i: torch.mm(x, ws[i % nrot].t(), out=y))
            t_cublas2, _ = graph_time(lambda i: F.linear(x, ws[i % nrot]))
            t_cublas = min(t_cublas, t_cublas2)
            tabled = gemv.config_for(N, K, b)
            cands = ([tabled] + [c for c in tune_candidates(N, K, b, arch, variants) if c != tabled] if M in tune_ms
                     else [tabled])
            best = None
            for cfg in cands:
                row = dict(family="gemv", N=N, K=K, M=M, bucket=b, config=cfg, wbytes=wbytes,
                           floor_us=floor_us, cublas_us=t_cublas, tabled=cfg == tabled,
                           routed=gemv.route(N, K, M)[0] is not None)
                try:
                    # through gemv.linear (builds it): the split-K variant takes its workspace and counters there
                    def run(xx, ww, yy, c=cfg):
                        gemv.linear(xx, ww, c, out=yy)
                    err = gemv_err(run, M, N, K)
                    t, (tmin, tmax) = graph_time(lambda i: run(x, ws[i % nrot], y))
                    row.update(err=err, us=t, us_min=tmin, us_max=tmax, pct_copy=floor_us / t * 100,
                               speedup_cublas=t_cublas / t, ok=err < 1e-2)
                    if row["ok"] and (best is None or t < best["us"]):
                        best = row
                except Exception as e:
                    row.update(ok=False, error=repr(e)[:400])
                    log("ERROR", N, K, M, cfg, repr(e)[:400])
                results.append(row)
                log(json.dumps(row))
            if best:
                table.setdefault(f"gemv:{N}x{K}", {})[str(b)] = best["config"]
                best["best"] = True
        del ws
        torch.cuda.empty_cache()
    return table


def pdl_pairs(N, K, b):
    """(pdl=0, pdl=1) config pairs for the small-shape comparison: the tuner's PDL bases (tabled config first)."""
    from k3fuse.codegen import gemv
    return [(c, dict(c, pdl=1)) for c in gemv._pdl_bases(N, K, b, gemv.candidates(N, K, b))]


def pdl_chain_check(M, cfg_up, cfg_down, rounds=3, replays=4):
    """RAW hazards PDL could break, in one CUDA graph: a torch kernel writes x, then `rounds` of
    h = x @ w_up^T (7168x768) and x' = h @ w_down^T (768x7168), each GEMV reading what the kernel just before it
    wrote while that kernel already let it launch (griddepcontrol.launch_dependents at its start). Every buffer
    but the source is NaN-poisoned before each replay, so a read ahead of griddepcontrol.wait shows up as NaN or
    as a mismatch against fp64 products of the values each stage really read. Returns the worst relative error."""
    from k3fuse.codegen import gemv
    from k3fuse.codegen.buckets import bucket_for
    b = bucket_for(M)
    wu = (torch.randn(7168, 768, device="cuda") * 768 ** -0.5).to(torch.bfloat16)
    wd = (torch.randn(768, 7168, device="cuda") * 7168 ** -0.5).to(torch.bfloat16)
    ku, kd = gemv.build(7168, 768, b, cfg_up), gemv.build(768, 7168, b, cfg_down)
    src = torch.randn(M, 768, device="cuda", dtype=torch.bfloat16)
    xs = [torch.empty(M, 768, device="cuda", dtype=torch.bfloat16) for _ in range(rounds + 1)]
    hs = [torch.empty(M, 7168, device="cuda", dtype=torch.bfloat16) for _ in range(rounds)]

    def body():
        torch.mul(src, 2.0, out=xs[0])            # an ordinary (non-PDL) kernel writing the first GEMV's x
        for r in range(rounds):
            ku(xs[r], wu, hs[r])
            kd(hs[r], wd, xs[r + 1])
    body()                                        # compile/load before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    worst = 0.0

    def err(out, ref):
        e = rel_err(out, ref)
        return e if e == e else float("inf")  # a NaN reference (poisoned input) must not vanish in max()
    for _ in range(replays):
        src.copy_(torch.randn(M, 768, device="cuda", dtype=torch.bfloat16))
        for t in xs + hs:
            t.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        worst = max(worst, err(xs[0], src.double() * 2))
        for r in range(rounds):
            worst = max(worst, err(hs[r], xs[r].double() @ wu.double().t()),
                        err(xs[r + 1], hs[r].double() @ wd.double().t()))
    return worst


def bench_pdl_small(copy_bw, results, shapes=SMALL, ms=SMALL_MS):
    """pdl=0 vs pdl=1 (same other parameters) on the small shapes, timed like bench_gemv (a CUDA graph of 20
    launches over weights rotated beyond L2): `us` back to back (each launch follows the same PDL kernel, so its
    prologue overlaps the previous launch), `after_write_us` with an ordinary torch kernel writing x before
    every launch (a predecessor that does not trigger early; the GEMV's share, pair minus the write alone).
    cuBLAS beside them. Rows have family "gemv_pdl" (make_tuning_table ignores them; the tuner's own pdl
    candidates are "gemv" rows)."""
    from k3fuse.codegen import gemv
    from k3fuse.codegen.buckets import bucket_for
    rows = []
    for (N, K) in shapes:
        wbytes = N * K * 2
        nrot = max(2, math.ceil(3 * L2_BYTES / wbytes))
        ws = [(torch.randn(N, K, device="cuda") * K ** -0.5).to(torch.bfloat16) for _ in range(nrot)]
        for M in ms:
            b = bucket_for(M)
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            xsrc = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            floor_us = (wbytes + M * K * 2 + M * N * 2) / copy_bw * 1e6
            t_cublas = min(graph_time(lambda i: torch.mm(x, ws[i % nrot].t(), out=y))[0],
                           graph_time(lambda i: F.linear(x, ws[i % nrot]))[0])
            t_write, _ = graph_time(lambda i: torch.mul(xsrc[i % 2], 1.0, out=x))
            t_cublas_w, _ = graph_time(lambda i: (torch.mul(xsrc[i % 2], 1.0, out=x),
                                                  torch.mm(x, ws[i % nrot].t(), out=y)))
            for pair in pdl_pairs(N, K, b):
                for cfg in pair:
                    row = dict(family="gemv_pdl", N=N, K=K, M=M, bucket=b, config=cfg, pdl=int(bool(cfg.get("pdl"))),
                               wbytes=wbytes, floor_us=floor_us, cublas_us=t_cublas,
                               cublas_after_write_us=t_cublas_w - t_write, write_us=t_write)
                    try:
                        k = gemv.build(N, K, b, cfg)
                        err = gemv_err(k, M, N, K)
                        t, (tmin, tmax) = graph_time(lambda i: k(x, ws[i % nrot], y))
                        t_w, _ = graph_time(lambda i: (torch.mul(xsrc[i % 2], 1.0, out=x), k(x, ws[i % nrot], y)))
                        row.update(err=err, ok=err < 1e-2, us=t, us_min=tmin, us_max=tmax,
                                   pct_copy=floor_us / t * 100, after_write_us=t_w - t_write,
                                   pct_copy_after_write=floor_us / max(t_w - t_write, 1e-9) * 100)
                    except Exception as e:
                        row.update(ok=False, error=repr(e)[:400])
                        log("ERROR", N, K, M, cfg, repr(e)[:400])
                    results.append(row)
                    rows.append(row)
                    log(json.dumps(row))
        del ws
        torch.cuda.empty_cache()
    for M in ms:  # the hazard check, with the first PDL pair of each shape
        b = bucket_for(M)
        up, down = pdl_pairs(7168, 768, b)[0][1], pdl_pairs(768, 7168, b)[0][1]
        row = dict(family="gemv_pdl_chain", M=M, cfg_up=up, cfg_down=down)
        try:
            err = pdl_chain_check(M, up, down)
            row.update(err=err, ok=err < 1e-2)
        except Exception as e:
            row.update(ok=False, error=repr(e)[:500] + traceback.format_exc()[-800:])
        results.append(row)
        log(json.dumps(row))
    return rows


def pdl_table(results):
    log(f"\n{'shape':>12} {'M':>3} {'config (pdl 0 -> 1)':>26} {'us':>13} {'%copy':>11} {'after write us':>15} "
        f"{'cuBLAS':>7} {'err':>8}")
    rows = [r for r in results if r.get("family") == "gemv_pdl"]
    for r0 in (r for r in rows if not r["pdl"]):
        r1 = next((r for r in rows if r["pdl"] and (r["N"], r["K"], r["M"]) == (r0["N"], r0["K"], r0["M"])
                   and {k: v for k, v in r["config"].items() if k != "pdl"} == r0["config"]), None)
        if r1 is None or "us" not in r0 or "us" not in r1:
            continue
        c = r0["config"]
        cs = c["variant"] + ":" + ",".join(f"{k}{v}" for k, v in c.items() if k != "variant")
        log(f"{r0['N']:>5}x{r0['K']:<6} {r0['M']:>3} {cs:>26} {r0['us']:5.2f} -> {r1['us']:5.2f} "
            f"{r0['pct_copy']:4.0f} -> {r1['pct_copy']:3.0f} {r0['after_write_us']:6.2f} -> {r1['after_write_us']:5.2f} "
            f"{r0['cublas_us']:7.2f} {max(r0['err'], r1['err']):8.1e}")
    for r in results:
        if r.get("family") == "gemv_pdl_chain":
            log(f"PDL chain hazard check M={r['M']}: {'ok' if r.get('ok') else 'FAILED'} err={r.get('err')} "
                f"{r.get('error', '')}")


def bench_frn(results, copy_bw):
    """fused_residual_norm: o_proj GEMV + mix-norm kernel vs the op's reference (the unfused path) on the GPU."""
    from k3fuse import ops
    from k3fuse.codegen import fused_residual_norm as frn
    ref = ops.fused_residual_norm._init_fn
    H = 7168
    variants = [dict(nb=3, addend=False, prefix=True, fp32=False), dict(nb=0, addend=True, prefix=True, fp32=True),
                dict(nb=8, addend=True, prefix=False, fp32=True), dict(nb=5, addend=False, prefix=True, fp32=True)]
    for K in (1536, 768):
        for M in (1, 3, 8, 64):
            for v in variants:
                row = dict(family="frn", H=H, K=K, M=M, **v)
                try:
                    errs = []
                    for trial in range(2):
                        def r(*s, scale=1.0):
                            return (torch.randn(*s, device="cuda") * scale).to(torch.bfloat16)
                        o, w_o = r(M, K), r(H, K, scale=K ** -0.5)
                        addend = r(M, H) if v["addend"] else None
                        prefix = r(M, H) if v["prefix"] else None
                        blocks_buf = r(M, 8, H)       # block snapshots as strided views of one buffer
                        blocks = [blocks_buf[:, i] for i in range(v["nb"])]
                        w_mix = torch.randn(H, device="cuda") * 0.05
                        norm_w = r(H, scale=0.5) + 1
                        out = torch.full((M, H), float("nan"), device="cuda", dtype=torch.bfloat16)
                        newp = torch.full((M, H), float("nan"), device="cuda", dtype=torch.bfloat16)
                        assert frn.launch_ok(o, w_o, addend, prefix, blocks, norm_w) is None
                        frn.fused_residual_norm(o, w_o, addend, prefix, blocks, w_mix, norm_w, 1e-5, 1e-5, "",
                                                v["fp32"], out=out, new_prefix=newp)
                        torch.cuda.synchronize()
                        rn, rp = ref(o, w_o, addend, prefix, blocks, w_mix, norm_w, 1e-5, 1e-5, "", v["fp32"])
                        errs += [rel_err(out, rn.double()), rel_err(newp, rp.double())]
                    row.update(err=max(errs), ok=max(errs) < 1e-2)
                    nrot = max(2, math.ceil(3 * L2_BYTES / (H * K * 2)))
                    wos = [torch.randn(H, K, device="cuda", dtype=torch.bfloat16) for _ in range(nrot)]
                    t_k, _ = graph_time(lambda i: frn.fused_residual_norm(o, wos[i % nrot], addend, prefix, blocks,
                                                                          w_mix, norm_w, 1e-5, 1e-5, "", v["fp32"]))
                    t_r, _ = graph_time(lambda i: ref(o, wos[i % nrot], addend, prefix, blocks, w_mix, norm_w,
                                                      1e-5, 1e-5, "", v["fp32"]))
                    nbytes = H * K * 2 + M * K * 2 + M * H * 2 * (v["nb"] + 2 + v["addend"] + v["prefix"])
                    row.update(us=t_k, ref_us=t_r, floor_us=nbytes / copy_bw * 1e6)
                    del wos
                except Exception as e:
                    row.update(ok=False, error=repr(e)[:500] + traceback.format_exc()[-800:])
                results.append(row)
                log(json.dumps(row))


def bench_router_topk(results):
    """k3fuse::topk_from_logits kernel vs the reference ops (sigmoid, + bias, ATen topk, gather, renorm), graphed."""
    from k3fuse import ops
    from k3fuse.codegen import router_topk as rt
    for E, k in ((896, 16), (896, 8)):
        for M in (1, 8, 64):
            logits = torch.randn(M, E, device="cuda") * 2
            bias = torch.randn(E, device="cuda") * 0.05
            ids, w = rt.topk_from_logits(logits, bias, k, True, 2.5)
            rids, rw = ops.topk_from_logits._init_fn(logits, bias, k, True, 2.5)
            ok = bool(torch.equal(ids, rids)) and rel_err(w, rw) < 1e-5
            t_k, _ = graph_time(lambda i: rt.topk_from_logits(logits, bias, k, True, 2.5))
            t_r, _ = graph_time(lambda i: ops.topk_from_logits._init_fn(logits, bias, k, True, 2.5))
            row = dict(family="router_topk", E=E, k=k, M=M, ok=ok, us=t_k, ref_us=t_r)
            results.append(row)
            log(f"router_topk E={E} k={k} M={M}: ok={ok} kernel {t_k:.2f} us, reference ops {t_r:.2f} us")


def bench_prefetch(results, copy_bw):
    """prefetch_l2: graph-capturable on a side stream; effect on a GEMV whose weight was evicted from L2."""
    from k3fuse.codegen import gemv, prefetch
    N, K, M = 7168, 1536, 1
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    flush_src = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    flush_dst = torch.empty_like(flush_src)
    tok = torch.zeros(1, device="cuda")
    cfg = gemv.config_for(N, K, 1)
    k = gemv.build(N, K, 1, cfg)

    def seq(pf, gemm=True, sleep=20000):
        def f(i):
            flush_dst.copy_(flush_src)                  # evict w from L2
            if pf:
                prefetch.prefetch_l2(tok, [w], N * K * 2, chunk=pf[0], per_cta=pf[1])
            if sleep:
                torch.cuda._sleep(sleep)                 # stands in for the collective
            prefetch.join_pending()
            if gemm:
                k(x, w, y)
        return f
    for pf in (None, (16384, 1), (65536, 1), (16384, 4), (4096, 1), (65536, 4)):
        row = dict(family="prefetch", N=N, K=K, chunk=pf and pf[0], per_cta=pf and pf[1])
        try:
            t_seq, _ = graph_time(seq(pf), iters_per_graph=5)
            t_base, _ = graph_time(seq(pf, gemm=False), iters_per_graph=5)
            t_flush_only, _ = graph_time(seq(None, gemm=False, sleep=0), iters_per_graph=5)
            t_pf_nosleep, _ = graph_time(seq(pf, gemm=False, sleep=0), iters_per_graph=5)
            row.update(us_seq=t_seq, us_seq_without_gemv=t_base, gemv_us=t_seq - t_base,
                       prefetch_kernel_us=t_pf_nosleep - t_flush_only, ok=True)
        except Exception as e:
            row.update(ok=False, error=repr(e)[:500] + traceback.format_exc()[-800:])
        results.append(row)
        log(json.dumps(row))


def bench_fused(results, copy_bw, only=None):
    """GEMV with the RMSNorm prologue and/or SiTU-GLU epilogue vs the same steps unfused (reference norm and
    SiTU-GLU ops on the GPU around the tuned GEMV kernel)."""
    from k3fuse import ops
    from k3fuse.codegen import gemv
    from k3fuse.codegen.buckets import bucket_for
    rms, situ = ops.rms_norm._init_fn, ops.situ_glu._init_fn
    cases = [(1536, 7168, True, True, "situ"), (768, 7168, True, True, "situ"), (2112, 7168, True, True, "none"),
             (8448, 7168, True, True, "situ"), (1536, 7168, False, False, "situ"),
             (7168, 3584, True, False, "none"), (7168, 3584, True, True, "none")]    # the routed up + its norm
    for N, K, norm, xf32, act in cases:
        if only and (N, K) not in only:
            continue
        for M in (1, 2, 4):
            row = dict(family="fused", N=N, K=K, M=M, norm=norm, x_fp32=xf32, act=act)
            try:
                errs = []
                for trial in range(2):
                    x = torch.randn(M, K, device="cuda") * 3
                    x = x if xf32 else x.to(torch.bfloat16)
                    w = (torch.randn(N, K, device="cuda") * K ** -0.5).to(torch.bfloat16)
                    nw = (torch.randn(K, device="cuda") * 0.3 + 1).to(torch.bfloat16) if norm else None
                    no = N // 2 if act == "situ" else N
                    y = torch.full((M, no), float("nan"), device="cuda", dtype=torch.bfloat16)
                    gemv.linear_fused(x, w, nw, 1e-5, act, out=y)
                    torch.cuda.synchronize()
                    h = rms(x, nw, 1e-5, torch.bfloat16) if norm else x
                    r = (h.double() @ w.double().t()).to(torch.bfloat16)
                    if act == "situ":
                        r = situ(r, 4.0, 25.0)
                    errs.append(rel_err(y, r.double()))
                row.update(err=max(errs), ok=max(errs) < 1e-2)
                nrot = max(2, math.ceil(3 * L2_BYTES / (N * K * 2)))
                ws = [(torch.randn(N, K, device="cuda") * K ** -0.5).to(torch.bfloat16) for _ in range(nrot)]
                t_f, _ = graph_time(lambda i: gemv.linear_fused(x, ws[i % nrot], nw, 1e-5, act))
                cfg = gemv.config_for(N, K, bucket_for(M))

                def unfused(i):
                    hh = rms(x, nw, 1e-5, torch.bfloat16) if norm else x
                    yy = gemv.linear(hh.contiguous(), ws[i % nrot], cfg)
                    return situ(yy, 4.0, 25.0) if act == "situ" else yy
                t_u, _ = graph_time(unfused)
                row.update(us=t_f, unfused_us=t_u, floor_us=(N * K * 2) / copy_bw * 1e6)
                del ws
            except Exception as e:
                row.update(ok=False, error=repr(e)[:500] + traceback.format_exc()[-800:])
            results.append(row)
            log(json.dumps(row))
    bench_group_situ(results, copy_bw)


def bench_group_situ(results, copy_bw, Ns=(3584, 768), K=7168):
    """The MoE group at TP16 widths (routed down + shared gate_up) with the SiTU-GLU epilogue on the gate_up
    (linear_group_situ) vs the plain group (whose SiTU is a separate kernel in the layer): the epilogue's cost."""
    from k3fuse import ops
    from k3fuse.codegen import gemv
    from k3fuse.codegen.buckets import bucket_for
    for M in (1, 2):
        row = dict(family="group_situ", N=list(Ns), K=K, M=M)
        try:
            cfg = gemv.group_config_for(list(Ns), K, bucket_for(M))
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            nrot = max(2, math.ceil(3 * L2_BYTES / (sum(Ns) * K * 2)))
            wsets = [[(torch.randn(n, K, device="cuda") * K ** -0.5).to(torch.bfloat16) for n in Ns]
                     for _ in range(nrot)]
            ys = gemv.linear_group(x, wsets[0], cfg, situ=((1,), 4.0, 25.0))
            torch.cuda.synchronize()
            r = ops.situ_glu._init_fn((x.double() @ wsets[0][1].double().t()).to(torch.bfloat16), 4.0, 25.0)
            row.update(err=rel_err(ys[1], r.double()), err0=rel_err(ys[0], x.double() @ wsets[0][0].double().t()))
            row["ok"] = max(row["err"], row["err0"]) < 1e-2
            row["situ_us"] = graph_time(lambda i: gemv.linear_group(x, wsets[i % nrot], cfg,
                                                                    situ=((1,), 4.0, 25.0)))[0]
            row["plain_us"] = graph_time(lambda i: gemv.linear_group(x, wsets[i % nrot], cfg))[0]
            row["floor_us"] = sum(Ns) * K * 2 / copy_bw * 1e6
            del wsets
        except Exception as e:
            row.update(ok=False, error=repr(e)[:500] + traceback.format_exc()[-800:])
        results.append(row)
        log(json.dumps(row))


def check_registry(results):
    """k3fuse ops through the registered CUDA kernels: values, one log line per fallback, CUDA-graph capture."""
    import io
    import logging
    from k3fuse.codegen import registry
    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    lg = logging.getLogger("k3fuse.codegen")
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    registry.register()
    row = dict(family="registry")
    try:
        errs = {}
        w = torch.randn(3584, 7168, device="cuda", dtype=torch.bfloat16)
        for M in (1, 2, 5, 8, 64, 65, 65):
            x = torch.randn(M, 7168, device="cuda", dtype=torch.bfloat16)
            y = torch.ops.k3fuse.linear(x, w)
            errs[M] = rel_err(y, x.double() @ w.double().t())
        x = torch.randn(4, 7168, device="cuda", dtype=torch.bfloat16)
        yg = torch.empty(4, 3584, device="cuda", dtype=torch.bfloat16)
        tok = torch.zeros(1, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            torch.ops.k3fuse.prefetch_l2(tok, [w], 1 << 24)
            yg.copy_(torch.ops.k3fuse.linear(x, w))
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            torch.ops.k3fuse.prefetch_l2(tok, [w], 1 << 24)
            yg.copy_(torch.ops.k3fuse.linear(x, w))
            from k3fuse.codegen.prefetch import join_pending
            join_pending()
        x.copy_(torch.randn(4, 7168, device="cuda", dtype=torch.bfloat16))
        yg.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        errs["graph"] = rel_err(yg, x.double() @ w.double().t())
        row.update(errs=errs, ok=all(e < 1e-2 for e in errs.values()))
    except Exception as e:
        row.update(ok=False, error=repr(e)[:500] + traceback.format_exc()[-1500:])
    row["log"] = buf.getvalue().strip().splitlines()
    results.append(row)
    log(json.dumps(row))


def main(argv=None):
    global LOG
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--shapes", default="tp8,tp16")
    ap.add_argument("--ms", default="1,8,64")
    ap.add_argument("--tune", action="store_true", help="time every candidate config (else the table's / default)")
    ap.add_argument("--tune-ms", default="", help="batch sizes to tune (the others in --ms are verified)")
    ap.add_argument("--families", default="gemv")
    ap.add_argument("--variants", default="", help="--tune: only these GEMV variants (e.g. wgmma) + the table's")
    ap.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 2))
    ap.add_argument("--only-small", action="store_true",
                    help="only the PDL on/off comparison on the 11 MB shapes (same as --families pdl)")
    ap.add_argument("--fused-only", action="store_true", help="--families fused: only the cases of --shapes")
    a = ap.parse_args(argv)
    if a.only_small:
        a.families = "pdl"
    os.makedirs(a.out, exist_ok=True)
    os.environ.setdefault("K3FUSE_CACHE_DIR", "/tmp/k3fuse-cache")
    LOG = open(os.path.join(a.out, "log.txt"), "w")
    shapes = []
    for s in a.shapes.split(","):
        if s == "tp8":
            shapes += TP8
        elif s == "tp16":
            shapes += TP16
        else:
            n, k = s.split("x")
            shapes.append((int(n), int(k)))
    shapes = list(dict.fromkeys(shapes))
    ms = [int(m) for m in a.ms.split(",")]
    tune_ms = {int(m) for m in a.tune_ms.split(",") if m} or (set(ms) if a.tune else set())
    ms = sorted(set(ms) | tune_ms)
    fams = a.families.split(",")
    variants = set(a.variants.split(",")) - {""}
    log(f"date {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} gpu {torch.cuda.get_device_name()} "
        f"torch {torch.__version__} argv {sys.argv}")
    from k3fuse.codegen import gemv
    from k3fuse.codegen.buckets import bucket_for
    from k3fuse.codegen.compile import current_arch
    arch = current_arch()
    jobs = []
    if "gemv" in fams:
        for (N, K) in shapes:
            for M in ms:
                b = bucket_for(M)
                for cfg in (tune_candidates(N, K, b, arch, variants) + [gemv.config_for(N, K, b)] if M in tune_ms
                            else [gemv.config_for(N, K, b)]):
                    jobs.append(("gemv", (N, K, b), cfg, arch))
    if "pdl" in fams:
        for (N, K) in SMALL:
            for M in SMALL_MS:
                for pair in pdl_pairs(N, K, bucket_for(M)):
                    jobs += [("gemv", (N, K, bucket_for(M)), c, arch) for c in pair]
    if "frn" in fams:
        from k3fuse.codegen import fused_residual_norm as frn_mod  # noqa: F401
        for nb, add, pre, f32 in ((3, False, True, False), (0, True, True, True), (8, True, False, True),
                                  (5, False, True, True)):
            jobs.append(("frn", (7168, nb, add, pre, True, f32, 1e-5, 1e-5), None, arch))
        for K in (1536, 768):
            for M in (1, 3, 8, 64):
                from k3fuse.codegen.buckets import bucket_for as bf
                c, _ = gemv.route(7168, K, M)
                if c:
                    jobs.append(("gemv", (7168, K, bf(M)), c, arch))
    precompile(jobs, a.workers)
    copy_bw = copy_bandwidth()
    log(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s (read + write, 1 GiB)")
    results = []
    tables = {}
    if "gemv" in fams:
        tables.update(bench_gemv(shapes, ms, tune_ms, copy_bw, results, arch, variants))
    if "pdl" in fams:
        try:
            bench_pdl_small(copy_bw, results)
        except Exception:
            log("FAMILY FAILED pdl", traceback.format_exc()[-2000:])
    for fam, fn in (("frn", lambda: bench_frn(results, copy_bw)), ("prefetch", lambda: bench_prefetch(results, copy_bw)),
                    ("fused", lambda: bench_fused(results, copy_bw, only=shapes if a.fused_only else None)),
                    ("registry", lambda: check_registry(results)), ("router_topk", lambda: bench_router_topk(results))):
        if fam in fams:
            try:
                fn()
            except Exception:
                log("FAMILY FAILED", fam, traceback.format_exc()[-2000:])
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(dict(copy_bw=copy_bw, gpu=torch.cuda.get_device_name(), results=results), f, indent=1)
    if tables:
        from k3fuse.codegen.tuning import gpu_slug, write_table
        write_table(gpu_slug(torch.cuda.get_device_name()), tables,
                    f"{time.strftime('%Y-%m-%d')} benchmarks/gpu_kernels.py {' '.join(sys.argv[1:])}",
                    path=__import__("pathlib").Path(a.out) / "tuning.json")
    # short table last
    log(f"\ncopy bw {copy_bw / 1e12:.2f} TB/s")
    log(f"{'shape':>12} {'M':>3} {'MB':>6} {'best cfg':>22} {'us':>7} {'%copy':>6} {'cuBLAS':>7} {'%copy':>6} {'x':>5} {'err':>8}")
    for r in results:
        if r.get("family") != "gemv" or not r.get("tabled"):
            continue
        if "us" not in r:
            continue
        cfg = r["config"]
        cs = ",".join(f"{k}{v}" for k, v in cfg.items() if k != "variant")
        cs = f"{cfg['variant']}:{cs}"
        log(f"{r['N']:>5}x{r['K']:<6} {r['M']:>3} {r['wbytes'] / 1e6:6.1f} {cs:>22} {r['us']:7.2f} {r['pct_copy']:6.1f} "
            f"{r['cublas_us']:7.2f} {r['floor_us'] / r['cublas_us'] * 100:6.1f} {r['speedup_cublas']:5.2f} {r['err']:8.1e}")
    for r in results:
        if r.get("family") in ("frn", "prefetch", "fused", "registry"):
            log(json.dumps(r))
    if "pdl" in fams:
        pdl_table(results)


if __name__ == "__main__":
    main()
