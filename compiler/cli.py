"""The `k3fuse` command.

    k3fuse inspect --config tiny --batch 3 [--tp 1] --out DIR      compile a preset on CPU, write the graphs before/
                                                                    after each pass and summary.json, print a summary
    k3fuse run --config tiny [--steps 4] [--batch 3] [--dtype ...]  compile and decode, compare with eager
    k3fuse kernels --config {tiny,k3} --tp T --batch 1,8,64 --arch sm_90a --out DIR
                                                                    render + compile the CuTe DSL kernels (no GPU)
    k3fuse knobs [--kind measured,unmeasured] [--json]             the K3FUSE_* environment variables: kind, value
                                                                    in this process, what each does
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def _decode(cfg_name: str, batch: int, steps: int, dtype: str, out: str | None, tp_group=None,
            inner: str = "eager", seed: int = 0):
    import torch

    from k3fuse.backend import LAST_PIPELINES
    from k3fuse.models import KimiK3Config, KimiK3ForCausalLM
    cfg = KimiK3Config.preset(cfg_name)
    torch.manual_seed(seed)
    model = KimiK3ForCausalLM(cfg, tp_group=tp_group, dtype=getattr(torch, dtype)).requires_grad_(False)
    opts = {"inner_compiler": inner}
    if out:
        opts["debug_dir"] = out
    compiled = torch.compile(model, backend="k3fuse", fullgraph=True, options=opts)
    ce, cc = model.new_cache(batch, max(steps, 1) + 1), model.new_cache(batch, max(steps, 1) + 1)
    g = torch.Generator().manual_seed(seed + 1)
    rows = []
    with torch.no_grad():
        for s in range(steps):
            ids = torch.randint(0, cfg.vocab_size, (batch,), generator=g)
            t0 = time.perf_counter()
            b = compiled(ids, cc)
            t1 = time.perf_counter()
            a = torch.ops._c10d_functional.wait_tensor(model(ids, ce)) if tp_group is not None else model(ids, ce)
            err = ((b.double() - a.double()).norm() / a.double().norm()).item()
            rows.append({"step": s, "rel_err": err, "argmax_equal": bool(torch.equal(a.argmax(-1), b.argmax(-1))),
                         "compiled_s": round(t1 - t0, 3)})
    return LAST_PIPELINES[-1].summary, rows


def _print_summary(summary: dict, rows=None):
    print("passes:")
    for p in summary["passes"]:
        print(f"  {p['name']:<40} matches={p['matches']:<5} ({p['ms']} ms)")
    before, after = summary["ops_before"], summary["ops"]
    keys = sorted(set(before) | set(after), key=lambda k: (not k.startswith("k3fuse"), k))
    interesting = [k for k in keys if k.startswith(("k3fuse", "_c10d")) or before.get(k, 0) != after.get(k, 0)]
    print(f"ops (before -> after), {sum(before.values())} -> {sum(after.values())} nodes in total:")
    for k in interesting:
        print(f"  {k:<45} {before.get(k, 0):>5} -> {after.get(k, 0):<5}")
    for r in rows or []:
        print(f"  step {r['step']}: compiled vs eager rel err {r['rel_err']:.2e}, argmax equal {r['argmax_equal']}, "
              f"{r['compiled_s']} s")


def _tp_worker(rank, world, init, args):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    out = os.path.join(args.out, f"rank{rank}") if args.out else None
    summary, rows = _decode(args.config, args.batch, args.steps, args.dtype, out, dist.group.WORLD)
    if rank == 0:
        with open(os.path.join(os.path.dirname(init), "rank0.json"), "w") as f:
            json.dump({"summary": summary, "rows": rows}, f)
    dist.barrier()
    dist.destroy_process_group()


def _run_decode(args):
    args.dtype = DTYPES[args.dtype]
    if args.tp == 1:
        summary, rows = _decode(args.config, args.batch, args.steps, args.dtype, args.out)
    else:  # one CPU process per rank (gloo)
        import torch.multiprocessing as mp
        with tempfile.TemporaryDirectory() as tmp:
            init = os.path.join(tmp, "store")
            mp.start_processes(_tp_worker, args=(args.tp, init, args), nprocs=args.tp, start_method="spawn")
            with open(os.path.join(tmp, "rank0.json")) as f:
                d = json.load(f)
        summary, rows = d["summary"], d["rows"]
    print(f"k3fuse: config={args.config} batch={args.batch} tp={args.tp} dtype={args.dtype}")
    _print_summary(summary, rows)
    if args.out:
        print(f"graphs and summary.json under {args.out}")
    return 0 if all(r["argmax_equal"] for r in rows) else 1


def _knobs(args, ap) -> int:
    from k3fuse.codegen import knobs
    kinds = tuple(k.strip() for k in args.kind.split(",")) if args.kind else None
    bad = sorted(set(kinds or ()) - set(knobs.KINDS))
    if bad:
        ap.error(f"--kind {','.join(bad)}: one of {', '.join(knobs.KINDS)}")
    rows = knobs.describe(kinds)
    unknown = knobs.unknown_set()
    if args.json:
        print(json.dumps(dict(knobs=rows, ignored=unknown), indent=1))
        return 0
    for r in rows:
        val = r["value"] if r["value"] is not None else "-"
        unset = f" (unset: {r['unset']!r})" if r["unset"] else ""
        fam = f" [{', '.join(r['families'])}]" if r["families"] else ""
        print(f"{r['name']:<30} {r['kind']:<11} {val:<8} {r['doc']}{unset}{fam}")
    for u in unknown:
        print(f"ignored: {u}")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="k3fuse", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, steps in (("inspect", 1), ("run", 4)):
        p = sub.add_parser(name)
        p.add_argument("--config", default="tiny", choices=["tiny", "k3"])
        p.add_argument("--batch", type=int, default=3)
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--steps", type=int, default=steps)
        p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
        p.add_argument("--out", default=None, help="debug directory (graphs before/after each pass, summary.json)")
    sub.add_parser("kernels", add_help=False)
    p = sub.add_parser("knobs")
    p.add_argument("--kind", default=None, help="comma-separated kinds (path, setting, measured, unmeasured, diagnostic)")
    p.add_argument("--json", action="store_true")
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "kernels":
        from k3fuse.codegen.kernels_cli import main as kernels_main
        return kernels_main(rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "knobs":
        return _knobs(args, ap)
    if args.cmd == "inspect" and not args.out:
        ap.error("inspect needs --out DIR")
    if args.config == "k3":
        ap.error("the k3 preset has ~1T parameters: it does not fit a CPU decode; use `k3fuse kernels --config k3`")
    return _run_decode(args)


if __name__ == "__main__":
    sys.exit(main())
