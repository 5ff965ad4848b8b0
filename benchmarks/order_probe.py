"""Does what a layer_bench row runs before k3fuse's timing slow that timing? (s168, session 47: on an H100 the KDA /
MLA TP8 M = 64 graphs timed 1055 / 1091 us first in the process and 1164 / 1252 us when timed again at the end of the
row, after k3fuse's profiled call and eager's graph and profiled call.)

    python3 benchmarks/order_probe.py --out DIR [--kinds kda,mla] [--tp 8] [--ms 64,1] [--reps 3]

Per (kind, tp, M), in one process: k3fuse compiled once, one graph G captured at the start; then the steps of a
layer_bench row one at a time (k3fuse's profiled call with CPU ops, eager's graph, eager's profiled call, a second
k3fuse profiled call without CPU ops). After each step: G replayed (the same graph, the same memory) and a freshly
captured k3fuse graph timed, each the median of 20 replays, `--reps` times. If G slows after a step, the process
(the profiler's leftovers, the allocator) slows the replay; if only the fresh captures slow, the capture does.
Writes order_probe.json under --out and prints one table per row.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from gpu_kernels import capture_graph, copy_bandwidth, replay_us
from layer_bench import (clone_inputs, make_inputs, make_layer, per_rank_config, profile_kernels, time_graph,
                         variants)


def replay_median(g, n, reps=20) -> float:
    return statistics.median(replay_us(g, n) for _ in range(reps))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kinds", default="kda,mla")
    ap.add_argument("--tp", default="8")
    ap.add_argument("--ms", default="64,1")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    bw = copy_bandwidth()
    gpu = torch.cuda.get_device_name()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s on {gpu}", flush=True)
    rows = []
    for kind in args.kinds.split(","):
        for tp in map(int, args.tp.split(",")):
            cfg = per_rank_config(tp)
            layers = [make_layer(cfg, kind, seed, period="model") for seed in (0, 1)]
            vs = variants(False)
            for M in map(int, args.ms.split(",")):
                torch.manual_seed(M)
                base = make_inputs(cfg, layers[0], M)
                k3 = vs["k3fuse"]
                k3(layers[0], *clone_inputs(base))
                copies = [(l, clone_inputs(base)) for l in layers]
                n = len(copies)
                g = capture_graph(lambda i: k3(copies[i % n][0], *copies[i % n][1]), n)

                def measure(step, g=g):
                    for r in range(args.reps):
                        same = replay_median(g, n)
                        fresh = time_graph(k3, [(l, clone_inputs(base)) for l in layers])
                        rows.append({"kind": kind, "tp": tp, "M": M, "gpu": gpu, "step": step, "rep": r,
                                     "same_graph_us": round(same, 1), "fresh_graph_us": round(fresh, 1)})
                        print(json.dumps(rows[-1]), flush=True)

                measure("0 first")
                profile_kernels(k3, layers[0], clone_inputs(base), with_ops=True)
                measure("1 after k3fuse profiled (CPU ops)")
                time_graph(vs["eager"], [(l, clone_inputs(base)) for l in layers])
                measure("2 after eager's graph")
                profile_kernels(vs["eager"], layers[0], clone_inputs(base))
                measure("3 after eager profiled")
                profile_kernels(k3, layers[0], clone_inputs(base))
                measure("4 after k3fuse profiled again")
                with open(os.path.join(args.out, "order_probe.json"), "w") as f:
                    json.dump(rows, f, indent=1)
                print(f"\n{kind} tp{tp} M{M}: us per layer, medians over reps (same graph G / fresh capture)")
                for step in dict.fromkeys(r["step"] for r in rows if (r["kind"], r["tp"], r["M"]) == (kind, tp, M)):
                    rs = [r for r in rows if (r["kind"], r["tp"], r["M"], r["step"]) == (kind, tp, M, step)]
                    print(f"  {step:38s} {statistics.median(r['same_graph_us'] for r in rs):9.1f} "
                          f"{statistics.median(r['fresh_graph_us'] for r in rs):9.1f}", flush=True)


if __name__ == "__main__":
    main()
