"""Run the routed-expert kernels (up + down) at K3's per-rank shapes a few times, for a profiler:

    ncu --kernel-name regex:"down_kernel|up_kernel" --launch-skip 2 --launch-count 2 --section SpeedOfLight \
        --section WarpStateStats --section Occupancy python3 benchmarks/ncu_moe.py [--tp 16] [--m 1]

Uniform routing (moe_sweep.routing), the tuned config (moe_experts.config_for). Prints the kernel time of the last
call (CUDA events) so the profiled run can be compared with the timed one.
"""
import argparse

import torch

from moe_sweep import BETA, D, E, I_TP, KT, LBETA, routing

from k3fuse.codegen import moe_experts as mx
from k3fuse.codegen.buckets import bucket_for

ap = argparse.ArgumentParser()
ap.add_argument("--tp", type=int, default=16)
ap.add_argument("--m", type=int, default=1)
ap.add_argument("--iters", type=int, default=5)
a = ap.parse_args()
I, M = I_TP[a.tp], a.m
torch.manual_seed(0)
w13 = (torch.randn(E, 2 * I, D, device="cuda") * D ** -0.5).to(torch.bfloat16)
w2 = (torch.randn(E, D, I, device="cuda") * I ** -0.5).to(torch.bfloat16)
z = torch.randn(M, D, device="cuda").to(torch.bfloat16)
ids, wts = routing("uniform", M)
cfg = mx.config_for(E, I, D, KT, bucket_for(M))
print("config", cfg)
for _ in range(a.iters):
    out = mx.moe_experts(z, ids, wts, w13, w2, BETA, LBETA, cfg)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
mx.moe_experts(z, ids, wts, w13, w2, BETA, LBETA, cfg)
e.record()
torch.cuda.synchronize()
print(f"up + down (warm L2: the same experts again) {s.elapsed_time(e) * 1e3:.1f} us")
