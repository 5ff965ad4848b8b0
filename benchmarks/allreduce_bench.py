"""Time the in-kernel all-reduce + mix-norm (codegen/mixnorm_allreduce.py) against the separate path, and the
in-kernel all-gather (codegen/allgather_oneshot.py) against NCCL's.

  CUDA_DEVICE_MAX_CONNECTIONS=32 python3 benchmarks/allreduce_bench.py --out $OUT [--steps 20] [--reps 10]
      [--what ar,ag]

One GPU ("emulated" rows): W in-process ranks on one device (compiler/peer_buffers.emulated_world), each rank's
GEMV + all-reduce kernel on its own stream, captured in one CUDA graph, vs the same W GEMVs + a torch reduction
of the partials (fp32 sum, bf16) + the TP = 1 mix-norm kernel, and vs TP = 1 (one GEMV over the full K + mix-norm).
THESE ARE NOT NVLINK LATENCIES: all ranks share one GPU's SMs and HBM and every "peer" read is a local HBM read.
They show what the protocol (flag stores, system fences, polling, the slot copy) costs on one device.

Two or more GPUs ("tp" rows): one process per GPU, TP = 2 / 4 / 8 as far as the GPUs go; per-rank time of one
step of o_proj + all-reduce + mix-norm: fused (symmetric-memory backend, no multicast) vs GEMV + NCCL all_reduce +
mix-norm (NCCL_NVLS_ENABLE=0).
Gather rows ("ag"): the MoE split's merged gather (router logits fp32 bit-cast + z shard, [M, 896/t * 2 + 3584/t]
bf16 per rank at TP = t = W): emulated = W in-kernel gathers on W streams vs W torch.cat copies of the same bytes
(a local-copy floor, no protocol); tp = per-rank all_gather_oneshot vs NCCL all_gather_into_tensor.
Each measurement is a CUDA graph of --steps consecutive steps, replayed --reps
times; the median replay / steps is reported. Prints a table; writes allreduce_bench.json under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")   # W rank streams must not share hardware queues
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402

from gpu_kernels import graph_time  # noqa: E402  (benchmarks/ is the script's directory)

H, K = 7168, 1536          # K3 o_proj per-rank slice at TP8 (7168 x 1536); the same K per rank at every W here
NB = 3                     # block snapshots in the mix (a mid-model layer)
NOTE = ("emulated ranks share one GPU: not a measurement of NVLink latency; it shows the protocol's cost "
        "(flags, fences, polling, the slot copy) with every peer read a local HBM read")


def bf(*shape, scale=1.0, dev="cuda"):
    return (torch.randn(*shape, device=dev) * scale).to(torch.bfloat16)


def time_graph(fn, steps, reps, sync=None):
    """Median time of one step: a CUDA graph of `steps` calls of fn, replayed `reps` times (sync() before each)."""
    return graph_time(lambda i: fn(), steps, reps, before_replay=sync)[0]


class State:
    def __init__(self, M, dev):
        self.M = M
        self.prefix = bf(M, H, dev=dev)
        self.blocks_buf = bf(M, 8, H, dev=dev)
        self.blocks = [self.blocks_buf[:, i] for i in range(NB)]
        self.w_mix = torch.randn(H, device=dev) * 0.05
        self.norm_w = bf(H, scale=0.5, dev=dev) + 1
        self.out = torch.empty(M, H, dtype=torch.bfloat16, device=dev)
        self.newp = torch.empty_like(self.out)


# ------------------------------------------------------------------------------------------ one GPU
def bench_emulated(W, M, steps, reps):
    from k3fuse import peer_buffers as pbuf
    from k3fuse.codegen import fused_residual_norm as frn
    from k3fuse.codegen import mixnorm_allreduce as mar
    st = State(M, "cuda")
    o = [bf(M, K) for _ in range(W)]
    w = [bf(H, K, scale=(W * K) ** -0.5) for _ in range(W)]
    ranks = pbuf.emulated_world(W, H)
    streams = [torch.cuda.Stream() for _ in range(W)]
    outs = [torch.empty_like(st.out) for _ in range(W)]
    newps = [torch.empty_like(st.out) for _ in range(W)]
    parts = [torch.empty(M, H, dtype=torch.bfloat16, device="cuda") for _ in range(W)]

    def fork(body):
        cur = torch.cuda.current_stream()
        for s in streams:
            s.wait_stream(cur)
        body()
        for s in streams:
            cur.wait_stream(s)

    def fused():
        def body():
            for r in range(W):       # every GEMV before any spinning kernel (see tests/test_allreduce_gpu.py)
                with torch.cuda.stream(streams[r]):
                    mar.gemv_into(o[r], w[r], ranks[r].partial[:M])
            for r in range(W):
                with torch.cuda.stream(streams[r]):
                    mar.mixnorm_allreduce(ranks[r].partial[:M], None, st.prefix, st.blocks, st.w_mix, st.norm_w,
                                          1e-5, 1e-5, ranks[r], out=outs[r], new_prefix=newps[r])
        fork(body)

    def separate():
        def body():
            for r in range(W):
                with torch.cuda.stream(streams[r]):
                    mar.gemv_into(o[r], w[r], parts[r])
        fork(body)
        acc = parts[0].float()
        for p in parts[1:]:
            acc = acc + p.float()
        frn.mix_norm(acc.to(torch.bfloat16), None, st.prefix, st.blocks, st.w_mix, st.norm_w, 1e-5, 1e-5, False,
                     out=st.out, new_prefix=st.newp)

    o_full, w_full = torch.cat(o, 1), torch.cat(w, 1)
    y_full = torch.empty(M, H, dtype=torch.bfloat16, device="cuda")

    def tp1():
        mar.gemv_into(o_full, w_full, y_full)
        frn.mix_norm(y_full, None, st.prefix, st.blocks, st.w_mix, st.norm_w, 1e-5, 1e-5, False, out=st.out,
                     new_prefix=st.newp)

    res = dict(kind="emulated", W=W, M=M, note=NOTE)
    res["fused_us"] = time_graph(fused, steps, reps)
    for pb in ranks:
        mar.check_error(pb)
    assert all(torch.equal(x, outs[0]) for x in outs), "emulated ranks differ"
    res["separate_us"] = time_graph(separate, steps, reps)
    res["tp1_us"] = time_graph(tp1, steps, reps)
    return res


def gather_cols(W):
    """bf16 columns of the split pass's merged gather at TP = W: fp32 logits of 896 / W experts, z shard 3584 / W."""
    return 896 // W * 2 + 3584 // W


