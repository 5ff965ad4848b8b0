"""Markdown tables from gpu_kernels.py results (the best config per (shape, M), cuBLAS beside it).

  python benchmarks/summarize.py benchmarks/results/<run>.json [--ms 1,8,64]
"""
import argparse
import json


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--ms", default="1,8,64")
    a = ap.parse_args(argv)
    d = json.load(open(a.results))
    ms = [int(m) for m in a.ms.split(",")]
    bw = d["copy_bw"]
    best = {}
    for r in d["results"]:
        if r.get("family") != "gemv" or not r.get("ok"):
            continue
        k = (r["N"], r["K"], r["M"])
        if k not in best or r["us"] < best[k]["us"]:
            best[k] = r
    print(f"copy bandwidth in the same run: {bw / 1e12:.2f} TB/s (read + write). %copy = (weight + x + y bytes) / "
          f"copy bandwidth / time.\n")
    print("| N x K | MB | M | best config | us | %copy | cuBLAS us | cuBLAS %copy | speed-up | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    shapes = list(dict.fromkeys((r["N"], r["K"]) for r in best.values()))
    for N, K in shapes:
        for M in ms:
            r = best.get((N, K, M))
            if not r:
                continue
            c = r["config"]
            cs = c["variant"] + " " + ",".join(f"{k}={v}" for k, v in c.items() if k != "variant")
            print(f"| {N}x{K} | {r['wbytes'] / 1e6:.1f} | {M} | {cs} | {r['us']:.2f} | {r['pct_copy']:.0f} | "
                  f"{r['cublas_us']:.2f} | {r['floor_us'] / r['cublas_us'] * 100:.0f} | {r['speedup_cublas']:.2f} | "
                  f"{r['err']:.1e} |")


if __name__ == "__main__":
    main()
