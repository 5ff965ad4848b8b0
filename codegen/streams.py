"""CUDA implementations of k3fuse::side_linear_situ / k3fuse::stream_join: the shared expert on a side stream.

side_linear_situ records an event on the current stream, makes the side stream wait for it, runs the GEMV (the
k3fuse::linear CUDA implementation: generated kernel or cuBLAS) and SiTU-GLU there, and returns at once;
stream_join makes the current stream wait for that work. Both work inside CUDA-graph capture (events become the
graph's fork / join edges). Memory: the result is allocated on the side stream and record_stream'ed on the
current one, so the caching allocator does not reuse it early.
"""
from __future__ import annotations

import threading

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
