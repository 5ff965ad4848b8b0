"""Session 48: compute-sanitizer synccheck reported 17 "Barrier error detected. Missing wait" errors (thread 0 of
CTAs of cluster ranks 8, 9, 14 and 15, only in the split-K cluster of 16) in the wgmma GEMV while running
test_gemv_wgmma_matches_reference[768-7168-40], whose KS = 16 config (a non-portable cluster) then hit an illegal
address under the tool; racecheck found nothing and plain runs passed. Which configs does synccheck flag, and does
any config ever give a wrong result in many plain runs (session 42's one failure of that test)?

    python3 benchmarks/wg_sync_probe.py --configs 8x4,16x4,1x2 --iters 500

Per config KSxST (BN = 64, N = 768, K = 7168, M = 40): iters launches on fresh random inputs with NaN-poisoned
outputs, each checked against fp64 (gpu_kernels.rel_err < 1e-2: any non-finite output counts as bad); prints the
count of bad results and the largest error.
"""
from __future__ import annotations

import argparse

import torch

from gpu_kernels import rel_err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="8x4,16x4")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--n", type=int, default=768)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--m", type=int, default=40)
    args = ap.parse_args()
    from k3fuse.codegen import gemv
    N, K, M = args.n, args.k, args.m
    for c in args.configs.split(","):
        ks, st = map(int, c.split("x"))
        cfg = {"variant": "wgmma", "KS": ks, "ST": st, "BN": 64}
        bad, worst = 0, 0.0
        for _ in range(args.iters):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            w = (torch.randn(N, K, device="cuda") * K ** -0.5).to(torch.bfloat16)
            y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            gemv.linear(x, w, cfg, out=y)
            e = rel_err(y, x.double() @ w.double().t())
            bad += not e < 1e-2
            worst = max(worst, e)
        print(f"KS={ks} ST={st}: {args.iters} runs, {bad} bad, worst rel err {worst:.3e}", flush=True)


if __name__ == "__main__":
    main()
