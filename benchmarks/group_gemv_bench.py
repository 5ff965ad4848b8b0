"""Grouped GEMV (k3fuse::linear_group) on a GPU: check and time the K3 groups of fuse_shared_input_linears.

  python3 benchmarks/group_gemv_bench.py --out $OUT [--tp 16,8] [--ms 1,8]

Per (group, M): the members' separate k3fuse::linear launches (K3FUSE_GROUPED_GEMV=0), separate
cuBLAS F.linear, and one grouped launch per candidate config (the padded concatenated shape's candidates, pdl
dropped, plus its tabled/default config); every grouped config is first checked against fp64 with NaN-poisoned
outputs. Timed as CUDA graphs over weight copies rotated beyond L2 (gpu_kernels.graph_time). Writes
group_gemv.json under --out and prints one row per (group, M): us and % of copy bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_kernels import L2_BYTES, copy_bandwidth, graph_time  # noqa: E402


def groups(tp: int) -> dict:
    from k3fuse.codegen.kernels_cli import group_shapes
    from k3fuse.models.config import KimiK3Config
    return group_shapes(KimiK3Config.preset("k3"), tp)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tp", default="16,8")
    ap.add_argument("--ms", default="1,8")
    a = ap.parse_args(argv)
    from k3fuse.codegen import gemv, registry
    from k3fuse.codegen.buckets import bucket_for
    registry.register()
    os.environ["K3FUSE_GROUPED_GEMV"] = "0"            # the separate path below is the flag-off behaviour
    bw = copy_bandwidth()
    rows = []
    for tp in (int(t) for t in a.tp.split(",")):
        for name, (Ns, K) in groups(tp).items():
            nbytes = sum(Ns) * K * 2
            copies = max(2, -(-3 * L2_BYTES // nbytes))
            wsets = [[(torch.randn(n, K, device="cuda") * K ** -0.5).to(torch.bfloat16) for n in Ns]
                     for _ in range(copies)]
            for M in (int(m) for m in a.ms.split(",")):
                b = bucket_for(M)
                x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
                row = dict(tp=tp, group=name, N=Ns, K=K, M=M, MB=round(nbytes / 1e6, 1))
                row["separate_us"] = graph_time(lambda i: [torch.ops.k3fuse.linear(x, w) for w in wsets[i % copies]])[0]
                row["cublas_us"] = graph_time(lambda i: [F.linear(x, w) for w in wsets[i % copies]])[0]
                rows_pad = gemv._group_rows(Ns)
                cands = [gemv.group_config_for(Ns, K, b)]
                cands += [gemv._group_cfg(c) for c in gemv.candidates(rows_pad, K, b)]
                best, results = None, []
                for cfg in {json.dumps(c, sort_keys=True): c for c in cands}.values():
                    if gemv.group_supports(Ns, K, b, cfg):
                        continue
                    ws = wsets[0]
                    ys = [torch.full((M, n), float("nan"), device="cuda", dtype=torch.bfloat16) for n in Ns]
                    gemv.linear_group(x, ws, cfg, outs=ys)
                    err = max(((y.double() - x.double() @ w.double().t()).norm() /
                               (x.double() @ w.double().t()).norm()).item() if torch.isfinite(y).all() else float("inf")
                              for y, w in zip(ys, ws))
                    if not err < 1e-2:
                        results.append(dict(config=cfg, error=err))
                        print(f"WRONG {name} tp{tp} M={M} {cfg}: rel err {err}", flush=True)
                        continue
                    outs = [torch.empty(M, n, device="cuda", dtype=torch.bfloat16) for n in Ns]
                    us = graph_time(lambda i: gemv.linear_group(x, wsets[i % copies], cfg, outs=outs))[0]
                    results.append(dict(config=cfg, us=us, err=err))
                    if best is None or us < best["us"]:
                        best = results[-1]
                row["grouped"] = results
                row["default_config"] = cands[0]
                row["default_us"] = next((r.get("us") for r in results if r["config"] == cands[0]), None)
                row["best"] = best
                for k in ("separate_us", "cublas_us", "default_us"):
                    if row.get(k):
                        row[k.replace("_us", "_bw")] = round(nbytes / (row[k] * 1e-6) / bw, 3)
                if best:
                    row["best_bw"] = round(nbytes / (best["us"] * 1e-6) / bw, 3)
                rows.append(row)
                print(f"tp{tp} {name:22s} M={M} {row['MB']:6.1f} MB  separate {row['separate_us']:7.2f}  "
                      f"cuBLAS {row['cublas_us']:7.2f}  grouped default {row['default_us'] or float('nan'):7.2f}  "
                      f"best {best['us'] if best else float('nan'):7.2f} us {best['config'] if best else ''}",
                      flush=True)
            del wsets
            torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "group_gemv.json"), "w") as f:
        json.dump(dict(copy_bw=bw, rows=rows), f, indent=1)
    return 0 if all(r.get("best") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
