"""How much faster is a weight read from L2 than from HBM on this GPU? (the ceiling of any L2-prefetch scheme)

    python3 benchmarks/l2_probe.py --out DIR [--order]

Why (PERF_NOTES "Session 30"): at M = 1 about two thirds of a layer's time above its floor sits in latency-bound
kernels (kda_decode, the two one-launch fused_residual_norms) while HBM idles; prefetching the next weights into L2
in those windows can only save bytes x (1 / HBM rate - 1 / L2 rate). Sessions 2 and 7 saw prefetched GEMVs gain
far less than an L2-resident read was assumed to be worth. This times each M = 1 GEMV of the K3 TP16 / TP8 shapes
(the tuning table's config, CUDA-graph replayed) with its weight rotated over copies that overflow L2 (HBM) and with
one copy read again and again (L2-resident after the first replay). Prints us and the implied GB/s per row. (Session
30's run also timed torch.sum over the same bytes: 1-3 TB/s both ways, no reader to compare with; dropped.)

--order: where a prefetch must be issued to land. A graph per step: a 51 MB streaming GEMV (a layer's latent up, copies
rotated), a 10 us sleep (a latency-bound kernel: kda_decode), then the 11 MB o_proj GEMV (copies rotated). Its time
(the sequence minus the same without it) with no prefetch, with k3fuse.prefetch_l2 of its weight on the side stream
issued after the streaming GEMV (during the sleep), and issued before it (the streaming GEMV's 51 MB pass through L2
meanwhile: session 7's early prefetch from the dependent's own CTAs resembles this).
"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch

from gpu_kernels import copy_bandwidth, graph_time

L2_BYTES = 50 * 2**20
SHAPES = [(7168, 768), (768, 7168), (7168, 1536), (1536, 7168), (3584, 7168)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--order", action="store_true", help="only the prefetch-placement probe")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.order:
        return order_probe(args.out)
    from k3fuse.codegen import gemv
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s on {torch.cuda.get_device_name()}", flush=True)
    rows = []
    for N, K in SHAPES:
        wb = N * K * 2
        nrot = max(2, math.ceil(3 * L2_BYTES / wb))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(nrot)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
        cfg = gemv.config_for(N, K, 1)
        run = lambda w: gemv.linear(x, w, cfg, out=y)
        ref = x.float() @ ws[0].float().t()
        run(ws[0])
        torch.cuda.synchronize()
        err = ((y.float() - ref).norm() / ref.norm()).item()
        hbm, _ = graph_time(lambda i: run(ws[i % nrot]))
        l2, _ = graph_time(lambda i: run(ws[0]))
        r = dict(N=N, K=K, MB=round(wb / 1e6, 2), err=err, floor_us=wb / bw * 1e6, gemv_hbm_us=hbm, gemv_l2_us=l2)
        rows.append(r)
        print(json.dumps(r), flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    print(f"{'N x K':>12} {'MB':>6} {'floor':>6} {'gemv HBM':>9} {'gemv L2':>8} {'GB/s HBM/L2':>17}")
    for r in rows:
        g = lambda t: r["MB"] * 1e3 / t
        print(f"{r['N']:>5} x {r['K']:<5} {r['MB']:>6.2f} {r['floor_us']:>6.2f} {r['gemv_hbm_us']:>9.2f} "
              f"{r['gemv_l2_us']:>8.2f} {g(r['gemv_hbm_us']):>8.0f}/{g(r['gemv_l2_us']):<8.0f}")
    with open(os.path.join(args.out, "l2_probe.json"), "w") as f:
        json.dump(dict(copy_TBps=bw / 1e12, gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


def order_probe(out):
    from k3fuse.codegen import gemv, prefetch
    bw = copy_bandwidth()
    (NB, KB), (NS, KS) = (3584, 7168), (7168, 768)
    nb = max(2, math.ceil(3 * L2_BYTES / (NB * KB * 2)))
    ns = max(2, math.ceil(3 * L2_BYTES / (NS * KS * 2)))
    wb = [torch.randn(NB, KB, device="cuda", dtype=torch.bfloat16) * KB ** -0.5 for _ in range(nb)]
    wsm = [torch.randn(NS, KS, device="cuda", dtype=torch.bfloat16) * KS ** -0.5 for _ in range(ns)]
    xb, yb = torch.randn(1, KB, device="cuda", dtype=torch.bfloat16), torch.empty(1, NB, device="cuda", dtype=torch.bfloat16)
    xs, ys = torch.randn(1, KS, device="cuda", dtype=torch.bfloat16), torch.empty(1, NS, device="cuda", dtype=torch.bfloat16)
    cb, cs = gemv.config_for(NB, KB, 1), gemv.config_for(NS, KS, 1)
    tok = torch.zeros(1, device="cuda")
    nbytes = NS * KS * 2
    for w in wsm:                           # the chunk tables outside any capture
        prefetch.prefetch_l2(tok, [w], nbytes)
    prefetch.join_pending()
    gemv.linear(xb, wb[0], cb, out=yb)
    gemv.linear(xs, wsm[0], cs, out=ys)
    torch.cuda.synchronize()
    sleep = 20000                           # cycles: ~10 us at the H200's 1.98 GHz

    def seq(where, small=True):
        def f(i):
            w = wsm[i % ns]
            if where == "before":
                prefetch.prefetch_l2(tok, [w], nbytes)
            gemv.linear(xb, wb[i % nb], cb, out=yb)
            if where == "after":
                prefetch.prefetch_l2(tok, [w], nbytes)
            torch.cuda._sleep(sleep)
            prefetch.join_pending()
            if small:
                gemv.linear(xs, w, cs, out=ys)
        return f
    rows = []
    for where in ("none", "after", "before"):
        t, _ = graph_time(seq(where), iters_per_graph=8)
        t0, _ = graph_time(seq(where, small=False), iters_per_graph=8)
        rows.append(dict(where=where, seq_us=t, seq_without_us=t0, gemv_us=t - t0))
        print(json.dumps(rows[-1]), flush=True)
    print(f"copy {bw / 1e12:.2f} TB/s; o_proj GEMV {NS}x{KS} ({nbytes / 1e6:.1f} MB, floor {nbytes / bw * 1e6:.2f} us) "
          f"after a {NB}x{KB} streaming GEMV and a ~10 us sleep:")
    for r in rows:
        print(f"  prefetch {r['where']:>6}: GEMV {r['gemv_us']:.2f} us (sequence {r['seq_us']:.2f}, without the GEMV "
              f"{r['seq_without_us']:.2f})")
    with open(os.path.join(out, "l2_probe_order.json"), "w") as f:
        json.dump(dict(copy_TBps=bw / 1e12, gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
