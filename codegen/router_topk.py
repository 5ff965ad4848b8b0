"""Kernel family: the router's top-k (k3fuse::topk_from_logits, and the selection half of k3fuse::router_topk).

One launch, one CTA per token (templates/router_topk.py.jinja): sigmoid, + correction bias, top-k by k rounds of
a block-wide max (one barrier and four redux.sync per round), the chosen sigmoid scores renormalised and scaled.
Memory: the [M, E] fp32 logits once (3.5 KB per token at E = 896): it is latency-bound, and it replaces ATen's
topk (gatherTopK + bitonicSort, 13.4 us at E = 896, k = 16 on the H200) and the elementwise kernels around it.

Also here: k3fuse::router_logits / router_topk on CUDA: the logits from the fp32-output simt GEMV at M <= 4, else one
bf16 x bf16 -> fp32 cuBLAS GEMM (no fp32 copy of the router weight), then this kernel.

GPU-tested on the H200 (tests/test_router_topk_gpu.py, sessions 3 and 4); registered unless K3FUSE_ROUTER_TOPK=0
(see IMPLS and codegen/registry.py).

Compile key: the rendered source (E, k, renormalize, scale, threads) + arch; M is a runtime dimension.
"""
from __future__ import annotations

import math
from typing import Optional

from .render import render
from . import knobs

FAMILY = "router_topk"
TEMPLATE = "router_topk.py.jinja"
OP = "k3fuse::topk_from_logits"
MAX_E = 4096
MAX_K = 32            # the final scores are reduced by one warp


def supports(E: int, k: int) -> Optional[str]:
    if not 1 <= k <= MAX_K:
        return f"top_k={k} (kernel for 1..{MAX_K})"
    if not k <= E <= MAX_E:
        return f"E={E} experts (kernel for k..{MAX_E})"
    return None


def threads_for(E: int) -> int:
    """Enough threads for <= 4 experts each (E = 896: 256 threads x 4), at least one warp, at most 1024."""
    return min(1024, max(32, 32 * math.ceil(E / 4 / 32)))


def rank_select() -> bool:
    """K3FUSE_TOPK_RANK (default 1 since session 12): the selection (templates/_topk_select.jinja, here and in the
    MoE group's last CTA) by a threshold and the ranks of the few candidates above it instead of k sequential rounds
    of a block max; H200, KDA TP16 M = 1: the MoE group with the selection tail 26.1 -> 23.6 / 23.7 us (RESULTS.md
    "Session 12", call 8). 0 renders the rounds only. Read when a kernel is rendered."""
    return knobs.env("K3FUSE_TOPK_RANK") != "0"


def template_params(E: int, k: int, renormalize: bool, scale: float) -> dict:
    t = threads_for(E)
    return dict(E=E, K=k, RENORM=bool(renormalize), SCALE=repr(float(scale)), THREADS=t, VPT=math.ceil(E / t),
                RANK=rank_select())


def render_source(E: int, k: int, renormalize: bool = True, scale: float = 1.0) -> str:
    why = supports(E, k)
    if why:
        raise ValueError(why)
    return render(TEMPLATE, **template_params(E, k, renormalize, scale))


_built: dict = {}


def build(E: int, k: int, renormalize: bool = True, scale: float = 1.0, arch: Optional[str] = None,
          load: bool = True):
    from .compile import compile_source, current_arch
    arch = arch or current_arch()
    memo = (E, k, bool(renormalize), float(scale), arch, load, knobs.key(FAMILY))
    if memo not in _built:
        meta = dict(family=FAMILY, op=OP, shape=dict(E=E, k=k), template=TEMPLATE,
                    config=dict(renormalize=bool(renormalize), scale=float(scale), threads=threads_for(E)))
        _built[memo] = compile_source(render_source(E, k, renormalize, scale), arch, load=load, meta=meta)
    return _built[memo]


def launch_ok(logits, bias, top_k) -> Optional[str]:
    import torch
    if logits.dim() != 2:
        return f"logits are {logits.dim()}-D, not [M, E]"
    M, E = logits.shape
    why = supports(E, top_k)
    if why:
        return why
    if M == 0:
        return "empty batch"
    if bias.numel() != E:
        return f"bias has {bias.numel()} entries for {E} experts"
    if logits.device != bias.device:
        return "logits and bias on different devices"
    if logits.dtype != torch.float32:
        return f"logits are {logits.dtype} (the kernel reads fp32)"
    return None


def bias_fp32(bias):
    """The correction bias as the kernels read it: fp32, contiguous, 16-byte aligned (a no-op for K3's fp32 bias)."""
    b = bias.float().contiguous()
    return b.clone() if b.data_ptr() % 16 else b


