"""Phase timeline of the one-launch fused_residual_norm inside the decode layer (K3FUSE_FRN_STAMPS=1).

    python3 benchmarks/frn_timeline.py --out DIR [--kinds kda] [--tp 16,8] [--ms 1] [--replays 20] [--kda-stamps]

Why: at M = 1 each of the layer's two one-launch fused_residual_norms (the o_proj or the shared down, the AttnRes
update, the depth mix and the RMSNorm behind a grid barrier) takes ~4 us more than its weight bytes need (RESULTS.md
"Session 31": 6.6 us for 11 MB, 5.3 for 5.6 MB at KDA TP16), and that time was never located. With the stamps on,
thread 0 of each of the G CTAs writes %globaltimer_lo and %clock at 7 phase boundaries (templates/
fused_residual_norm_onekernel.py.jinja, stamp(k)): start, wait done (the PDL chain's griddepcontrol.wait), GEMV done
(the CTA's rows reduced), statistics sent (atomics issued, before the arrival), barrier passed, totals loaded, stored.
The layer is compiled by k3fuse at layer_bench's per-rank shapes, captured as a CUDA graph (two layer copies, as
layer_bench), replayed; the last replay's stamps are read: per phase the earliest / median / latest CTA in us after
the launch's first CTA start, and the median phase length in SM clocks (per CTA, exact). With --kda-stamps (KDA
layers) kda_decode, the first one's predecessor, is stamped too (K3FUSE_KDA_STAMPS=1: start, wait done, staged, S
updated, stored) and the three launches share one time axis from kda_decode's first CTA start (%globaltimer is one
clock for the whole GPU). Not yet working: its one GPU run (session 31, s100) got None from the compiled layer in the
stamped arm, cause unknown (the KDA GPU tests pass with K3FUSE_KDA_STAMPS=1); without it the tool ran (s98). The same layer without stamps gives the time they add (not an A/B: the arms run one after the
other). Writes frn_timeline.json; prints the tables.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

PHASES = ("start", "wait done", "GEMV done", "stats sent", "barrier passed", "totals loaded", "stored")
# kda_decode's (K3FUSE_KDA_STAMPS=1, KDA layers): on the same time axis, the frn 1 launch's predecessor
KDA_PHASES = ("start", "wait done", "staged", "S updated", "stored")
CLK0 = 16           # the templates' slot of phase 0's %clock (phase k's timer at k, its clock at CLK0 + k)


def first_start(buf: torch.Tensor) -> int:
    """The raw u32 %globaltimer_lo of a launch's earliest CTA start (the reference of a shared time axis)."""
    t = buf.detach().to("cpu").to(torch.int64)[:, 0] & 0xFFFFFFFF
    rel = (t - t[0]) % (1 << 32)
    rel = torch.where(rel >= (1 << 31), rel - (1 << 32), rel)
    return int((t[0] + rel.min()) % (1 << 32))


def summarize(buf: torch.Tensor, phases=PHASES, t_ref=None) -> dict:
    """One launch's stamps (its int32 [CTAs, 32] buffer): per phase the earliest, median and latest CTA in us after
    t_ref (a raw u32 timer value; default: this launch's earliest start), and the median phase length (from the
    previous phase) in SM clocks. u32 differences are taken mod 2^32 (the counters wrap). Pure torch on the CPU."""
    b = buf.detach().to("cpu").to(torch.int64) & 0xFFFFFFFF
    n = len(phases)
    t, ck = b[:, :n], b[:, CLK0:CLK0 + n]
    ref = first_start(buf) if t_ref is None else t_ref
    rel = (t - ref) % (1 << 32)                              # ns after the reference, signed (the timer wraps)
    rel = torch.where(rel >= (1 << 31), rel - (1 << 32), rel)
    rows = []
    for k, name in enumerate(phases):
        col = rel[:, k].double() / 1000
        rows.append(dict(phase=k, name=name, first_us=round(col.min().item(), 3),
                         median_us=round(col.median().item(), 3), last_us=round(col.max().item(), 3),
                         clocks=int(((ck[:, k] - ck[:, k - 1]) % (1 << 32)).median().item()) if k else 0))
    return dict(ctas=int(b.shape[0]), phases=rows)


