"""The fused KDA decode kernel (k3fuse::kda_decode_, in place as in the layer) alone, per value of one knob.

    python3 benchmarks/kda_decode_bench.py --out DIR [--heads 6,12] [--ms 1,2,4] [--var K3FUSE_KDA_LPR=1,2,4] [--copies 64]

Session 23 timed a cluster of CTAs per (token, head) with it (K3FUSE_KDA_CLUSTER, commit 54d6841, since removed:
RESULTS.md "Session 23"). Each (h, M, knob value) is checked against the op's fp32 reference (o, S, conv state) on fresh random inputs, then timed as
a CUDA graph of `copies` launches, each on its own copy of the state (so every launch reads S from HBM, not L2),
median of 15 replays. The floor is the state's bytes (S read + written, fp32) over the copy bandwidth measured in
the same run. Writes kda_decode_bench.json; prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from gpu_kernels import capture_graph, copy_bandwidth, rel_err, replay_us

LOWER_BOUND, EPS = -5.0, 1e-5


def inputs(M, h, d=128, K=4, fk=128):
    bf = torch.bfloat16
    P = h * d
    rn = lambda *s, scale=1.0, dt=torch.float32: (torch.randn(*s, device="cuda") * scale).to(dt)
    return [rn(M, P, dt=bf), rn(M, P, dt=bf), rn(M, P, dt=bf), rn(M, K - 1, 3 * P, dt=bf),
            rn(P, K, scale=0.5), rn(P, K, scale=0.5), rn(P, K, scale=0.5),
            rn(M, fk, dt=bf), rn(P, fk, scale=fk ** -0.5, dt=bf), rn(P, scale=0.5),
            torch.log(torch.rand(h, device="cuda") * 15 + 1), rn(M, h, dt=bf),
            rn(M, P, dt=bf), 1 + rn(d, scale=0.1), rn(M, h, d, d, scale=0.1)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--heads", default="6,12")
    ap.add_argument("--ms", default="1,2,4")
    ap.add_argument("--var", default="K3FUSE_KDA_LPR=2", help="NAME=V1,V2,...: the knob and the values to time")
    ap.add_argument("--copies", type=int, default=64)
    args = ap.parse_args()
    from k3fuse import ops
    from k3fuse.codegen import compile as kcompile
    from k3fuse.codegen import registry
    registry.register()
    var, _, vals = args.var.partition("=")
    bw = copy_bandwidth()
    rows = []
    for h in map(int, args.heads.split(",")):
        for M in map(int, args.ms.split(",")):
            base = inputs(M, h)
            copies = [[t.clone() for t in base] for _ in range(args.copies)]
            state_bytes = 2 * base[-1].numel() * base[-1].element_size()     # S read and written
            for val in vals.split(","):
                os.environ[var] = val
                kcompile.clear_memo()
                chk = [t.clone() for t in base]
                ro, rS, rC = ops.kda_decode._init_fn(*[t.clone() for t in base], LOWER_BOUND, EPS, True, torch.bfloat16)
                o = torch.ops.k3fuse.kda_decode_(*chk, LOWER_BOUND, EPS, True, torch.bfloat16)
                torch.cuda.synchronize()
                err = max(rel_err(o, ro.double()), rel_err(chk[-1], rS.double()), rel_err(chk[3], rC.double()))
                fn = lambda i: torch.ops.k3fuse.kda_decode_(*copies[i % len(copies)], LOWER_BOUND, EPS, True,
                                                          torch.bfloat16)
                g = capture_graph(fn, len(copies))
                us = statistics.median(replay_us(g, len(copies)) for _ in range(15))
                floor = state_bytes / bw * 1e6
                rows.append(dict(h=h, M=M, var=var, value=val, us=round(us, 2), floor_us=round(floor, 2), rel_err=err,
                                 gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d")))
                print(json.dumps(rows[-1]), flush=True)
    os.environ.pop(var, None)
    json.dump(rows, open(os.path.join(args.out, "kda_decode_bench.json"), "w"), indent=1)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'h':>3} {'M':>3} {var:>20} {'us':>7} {'floor':>7} {'rel err':>9}")
    for r in rows:
        print(f"{r['h']:>3} {r['M']:>3} {r['value']:>20} {r['us']:7.2f} {r['floor_us']:7.2f} {r['rel_err']:9.1e}")


if __name__ == "__main__":
    main()
