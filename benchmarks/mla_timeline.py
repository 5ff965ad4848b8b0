"""Phase timeline of the per-head MLA attention kernel inside the decode layer (K3FUSE_MLA_STAMPS=1).

    python3 benchmarks/mla_timeline.py --out DIR [--tp 16] [--ms 1] [--cls 8,16] [--qb 1,0] [--replays 20]

Why: at M = 1 the per-head kernel (one launch, a cluster per (head, row)) is slower than the three-launch attention
although it moves the same bytes with two grid boundaries fewer (RESULTS.md sessions 24-25), and halving each CTA's
work (clusters of 16) bought only 0.26 us. This says where its time goes. Each arm compiles the MLA + MoE layer
(layer_bench's per-rank shapes, K3FUSE_MLA_HEADS=1) with the stamps on: thread 0 of every CTA writes %globaltimer_lo
and %clock at 13 phase boundaries (templates/mla_attention_heads.py.jinja, stamp(k)) into the partials buffer the
cluster variant does not use (with the MMA tiles also 4 phases inside the first tile: slots 13-16). The layer is captured as a CUDA graph (two layer copies, as layer_bench), replayed,
and the last replay's stamps are read: per phase the earliest / median / latest CTA in us after the first CTA's
start (globaltimer), and each phase's median length in SM clocks (per CTA, so exact). One arm without stamps (the
three launches, K3FUSE_MLA_HEADS=0) gives the layer time to compare. Writes mla_timeline.json; prints the tables.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

PHASES = ("start", "wait done", "q ready", "W_UK landed", "cluster bar 1", "query ready", "tiles done",
          "o_lat summed", "cluster bar 2", "merged", "W_UV landed", "stored", "exit")
CLK0 = 32           # the template's slot of phase 0's %clock (phase k at k, its clock at CLK0 + k)
# inside the first tile (the MMA tiles only; slot, name, the phase its clocks count from): the next tile's loads
# issued, the score's MMAs done, the softmax done, PV done
TILE_PHASES = ((16, "t1 loads issued", 5), (13, "t1 score", 16), (14, "t1 softmax", 13), (15, "t1 PV", 14))
# inside the q phase (q computed in the kernel only): cq landed (thread 0's sum of squares done), the normed x stored
# and W_qb landed; "q ready" (2) follows the row sums
Q_PHASES = ((17, "q: cq landed", 1), (18, "q: x normed", 17))


def summarize(buf: torch.Tensor) -> dict:
    """One launch's stamps (its [M, ns, h, >= 29] fp32 partials buffer holding u32 bits): per phase the earliest,
    median and latest CTA in us after the earliest start, and the median phase length (from the previous phase) in
    SM clocks. u32 differences are taken mod 2^32 (the counters wrap). Pure torch on the CPU (tests)."""
    b = buf.detach().to("cpu").contiguous().view(torch.int32).reshape(-1, buf.shape[-1]).to(torch.int64) & 0xFFFFFFFF
    t, ck = b[:, :CLK0], b[:, CLK0:2 * CLK0]                 # all slots (the first tile's phases at 13-16)
    rel = (t - t[0, 0]) % (1 << 32)                          # ns after CTA 0's start, signed (the timer wraps)
    rel = torch.where(rel >= (1 << 31), rel - (1 << 32), rel)
    rel = rel - rel[:, 0].min()                              # ... after the earliest CTA's start
    rows = []
    # (slot, name, the slot its clocks count from): each phase from the previous one, then the first tile's
    for k, name, k0 in [(k, name, k - 1) for k, name in enumerate(PHASES)] + list(TILE_PHASES) + list(Q_PHASES):
        if k >= len(PHASES) and not bool((b[:, k] != 0).any()):
            continue                                         # a phase this variant does not stamp
        col = rel[:, k].double() / 1000
        rows.append(dict(phase=k, name=name, first_us=round(col.min().item(), 3),
                         median_us=round(col.median().item(), 3), last_us=round(col.max().item(), 3),
                         clocks=int(((ck[:, k] - ck[:, k0]) % (1 << 32)).median().item()) if k else 0))
    return dict(ctas=int(b.shape[0]), phases=rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tp", default="16")
    ap.add_argument("--ms", default="1")
    ap.add_argument("--cls", default="8,16", help="K3FUSE_MLA_HEADS_CL values")
    ap.add_argument("--qb", default="1,0", help="K3FUSE_MLA_QB values (1: q computed in the kernel)")
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch._dynamo.config.cache_size_limit = 64
    from k3fuse.codegen import mla_attention as ma
    from frn_timeline import print_launch
    from layer_ab import build_arm, capture, restore_env
    from gpu_kernels import replay_us
    from layer_bench import clone_inputs, make_inputs, make_layer, per_rank_config, rel
    res = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), runs=[])
    env0 = {k: os.environ.get(k) for k in ("K3FUSE_MLA_STAMPS", "K3FUSE_MLA_HEADS", "K3FUSE_MLA_HEADS_CL",
                                           "K3FUSE_MLA_QB")}
    try:
        for tp in map(int, args.tp.split(",")):
            cfg = per_rank_config(tp)
            layers = [make_layer(cfg, "mla", seed, period="model") for seed in (0, 1)]
            for M in map(int, args.ms.split(",")):
                torch.manual_seed(M)
                base = make_inputs(cfg, layers[0], M)
                ref = layers[0](*clone_inputs(base))
                arms = [("three", None, None)] + [(f"cl{cl} qb{qb}", cl, qb) for cl in args.cls.split(",")
                                                  for qb in args.qb.split(",")]
                for name, cl, qb in arms:
                    os.environ["K3FUSE_MLA_STAMPS"] = "0" if cl is None else "1"
                    os.environ["K3FUSE_MLA_HEADS_CL"] = cl or "8"
                    os.environ["K3FUSE_MLA_QB"] = qb or "1"
                    fn = build_arm("K3FUSE_MLA_HEADS", "0" if cl is None else "1")
                    got = fn(layers[0], *clone_inputs(base))
                    err = max(rel(g, r) for g, r in zip(got, ref))
                    copies = [(l, clone_inputs(base)) for l in layers]
                    ma.STAMP_BUFS.clear()
                    g, n = capture(fn, copies, 1)
                    bufs = list(ma.STAMP_BUFS)[-len(copies):] if cl is not None else []
                    ts = [replay_us(g, n) for _ in range(args.replays)]
                    torch.cuda.synchronize()
                    run = dict(tp=tp, M=M, arm=name, rel_err=err, layer_us=round(statistics.median(ts), 2),
                               launches=[summarize(b) for b in bufs])
                    res["runs"].append(run)
                    print(json.dumps(dict(tp=tp, M=M, arm=name, rel_err=err, layer_us=run["layer_us"],
                                          stamped_launches=len(bufs))), flush=True)
                    del g
    finally:
        restore_env(env0)
    with open(os.path.join(args.out, "mla_timeline.json"), "w") as f:
        json.dump(res, f, indent=1)
    for run in res["runs"]:
        print(f"\nTP{run['tp']} M={run['M']} {run['arm']}: layer {run['layer_us']} us (median of {args.replays})")
        for i, l in enumerate(run["launches"]):
            print_launch(f"launch {i}", l, width=14)


if __name__ == "__main__":
    main()