def topk_from_logits(logits, bias, top_k, renormalize, scale):
    """Launch (caller checked launch_ok()). Returns (ids [M, k] int64, weights [M, k] fp32)."""
    import torch
    M, E = logits.shape
    kern = build(E, top_k, renormalize, scale)
    lg = logits if logits.is_contiguous() and logits.data_ptr() % 16 == 0 else logits.contiguous().clone()
    b = bias_fp32(bias)
    ids = torch.empty(M, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(M, top_k, dtype=torch.float32, device=logits.device)
    kern(lg, b, ids, w)
    return ids, w


def topk_from_logits_cuda(logits, bias, top_k, renormalize, scale):
    """CUDA implementation of k3fuse::topk_from_logits; the reference where the kernel does not apply."""
    from k3fuse import ops
    from .registry import _env_ok, log_fallback
    why = launch_ok(logits, bias, top_k)
    if why is not None:
        log_fallback(OP, why)
    if why is not None or not _env_ok(OP, logits.device):       # _env_ok logs its own reason once
        return ops.topk_from_logits._init_fn(logits, bias, top_k, renormalize, scale)
    return topk_from_logits(logits, bias, top_k, renormalize, scale)


_mm_out_dtype = True      # until torch.mm(..., out_dtype=float32) fails once
GEMV_MAX_M = 4            # the CUDA-core GEMV is the faster one up to M ~ 4 on the H200 (RESULTS.md, run 5)


def router_gemv_enabled() -> bool:
    """The fp32-output simt GEMV for the router logits at M <= GEMV_MAX_M (one launch; cuBLAS's split-K GEMM took
    two, 5.9 + 1.8 us at TP16 M = 1, RESULTS.md session 4); K3FUSE_ROUTER_GEMV=0 keeps cuBLAS."""
    return knobs.env("K3FUSE_ROUTER_GEMV") != "0"


def _gemv_ok(x, weight) -> Optional[str]:
    import torch
    from . import gemv
    from .buckets import bucket_for
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    if not router_gemv_enabled():
        return "K3FUSE_ROUTER_GEMV=0"
    if not 1 <= M <= GEMV_MAX_M:
        return f"M={M} > {GEMV_MAX_M} (cuBLAS)"
    if not weight.is_contiguous() or weight.data_ptr() % 16 or weight.dtype != torch.bfloat16:
        return "weight not contiguous / 16-byte aligned bf16"
    return gemv.fp32_out_supports(weight.shape[0], K, bucket_for(M))


def router_logits_cuda(x, weight):
    """CUDA implementation of k3fuse::router_logits (fp32 x @ weight^T of bf16 operands, fp32 accumulate: the
    reference's math up to the summation order). M <= GEMV_MAX_M: the simt GEMV with an fp32 output (codegen/gemv.py
    linear_fp32_out, one launch); otherwise one cuBLAS GEMM with bf16 inputs and an fp32 output
    (`mm(..., out_dtype=float32)`) instead of converting the weight to fp32 first (13 MB read instead of
    13 + 26 + 26 MB at E = 896)."""
    import torch
    from k3fuse import ops
    from . import gemv
    from .registry import _env_ok, log_fallback
    global _mm_out_dtype
    op = "k3fuse::router_logits"
    if x.dtype == weight.dtype == torch.bfloat16 and x.is_cuda and weight.dim() == 2:
        why = _gemv_ok(x, weight)
        if why is None and _env_ok(op, x.device):
            x2 = x.reshape(-1, x.shape[-1])
            if not x2.is_contiguous() or x2.data_ptr() % 16:
                x2 = x2.clone(memory_format=torch.contiguous_format)
            return gemv.linear_fp32_out(x2, weight).reshape(*x.shape[:-1], weight.shape[0])
        if why is not None:
            log_fallback(op + " (gemv)", why)
        if _mm_out_dtype:
            try:
                x2 = x.reshape(-1, x.shape[-1])
                return torch.mm(x2, weight.t(), out_dtype=torch.float32).reshape(*x.shape[:-1], weight.shape[0])
            except (RuntimeError, TypeError) as e:    # a torch without mm(out_dtype): found once, not per call
                _mm_out_dtype = False
                log_fallback(op, f"mm(out_dtype=float32) unavailable: {str(e)[:120]}")
    else:
        log_fallback(op, f"operands {x.dtype} / {weight.dtype} on {x.device} (the fp32-output GEMM is for bf16 CUDA)")
    return ops.router_logits._init_fn(x, weight)


def router_topk_cuda(x, weight, bias, top_k, renormalize, scale):
    """CUDA implementation of k3fuse::router_topk: router_logits_cuda, then the top-k kernel (or its reference)."""
    return topk_from_logits_cuda(router_logits_cuda(x, weight), bias, top_k, renormalize, scale)


# registered by default (K3FUSE_ROUTER_TOPK=0 in codegen/registry.py opts out); GPU-tested in tests/test_router_topk_gpu.py
IMPLS = {OP: topk_from_logits_cuda, "k3fuse::router_logits": router_logits_cuda,
         "k3fuse::router_topk": router_topk_cuda}
