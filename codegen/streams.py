"""CUDA implementations of k3fuse::side_linear_situ / k3fuse::stream_join: the shared expert on a side stream;
and run_concurrently, the library GEMMs of one linear group forked over side streams and joined.

side_linear_situ records an event on the current stream, makes the side stream wait for it, runs the GEMV (the
k3fuse::linear CUDA implementation: generated kernel or cuBLAS) and SiTU-GLU there, and returns at once;
stream_join makes the current stream wait for that work. Both work inside CUDA-graph capture (events become the
graph's fork / join edges). Memory: the result is allocated on the side stream and record_stream'ed on the
current one, so the caching allocator does not reuse it early.
"""
from __future__ import annotations

import threading

from . import knobs

_local = threading.local()


def _side_stream(device):
    import torch
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    if device not in streams:
        streams[device] = torch.cuda.Stream(device=device)
    return streams[device]


def _pending() -> dict:
    p = getattr(_local, "pending", None)
    if p is None:
        p = _local.pending = {}
    return p


def side_linear_situ_cuda(x, weight, beta, linear_beta):
    import torch
    cur = torch.cuda.current_stream(x.device)
    side = _side_stream(x.device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        # the simt GEMV with the SiTU-GLU epilogue where it applies (M <= 4), else GEMV + SiTU (registry)
        from .registry import linear_situ_glu_cuda
        y = linear_situ_glu_cuda(x, weight, beta, linear_beta)
        done = torch.cuda.Event()
        done.record(side)
    x.record_stream(side)
    weight.record_stream(side)
    y.record_stream(cur)
    _pending()[y.data_ptr()] = done
    return y


def stream_join_cuda(x):
    import torch
    done = _pending().pop(x.data_ptr(), None)
    if done is not None:
        torch.cuda.current_stream(x.device).wait_event(done)
    return x.clone()


# ------------------------------------------------------------------------------- a group's library GEMMs at once
# Default 4 (session 32, H200, layer_ab.py --var K3FUSE_GROUP_STREAMS, 8 pairs, RESULTS.md "Session 32"): KDA's in_proj
# group (5-6 GEMMs) on side streams: KDA + MoE TP16 M = 64 -20.3 us (8 / 8), TP8 -18.1, TP16 M = 32 -20.2; the MoE
# group (3 with the router) and MLA's q_a / kv_a (2) gained nothing measurable (4 -> 3: KDA +0.5, MLA -1.7 us).
GROUP_STREAMS_DEFAULT = "4"


def group_streams_min() -> int:
    """K3FUSE_GROUP_STREAMS=N: where every GEMM of a linear group goes to the library (cuBLAS: the buckets the tuning
    table routes there, M = 17..64 on the H200), groups of N or more GEMMs (the router's counted) run them
    concurrently on side streams instead of one after another; 0 = never, 1 = as 2. Each of those GEMMs alone is a
    few waves of split-K CTAs plus a reduce kernel, far from the copy bandwidth at decode widths (768 x 7168 at
    M = 64: 8.6 us for 11 MB, RESULTS.md "Session 19"). Read at every launch and by the lowering."""
    n = knobs.integer("K3FUSE_GROUP_STREAMS", int(GROUP_STREAMS_DEFAULT))
    return 0 if n <= 0 else max(2, n)


def _group_pool(device, n: int) -> list:
    """n side streams of the device for run_concurrently (not the shared expert's: that one may be in flight)."""
    import torch
    pools = getattr(_local, "group_pools", None)
    if pools is None:
        pools = _local.group_pools = {}
    pool = pools.setdefault(device, [])
    while len(pool) < n:
        pool.append(torch.cuda.Stream(device=device))
    return pool[:n]


def run_concurrently(device, fns: list) -> list:
    """[fn() for fn in fns], fns[1:] each on its own side stream (forked from the current stream's position), fns[0]
    on the current stream, launched last; the current stream then waits for every side stream, so what follows sees
    all results. Works inside CUDA-graph capture (fork / join edges). A side stream's tensors are record_stream'ed on
    the current one: the allocator keeps them until the current stream's uses are done."""
    import torch
    cur = torch.cuda.current_stream(device)
    fork = torch.cuda.Event()
    fork.record(cur)
    outs: list = [None] * len(fns)
    joins = []
    for i, (fn, side) in enumerate(zip(fns[1:], _group_pool(device, len(fns) - 1)), 1):
        side.wait_event(fork)
        with torch.cuda.stream(side):
            outs[i] = fn()
            done = torch.cuda.Event()
            done.record(side)
        joins.append(done)
        for t in outs[i] if isinstance(outs[i], (list, tuple)) else [outs[i]]:
            t.record_stream(cur)
    outs[0] = fns[0]()
    for done in joins:
        cur.wait_event(done)
    return outs
