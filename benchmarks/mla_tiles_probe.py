"""Is the per-head MLA kernel's tile loop limited per SM or by the whole GPU's cache-row traffic?

    python3 benchmarks/mla_tiles_probe.py --out DIR [--heads 1,2,3,6] [--T 1001] [--copies 64]

Why (PERF_NOTES "Session 28"): a 32-token tile costs ~1.1 us whether its score and PV run on CUDA cores or tensor
cores and whether its rows are loaded one or two tiles ahead. Each CTA reads the same bytes per tile (32 rows of
1152 B) at any head count, and every head's CTAs read the same rows, so the number of CTAs (16 per head at clusters of
16) sets the traffic through L2 and not the work of one CTA. This launches the kernel alone (M = 1, clusters of 16,
stamps on) for h heads, the caches rotated over --copies (from HBM), CUDA-graph replayed: if the tiles' clocks per
CTA fall as h shrinks, the limit is the GPU's aggregate traffic (then several heads per CTA, sharing each row, pay);
if they stay, it is each SM's (then more loads in flight per SM, or more CTAs per (head, row)).
Prints a row per h: kernel us, the median CTA's clocks from "query ready" to "tiles done", tile 1's phases.
Written after session 28's device time ran out: not run yet (validate_pending.sh s81).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

N, R, V, C = 128, 64, 128, 512          # K3's MLA widths


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--heads", default="1,2,3,6")
    ap.add_argument("--T", type=int, default=1001)
    ap.add_argument("--copies", type=int, default=64, help="cache / weight copies rotated (64 x 1.2 MB > L2)")
    ap.add_argument("--replays", type=int, default=15)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.environ["K3FUSE_MLA_STAMPS"] = "1"
    os.environ["K3FUSE_MLA_HEADS_CL"] = "16"
    from k3fuse.codegen import mla_attention as ma
    from gpu_kernels import capture_graph, replay_us
    from mla_timeline import summarize
    dev, bf = "cuda", torch.bfloat16
    T, scale = args.T, (N + R) ** -0.5
    rows = []
    for h in map(int, args.heads.split(",")):
        torch.manual_seed(h)
        sl = torch.tensor([T - 1], dtype=torch.int64, device=dev)
        sets = []
        for _ in range(args.copies):
            q = torch.randn(1, h, N + R, device=dev).to(bf)
            sets.append((q[..., :N], q[..., N:], torch.randn(1, T, C + R, device=dev).to(bf),
                         (torch.randn(h * (N + V), C, device=dev) * C ** -0.5).to(bf)))
        ns = ma.heads_splits(1, h, T)
        outs = [torch.empty(1, h, V, device=dev) for _ in sets]

        def call(i):
            qn, qp, cache, kv_b = sets[i % len(sets)]
            ma.mla_attention(qn, qp, cache, kv_b, sl, scale, out=outs[i % len(sets)], n_split=ns, heads=True)

        ma.STAMP_BUFS.clear()
        g = capture_graph(call, len(sets))
        buf = ma.STAMP_BUFS[-1]
        ts = [replay_us(g, len(sets)) for _ in range(args.replays)]
        torch.cuda.synchronize()
        ph = {p["name"]: p for p in summarize(buf)["phases"]}
        tiles = ph["tiles done"]["clocks"]
        row = dict(h=h, ctas=ns * h, splits=ns, kernel_us=round(statistics.median(ts), 2),
                   tiles_clocks=tiles, exit_us=ph["exit"]["median_us"],
                   **{k.replace(" ", "_"): ph[k]["clocks"] for k in ("t1 loads issued", "t1 score", "t1 softmax",
                                                                       "t1 PV") if k in ph})
        rows.append(row)
        print(json.dumps(row), flush=True)
        g = None                        # the graph's memory back before the next h (its inputs are rebound there)
        torch.cuda.empty_cache()
    res = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), T=T, rows=rows)
    with open(os.path.join(args.out, "mla_tiles_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{'h':>3} {'CTAs':>5} {'kernel us':>10} {'tiles clk':>10} {'t1 loads':>9} {'t1 score':>9} "
          f"{'t1 softmax':>11} {'t1 PV':>7}")
    for r in rows:
        print(f"{r['h']:>3} {r['ctas']:>5} {r['kernel_us']:>10.2f} {r['tiles_clocks']:>10} "
              f"{r.get('t1_loads_issued', '-'):>9} {r.get('t1_score', '-'):>9} {r.get('t1_softmax', '-'):>11} "
              f"{r.get('t1_PV', '-'):>7}")


if __name__ == "__main__":
    main()