def print_launch(name: str, launch: dict, axis: str = "the first CTA's start", width: int = 15) -> None:
    """One summarized launch's phase table (also mla_timeline's)."""
    print(f"  {name} ({launch['ctas']} CTAs): us after {axis} (first / median / last CTA), median SM clocks since "
          f"the previous phase")
    for p in launch["phases"]:
        print(f"    {p['phase']:>2} {p['name']:<{width}} {p['first_us']:>7.2f} {p['median_us']:>7.2f} "
              f"{p['last_us']:>7.2f} {p['clocks']:>8}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--kinds", default="kda")
    ap.add_argument("--tp", default="16,8")
    ap.add_argument("--ms", default="1")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--kda-stamps", action="store_true", help="stamp kda_decode too (see the docstring: not working yet)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch._dynamo.config.cache_size_limit = 64
    from k3fuse.codegen import fused_residual_norm as frn
    from k3fuse.codegen import kda_recurrent as kr
    from layer_ab import build_arm, capture, restore_env
    from gpu_kernels import replay_us
    from layer_bench import clone_inputs, make_inputs, make_layer, per_rank_config, rel
    res = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), runs=[])
    env0 = {k: os.environ.get(k) for k in ("K3FUSE_FRN_STAMPS", "K3FUSE_KDA_STAMPS")}
    try:
        for kind in args.kinds.split(","):
            for tp in map(int, args.tp.split(",")):
                cfg = per_rank_config(tp)
                layers = [make_layer(cfg, kind, seed, period="model") for seed in (0, 1)]
                for M in map(int, args.ms.split(",")):
                    torch.manual_seed(M)
                    base = make_inputs(cfg, layers[0], M)
                    ref = layers[0](*clone_inputs(base))
                    for stamps in ("0", "1"):
                        os.environ["K3FUSE_KDA_STAMPS"] = stamps if args.kda_stamps else "0"
                        fn = build_arm("K3FUSE_FRN_STAMPS", stamps)
                        got = fn(layers[0], *clone_inputs(base))
                        if got is None:         # (session 31's first run with kda_decode's stamps: say so, go on)
                            print(f"compiled layer returned None (stamps {stamps}); eager with the same env: "
                                  f"{type(layers[0](*clone_inputs(base))).__name__}", flush=True)
                            got = fn(layers[0], *clone_inputs(base))
                        err = max(rel(g, r) for g, r in zip(got, ref)) if got is not None else float("nan")
                        copies = [(l, clone_inputs(base)) for l in layers]
                        frn.STAMP_BUFS.clear()
                        kr.STAMP_BUFS.clear()
                        g, n = capture(fn, copies, 1)
                        bufs = list(frn.STAMP_BUFS)
                        kbufs = list(kr.STAMP_BUFS)
                        ts = [replay_us(g, n) for _ in range(args.replays)]
                        torch.cuda.synchronize()
                        # the last layer copy's two launches; with kda_decode's stamps, all three on one time axis
                        # from kda_decode's first CTA start
                        t0 = first_start(kbufs[-1]) if kbufs else None     # (not `ref`: the eager output)
                        run = dict(kind=kind, tp=tp, M=M, stamps=stamps == "1", rel_err=err,
                                   layer_us=round(statistics.median(ts), 2),
                                   launches=[summarize(b, t_ref=t0) for b in bufs[-2:]],
                                   kda=summarize(kbufs[-1], KDA_PHASES) if kbufs else None)
                        res["runs"].append(run)
                        print(json.dumps(dict(kind=kind, tp=tp, M=M, stamps=run["stamps"], rel_err=err,
                                              layer_us=run["layer_us"], stamped_launches=len(bufs))), flush=True)
                        del g
    finally:
        restore_env(env0)
    with open(os.path.join(args.out, "frn_timeline.json"), "w") as f:
        json.dump(res, f, indent=1)
    for run in res["runs"]:
        print(f"\n{run['kind']} TP{run['tp']} M={run['M']} stamps {'on' if run['stamps'] else 'off'}: layer "
              f"{run['layer_us']} us (median of {args.replays})")
        axis = "kda_decode's first CTA start" if run.get("kda") else "the first CTA's start"
        named = ([("kda_decode", run["kda"])] if run.get("kda") else []) + \
            [(f"fused_residual_norm {i + 1}", l) for i, l in enumerate(run["launches"])]
        for name, l in named:
            print_launch(name, l, axis)


if __name__ == "__main__":
    main()
