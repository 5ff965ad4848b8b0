"""Tune the routed-expert kernels (codegen/moe_experts.py) per batch bucket on the GPU: coordinate descent over the
config knobs from the heuristic default (one knob at a time, then JOINT groups over their products), every
candidate checked against the reference (rel err < 1e-2, output NaN-poisoned) and timed with CUDA graphs (median of
replays; the ~600 chosen experts' weights at M = 64 are GBs, far beyond L2, so reads come from HBM).

    python3 benchmarks/moe_sweep.py --out DIR [--tp 16,8] [--ms 8,64]

Each timed launch takes the next of --rotate relabelings of the routing (the same token -> slot structure, the expert
ids through a fresh random permutation of the E experts), so that consecutive launches read different experts'
weights and none can come from L2 (at M = 1 one launch's chosen experts are 132 MB at TP8, 2.6x the L2). A guard,
not a fix: in session 19 it changed nothing measurable (TP8 M = 1 40.7 -> 41.0 us per routing). --copies N cycles N
weight copies too (the layer benchmarks' footprint): also no effect (session 20, <= 0.5%). Around the config the layer
chose (TP8 M = 1 KS = 4, LPR = 8) the sweep ranks as the layer does; it had missed it because each of the two knobs
alone is slower (hence JOINT). benchmarks/moe_layer_tune.py tunes the down's knobs in the layer.

Every candidate is timed on each routing of --routing (uniform: a load-balanced router; model: the peaked random-init
router of layer_bench.py) and the descent minimises the sum: a config tuned on one routing alone lost 40% on the
other (benchmarks/RESULTS.md, session 3). Writes moe_sweep.json (every trial, the best config per shape x bucket,
the floor = bytes of the distinct chosen experts / copy bandwidth of the same run, summed over the routings) and
prints a table; --write-table merges the winners into codegen/tuning/<gpu>.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import time

import torch

from gpu_kernels import copy_bandwidth, graph_time, rel_err

E, D, KT = 896, 3584, 16
I_TP = {16: 192, 8: 384}
BETA, LBETA = 4.0, 25.0
KNOBS = [("KS", (1, 2, 4)), ("SB", (1, 2, 4)), ("CPC", (1, 2, 4, 8, 16, 32, 64)), ("R", (1, 2, 4)), ("G", (1, 2, 4, 8)), ("W", (4, 7, 8)),
         ("LPR", (4, 8, 16)), ("WD", (1, 2, 4, 8, 16)), ("RT", (1, 2))]
# WD = 1 since session 23: the down's M = 1 grid at 4 rows per CTA (896 CTAs, 6.8 per SM: even across the SMs) was
# -1.14 us per TP8 KDA layer (11 / 12 pairs, not yet confirmed) and had never been a candidate
# knobs also searched together, after the one-knob steps: the down kernel's slot groups (KS) and lanes per W2 row (LPR)
# set its loads in flight together. At TP8 M = 1 (session 20) KS = 4 alone (+2.7 us) and LPR = 8 alone (+20) were
# slower than KS = 1, LPR = 4, both together 5.5 us faster: a one-knob-at-a-time descent cannot get there.
JOINT = [("KS", "LPR")]


def search_steps(knobs=KNOBS, joint=JOINT, only=()):
    """The descent's steps: [(knob names, [value tuples])], each knob of `knobs` alone (in its order), then the
    `joint` groups over the product of their values (KNOBS' values for knobs not in `knobs`); `only` (knob names)
    keeps the steps whose knobs are all in it."""
    values = dict(KNOBS, **dict(knobs))
    keep = lambda names: not only or all(n in only for n in names)
    return ([((k,), [(v,) for v in vs]) for k, vs in knobs if keep((k,))]
            + [(names, list(itertools.product(*(values[n] for n in names)))) for names in joint if keep(names)])


def routing(kind: str, M: int):
    """(ids [M, KT] int64, weights [M, KT] fp32) for M tokens.
    uniform: top-k of random scores (every expert equally likely; ~1.7 tokens per chosen expert at M = 64), close to a
             trained, load-balanced router;
    model:   the random-init K3 router of benchmarks/layer_bench.py (sigmoid + correction bias, seeded as there) on
             random hidden states: peaked, fewer distinct experts, several tokens per expert."""
    if kind == "uniform":
        ids = torch.rand(M, E, device="cuda").topk(KT, dim=1).indices.contiguous()
        w = torch.rand(M, KT, device="cuda") + 0.1
        return ids, (w / w.sum(1, keepdim=True)).contiguous()
    if kind != "model":
        raise SystemExit(f"unknown routing {kind!r} (uniform, model)")
    import zlib
    from k3fuse.models import KimiK3Config
    from k3fuse.models.modeling_kimi_k3 import Router, init_tensor
    cfg = KimiK3Config()
    gate = Router(cfg, torch.bfloat16).cuda()
    for name, p in gate.named_parameters():
        full = "layer.mlp.gate." + name
        g = torch.Generator(device="cuda").manual_seed(zlib.crc32(full.encode()))
        with torch.no_grad():
            p.copy_(init_tensor(full, tuple(p.shape), g, cfg.num_hidden_layers, device="cuda").to(p.dtype))
    with torch.no_grad():
        ids, w = gate(torch.randn(M, cfg.hidden_size, device="cuda").to(torch.bfloat16))
    return ids.contiguous(), w.float().contiguous()


def relabel(ids, n: int, seed: int = 0):
    """[ids] + n - 1 copies with the expert ids mapped through random permutations of the E experts: the same routing
    structure (tokens per expert, slots per token), other experts, so that launches cycling over them read weights
    that the previous launch did not leave in L2."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = [ids]
    for _ in range(n - 1):
        perm = torch.randperm(E, generator=g).to(ids.device)
        out.append(perm[ids].contiguous())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tp", default="16,8")
    ap.add_argument("--ms", default="8,64")
    ap.add_argument("--routing", default="uniform,model", help="routings timed per candidate (objective: the sum)")
    ap.add_argument("--budget-s", type=float, default=300, help="stop trying candidates after this many seconds")
    ap.add_argument("--write-table", action="store_true",
                    help="merge the best configs into codegen/tuning/<gpu>.json (what moe_experts.config_for reads), "
                         "only where the best is no slower than the default on every routing")
    ap.add_argument("--from-table", action="store_true",
                    help="start from the config the layer runs (the tuning table's, else the heuristic default)")
    ap.add_argument("--rotate", type=int, default=8,
                    help="relabelings of each routing cycled over the timed launches (1: one fixed routing, as before "
                         "session 19)")
    ap.add_argument("--copies", type=int, default=1,
                    help="weight copies cycled over the timed launches (2: the layer benchmarks' footprint; it "
                         "changed nothing at TP8 M = 1, session 20)")
    ap.add_argument("--knobs", default="", help="only these knobs (comma list), e.g. SB for an A/B of one knob")
    ap.add_argument("--from-json", help="no GPU: take the results of an earlier run's moe_sweep.json (with "
                                        "--write-table: write its winners)")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            res = json.load(f)
        if args.write_table:
            write_table(res)
        print_table(res)
        return
    from k3fuse import ops
    from k3fuse.codegen import moe_experts as me
    from k3fuse.codegen.buckets import bucket_for
    t_start = time.time()
    bw = copy_bandwidth()
    res = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), copy_TBps=round(bw / 1e12, 3),
               rotate=args.rotate, copies=args.copies, trials=[], best={}, entries={})
    for tp in map(int, args.tp.split(",")):
        I = I_TP[tp]
        g = torch.Generator(device="cuda").manual_seed(tp)
        w13 = (torch.randn(E, 2 * I, D, device="cuda", generator=g) * D ** -0.5).to(torch.bfloat16)
        w2 = (torch.randn(E, D, I, device="cuda", generator=g) * I ** -0.5).to(torch.bfloat16)
        # --copies: further copies of the weights (same values, other addresses) cycled over the timed launches
        copies = [(w13, w2)] + [(w13.clone(), w2.clone()) for _ in range(args.copies - 1)]
        for M in map(int, args.ms.split(",")):
            b = bucket_for(M)
            torch.manual_seed(M)
            z = torch.randn(M, D, device="cuda").to(torch.bfloat16)
            cases = {r: routing(r, M) for r in args.routing.split(",")}
            rotations = {r: relabel(ids, args.rotate, seed=M) for r, (ids, _) in cases.items()}
            refs = {r: torch.cat([ops.moe_experts._init_fn(z[i:i + 8], ids[i:i + 8], w[i:i + 8], w13, w2, BETA,
                                                           LBETA) for i in range(0, M, 8)])
                    for r, (ids, w) in cases.items()}
            distinct = {r: ids.unique().numel() for r, (ids, _) in cases.items()}
            floor_us = {r: n * (2 * I * D + D * I) * 2 / bw * 1e6 for r, n in distinct.items()}
            out = torch.empty(M, D, device="cuda", dtype=torch.bfloat16)
            scratch = torch.empty(M, KT, I, device="cuda", dtype=torch.bfloat16)
            seen = {}

            def trial(cfg):
                key = json.dumps(cfg, sort_keys=True)
                if key in seen:
                    return seen[key]
                why = me.supports(E, I, D, KT, b, cfg)
                row = dict(tp=tp, M=M, cfg=cfg)
                if why:
                    row["skip"] = why
                    seen[key] = None
                    return None
                try:
                    me.build(E, I, D, KT, b, BETA, LBETA, cfg)
                    total = 0.0
                    for r, (ids, w) in cases.items():       # the objective: the sum over the routings
                        out.fill_(float("nan"))
                        me.moe_experts(z, ids, w, w13, w2, BETA, LBETA, cfg, out=out, scratch=scratch)
                        torch.cuda.synchronize()
                        row[f"rel_err_{r}"] = rel_err(out, refs[r].double())
                        if not row[f"rel_err_{r}"] < 1e-2:
                            raise AssertionError(f"{r} routing: rel err {row[f'rel_err_{r}']}")
                        rot = rotations[r]
                        row[f"us_{r}"] = round(graph_time(
                            lambda i: me.moe_experts(z, rot[i % len(rot)], w, *copies[i % len(copies)], BETA, LBETA,
                                                     cfg, out=out, scratch=scratch), 10, 7)[0], 1)
                        total += row[f"us_{r}"]
                    row["us"] = round(total, 1)
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                res["trials"].append(row)
                print(json.dumps(row), flush=True)
                seen[key] = row.get("us")
                return seen[key]

            default = me.config_for(E, I, D, KT, b) if args.from_table else me.default_config(E, I, D, KT, b)
            best, best_us = dict(default), trial(default)
            only = set(filter(None, args.knobs.split(",")))
            for names, combos in search_steps(only=only):
                for vals in combos:
                    if time.time() - t_start > args.budget_s:
                        break
                    cand = dict(best, **dict(zip(names, vals)))
                    if cand == best:
                        continue
                    us = trial(cand)
                    if us is not None and (best_us is None or us < best_us * 0.98):   # 2%: not noise
                        best, best_us = cand, us
            name = f"tp{tp} M={M}"
            res["best"][name] = dict(default=default, default_us=seen[json.dumps(default, sort_keys=True)],
                                     best=best, best_us=best_us, routings=list(cases),
                                     floor_us=round(sum(floor_us.values()), 1), distinct=distinct)
            if best_us is not None:
                res["entries"].setdefault(f"moe_experts:{E}x{I}x{D}x{KT}", {})[str(b)] = dict(
                    best, kernel_us=best_us, default_us=res["best"][name]["default_us"])
            with open(os.path.join(args.out, "moe_sweep.json"), "w") as f:
                json.dump(res, f, indent=1)
        del w13, w2, copies
        torch.cuda.empty_cache()
    if args.write_table:
        write_table(res)
    print_table(res)

