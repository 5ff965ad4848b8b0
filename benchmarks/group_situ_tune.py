"""Time the MoE group with the SiTU-GLU epilogue (k3fuse::linear_group_situ: routed latent down 3584 + shared gate_up
768 rows at TP16 widths, 1536 with --tp 8, K = 7168) over even-R simt configs at M = 1, 2; weights rotated beyond L2, CUDA-graph replays,
checked against situ_glu of the fp64 products.   python3 benchmarks/group_situ_tune.py --out DIR
--router: the same group with the router's 896 rows as a third, fp32-output member (k3fuse::linear_group_router),
and, in the same run, the group without it followed by the router's own fp32 GEMV (what it replaces)."""
from __future__ import annotations

import argparse
import json
import math
import os

import torch

from gpu_kernels import L2_BYTES, copy_bandwidth, graph_time, rel_err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--router", action="store_true")
    ap.add_argument("--tp", type=int, default=16, choices=(8, 16),
                    help="the shared gate_up's per-rank rows: 2 * 6144 / tp (768 at TP16, 1536 at TP8)")
    a = ap.parse_args()
    from k3fuse import ops
    from k3fuse.codegen import gemv
    from k3fuse.codegen.buckets import bucket_for
    gu = 2 * 6144 // a.tp
    Ns, K = ([3584, gu, 896] if a.router else [3584, gu]), 7168
    f32 = (2,) if a.router else ()
    bw = copy_bandwidth()
    nrot = max(2, math.ceil(3 * L2_BYTES / (sum(Ns) * K * 2)))
    wsets = [[(torch.randn(n, K, device="cuda") * K ** -0.5).to(torch.bfloat16) for n in Ns] for _ in range(nrot)]
    rows = []
    for M in (1, 2):
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        r1 = ops.situ_glu._init_fn((x.double() @ wsets[0][1].double().t()).to(torch.bfloat16), 4.0, 25.0)
        r0 = x.double() @ wsets[0][0].double().t()
        if a.router:     # the router alone (its own fp32 GEMV) after the two-member group: the unfused pair
            c2 = gemv.group_situ_route(Ns[:2], K, M, (1,))[0]      # the layer's config for the two-member group
            sep = lambda i: (gemv.linear_group(x, wsets[i % nrot][:2], c2, situ=((1,), 4.0, 25.0)),
                             gemv.linear_fp32_out(x, wsets[i % nrot][2]))
            sep(0)
            rows.append(dict(M=M, cfg="group + router gemv", us=graph_time(sep)[0], err=0.0))
        for R in (2, 4):
            for W in (2, 4, 8):
                cfg = {"variant": "simt", "R": R, "W": W}
                row = dict(M=M, cfg=cfg)
                try:
                    ys = gemv.linear_group(x, wsets[0], cfg, situ=((1,), 4.0, 25.0), f32=f32)
                    torch.cuda.synchronize()
                    row["err"] = max(rel_err(ys[0], r0), rel_err(ys[1], r1.double()))
                    if a.router:
                        r2 = x.double() @ wsets[0][2].double().t()
                        row["err"] = max(row["err"], rel_err(ys[2], r2))
                        row["router_dtype"] = str(ys[2].dtype)
                    row["us"] = graph_time(lambda i: gemv.linear_group(x, wsets[i % nrot], cfg,
                                                                       situ=((1,), 4.0, 25.0), f32=f32))[0]
                except Exception as e:
                    row["error"] = repr(e)[:300]
                rows.append(row)
        ok = [r for r in rows if r["M"] == M and r.get("err", 1) < 1e-2 and "us" in r and isinstance(r["cfg"], dict)]
        best = min(ok, key=lambda r: r["us"])
        dflt = gemv.group_situ_config(gemv.group_config_for(Ns, K, bucket_for(M)))
        print(f"M {M}: best {best['cfg']} {best['us']:.2f} us ({sum(Ns) * K * 2 / bw * 1e6 / best['us'] * 100:.1f}% "
              f"of copy); default {dflt} {[round(r['us'], 2) for r in ok if r['cfg'] == dflt]}; "
              f"all {[(r['cfg']['R'], r['cfg']['W'], round(r['us'], 2)) for r in ok]}"
              + "".join(f"; {r['cfg']} {r['us']:.2f} us" for r in rows if r["M"] == M and isinstance(r["cfg"], str)),
              flush=True)
    name = ("group_router_tune" if a.router else "group_situ_tune") + ("" if a.tp == 16 else f"_tp{a.tp}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, name + ".json"), "w") as f:
        json.dump(dict(copy_TBps=bw / 1e12, gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
