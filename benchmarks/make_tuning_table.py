"""Turn a gpu_kernels.py results.json into a tuning table codegen/tuning/<gpu>.json.

For each (family, shape, bucket) the fastest correct config is kept, with its time and cuBLAS's time in the
same run. Where cuBLAS (the unfused path) was faster, the entry is {"variant": "torch"}: the registry then
routes that (shape, bucket) to the unfused path.

  python benchmarks/make_tuning_table.py RESULTS.json [more.json ...] [--out codegen/tuning/nvidia_h200.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(paths):
    """Later files take precedence for the (shape, bucket) pairs they measured."""
    best = {}
    gpu = None
    for p in paths:
        best_p = {}
        text = Path(p).read_text()
        if p.endswith(".json"):
            d = json.loads(text)
        else:  # a gpu_kernels.py log: one JSON result per line
            d = {"results": [json.loads(l) for l in text.splitlines() if l.startswith("{")]}
            for l in text.splitlines():
                if l.startswith("date ") and " gpu " in l:
                    d["gpu"] = l.split(" gpu ", 1)[1].split(" torch ")[0]
        gpu = d.get("gpu", gpu)
        for r in d["results"]:
            if r.get("family") != "gemv" or not r.get("ok") or "us" not in r:
                continue
            key = (f"gemv:{r['N']}x{r['K']}", str(r["bucket"]))
            if key not in best_p or r["us"] < best_p[key]["us"]:
                best_p[key] = r
        best.update(best_p)
    entries = {}
    for (shape, bucket), r in sorted(best.items()):
        if r["us"] <= r["cublas_us"]:
            cfg = dict(r["config"])
        else:
            cfg = {"variant": "torch", "best_kernel": r["config"]}
        cfg.update(kernel_us=round(r["us"], 2), cublas_us=round(r["cublas_us"], 2))
        entries.setdefault(shape, {})[bucket] = cfg
    return gpu, entries


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out")
    ap.add_argument("--measured", default="")
    a = ap.parse_args(argv)
    from k3fuse.codegen.tuning import gpu_slug, write_table
    gpu, entries = build(a.results)
    out = Path(a.out) if a.out else None
    p = write_table(gpu_slug(gpu), entries, a.measured or ", ".join(Path(r).name for r in a.results), path=out)
    print(p)


if __name__ == "__main__":
    main()
