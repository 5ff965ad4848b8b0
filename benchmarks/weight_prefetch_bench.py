"""Does a GEMV's weight prefetch before the PDL chain's wait overlap a latency-bound predecessor? (session 7)

    python3 benchmarks/weight_prefetch_bench.py --out DIR [--mbs 0,8,16,32] [--ms 1]

Predecessor: the router top-k kernel (one CTA per token, ~5 us at M = 1, triggers its dependents at its start), as in
the MoE layer where the latent-down + shared gate_up group follows it. For each prefetch budget (K3FUSE_WEIGHT_PREFETCH,
MB) and GEMV shape (the K3 TP16 groups / 11 MB GEMVs) at M: CUDA-graph replay time of top-k alone, the GEMV alone
(back to back, weights rotated over copies > 3x L2) and the pair top-k -> GEMV. If the prefetch overlaps, pair - topk
falls below the GEMV's time by up to the bytes HBM moves during the top-k. Prints a table last; JSON under --out.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from gpu_kernels import copy_bandwidth, graph_time

SHAPES = {"latent_down+gate_up": ([3584, 768], 7168), "in_proj(kda)": ([768, 768, 768, 768, 128, 6], 7168),
          "o_proj 7168x768": ([7168], 768), "768x7168": ([768], 7168), "router 896x7168": ([896], 7168)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--mbs", default="0,8,16,32")
    ap.add_argument("--ms", default="1")
    args = ap.parse_args()
    from k3fuse.codegen import gemv
    from k3fuse.codegen import router_topk as rt
    from k3fuse.codegen.buckets import bucket_for
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s on {torch.cuda.get_device_name()}", flush=True)
    rows = []
    for M in map(int, args.ms.split(",")):
        b = bucket_for(M)
        logits = torch.randn(M, 896, device="cuda") * 2
        bias = torch.randn(896, device="cuda") * 0.05
        topk = lambda i: rt.topk_from_logits(logits, bias, 16, True, 2.5)   # noqa: E731
        t_topk, _ = graph_time(topk)
        for name, (Ns, K) in SHAPES.items():
            nbytes = sum(Ns) * K * 2
            copies = max(4, -(-3 * 60 * 2**20 // nbytes))
            ws = [[(torch.randn(n, K, device="cuda") * K ** -0.5).to(torch.bfloat16) for n in Ns]
                  for _ in range(copies)]
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ys = [torch.empty(M, n, device="cuda", dtype=torch.bfloat16) for n in Ns]
            for mb in map(float, args.mbs.split(",")):
                os.environ["K3FUSE_WEIGHT_PREFETCH"] = str(mb)
                if len(Ns) > 1:
                    k = gemv.build_group(Ns, K, b, gemv.group_config_for(Ns, K, b))
                    call = lambda i: k(x, *ws[i % copies], *ys)       # noqa: E731
                else:
                    k = gemv.build(Ns[0], K, b, gemv.config_for(Ns[0], K, b))
                    call = lambda i: k(x, ws[i % copies][0], ys[0])   # noqa: E731
                call(0)
                torch.cuda.synchronize()
                err = max(float((y.double() - x.double() @ w.double().t()).norm() / (x.double() @ w.double().t()).norm())
                          for y, w in zip(ys, ws[0]))
                t_g, _ = graph_time(call)

                def pair(i):
                    topk(i)
                    call(i)
                t_p, _ = graph_time(pair)
                row = dict(shape=name, M=M, MB=round(nbytes / 1e6, 1), prefetch_MB=mb, topk_us=round(t_topk, 2),
                           gemv_us=round(t_g, 2), pair_us=round(t_p, 2), pair_minus_topk=round(t_p - t_topk, 2),
                           gemv_floor_us=round(nbytes / bw * 1e6, 2), gemv_pct_copy=round(100 * nbytes / bw / (t_g * 1e-6), 1),
                           rel_err=err, gpu=torch.cuda.get_device_name(), copy_TBps=round(bw / 1e12, 3))
                rows.append(row)
                print(json.dumps(row), flush=True)
            del ws
    os.environ.pop("K3FUSE_WEIGHT_PREFETCH", None)
    with open(os.path.join(args.out, "weight_prefetch_bench.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'shape':<22} {'M':>2} {'MB':>5} {'pf MB':>5} {'floor':>6} {'gemv':>6} {'%copy':>6} {'topk':>5} "
          f"{'pair':>6} {'pair-topk':>9} {'err':>8}")
    for r in rows:
        print(f"{r['shape']:<22} {r['M']:>2} {r['MB']:>5} {r['prefetch_MB']:>5} {r['gemv_floor_us']:>6} {r['gemv_us']:>6} "
              f"{r['gemv_pct_copy']:>6} {r['topk_us']:>5} {r['pair_us']:>6} {r['pair_minus_topk']:>9} {r['rel_err']:>8.1e}")


if __name__ == "__main__":
    main()
