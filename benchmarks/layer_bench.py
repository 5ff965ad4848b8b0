"""One Kimi K3 decoder layer at the per-rank shapes of TP8 / TP16, on one GPU: eager, Inductor and k3fuse, all
CUDA-graph replayed, against the HBM floor (bytes the layer must read / copy bandwidth measured in the same run).

    python3 benchmarks/layer_bench.py --out DIR [--kinds kda,mla] [--tp 16,8] [--ms 1,8,64] [--max-autotune]
                                      [--period model|layer]

Per-rank shapes: heads 96/t (KDA and MLA), expert and shared-expert widths 3072/t and 6144/t, router, routed
down/up projections and MLA q_a/kv_a replicated (K3_MODEL.md section 7). On one GPU there is no all-reduce: the
numbers are the layer's compute and HBM traffic only. Layers: 13 (KDA + MoE) and 15 (MLA + MoE), two AttnRes
blocks completed, MLA context 1024. Weights rotate between 2 copies of the layer (each > 3x the 60 MiB L2), so
every replay reads HBM. Writes results JSON (one row per kind x tp x M) and a PNG; prints a table last.

What one layer is (--period): "model" (default since session 5) is one period of the model's steady state, from
the layer's normed input x to the NEXT layer's normed input: attention ... MoE, then the next layer's input step
(prefix += MoE output, depth mix, RMSNorm), as every layer but the first runs inside the model, where the MoE output
feeds the next layer's mix-norm (pass fuse_attn_out_allreduce_attnres_norm fuses it with the shared expert's down
projection). The next layer's input step uses this layer's input-mix modules: same shapes and, for the layers
benchmarked (13 -> 14, 15 -> 16), the same block structure. "layer" (sessions 1-4) starts from the raw (prefix,
MoE output) and ends at the MoE output: the input step then has no producer in the graph to fuse with, so it and
the final add run as separate glue kernels that the model does not have.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
import zlib

import torch
from torch import nn

from gpu_kernels import copy_bandwidth, graph_time  # the same copy-bandwidth and graph timing

import op_ledger
from k3fuse import backend as k3backend
from k3fuse.models import KimiK3Cache, KimiK3Config
from k3fuse.models.modeling_kimi_k3 import TP, KimiK3DecoderLayer, init_tensor

LAYER = {"kda": 13, "mla": 15}
CONTEXT = 1024


def per_rank_config(tp: int) -> KimiK3Config:
    d = KimiK3Config().to_dict()
    d["linear_attn_config"] = {**d["linear_attn_config"], "num_heads": 96 // tp}
    d.update(num_attention_heads=96 // tp, moe_intermediate_size=3072 // tp)
    return KimiK3Config.from_dict(d)


class OneLayer(nn.Module):
    """--period layer: (prefix, blocks, previous MoE output) -> (prefix, MoE output)."""

    def __init__(self, cfg, layer, group=None):
        super().__init__()
        self.layer = KimiK3DecoderLayer(cfg, layer, TP(group), torch.bfloat16)

    def forward(self, prefix, b0, b1, mlp_out, cache: KimiK3Cache):
        return self.layer(prefix, [b0, b1], mlp_out, cache)


class OnePeriod(OneLayer):
    """--period model: (x, prefix, blocks) -> (prefix, the next layer's x); see the module docstring."""

    def forward(self, x, prefix, b0, b1, cache: KimiK3Cache):
        prefix, mlp_out = self.layer.body(x, prefix, [b0, b1], cache)
        return self.layer.mix_input(prefix, [b0, b1], mlp_out)


@torch.no_grad()
def make_layer(cfg, kind, seed, device="cuda", group=None, period="layer"):
    """The layer's per-rank shapes: cfg's (per_rank_config) without a group; the full config sharded with one."""
    l = LAYER[kind]
    assert cfg.layer_kind(l) == kind
    if period == "model":   # the next layer's input step reuses this layer's modules: same block structure
        B = cfg.attn_res_block_size
        assert (l + 1) % B and math.ceil((l + 1) / B) == math.ceil(l / B), "layer l+1 starts a block"
    with torch.device("meta"):
        m = (OnePeriod if period == "model" else OneLayer)(cfg, l, group)
    m = m.to_empty(device=device)
    for name, p in m.named_parameters():
        g = torch.Generator(device=device).manual_seed(seed + zlib.crc32(name.encode()))
        # experts in slices of 64: the whole fp32 temporary is 39 GB at TP2 (the scale depends only on shape[-1])
        for i in range(0, p.shape[0], 64 if p.dim() == 3 else p.shape[0]):
            q = p[i:i + 64] if p.dim() == 3 else p
            q.copy_(init_tensor(name, tuple(q.shape), g, cfg.num_hidden_layers, device=device).to(p.dtype))
    return m.requires_grad_(False)


def make_inputs(cfg, m: OneLayer, M, device="cuda"):
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    a = m.layer.self_attn
    r = lambda *s, dt=torch.bfloat16: torch.randn(*s, device=device).to(dt)
    conv = [None] * L
    rec = [None] * L
    lat = [None] * L
    l = m.layer.layer_idx
    if m.layer.kind == "kda":
        conv[l] = r(M, cfg.conv_kernel_size - 1, 3 * a.P)
        rec[l] = r(M, a.heads, a.head_dim, a.head_dim, dt=torch.float32) * 0.1
    else:
        lat[l] = r(M, CONTEXT, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    cache = KimiK3Cache(conv, rec, lat, torch.full((M,), CONTEXT - 24, dtype=torch.int64, device=device))
    if isinstance(m, OnePeriod):        # x (normed: unit rms), prefix, two blocks
        return [r(M, H), r(M, H), r(M, H), r(M, H), cache]
    return [r(M, H), r(M, H), r(M, H), r(M, H) * 0.1, cache]


def clone_inputs(inp):
    *t, c = inp
    cl = lambda xs: [x.clone() if x is not None else None for x in xs]
    return [x.clone() for x in t] + [KimiK3Cache(cl(c.conv_state), cl(c.recurrent_state), cl(c.latent_cache),
                                                 c.seq_lens.clone())]


def chosen_experts(cfg, m: OneLayer, M) -> int:
    """Distinct experts the router picks for M random rows (at M = 1 exactly top-k): the experts a step reads."""
    x = torch.randn(M, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    ids, _ = m.layer.mlp.gate(x)
    return ids.unique().numel()


def routed_experts(fn, m: OneLayer, inp) -> int:
    """Distinct experts the layer's own router picks in one call fn(m, *inp) (eager: the hook sees the router module
    run): what the timed graph reads for this copy, where chosen_experts routes fresh random rows."""
    seen = []
    h = m.layer.mlp.gate.register_forward_hook(lambda mod, a, out: seen.append(out[0]))
    try:
        fn(m, *clone_inputs(inp))
    finally:
        h.remove()
    return torch.cat([ids.flatten() for ids in seen]).unique().numel()


def floor_bytes(cfg, m: OneLayer, inp, M, distinct: int | None = None) -> int:
    """Bytes the layer must move: every weight it reads once (experts: the `distinct` chosen, by default those of
    chosen_experts), state read + written."""
    if distinct is None:
        distinct = chosen_experts(cfg, m, M)
    n = 0
    moe = m.layer.mlp
    for name, p in m.named_parameters():
        if "experts.w" not in name:
            n += p.numel() * p.element_size()
    per_expert = (moe.experts.w13_weight[0].numel() + moe.experts.w2_weight[0].numel()) * 2
    n += distinct * per_expert
    c = inp[-1]
    l = m.layer.layer_idx
    if m.layer.kind == "kda":
        n += 2 * (c.conv_state[l].numel() * 2 + c.recurrent_state[l].numel() * 4)
    else:
        n += M * (CONTEXT - 23) * c.latent_cache[l].shape[-1] * 2
    n += 6 * M * cfg.hidden_size * 2           # 4 [M, H] rows in (x or mlp_out, prefix, 2 blocks), 2 out
    return n


def time_graph(fn, copies, reps=20, per_copy=1):
    """fn over every (layer, inputs) copy, per_copy times round (copy 0, 1, 0, 1, ...), in one CUDA graph; median
    replay time per layer in us. per_copy = 1: two layers per graph, so the graph launch's fixed cost is shared by
    two layers only (the decode step's graph has 93)."""
    return graph_time(lambda i: fn(copies[i % len(copies)][0], *copies[i % len(copies)][1]),
                      len(copies) * per_copy, reps)[0]


def kernel_events(prof):
    """The profiler's CUDA kernel events (memcpy / memset left out)."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.lower().startswith(("memcpy", "memset"))]


def aggregate(evs, per: int = 1):
    """[(name[:90], total us / per, launches / per)] by total time: per = the layer calls the events cover."""
    agg = {}
    for e in evs:
        t, c = agg.get(e.name, (0.0, 0))
        agg[e.name] = (t + e.time_range.elapsed_us(), c + 1)
    return sorted(((n[:90], round(t / per, 1), round(c / per, 2) if c % per else c // per) for n, (t, c) in agg.items()),
                  key=lambda r: -r[1])


def profile_kernels(fn, m, inp, with_ops=False):
    """Kernels of one un-graphed call: (count, [(name, total us, launches)] by total time, the profiler's events
    with the CPU ops too if with_ops, else None). The times are kernel durations only (no launch gaps), so their sum is
    below the graph-replayed time per layer."""
    from torch.profiler import ProfilerActivity, profile
    fn(m, *inp)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if with_ops else [])) as prof:
        fn(m, *inp)
        torch.cuda.synchronize()
    evs = kernel_events(prof)
    return len(evs), aggregate(evs), (prof.events() if with_ops else None)


def profile_graph(fn, copies, rounds: int) -> dict:
    """--graph-profile: the kernels of one replay of the timed graph (the same copies and rounds as time_graph), per
    layer call: where the graph's time per layer differs from the un-graphed call's kernel sum, which kernels take
    it. The replay's span (first kernel start to last kernel end) per layer is set beside their sum."""
    from torch.profiler import ProfilerActivity, profile
    from gpu_kernels import capture_graph
    n = len(copies) * rounds
    g = capture_graph(lambda i: fn(copies[i % len(copies)][0], *copies[i % len(copies)][1]), n)
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    evs = kernel_events(prof)
    del g
    if not evs:     # a profiler that does not see a graph's kernels: say so instead of a zero row
        return {"graph_profile_error": "no kernel events in the profiled graph replay"}
    start = min(e.time_range.start for e in evs)
    end = max(e.time_range.end for e in evs)
    top = aggregate(evs, n)
    return {"graph_kernels": top, "graph_kernel_us": round(sum(t for _, t, _ in top), 1),
            "graph_span_us": round((end - start) / n, 1), "graph_launches": round(len(evs) / n, 2),
            "graph_per_call": per_call(evs, n)}


def per_call(evs, n: int) -> list:
    """[(kernel us, span us)] of each of the graph's n layer calls, in launch order (copy 0, 1, 0, ...): the events
    by start time cut into n equal runs (every call launches the same kernels). Tells one copy's slower layer (it routes
    with its own router) from every call slowing alike."""
    evs = sorted(evs, key=lambda e: e.time_range.start)
    k = len(evs) // n
    if k * n != len(evs):
        return []
    runs = [evs[i * k:(i + 1) * k] for i in range(n)]
    return [(round(sum(e.time_range.elapsed_us() for e in r), 1),
             round(max(e.time_range.end for e in r) - min(e.time_range.start for e in r), 1)) for r in runs]


def graph_vs_call(call_top, graph_top, most: int = 12) -> list:
    """(name, us in the un-graphed call, us per layer in the graph, difference) for the kernels whose time differs
    most between the two, largest first."""
    a, b = ({n: t for n, t, _ in top} for top in (call_top, graph_top))
    rows = [(n, a.get(n, 0.0), b.get(n, 0.0), round(b.get(n, 0.0) - a.get(n, 0.0), 1)) for n in set(a) | set(b)]
    return sorted(rows, key=lambda r: -abs(r[3]))[:most]


def ledger(pipes, events, cfg, distinct, bw) -> dict:
    """The k3fuse op ledger of one row (benchmarks/op_ledger.py): bytes per op call of the compiled graphs, the
    device time of its kernels in the profiled call. Never fails the row: an error is recorded instead."""
    try:
        rows = [r for p in pipes if p.graph_module is not None
                for r in op_ledger.op_bytes(p.graph_module, cfg.num_experts, distinct)]
        op_ledger.add_times(rows, events or [])
        return {"k3fuse_op_ledger": op_ledger.ledger_rows(rows, bw)}
    except Exception as e:
        return {"k3fuse_op_ledger_error": f"{type(e).__name__}: {e}"[:300]}


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def variants(max_autotune, passes=None):
    call = lambda m, *a: m(*a)
    out = {"eager": call, "inductor": torch.compile(call, dynamic=False)}
    if max_autotune:
        out["inductor_max_autotune"] = torch.compile(call, dynamic=False, mode="max-autotune-no-cudagraphs")
    out["k3fuse"] = torch.compile(call, backend="k3fuse", dynamic=False,
                                  options={} if passes is None else {"passes": passes})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--kinds", default="kda,mla")
    ap.add_argument("--tp", default="16,8")
    ap.add_argument("--ms", default="1,8,64")
    ap.add_argument("--max-autotune", action="store_true")
    ap.add_argument("--graph-rounds", type=int, default=1,
                    help="rounds over the 2 weight copies per CUDA graph (1: 2 layers per graph, as sessions 1-13's "
                         "tables; 8: 16 layers, closer to the 93-layer decode graph's share of its launch cost)")
    ap.add_argument("--top", type=int, default=12, help="k3fuse kernels listed per row, by total time")
    ap.add_argument("--skip", default="", help="variants not to run, e.g. eager,inductor (k3fuse-only reruns)")
    ap.add_argument("--without-passes", default="", help="k3fuse passes to leave out (A/B of one fusion), e.g. "
                                                          "fuse_kda_conv_gated_norm")
    ap.add_argument("--tag", default="", help="suffix of the output files (several runs in one directory)")
    ap.add_argument("--graph-profile", action="store_true",
                    help="also profile one replay of k3fuse's timed graph: its kernels per layer against the un-graphed "
                         "call's (where a graph runs above its kernel sum, which kernels take the time)")
    ap.add_argument("--k3fuse-first", action="store_true",
                    help="time k3fuse before the other variants (before any of their graphs or profiler sessions)")
    ap.add_argument("--recheck", action="store_true",
                    help="time k3fuse's graph again at the end of each row (k3fuse_us_recheck)")
    ap.add_argument("--recheck-steps", action="store_true",
                    help="with --k3fuse-first: time k3fuse's graph again (fresh input clones and capture, as --recheck) "
                         "after each step of the row (k3fuse_recheck_steps): which step leaves a later timing slower")
    ap.add_argument("--period", choices=("model", "layer"), default="model",
                    help="model: x -> next layer's x, as inside the model (default); layer: sessions 1-4's boundary")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)      # before the measurements: a missing folder lost session 10's call 5
    torch._dynamo.config.cache_size_limit = 64
    passes = None
    if args.without_passes:
        from k3fuse.pipeline import PASS_NAMES
        drop = set(args.without_passes.split(","))
        unknown = drop - set(PASS_NAMES)
        if unknown:
            ap.error(f"unknown passes {sorted(unknown)}; the pipeline is {list(PASS_NAMES)}")
        passes = [p for p in PASS_NAMES[1:] if p not in drop]
    bw = copy_bandwidth()
    gpu, date = torch.cuda.get_device_name(), time.strftime("%Y-%m-%d")
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s on {gpu}", flush=True)
    rows = []
    for kind in args.kinds.split(","):
        for tp in map(int, args.tp.split(",")):
            cfg = per_rank_config(tp)
            layers = [make_layer(cfg, kind, seed, period=args.period) for seed in (0, 1)]
            vs = variants(args.max_autotune, passes)
            for v in filter(None, args.skip.split(",")):
                if v != "eager":            # eager stays: it is the reference
                    vs.pop(v, None)
            if args.k3fuse_first:
                vs = {"k3fuse": vs.pop("k3fuse"), **vs}
            for M in map(int, args.ms.split(",")):
                torch.manual_seed(M)
                base = make_inputs(cfg, layers[0], M)
                row = {"kind": kind, "tp": tp, "M": M, "gpu": gpu, "date": date, "copy_TBps": round(bw / 1e12, 3),
                       "period": args.period, "graph_rounds": args.graph_rounds}
                distinct = chosen_experts(cfg, layers[0], M)
                fb = floor_bytes(cfg, layers[0], base, M, distinct)
                row["floor_MB"], row["floor_us"] = round(fb / 1e6, 1), round(fb / bw * 1e6, 1)
                ref = vs["eager"](layers[0], *clone_inputs(base))
                # the floor of what the graph replays: copies 0 and 1 in turn, each with its own router, so each its
                # own chosen experts (session 45: copy 1's MLA TP8 M = 64 layer ran 56 us longer than copy 0's);
                # floor_us stays chosen_experts' (random rows, copy 0) for the tables' continuity
                row["distinct"] = distinct
                row["routed_distinct_per_copy"] = [routed_experts(vs["eager"], l, base) for l in layers]
                row["floor_copies_us"] = round(sum(floor_bytes(cfg, l, base, M, d) for l, d in zip(
                    layers, row["routed_distinct_per_copy"])) / len(layers) / bw * 1e6, 1)
                def k3fuse_again():
                    # k3fuse's graph timed again over fresh input clones and a fresh capture (--recheck, --recheck-steps)
                    cs = [(l, clone_inputs(base)) for l in layers]
                    return round(time_graph(vs["k3fuse"], cs, per_copy=args.graph_rounds), 1)

                def recheck(label):
                    # --recheck-steps: k3fuse timed again after this step of the row (session 48: on the H200 the
                    # recheck at a row's end read +10% at TP8 M = 64, and order_probe's steps moved nothing)
                    if args.recheck_steps and "k3fuse_us" in row:
                        row.setdefault("k3fuse_recheck_steps", []).append([label, k3fuse_again()])
                for name, fn in vs.items():
                    try:
                        t0 = time.perf_counter()
                        g0 = max((p.graph_id for p in k3backend.LAST_PIPELINES), default=-1)
                        got = fn(layers[0], *clone_inputs(base))
                        # the graphs of this first (compiling) call (LAST_PIPELINES keeps the last 16: by id, not index)
                        pipes = [p for p in k3backend.LAST_PIPELINES if p.graph_id > g0]
                        row[f"{name}_first_call_s"] = round(time.perf_counter() - t0, 1)
                        row[f"{name}_rel_err"] = max(rel(g, r) for g, r in zip(got, ref))
                        recheck(f"{name} first call")     # after first_call_s: its time is not the variant's
                        copies = [(l, clone_inputs(base)) for l in layers]
                        row[f"{name}_us"] = round(time_graph(fn, copies, per_copy=args.graph_rounds), 1)
                        recheck(f"{name} timed")
                        n, top, evs = profile_kernels(fn, layers[0], clone_inputs(base), with_ops=name == "k3fuse")
                        recheck(f"{name} profiled")
                        row[f"{name}_kernels"] = n
                        if name == "k3fuse":
                            row["k3fuse_kernel_us"] = round(sum(t for _, t, _ in top), 1)
                            row["k3fuse_top_kernels"] = top[:args.top]
                            row.update(ledger(pipes, evs, cfg, distinct, bw))
                            if args.graph_profile:
                                try:
                                    gp = profile_graph(fn, copies, args.graph_rounds)
                                except Exception as e:  # never lose the row to the diagnostic
                                    gp = {"graph_profile_error": f"{type(e).__name__}: {e}"[:300]}
                                row.update({f"k3fuse_{k}": v for k, v in gp.items()})
                                if "graph_kernels" in gp:
                                    row["k3fuse_graph_vs_call"] = graph_vs_call(top, gp["graph_kernels"])
                                    row["k3fuse_graph_kernels"] = gp["graph_kernels"][:args.top]
                    except Exception as e:
                        row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:400]
                recheck("row end")
                if args.recheck and "k3fuse_us" in row:
                    # the same k3fuse graph timed again after every variant has been timed and profiled: with
                    # --k3fuse-first its first timing saw none of that, so the two differ by what they leave behind
                    row["k3fuse_us_recheck"] = k3fuse_again()
                row["kernels_per_layer"] = row.get("k3fuse_kernels")
                rows.append(row)
                print(json.dumps(row), flush=True)
                with open(os.path.join(args.out, f"layer_bench{args.tag}.json"), "w") as f:
                    json.dump(rows, f, indent=1)
    names = [n for n in ("eager", "inductor", "inductor_max_autotune", "k3fuse") if any(f"{n}_us" in r for r in rows)]
    print(f"\n{'kind':<4} {'tp':>3} {'M':>3} {'floor us':>9} " + " ".join(f"{n[:14]:>14}" for n in names)
          + "  (us / kernels; k3fuse/floor)")
    for r in rows:
        cells = [f"{r.get(n + '_us', float('nan')):>8.1f}/{r.get(n + '_kernels', 0):<5}" for n in names]
        k = r.get("k3fuse_us")
        print(f"{r['kind']:<4} {r['tp']:>3} {r['M']:>3} {r['floor_us']:>9.1f} " + " ".join(f"{c:>14}" for c in cells)
              + (f"  {k / r['floor_us']:.2f}x" if k else "")
              + (f"  recheck {r['k3fuse_us_recheck']}" if r.get("k3fuse_us_recheck") else "")
              + ("  steps " + ", ".join(f"{a}: {b}" for a, b in r["k3fuse_recheck_steps"])
                 if r.get("k3fuse_recheck_steps") else "")
              + (f"  (copies' own routing: floor {r['floor_copies_us']} us, {k / r['floor_copies_us']:.2f}x, "
                 f"experts {r['routed_distinct_per_copy']} vs {r['distinct']})" if k and r.get("floor_copies_us") else ""))
    for r in rows:
        if r.get("k3fuse_top_kernels"):
            print(f"\nk3fuse {r['kind']} tp{r['tp']} M{r['M']}: {r['k3fuse_kernels']} kernels, "
                  f"{r['k3fuse_kernel_us']} us of kernel time (graph: {r.get('k3fuse_us')} us; under the PDL chain a "
                  f"kernel's time includes its wait for the previous one); top:")
            for n, t, c in r["k3fuse_top_kernels"]:
                print(f"  {t:>7.1f} us  x{c:<3} {n}")
        if r.get("k3fuse_graph_vs_call"):
            print(f"k3fuse {r['kind']} tp{r['tp']} M{r['M']} in its graph, per layer: kernels {r['k3fuse_graph_kernel_us']} "
                  f"us, replay span {r['k3fuse_graph_span_us']} us (un-graphed call: {r['k3fuse_kernel_us']} us); the "
                  f"kernels whose time differs most (call us -> graph us):")
            for n, a, b, d in r["k3fuse_graph_vs_call"]:
                print(f"  {a:>7.1f} -> {b:>7.1f} us ({d:+.1f})  {n}")
            print(f"  per layer call of the replay (kernel us, span us): {r.get('k3fuse_graph_per_call')}")
        elif r.get("k3fuse_graph_profile_error"):
            print(f"k3fuse {r['kind']} tp{r['tp']} M{r['M']}: {r['k3fuse_graph_profile_error']}")
        if r.get("k3fuse_op_ledger"):
            print(f"k3fuse {r['kind']} tp{r['tp']} M{r['M']}: bytes per op call (read + written; experts: the chosen) "
                  f"against its kernels' device time in the profiled call, copy {r['copy_TBps']} TB/s:")
            print(op_ledger.format_ledger(r["k3fuse_op_ledger"]))
    try:
        plot(rows, names, os.path.join(args.out, f"layer_bench{args.tag}.png"))
    except Exception as e:  # matplotlib may be absent
        print("no plot:", e)


def plot(rows, names, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['kind']} tp{r['tp']} M{r['M']}" for r in rows]
    x = range(len(rows))
    w = 0.8 / (len(names) + 1)
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 1.2), 4))
    ax.bar([i - 0.4 for i in x], [r["floor_us"] for r in rows], w, label="floor", align="edge")
    for j, n in enumerate(names):
        ax.bar([i - 0.4 + (j + 1) * w for i in x], [r.get(f"{n}_us", 0) for r in rows], w, label=n, align="edge")
    ax.set_xticks(list(x), labels, rotation=30, ha="right")
    ax.set_ylabel("us per layer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
