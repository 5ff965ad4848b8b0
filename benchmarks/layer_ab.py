"""A/B of one k3fuse knob on one decoder layer, both arms in ONE process with their replays interleaved.

    python3 benchmarks/layer_ab.py --out DIR --var K3FUSE_ROUTER_FIRST=0,1 [--kinds kda,mla] [--tp 16] [--ms 1]
                                   [--pairs 40] [--graph-rounds 1] [--tag _ew]
    python3 benchmarks/layer_ab.py --out DIR --arms "K3FUSE_MLA_ASYNC=0 K3FUSE_MLA_CMMA_TOK=8; -" ...

--var NAME=A,B sets one knob to A, then B. --arms "A; B" compares two sets of settings, each space-separated
NAME=VALUE pairs or "-" (the defaults): a variable one arm names and the other does not is unset in the other.

Why: separate layer_bench runs of the same kernels differ by up to ~5% (session 14: KDA TP16 M = 1 88.2-92.8 us
over four runs), so a 2 us effect needed four A/B rounds and two rounds pointed the wrong way. Here each arm is
compiled with the knob set (kernel memos and dynamo cleared in between, since knobs are read when a kernel is
rendered or launched, i.e. at capture), captured as its own CUDA graph over the same weights and inputs (rotated
through HBM as in layer_bench), checked against eager, and then the graphs are replayed in ABBA order, so drift
(clocks, temperature) falls on both arms alike. Reported per (kind, tp, M): each arm's median us per layer, the
median and quartiles of the paired differences (B - A per pair), and in how many pairs B was faster.
Arms: the values after `=`, the first is the baseline A. Writes layer_ab{tag}.json; prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from k3fuse.codegen import compile as kcompile
from gpu_kernels import capture_graph, copy_bandwidth, replay_us
from layer_bench import clone_inputs, floor_bytes, make_inputs, make_layer, per_rank_config, rel


def paired_summary(a_us: list, b_us: list) -> dict:
    """Medians of two interleaved samples and of their paired differences (b - a), with quartiles, and the count
    of pairs where b was faster. Pure python (tested on the CPU: tests/test_layer_ab.py)."""
    if len(a_us) != len(b_us) or not a_us:
        raise ValueError(f"paired samples of equal, nonzero length needed (got {len(a_us)} and {len(b_us)})")
    d = sorted(b - a for a, b in zip(a_us, b_us))
    q = statistics.quantiles(d, n=4, method="inclusive") if len(d) > 1 else [d[0]] * 3
    return {"a_us": round(statistics.median(a_us), 2), "b_us": round(statistics.median(b_us), 2),
            "diff_us": round(q[1], 2), "diff_q1_us": round(q[0], 2), "diff_q3_us": round(q[2], 2),
            "b_faster": sum(x < 0 for x in d), "pairs": len(d)}


def abba(n_pairs: int) -> list:
    """The replay order: (pair, arm) with arms 0, 1 in ABBA blocks, so a linear drift cancels within each block."""
    order = []
    for p in range(n_pairs):
        order += [(p, 0), (p, 1)] if p % 2 == 0 else [(p, 1), (p, 0)]
    return order


def capture(fn, copies, per_copy):
    """One CUDA graph of fn over the (layer, inputs) copies, per_copy rounds (as layer_bench.time_graph): (graph,
    layer calls in it)."""
    n = len(copies) * per_copy
    return capture_graph(lambda i: fn(copies[i % len(copies)][0], *copies[i % len(copies)][1]), n), n


KEEP: list = []     # the kernels the memos forget between arms: the captured graphs launch them


def restore_env(saved: dict) -> None:
    """Put the environment variables of `saved` (name -> value, None: unset) back, after arms that set them."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def parse_arms(var: str = "", arms: str = "") -> list:
    """The two arms as {NAME: value, or None for unset}, from --var NAME=A,B or --arms "A; B" (module docstring).
    Every arm names the same variables, so that building one arm undoes the other's."""
    if bool(var) == bool(arms):
        raise ValueError("give one of --var NAME=A,B and --arms 'A; B'")
    if var:
        name, _, vals = var.partition("=")
        vs = vals.split(",")
        if not name or len(vs) != 2 or not all(vs):
            raise ValueError(f"--var wants NAME=A,B (got {var!r})")
        return [{name: vs[0]}, {name: vs[1]}]
    parts = arms.split(";")
    if len(parts) != 2:
        raise ValueError(f"--arms wants two settings separated by ';' (got {arms!r})")
    out = []
    for p in parts:
        d = {}
        for item in ([] if p.strip() in ("", "-") else p.split()):
            name, eq, v = item.partition("=")
            if not name or not eq or not v:
                raise ValueError(f"--arms: {item!r} is not NAME=VALUE")
            d[name] = v
        out.append(d)
    if out[0] == out[1]:
        raise ValueError(f"--arms: both arms set the same ({arms!r})")
    names = set(out[0]) | set(out[1])
    return [{n: d.get(n) for n in sorted(names)} for d in out]