def bench_gather_emulated(W, M, steps, reps):
    from k3fuse import peer_buffers as pbuf
    from k3fuse.codegen import allgather_oneshot as ag
    C = gather_cols(W)
    ranks = pbuf.emulated_world(W, H)
    streams = [torch.cuda.Stream() for _ in range(W)]
    xs = [bf(M, C) for _ in range(W)]
    outs = [torch.empty(W * M, C, dtype=torch.bfloat16, device="cuda") for _ in range(W)]
    ag.build_for(ranks[0], C * 2)

    def fused():
        cur = torch.cuda.current_stream()
        for s in streams:
            s.wait_stream(cur)
        for r in range(W):
            with torch.cuda.stream(streams[r]):
                ag.all_gather_oneshot(xs[r], ranks[r], out=outs[r])
        for s in streams:
            cur.wait_stream(s)

    def copy():
        for r in range(W):
            torch.cat(xs, 0, out=outs[r])

    res = dict(kind="emulated_ag", W=W, M=M, row_bytes=C * 2, note=NOTE)
    res["fused_us"] = time_graph(fused, steps, reps)
    for pb in ranks:
        ag.check_error(pb)
    ref = torch.cat(xs, 0)
    assert all(torch.equal(o, ref) for o in outs), "emulated gather differs from torch.cat"
    res["copy_us"] = time_graph(copy, steps, reps)
    return res


