"""Check and time the MLA decode kernels' split configurations (codegen/mla_attention.py DEFAULT_SPLITS): QS splits
of the qabsorb kernel over W_UK's columns, VS splits of the combine kernel over W_UV's rows.

    python3 benchmarks/mla_splits.py --out DIR [--heads 6,12] [--ms 1,8,64] [--context 1024]

Per (heads per rank, M): every candidate's output against the ops.py reference (rel err < 1e-2, output NaN-poisoned
before each check), then the three launches timed in a CUDA graph over enough copies of (kv_b, cache) to exceed the
L2 (reads from HBM), against the floor = bytes of kv_b + the cache rows read / copy bandwidth of the same run.
Writes mla_splits.json and prints a table; the fastest correct candidate per row is what DEFAULT_SPLITS (or a
per-(h, bucket) table) should become.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from gpu_kernels import copy_bandwidth, graph_time, rel_err

N, V, R, C = 128, 128, 64, 512
SCALE = (N + R) ** -0.5
CANDIDATES = [(1, 1), (2, 2), (4, 4), (8, 8), (16, 16), (4, 8), (8, 16), (16, 32), (32, 32)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--heads", default="6,12", help="heads per rank (K3: 6 at TP16, 12 at TP8)")
    ap.add_argument("--ms", default="1,8,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--splits", default="", help="only these QSxVS candidates, e.g. 16x32,8x8")
    ap.add_argument("--kv-splits", default="0", help="KV split counts of the split kernel to try (0: the launcher's "
                                                     "n_splits(); others are keyed QSxVS/ns)")
    ap.add_argument("--hpt", default="0", help="score heads per thread (K3FUSE_MLA_SCORE_HPT; 0: the default)")
    ap.add_argument("--pipe", default="", help="K3FUSE_MLA_PIPE values to try, e.g. 0,1 (keyed ~0 / ~1; default: as set)")
    ap.add_argument("--per-head", default="", help="also (1) or only (2) the per-head one-launch kernel, keyed heads "
                                                   "(/ns with --kv-splits)")
    ap.add_argument("--heads-cl", default="", help="K3FUSE_MLA_HEADS_CL values for the per-head kernel, e.g. 8,1 "
                                                   "(keyed heads:CL)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pipes = args.pipe.split(",") if args.pipe else [None]
    hpts = [int(v) for v in args.hpt.split(",")]
    cands = [tuple(int(v) for v in c.split("x")) for c in args.splits.split(",")] if args.splits else CANDIDATES
    kvs = [int(v) for v in args.kv_splits.split(",")]
    from k3fuse import ops
    from k3fuse.codegen import mla_attention as ma
    bw = copy_bandwidth()
    T = args.context
    res = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), copy_TBps=round(bw / 1e12, 3),
               context=T, rows=[])
    for h in map(int, args.heads.split(",")):
        for M in map(int, args.ms.split(",")):
            per_copy = h * (N + V) * C * 2 + M * T * (C + R) * 2
            copies = max(2, -(-120 * 2**20 // per_copy))
            q = torch.randn(M, h, N + R, device="cuda").to(torch.bfloat16)
            sl = torch.full((M,), T - 1, dtype=torch.int64, device="cuda")
            data = [((torch.randn(h * (N + V), C, device="cuda") * C ** -0.5).to(torch.bfloat16),
                     torch.randn(M, T, C + R, device="cuda").to(torch.bfloat16)) for _ in range(copies)]
            ref = ops.mla_attention._init_fn(q[..., :N], q[..., N:], data[0][1], data[0][0], sl, SCALE)
            floor_us = per_copy / bw * 1e6
            out = torch.empty(M, h, V, device="cuda")
            row = dict(h=h, M=M, copies=copies, floor_us=round(floor_us, 2), us={}, rel_err={}, errors={})
            jobs = [] if args.per_head == "2" else [(sp, ns, hpt, pipe) for sp in cands for ns in kvs
                                                     for hpt in hpts for pipe in pipes]
            if args.per_head:
                jobs += [("heads", ns, 0, cl) for ns in kvs for cl in (args.heads_cl.split(",") if args.heads_cl
                                                                            else [None])]
            for sp, ns, hpt, pipe in jobs:
                heads = sp == "heads"
                if heads:
                    key = "heads" + (f"/{ns}" if ns else "") + (f":{pipe}" if pipe is not None else "")
                    if pipe is not None:
                        os.environ["K3FUSE_MLA_HEADS_CL"] = pipe
                    sp, pipe = None, None
                else:
                    key = f"{sp[0]}x{sp[1]}" + (f"/{ns}" if ns else "") + \
                        (f"#{hpt}" if hpt else "") + (f"~{pipe}" if pipe is not None else "")
                os.environ["K3FUSE_MLA_SCORE_HPT"] = str(hpt)
                if pipe is not None:
                    os.environ["K3FUSE_MLA_PIPE"] = pipe
                ns = ns or None
                if not heads and ma.splits_ok(N, V, sp, C):
                    continue
                try:
                    out.fill_(float("nan"))
                    ma.mla_attention(q[..., :N], q[..., N:], data[0][1], data[0][0], sl, SCALE, out=out, splits=sp,
                                     n_split=ns, heads=heads)
                    torch.cuda.synchronize()
                    row["rel_err"][key] = rel_err(out, ref.double())
                    if not row["rel_err"][key] < 1e-2:
                        raise AssertionError(f"rel err {row['rel_err'][key]}")
                    row["us"][key] = round(graph_time(
                        lambda i: ma.mla_attention(q[..., :N], q[..., N:], data[i % copies][1], data[i % copies][0],
                                                   sl, SCALE, out=out, splits=sp, n_split=ns, heads=heads),
                        2 * copies,
                        10)[0], 2)
                except Exception as e:
                    row["errors"][key] = f"{type(e).__name__}: {e}"[:300]
                print(json.dumps(dict(h=h, M=M, splits=key, us=row["us"].get(key), rel_err=row["rel_err"].get(key),
                                      error=row["errors"].get(key))), flush=True)
            res["rows"].append(row)
            with open(os.path.join(args.out, "mla_splits.json"), "w") as f:
                json.dump(res, f, indent=1)
            del data
            torch.cuda.empty_cache()
    print(f"\n{'h':>3} {'M':>3} {'floor us':>9} {'1x1 us':>8} {'best':>8} {'best us':>8}")
    for r in res["rows"]:
        best = min(r["us"], key=r["us"].get) if r["us"] else None
        print(f"{r['h']:>3} {r['M']:>3} {r['floor_us']:>9.2f} {r['us'].get('1x1', float('nan')):>8.2f} "
              f"{best or '-':>8} {r['us'].get(best, float('nan')):>8.2f}  errors: {sorted(r['errors'])}")


if __name__ == "__main__":
    main()