def arm_label(settings: dict) -> str:
    """One arm's settings as NAME=VALUE words ("-": all unset, i.e. the defaults)."""
    return " ".join(f"{k}={v}" for k, v in settings.items() if v is not None) or "-"


def build_arm(settings: dict):
    """A fresh k3fuse compile with the arm's settings (NAME -> value, None: unset): kernel memos (kept alive in KEEP)
    and dynamo's caches cleared first."""
    restore_env(settings)
    kcompile.clear_memo(keep=KEEP)
    torch._dynamo.reset()
    call = lambda m, *a: m(*a)
    return torch.compile(call, backend="k3fuse", dynamic=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--var", default="", help="NAME=A,B: the knob and its two values (A is the baseline)")
    ap.add_argument("--arms", default="", help="'A; B': two sets of NAME=VALUE settings ('-': the defaults)")
    ap.add_argument("--kinds", default="kda,mla")
    ap.add_argument("--tp", default="16")
    ap.add_argument("--ms", default="1")
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--graph-rounds", type=int, default=1)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    try:
        settings = parse_arms(args.var, args.arms)
    except ValueError as e:
        ap.error(str(e))
    var = args.var.partition("=")[0] if args.var else "arms"
    arms = [arm_label(a) if args.arms else a[var] for a in settings]
    os.makedirs(args.out, exist_ok=True)
    torch._dynamo.config.cache_size_limit = 64
    bw = copy_bandwidth()
    gpu, date = torch.cuda.get_device_name(), time.strftime("%Y-%m-%d")
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s on {gpu}; {var}: A = {arms[0]}, B = {arms[1]}", flush=True)
    old = {k: os.environ.get(k) for k in settings[0]}
    rows = []
    try:
        for kind in args.kinds.split(","):
            for tp in map(int, args.tp.split(",")):
                cfg = per_rank_config(tp)
                layers = [make_layer(cfg, kind, seed, period="model") for seed in (0, 1)]
                for M in map(int, args.ms.split(",")):
                    torch.manual_seed(M)
                    base = make_inputs(cfg, layers[0], M)
                    fb = floor_bytes(cfg, layers[0], base, M)
                    ref = layers[0](*clone_inputs(base))
                    row = {"kind": kind, "tp": tp, "M": M, "gpu": gpu, "date": date, "var": var, "A": arms[0],
                           "B": arms[1], "copy_TBps": round(bw / 1e12, 3), "floor_us": round(fb / bw * 1e6, 1),
                           "graph_rounds": args.graph_rounds}
                    graphs, keys = [], []
                    for j, st in enumerate(settings):
                        fn = build_arm(st)
                        got = fn(layers[0], *clone_inputs(base))
                        row[f"rel_err_{'AB'[j]}"] = max(rel(g, r) for g, r in zip(got, ref))
                        keys.append({k.key for k in kcompile._memo.values()})
                        copies = [(l, clone_inputs(base)) for l in layers]
                        graphs.append(capture(fn, copies, args.graph_rounds) + ((fn, copies),))
                        for _ in range(3):                  # warm: clocks, TLBs
                            replay_us(*graphs[-1][:2])
                    # kernels only one arm built: 0 for a knob read at launch (or one without effect)
                    row["kernels_differ"] = len(keys[0] ^ keys[1])
                    ts = ([], [])
                    for _, arm in abba(args.pairs):
                        g, n, _ = graphs[arm]
                        ts[arm].append(replay_us(g, n))
                    row.update(paired_summary(*ts))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    with open(os.path.join(args.out, f"layer_ab{args.tag}.json"), "w") as f:
                        json.dump(rows, f, indent=1)
                    del graphs
    finally:
        restore_env(old)
    print(f"\n{var}: A = {arms[0]}, B = {arms[1]}; us per layer, medians of {args.pairs} ABBA-interleaved replays")
    print(f"{'kind':<4} {'tp':>3} {'M':>3} {'floor':>6} {'A':>8} {'B':>8} {'B - A':>7} {'[q1, q3]':>16} {'B faster':>9} "
          f"{'kernels differ':>14}")
    for r in rows:
        print(f"{r['kind']:<4} {r['tp']:>3} {r['M']:>3} {r['floor_us']:>6.1f} {r['a_us']:>8.2f} {r['b_us']:>8.2f} "
              f"{r['diff_us']:>7.2f} [{r['diff_q1_us']:>6.2f}, {r['diff_q3_us']:>6.2f}] "
              f"{r['b_faster']:>4}/{r['pairs']:<4} {r['kernels_differ']:>14}")
    same = [f"{r['kind']} TP{r['tp']} M={r['M']}" for r in rows if r["kernels_differ"] == 0]
    if same:    # session 20: table entries that never reached a kernel showed up only as this 0
        print(f"note: A and B built the same kernels at {', '.join(same)}: {var} is read at launch there, or it did "
              "not reach a kernel (an override the config lookup drops?)")


if __name__ == "__main__":
    main()