def _wins_everywhere(res, name, tp, M):
    """The best config of one shape is no slower than the default on every routing (session 3: a winner on uniform
    routing lost 40% in the layer, whose routing is peaked)."""
    trials = [t for t in res["trials"] if t["tp"] == tp and t["M"] == M]
    r = res["best"][name]
    pick = lambda cfg: next(t for t in trials if t["cfg"] == cfg)
    b, d = pick(r["best"]), pick(r["default"])
    return all(b[f"us_{k}"] <= d[f"us_{k}"] for k in r["routings"])


def write_table(res):
    from k3fuse.codegen import moe_experts, tuning
    from k3fuse.codegen.buckets import bucket_for
    path = tuning.TABLE_DIR / f"{tuning.gpu_slug(res['gpu'])}.json"
    table = json.loads(path.read_text()) if path.is_file() else {"gpu": res["gpu"], "entries": {}}
    n = 0
    for name, r in res["best"].items():
        tp, M = (int(x) for x in re.fullmatch(r"tp(\d+) M=(\d+)", name).groups())
        if r["best_us"] is None or not _wins_everywhere(res, name, tp, M):
            print(f"not written: {name} (the best is slower than the default on some routing)")
            continue
        key = f"moe_experts:{E}x{I_TP[tp]}x{D}x{KT}"
        old = table["entries"].get(key, {}).get(str(bucket_for(M))) or {}
        keep = {k: old[k] for k in moe_experts.VARIANT_KEYS + (moe_experts.LAYER_KEY,) if k in old}   # measured in
        # the layer, not swept here (LAYER_KEY's knobs override the sweep's: session 19)
        table["entries"].setdefault(key, {})[str(bucket_for(M))] = dict(
            r["best"], kernel_us=r["best_us"], default_us=r["default_us"], **keep)
        n += 1
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {n} moe_experts entries into {path}")


def print_table(res):
    print(f"\n{'shape':<12} {'floor us':>9} {'default us':>10} {'best us':>8}  (sums over the routings) best config")
    for name, r in res["best"].items():
        print(f"{name:<12} {r['floor_us']:>9.1f} {r['default_us'] or float('nan'):>10.1f} "
              f"{r['best_us'] or float('nan'):>8.1f}  {r['best']}  distinct experts {r['distinct']}")


if __name__ == "__main__":
    main()
