"""One Kimi K3 decoder layer under real tensor parallelism, one process per GPU (TP = 2, 4, 8): eager (NCCL),
k3fuse with NCCL collectives + the separate kernels, and k3fuse with the in-kernel one-shot collectives
(K3FUSE_INKERNEL_COLLECTIVES=1: the attention-output all-reduce + AttnRes mix-norm kernel, the MoE split's gather);
all CUDA-graph replayed with weights rotated (2 copies of the layer), against the floor.

    python3 benchmarks/tp_layer_bench.py --out DIR [--tp 2] [--kinds kda,mla] [--ms 1,8,64]

Floor per rank = HBM bytes the rank must read / copy bandwidth + bytes it receives from peers / peer copy bandwidth
(both measured in this run). HBM bytes as layer_bench.floor_bytes on the rank's shards, with the router and the
routed latent down/up projections (replicated in the model) counted 1/t: the MoE split reads only that share.
Received bytes: the two [M, 7168] bf16 all-reduces (attention output, MoE output) and the MoE split's gather, each
one-shot: (t - 1) peers' rows. A layer's time is the slowest rank's median replay. Every variant is checked against
eager on every rank (rel err), and the in-kernel variant's outputs must be identical across ranks.
Needs >= t GPUs; NVLink multicast stays off (tests/_launch.MULTICAST_OFF).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

MULTICAST_OFF = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
os.environ.update(MULTICAST_OFF)
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import torch  # noqa: E402

from layer_bench import CONTEXT, clone_inputs, floor_bytes, make_inputs, make_layer, profile_kernels, rel  # noqa
from gpu_kernels import copy_bandwidth, graph_time  # noqa: E402

ENV = "K3FUSE_INKERNEL_COLLECTIVES"
SPLIT = ("mlp.gate.weight", "mlp.routed_expert_down_proj.weight", "mlp.routed_expert_up_proj.weight")


def peer_bandwidth() -> float:
    """Bytes/s of a 256 MiB copy GPU 1 -> GPU 0 (peer access over NVLink), median of 10."""
    n = 256 << 20
    src = torch.empty(n, dtype=torch.uint8, device="cuda:1").random_()
    dst = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(0):
            a.record()
            dst.copy_(src)
            b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1000)
    return n / statistics.median(ts)


def rank_floor(cfg, m, inp, M, t, hbm_bw, peer_bw):
    hbm = floor_bytes(cfg, m, inp, M)
    params = dict(m.named_parameters())
    hbm -= sum(params["layer." + n].numel() * 2 * (t - 1) // t for n in SPLIT)
    E, D = cfg.num_experts, params["layer.mlp.routed_expert_down_proj.weight"].shape[0]
    recv = (t - 1) * M * (2 * cfg.hidden_size * 2 + (E // t) * 4 + (D // t) * 2)
    return hbm, recv, hbm / hbm_bw * 1e6, recv / peer_bw * 1e6


def worker(rank, world, tmp, args, hbm_peer):
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=rank, world_size=world, device_id=dev)
    torch._dynamo.config.cache_size_limit = 64
    from k3fuse.models import KimiK3Config
    hbm_bw, peer_bw = hbm_peer
    cfg = KimiK3Config()
    group = dist.group.WORLD

    def sync():
        torch.cuda.synchronize()
        dist.barrier()

    call = lambda m, *a: m(*a)
    k3 = torch.compile(call, backend="k3fuse", dynamic=False)
    variants = {"eager": (call, "0"), "k3fuse_nccl": (k3, "0"), "k3fuse_inkernel": (k3, "1")}
    rows = []
    for kind in args.kinds.split(","):
        layers = [make_layer(cfg, kind, seed, group=group) for seed in (0, 1)]
        for M in map(int, args.ms.split(",")):
            torch.manual_seed(M)                   # the same replicated activations on every rank
            base = make_inputs(cfg, layers[0], M)
            hbm, recv, hbm_us, ex_us = rank_floor(cfg, layers[0], base, M, world, hbm_bw, peer_bw)
            row = dict(kind=kind, tp=world, M=M, rank=rank, hbm_MB=round(hbm / 1e6, 2), recv_KB=round(recv / 1e3, 1),
                       floor_hbm_us=round(hbm_us, 2), floor_exchange_us=round(ex_us, 2),
                       floor_us=round(hbm_us + ex_us, 1))
            copies = None
            ref = [x.clone() for x in call(layers[0], *clone_inputs(base))]    # clone: waits on the collectives
            for name, (fn, flag) in variants.items():
                os.environ[ENV] = flag
                try:
                    sync()
                    got = fn(layers[0], *clone_inputs(base))
                    torch.cuda.synchronize()
                    row[f"{name}_rel_err"] = max(rel(g, r) for g, r in zip(got, ref))
                    if flag == "1":
                        outs = [torch.empty_like(got[0]) for _ in range(world)]
                        dist.all_gather(outs, got[0].contiguous())
                        row[f"{name}_ranks_identical"] = all(torch.equal(o, outs[0]) for o in outs)
                    copies = [(l, clone_inputs(base)) for l in layers]
                    sync()
                    row[f"{name}_us"] = round(graph_time(
                        lambda i: fn(copies[i % 2][0], *copies[i % 2][1]), 20, 15, before_replay=sync)[0], 1)
                    sync()
                    n, top, _ = profile_kernels(fn, layers[0], clone_inputs(base))
                    row[f"{name}_kernels"] = n
                    if name != "eager":
                        row[f"{name}_top"] = top[:args.top]
                except Exception as e:
                    row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:400]
                    print(f"rank {rank} {kind} M={M} {name}: {row[f'{name}_error']}", flush=True)
                sync()
            rows.append(row)
            if rank == 0:
                print(json.dumps({k: v for k, v in row.items() if not k.endswith("_top")}), flush=True)
            del base, ref, copies
        del layers                                 # two copies of a TP2 layer are ~60 GB: one kind at a time
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
    os.environ[ENV] = "0"
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(os.path.join(tmp, "rows.json"), "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


def merge(per_rank):
    """One row per (kind, M): the slowest rank's time, the worst rank's error, rank 0's kernel list."""
    out = []
    for i, r0 in enumerate(per_rank[0]):
        rs = [pr[i] for pr in per_rank]
        row = {k: v for k, v in r0.items() if k != "rank"}
        for k in r0:
            if k.endswith("_us") and not k.startswith("floor"):
                row[k] = max(r[k] for r in rs if k in r)
                row[k.replace("_us", "_us_per_rank")] = [r.get(k) for r in rs]
            elif k.endswith("_rel_err"):
                row[k] = max(r[k] for r in rs if k in r)
            elif k.endswith("_ranks_identical"):
                row[k] = all(r.get(k) for r in rs)
        out.append(row)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tp", default="2")
    ap.add_argument("--kinds", default="kda,mla")
    ap.add_argument("--ms", default="1,8,64")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    import torch.multiprocessing as mp
    n = torch.cuda.device_count()
    if n < 2:
        sys.exit(f"needs >= 2 GPUs (have {n})")
    os.makedirs(args.out, exist_ok=True)
    hbm_bw, peer_bw = copy_bandwidth(), peer_bandwidth()
    torch.cuda.empty_cache()
    gpu, date = torch.cuda.get_device_name(), time.strftime("%Y-%m-%d")
    print(f"copy bandwidth {hbm_bw / 1e12:.2f} TB/s, peer copy GPU1->GPU0 {peer_bw / 1e9:.0f} GB/s on {n} x {gpu}",
          flush=True)
    rows = []
    for t in map(int, args.tp.split(",")):
        if t > n:
            print(f"TP={t}: only {n} GPUs, skipped")
            continue
        tmp = tempfile.mkdtemp(prefix="k3fuse-tplayer-")
        t0 = time.time()
        mp.spawn(worker, args=(t, tmp, args, (hbm_bw, peer_bw)), nprocs=t, join=True)
        rows += [dict(r, gpu=gpu, date=date, copy_TBps=round(hbm_bw / 1e12, 3), peer_GBps=round(peer_bw / 1e9, 1))
                 for r in merge(json.load(open(os.path.join(tmp, "rows.json"))))]
        print(f"TP={t} done in {time.time() - t0:.0f} s", flush=True)
        with open(os.path.join(args.out, "tp_layer_bench.json"), "w") as f:
            json.dump(rows, f, indent=1)
    names = ("eager", "k3fuse_nccl", "k3fuse_inkernel")
    print(f"\n{'kind':<4} {'tp':>3} {'M':>3} {'floor us':>9} " + " ".join(f"{x:>16}" for x in names)
          + "  (us / kernels, slowest rank; inkernel/floor; inkernel vs nccl)")
    for r in rows:
        cells = [f"{r.get(x + '_us', float('nan')):>9.1f}/{r.get(x + '_kernels', 0):<5}" for x in names]
        a, b = r.get("k3fuse_inkernel_us"), r.get("k3fuse_nccl_us")
        tail = f"  {a / r['floor_us']:.2f}x  {b / a:.2f}x" if a and b else ""
        print(f"{r['kind']:<4} {r['tp']:>3} {r['M']:>3} {r['floor_us']:>9.1f} " + " ".join(cells) + tail)
    for r in rows:
        errs = {x: r.get(x + "_rel_err") for x in names[1:]}
        print(f"{r['kind']} tp{r['tp']} M{r['M']}: rel err vs eager {errs}, ranks identical "
              f"{r.get('k3fuse_inkernel_ranks_identical')}; errors: "
              f"{ {x: r[x + '_error'] for x in names if x + '_error' in r} }")


if __name__ == "__main__":
    main()
