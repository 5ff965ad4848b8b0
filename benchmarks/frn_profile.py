"""Time k3fuse::fused_residual_norm alone at K3's per-rank widths, one launch against two (GEMV + mix-norm), per
batch M, weights rotated beyond L2, CUDA-graph replays; the one-launch kernel's M = 2..4 buckets through
K3FUSE_FRN_ONE_MAX_M=4. Session 21 measured the one launch slower in the layer at M = 2 and 4 (RESULTS.md): this
separates the kernel from the layer, and --ncu-launches N makes a short run for Nsight Compute instead:
  python3 benchmarks/frn_profile.py --out DIR [--ks 768,384] [--ms 1,2,4] [--preloads 0,1,2]
  ncu --kernel-name regex:frn1 --launch-skip 2 --launch-count 4 --section SpeedOfLight --section WarpStateStats \
      python3 benchmarks/frn_profile.py --ncu-launches 3 --ms 1,4"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch

from gpu_kernels import L2_BYTES, copy_bandwidth, graph_time, rel_err

H = 7168
NB = 4                  # completed AttnRes blocks (K3 has 0-8 by depth)


def inputs(M: int, K: int, nrot: int):
    bf = torch.bfloat16
    ws = [(torch.randn(H, K, device="cuda") * K ** -0.5).to(bf) for _ in range(nrot)]
    o = torch.randn(M, K, device="cuda").to(bf)
    prefix = torch.randn(M, H, device="cuda").to(bf)
    blocks = [torch.randn(M, H, device="cuda").to(bf) for _ in range(NB)]
    wm, wm2 = (torch.randn(H, device="cuda") * 0.5 + 1).to(bf), (torch.randn(H, device="cuda") * 0.005).to(bf)
    norm_w = (torch.randn(H, device="cuda") * 0.5 + 1).to(bf)
    return ws, o, prefix, blocks, wm, wm2, norm_w


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ks", default="768,384", help="o_proj / shared down widths (TP16; TP8: 1536,768)")
    ap.add_argument("--ms", default="1,2,4")
    ap.add_argument("--ncu-launches", type=int, default=0, help="launch each case this many times, no timing")
    ap.add_argument("--preloads", default="0", help="K3FUSE_FRN_PRELOAD values of the one-launch arm (0,1,2)")
    a = ap.parse_args()
    from k3fuse import ops
    from k3fuse.codegen import fused_residual_norm as frn
    os.environ["K3FUSE_FRN_ONE_MAX_M"] = "4"
    bw = 0.0 if a.ncu_launches else copy_bandwidth()
    rows = []
    for K in (int(k) for k in a.ks.split(",")):
        nrot = max(2, math.ceil(3 * L2_BYTES / (H * K * 2)))
        for M in (int(m) for m in a.ms.split(",")):
            ws, o, prefix, blocks, wm, wm2, norm_w = inputs(M, K, nrot)
            row = dict(K=K, M=M, MB=H * K * 2 / 1e6)
            arms = [(f"one{p}" if p != "0" else "one", "1", p) for p in a.preloads.split(",")] + [("two", "0", "0")]
            for arm, knob, pre in arms:
                os.environ["K3FUSE_FRN_ONE_KERNEL"] = knob
                os.environ["K3FUSE_FRN_PRELOAD"] = pre

                def call(i):
                    return frn.fused_residual_norm(o, ws[i % nrot], None, prefix, blocks, wm, norm_w, 1e-6, 1e-5, "",
                                                   False, w_mix_scale=wm2)
                if a.ncu_launches:
                    for i in range(a.ncu_launches):
                        call(i)
                    torch.cuda.synchronize()
                    continue
                out, newp = call(0)
                rn, rp = ops.fused_residual_norm._init_fn(o, ws[0], None, prefix, blocks, wm.float() * wm2.float(),
                                                          norm_w, 1e-6, 1e-5, "", False)
                row[f"{arm}_err"] = max(rel_err(out, rn), rel_err(newp, rp))
                row[f"{arm}_us"] = graph_time(call)[0]
            if not a.ncu_launches:
                row["floor_us"] = H * K * 2 / bw * 1e6
                rows.append(row)
                print(f"K {K} M {M}: " + ", ".join(f"{arm} {row[arm + '_us']:.2f} us (err {row[arm + '_err']:.1e})"
                                                   for arm, _, _ in arms) + f", floor {row['floor_us']:.2f}", flush=True)
    os.environ.pop("K3FUSE_FRN_ONE_KERNEL", None)
    os.environ.pop("K3FUSE_FRN_PRELOAD", None)
    if rows:
        with open(os.path.join(a.out, "frn_profile.json"), "w") as f:
            json.dump(dict(copy_TBps=bw / 1e12, gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