# ------------------------------------------------------------------------------------------ several GPUs
def _tp_worker(rank, world, tmp, steps, reps, ms, what=("ar",)):
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=rank, world_size=world, device_id=dev)
    from k3fuse import peer_buffers as pbuf
    from k3fuse.codegen import fused_residual_norm as frn
    from k3fuse.codegen import mixnorm_allreduce as mar
    from k3fuse.codegen import allgather_oneshot as ag
    peer = pbuf.PeerBuffers.symmetric(dist.group.WORLD, H)
    rows = []
    for M in (ms if "ag" in what else ()):
        C = gather_cols(world)
        x = bf(M, C, dev=dev)
        out = torch.empty(world * M, C, dtype=torch.bfloat16, device=dev)
        ag.build_for(peer, C * 2)
        dist.barrier()

        def sync():
            torch.cuda.synchronize()
            dist.barrier()

        r = dict(kind="tp_ag", W=world, M=M, rank=rank, row_bytes=C * 2)
        r["fused_us"] = time_graph(lambda: ag.all_gather_oneshot(x, peer, out=out), steps, reps, sync)
        ag.check_error(peer)
        ref = torch.empty_like(out)
        dist.all_gather_into_tensor(ref, x)
        assert torch.equal(out, ref), "in-kernel gather differs from NCCL's"
        sync()
        r["nccl_us"] = time_graph(lambda: dist.all_gather_into_tensor(out, x), steps, reps, sync)
        rows.append(r)
    for M in (ms if "ar" in what else ()):
        torch.manual_seed(100 + rank)
        st = State(M, dev)
        o, w = bf(M, K, dev=dev), bf(H, K, scale=(world * K) ** -0.5, dev=dev)
        y = torch.empty(M, H, dtype=torch.bfloat16, device=dev)
        mar.build(H, NB, world, False, True, True, False)
        frn.build_mix_norm(H, NB, False, True, True, False)
        dist.barrier()

        def fused():
            mar.fused_residual_norm_ar(o, w, None, st.prefix, st.blocks, st.w_mix, st.norm_w, 1e-5, 1e-5, peer,
                                       out=st.out, new_prefix=st.newp)

        def nccl():
            mar.gemv_into(o, w, y)
            dist.all_reduce(y)
            frn.mix_norm(y, None, st.prefix, st.blocks, st.w_mix, st.norm_w, 1e-5, 1e-5, False, out=st.out,
                         new_prefix=st.newp)

        def sync():
            torch.cuda.synchronize()
            dist.barrier()

        r = dict(kind="tp", W=world, M=M, rank=rank)
        r["fused_us"] = time_graph(fused, steps, reps, sync)
        mar.check_error(peer)
        sync()
        r["nccl_us"] = time_graph(nccl, steps, reps, sync)
        rows.append(r)
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def bench_tp(world, steps, reps, ms, what=("ar",)):
    import torch.multiprocessing as mp
    tmp = tempfile.mkdtemp(prefix="k3fuse-arbench-")
    mp.spawn(_tp_worker, args=(world, tmp, steps, reps, ms, tuple(what)), nprocs=world, join=True)
    per_rank = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]
    out = []
    for i, r0 in enumerate(per_rank[0]):
        rs = [per_rank[r][i] for r in range(world)]
        out.append(dict(kind=r0["kind"], W=world, M=r0["M"], **{k: r0[k] for k in ("row_bytes",) if k in r0},
                        fused_us=statistics.median(x["fused_us"] for x in rs),
                        nccl_us=statistics.median(x["nccl_us"] for x in rs),
                        per_rank=[dict(rank=x["rank"], fused_us=x["fused_us"], nccl_us=x["nccl_us"]) for x in rs]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--what", default="ar,ag", help="ar: all-reduce + mix-norm rows; ag: all-gather rows")
    ap.add_argument("--skip-emulated", action="store_true", help="only the multi-GPU (one process per GPU) rows")
    args = ap.parse_args()
    what = args.what.split(",")
    ms = [int(x) for x in args.ms.split(",")]
    worlds = [int(x) for x in args.worlds.split(",")]
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    results = dict(gpu=torch.cuda.get_device_name(), n_gpus=torch.cuda.device_count(), H=H, K_per_rank=K,
                   blocks=NB, steps=args.steps, reps=args.reps, rows=[], errors=[])

    def save():
        with open(os.path.join(args.out, "allreduce_bench.json"), "w") as f:
            json.dump(results, f, indent=1)

    emulated = []                                   # (collective, bench, label, line for a row)
    if "ag" in what:
        emulated.append(("gather", bench_gather_emulated, lambda r: f"({r['row_bytes']} B/row): in-kernel "
                         f"{r['fused_us']:.1f} us, W local cat copies {r['copy_us']:.1f} us"))
    if "ar" in what:
        emulated.append(("", bench_emulated, lambda r: f"fused {r['fused_us']:.1f} us, separate "
                         f"{r['separate_us']:.1f} us, tp1 {r['tp1_us']:.1f} us"))
    for label, bench, line in ([] if args.skip_emulated else emulated):
        for W in worlds:
            for M in ms:
                if W * M > 64:                      # every rank's CTAs must be resident at once
                    continue
                name = f"emulated {label + ' ' if label else ''}W={W} M={M}"
                try:
                    r = bench(W, M, args.steps, args.reps)
                    results["rows"].append(r)
                    print(f"{name} {line(r)}  [{time.time() - t0:.0f} s]", flush=True)
                except Exception as e:
                    results["errors"].append(f"{name}: {e!r}"[:500])
                    print(results["errors"][-1], flush=True)
                save()
    n = torch.cuda.device_count()
    for W in worlds:
        if W > n:
            continue
        try:
            rows = bench_tp(W, args.steps, args.reps, ms, what)
            results["rows"] += rows
            for r in rows:
                print(f"TP={W} M={r['M']} {'gather' if r['kind'] == 'tp_ag' else 'all-reduce + mix-norm'}: "
                      f"fused {r['fused_us']:.1f} us, NCCL {r['nccl_us']:.1f} us [{time.time() - t0:.0f} s]",
                      flush=True)
        except Exception as e:
            results["errors"].append(f"tp W={W}: {e!r}"[:500])
            print(results["errors"][-1], flush=True)
        save()
    if n < 2:
        results["tp_note"] = f"{n} GPU: no multi-GPU rows"

    print()
    print(f"o_proj {H}x{K} per rank + all-reduce + AttnRes mix ({NB} blocks) + RMSNorm, us per step (median)")
    print(f"{'kind':9} {'W':>2} {'M':>3} {'fused':>8} {'separate':>9} {'tp1/nccl':>9}")
    for r in results["rows"]:
        if r["kind"] == "emulated":
            print(f"{'emulated':9} {r['W']:>2} {r['M']:>3} {r['fused_us']:8.1f} {r['separate_us']:9.1f} "
                  f"{r['tp1_us']:9.1f}")
        elif r["kind"] == "tp":
            print(f"{'tp':9} {r['W']:>2} {r['M']:>3} {r['fused_us']:8.1f} {'':>9} {r['nccl_us']:9.1f}")
    print()
    print("MoE split's merged all-gather (logits + z), us per step (median)")
    print(f"{'kind':12} {'W':>2} {'M':>3} {'B/row':>6} {'in-kernel':>10} {'cat/nccl':>9}")
    for r in results["rows"]:
        if r["kind"] == "emulated_ag":
            print(f"{'emulated':12} {r['W']:>2} {r['M']:>3} {r['row_bytes']:>6} {r['fused_us']:10.1f} "
                  f"{r['copy_us']:9.1f}")
        elif r["kind"] == "tp_ag":
            print(f"{'tp':12} {r['W']:>2} {r['M']:>3} {r['row_bytes']:>6} {r['fused_us']:10.1f} "
                  f"{r['nccl_us']:9.1f}")
    print(f"emulated: {NOTE}")
    print("emulated 'separate' = W GEMVs + torch fp32 sum + mix-norm; 'tp1' = one GEMV over W*K + mix-norm; "
          "tp 'nccl' = GEMV + NCCL all_reduce + mix-norm; gather 'cat' = W local torch.cat copies, 'nccl' = "
          "all_gather_into_tensor")
    save()
    print(f"wrote {os.path.join(args.out, 'allreduce_bench.json')} in {time.time() - t0:.0f} s")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
