"""Time the fused RMSNorm GEMV (k3fuse::rms_norm_linear's simt kernel, the norm's scale in the epilogue) over simt
configs on K3's routed up projection (7168 x 3584), x in fp32 and bf16, M = 1, 2, 4; weights rotated beyond L2,
CUDA-graph replays. The norm kernel reads x and the norm weight once per CTA from L2, so fewer, wider CTAs (R) may
pay where the plain GEMV's best is R = 1.   python3 benchmarks/fused_norm_tune.py --out DIR"""
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
    ap.add_argument("--shape", default="7168x3584")
    ap.add_argument("--x", choices=("both", "fp32", "bf16"), default="both",
                    help="x dtypes to time (MLA's q_b gets bf16 x; the routed up projection fp32)")
    a = ap.parse_args()
    from k3fuse import ops
    from k3fuse.codegen import gemv
    from k3fuse.codegen.buckets import bucket_for
    N, K = (int(v) for v in a.shape.split("x"))
    bw = copy_bandwidth()
    rows = []
    nrot = max(2, math.ceil(3 * L2_BYTES / (N * K * 2)))
    ws = [(torch.randn(N, K, device="cuda") * K ** -0.5).to(torch.bfloat16) for _ in range(nrot)]
    nw = (torch.randn(K, device="cuda") * 0.3 + 1).to(torch.bfloat16)
    for M in (1, 2, 4):
        b = bucket_for(M)
        for xf32 in {"both": (True, False), "fp32": (True,), "bf16": (False,)}[a.x]:
            x = torch.randn(M, K, device="cuda") * 3
            x = x if xf32 else x.to(torch.bfloat16)
            ref = ((ops.rms_norm._init_fn(x, nw, 1e-5, torch.bfloat16).double() @ ws[0].double().t()))
            for R in (1, 2, 4):
                for W in (2, 4, 8):
                    cfg = {"variant": "simt", "R": R, "W": W}
                    if gemv.supports(N, K, b, cfg):
                        continue
                    row = dict(N=N, K=K, M=M, x_fp32=xf32, cfg=cfg)
                    try:
                        y = gemv.linear_fused(x, ws[0], nw, 1e-5, cfg=cfg)
                        torch.cuda.synchronize()
                        row["err"] = rel_err(y, ref)
                        row["us"] = graph_time(lambda i: gemv.linear_fused(x, ws[i % nrot], nw, 1e-5, cfg=cfg))[0]
                        row["pct_copy"] = N * K * 2 / bw * 1e6 / row["us"] * 100
                    except Exception as e:
                        row["error"] = repr(e)[:300]
                    rows.append(row)
            ok = [r for r in rows if r["M"] == M and r["x_fp32"] == xf32 and r.get("err", 1) < 1e-2 and "us" in r]
            plain = graph_time(lambda i: gemv.linear(x.to(torch.bfloat16), ws[i % nrot], gemv.config_for(N, K, b)))[0]
            best = min(ok, key=lambda r: r["us"]) if ok else None
            print(f"M {M} x {'fp32' if xf32 else 'bf16'}: best {best and best['cfg']} {best and round(best['us'], 2)} us"
                  f" ({best and round(best['pct_copy'], 1)}% copy); default {gemv.default_fused_config(N, K, b, dict(norm=True))}"
                  f" {[round(r['us'], 2) for r in ok if r['cfg'] == gemv.default_fused_config(N, K, b, dict(norm=True))]};"
                  f" plain GEMV (tuned) {plain:.2f} us", flush=True)
    with open(os.path.join(a.out, "fused_norm_tune.json"), "w") as f:
        json.dump(dict(copy_TBps=bw / 1e12, gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
