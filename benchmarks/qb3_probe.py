"""Session 48: q_b inside the three MLA launches' first kernel (qb_absorb, K3FUSE_MLA_QB3) lost 1.94 us in the layer
(TP8 M = 1). Is the kernel itself slower than the q_b GEMV + qabsorb, or only where the layer places it (behind a
streaming GEMV, clusters of 8 CTAs with 88 KB of shared memory each waiting for free SMs)?

    python3 benchmarks/qb3_probe.py --out DIR [--heads 12] [--context 1024] [--rounds 3]

k3fuse::mla_qb_append_attention_ (the q_b projection + the three-launch attention) at M = 1, QB3 = 0 and 1, timed as
CUDA-graph replays over copies of (w_qb, kv_b, cache) rotated beyond L2, alone and each call behind a 52 MB GEMV
(k3fuse::linear 3648 x 7168, the MLA in_proj group's bytes). Arms alternate for --rounds rounds; us per call (the
GEMV's own time is in the "behind" rows: compare arms within a row). Writes qb3_probe.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from gpu_kernels import graph_time

N, V, R, C, QL, H = 128, 128, 64, 512, 1536, 7168
SCALE = (N + R) ** -0.5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from k3fuse.codegen import registry
    registry.register()
    bf, h, T, M = torch.bfloat16, args.heads, args.context, 1
    per = h * (N + R) * QL * 2 + h * (N + V) * C * 2 + T * (C + R) * 2
    copies = max(2, -(-120 * 2**20 // per))
    dev = "cuda"
    data = [((torch.randn(h * (N + R), QL, device=dev) * QL ** -0.5).to(bf),
             (torch.randn(h * (N + V), C, device=dev) * C ** -0.5).to(bf),
             torch.randn(M, T, C + R, device=dev).to(bf)) for _ in range(copies)]
    cq = (torch.randn(M, QL, device=dev) * 3).to(bf)
    qw = (torch.rand(QL, device=dev) + 0.5).to(bf)
    ckv = (torch.randn(M, C + R, device=dev) * 3).to(bf)
    nw = (torch.rand(C, device=dev) + 0.5).to(bf)
    gate = torch.randn(M, h * V, device=dev).to(bf)
    sl = torch.full((M,), T - 2, dtype=torch.int64, device=dev)
    x = torch.randn(M, H, device=dev).to(bf)
    gw = [(torch.randn(3648, H, device=dev) * H ** -0.5).to(bf) for _ in range(3)]    # 52 MB each

    def op(i):
        w_qb, kv_b, cache = data[i % copies]
        return torch.ops.k3fuse.mla_qb_append_attention_(cq, qw, 1e-6, w_qb, h, ckv, nw, 1e-6, bf, cache, kv_b, sl,
                                                         SCALE, gate, bf)

    def behind(i):
        torch.ops.k3fuse.linear(x, gw[i % len(gw)])
        return op(i)

    outs = {}
    for a in ("0", "1"):
        os.environ["K3FUSE_MLA_QB3"] = a
        outs[a] = op(0).float()
    torch.cuda.synchronize()
    err = ((outs["0"] - outs["1"]).norm() / outs["0"].norm()).item()
    res = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), heads=h, context=T, copies=copies,
               rel_diff_qb3_vs_gemv=err, us={})
    for _ in range(args.rounds):
        for where, fn in (("alone", op), ("behind_52MB_gemv", behind)):
            for a in ("0", "1"):
                os.environ["K3FUSE_MLA_QB3"] = a
                us, _ = graph_time(fn, iters_per_graph=20, replays=15)
                res["us"].setdefault(f"{where} QB3={a}", []).append(round(us, 2))
    print(f"{res['gpu']}  h={h} T={T}  rel diff QB3 1 vs 0: {err:.2e}")
    for k, v in res["us"].items():
        print(f"  {k:28s} median {statistics.median(v):7.2f} us  rounds {v}")
    with open(os.path.join(args.out, "qb3_probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
