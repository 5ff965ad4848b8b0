"""CUDA implementations of the k3fuse ops, backed by the generated kernels.

    from k3fuse.codegen import registry
    registry.register()          # idempotent; K3FUSE_KERNELS=0 in the environment turns it into a no-op,
                                 # K3FUSE_DISABLE_KERNELS=op1,op2 leaves those ops unfused

registers, with torch.library.register_kernel(..., "cuda", ...):
  k3fuse::linear               GEMV family for M <= 64 where a kernel exists and the tuning table does not
                               prefer cuBLAS; else the unfused path (cuBLAS F.linear for bf16, the reference otherwise)
  k3fuse::linear_group         unless K3FUSE_GROUPED_GEMV=0: one grouped GEMV launch over all the weights (same routing
                               as one GEMV of the concatenated shape); otherwise, or where it does not apply, one
                               k3fuse::linear CUDA call per weight (what the separate linears did before the pass),
                               concurrently on side streams where they all go to cuBLAS and the group has
                               K3FUSE_GROUP_STREAMS (default 4) or more (streams.run_concurrently)
  k3fuse::linear_group_situ    the grouped GEMV with a SiTU-GLU epilogue on one member where the simt kernel applies
                               (KERNEL_APPLIES; else the lowering splits it), otherwise linear_group + the SiTU reference
  k3fuse::linear_group_router  the group (SiTU member or not) with the MoE router's rows as one more, fp32-output member,
                               where the simt kernel applies (KERNEL_APPLIES; else split), otherwise group + router_logits
  k3fuse::linear_group_router_topk   that op + the router's top-k: in the group's last CTA where its config has 256 threads
                               (KERNEL_APPLIES; else, or with K3FUSE_TOPK_IN_GROUP=0, the lowering splits the op back
                               into linear_group_router + topk_from_logits), otherwise those two
  k3fuse::fused_residual_norm  at M = 1 without an all-reduce one launch (the projection, a grid barrier, the mix-norm:
                               fused_residual_norm.one_kernel_reason); else the o_proj GEMV (or cuBLAS) +
                               [functional all-reduce] + the mix-norm kernel; under TP with
                               K3FUSE_INKERNEL_COLLECTIVES=1 the one-shot in-kernel all-reduce (mixnorm_allreduce.py)
  k3fuse::all_gather           with K3FUSE_INKERNEL_COLLECTIVES=1 the one-shot in-kernel gather (allgather_oneshot.py)
  k3fuse::topk_from_logits, router_logits, router_topk   unless K3FUSE_ROUTER_TOPK=0: the router top-k kernel
                               after the logits: the fp32-output simt GEMV at M <= 4 (K3FUSE_ROUTER_GEMV=0: cuBLAS),
                               else a bf16 -> fp32 cuBLAS GEMM (router_topk.py)
  k3fuse::prefetch_l2          bulk L2 prefetch on a side stream
  k3fuse::kda_recurrent, kda_decode, kda_decode_, mla_attention, mla_append_attention_, mla_qb_append_attention_,
  moe_experts                  (kda_recurrent.py, mla_attention.py, moe_experts.py; kda_decode = the recurrence kernel
                               with conv, f_b and gated norm inside, kda_decode_ = the same writing the states in
                               place; mla_append_attention_ = the MLA kernel writing the new cache row first and
                               applying the output gate last; mla_qb_append_attention_ = the per-head one computing q
                               too, else the q_b GEMV and mla_append_attention_'s kernels)
and, where compiler/ops.py defines them, the fused GEMVs k3fuse::rms_norm_linear (pass fuse_rms_norm_into_linear),
k3fuse::linear_situ_glu and k3fuse::rms_norm_linear_situ_glu (RMSNorm prologue / SiTU-GLU epilogue; see
OPTIONAL_IMPLS); KERNEL_APPLIES tells the lowering where their kernels exist (M <= 4).
Every fallback logs ONE line per (op, reason) on the "k3fuse.codegen" logger, at INFO level... the first time.
Kernels compile (or load from the disk cache) at their first call: run each bucket once before capturing a
CUDA graph, and call k3fuse.codegen.prefetch.join_pending() before ending a capture.
"""
from __future__ import annotations

import logging
import threading

from . import streams
from .buckets import MAX_M
from . import knobs

log = logging.getLogger("k3fuse.codegen")

_registered = False
_seen: set = set()
_seen_lock = threading.Lock()


def log_fallback(op: str, reason: str) -> None:
    """Log once per (op, reason) that `op` takes the unfused path."""
    key = (op, reason)
    with _seen_lock:
        if key in _seen:
            return
        _seen.add(key)
    log.info("k3fuse: %s takes the unfused path: %s", op, reason)


def _dsl_available() -> bool:
    try:
        import cutlass.cute  # noqa: F401
        return True
    except Exception:
        return False


_DSL = None


def _env_ok(op: str, device) -> bool:
    global _DSL
    if getattr(device, "type", "cuda") != "cuda":
        log_fallback(op, f"tensor on {device}, not CUDA")
        return False
    if _DSL is None:
        _DSL = _dsl_available()
    if not _DSL:
        log_fallback(op, "nvidia-cutlass-dsl is not importable")
        return False
    import torch
    major, _ = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        log_fallback(op, f"no kernels for compute capability {major}.x (sm_90a / sm_100a only)")
        return False
    return True


def _ref(op_name):
    from k3fuse import ops
    return getattr(ops, op_name)._init_fn


# ---------------------------------------------------------------------------------------------------- linear
def linear_cuda(x, weight):
    import torch
    from . import gemv
    from .prefetch import join_pending
    K = x.shape[-1]
    N = weight.shape[0]
    M = x.numel() // K if K else 0
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        log_fallback("k3fuse::linear", f"dtype {x.dtype}/{weight.dtype} (kernels are bf16)")
        return _ref("linear")(x, weight)
    reason = None
    if M > MAX_M or M < 1:
        reason = f"M={M} > {MAX_M}" if M > MAX_M else "empty input"
    elif not weight.is_contiguous():
        reason = "weight not contiguous"
    elif not _env_ok("k3fuse::linear", x.device):
        return torch.nn.functional.linear(x, weight)
    cfg = None
    if reason is None:
        cfg, reason = gemv.route(N, K, M)
    if cfg is None:
        log_fallback("k3fuse::linear", f"{N}x{K}: {reason}")
        return torch.nn.functional.linear(x, weight)
    if weight.data_ptr() % 16:
        log_fallback("k3fuse::linear", "weight not 16-byte aligned")
        return torch.nn.functional.linear(x, weight)
    join_pending()
    x2 = x.reshape(M, K)
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.clone(memory_format=torch.contiguous_format)   # a fresh allocation is 16-byte aligned
    y = gemv.linear(x2, weight, cfg)
    return y.reshape(*x.shape[:-1], N)


# ------------------------------------------------------------------------------------------- linear_group
def grouped_gemv_enabled() -> bool:
    """On by default since it was timed on the H200 (RESULTS.md, session 3: the KDA TP16 group 28.7 -> 13.5 us);
    K3FUSE_GROUPED_GEMV=0 launches one k3fuse::linear per weight instead."""
    return knobs.env("K3FUSE_GROUPED_GEMV") != "0"


def _concurrent_fns(x, weights, situ_member: int = -1, beta=None, linear_beta=None, router_weight=None):
    """The group's GEMMs as callables for streams.run_concurrently (each member through k3fuse::linear's CUDA path,
    the SiTU member with its reference SiTU-GLU after it, the router's fp32 logits last), where K3FUSE_GROUP_STREAMS
    (streams.group_streams_min) takes a group of this many GEMMs and every member goes to the library at this M (the
    tuning table's cuBLAS buckets) or to the wgmma variant (_not_concurrent); else None. Also the lowering's reason to
    keep the group ops whole there (on fake tensors: shapes and devices only)."""
    import torch
    from . import gemv
    least = streams.group_streams_min()
    if not least or getattr(x.device, "type", "") != "cuda":
        return None
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    ws = list(weights) + ([router_weight] if router_weight is not None else [])
    if not isinstance(M, int) or not 1 <= M <= MAX_M or len(ws) < least or x.dtype != torch.bfloat16:
        return None
    if any(w.dtype != torch.bfloat16 or w.dim() != 2 or _not_concurrent(gemv.route(w.shape[0], K, M)[0])
           for w in weights):
        return None
    fns = [(lambda w=w: linear_cuda(x, w)) for w in weights]
    if situ_member >= 0:
        lin = fns[situ_member]
        fns[situ_member] = lambda: _ref("situ_glu")(lin(), beta, linear_beta)
    if router_weight is not None:
        fns.append(lambda: torch.ops.k3fuse.router_logits(x, router_weight))
    return fns


def _not_concurrent(cfg) -> bool:
    """A member whose route is a generated GEMV kernel sized for the whole GPU; cuBLAS (None) and the wgmma variant
    (a table entry or K3FUSE_GEMV_WGMMA: grids of ~1 wave or less at K3's small shapes) run concurrently on side
    streams."""
    return cfg is not None and cfg["variant"] != "wgmma"


def _group_concurrently(x, fns, sizes):
    """streams.run_concurrently over the group's callables (in member order), the largest GEMM (sizes: weight
    elements per callable) on the current stream, launched after the small ones are already running on the side
    streams. Returns the results in member order."""
    from .prefetch import join_pending
    join_pending()
    big = max(range(len(fns)), key=lambda i: sizes[i])
    order = [big] + [i for i in range(len(fns)) if i != big]
    outs = streams.run_concurrently(x.device, [fns[i] for i in order])
    res = [None] * len(fns)
    for i, o in zip(order, outs):
        res[i] = o
    return res


def linear_group_cuda(x, weights):
    import torch
    from . import gemv
    from .prefetch import join_pending
    op = "k3fuse::linear_group"
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    reason = None
    if not grouped_gemv_enabled():
        reason = "K3FUSE_GROUPED_GEMV=0 (one k3fuse::linear per weight)"
    elif x.dtype != torch.bfloat16 or any(w.dtype != torch.bfloat16 for w in weights):
        reason = f"dtype {x.dtype}/{sorted({str(w.dtype) for w in weights})} (kernels are bf16)"
    elif not 1 <= M <= MAX_M:
        reason = f"M={M} outside 1..{MAX_M}"
    elif any(not w.is_contiguous() or w.data_ptr() % 16 or w.dim() != 2 for w in weights):
        reason = "a weight not contiguous, 2-D and 16-byte aligned"
    elif not _env_ok(op, x.device):
        reason = "no kernel environment"
    cfg = None
    if reason is None:
        cfg, why = gemv.group_route([w.shape[0] for w in weights], K, M)
        if cfg is None:
            reason = f"{[w.shape[0] for w in weights]}x{K}: {why}"
    if reason is not None:
        log_fallback(op, reason)
        fns = _concurrent_fns(x, weights) if grouped_gemv_enabled() else None
        if fns is not None:
            return _group_concurrently(x, fns, [w.numel() for w in weights])
        return [linear_cuda(x, w) for w in weights]
    join_pending()
    x2 = x.reshape(M, K)
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.clone(memory_format=torch.contiguous_format)
    ys = gemv.linear_group(x2, list(weights), cfg)
    return [y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys]


def _fused_group_checks(op, cfg, reason, x, ws):
    """(cfg, reason) after the checks the fused group ops make on top of their route: bf16 operands, contiguous 2-D
    16-byte aligned weights, a kernel environment (which logs its own reason: None)."""
    import torch
    if cfg is not None and (x.dtype != torch.bfloat16 or any(w.dtype != torch.bfloat16 for w in ws)):
        return None, "dtypes (kernels are bf16)"
    if cfg is not None and any(not w.is_contiguous() or w.data_ptr() % 16 or w.dim() != 2 for w in ws):
        return None, "a weight not contiguous, 2-D and 16-byte aligned"
    if cfg is not None and not _env_ok(op, x.device):
        return None, None
    return cfg, reason


def _rows_2d(x):
    """x as contiguous, 16-byte aligned [M, K] rows (a fresh allocation is aligned)."""
    import torch
    K = x.shape[-1]
    x2 = x.reshape(x.numel() // K, K)
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.clone(memory_format=torch.contiguous_format)
    return x2


def _group_situ_cfg(x, weights, situ_member):
    """(config, "") where the grouped kernel with the SiTU-GLU epilogue runs for these shapes, else (None, why)."""
    from . import gemv
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    Ns = [w.shape[0] for w in weights]
    if not grouped_gemv_enabled():
        return None, "K3FUSE_GROUPED_GEMV=0"
    if not isinstance(M, int) or not 1 <= M <= MAX_M:
        return None, f"M={M} outside 1..{MAX_M}"
    return gemv.group_situ_route(Ns, K, M, (situ_member,))


def _linear_group_situ_applies(x, weights, situ_member, beta, linear_beta) -> bool:
    """Where not (the mma buckets, from M = 3-4 on the H200), the lowering inlines linear_group + situ_glu; kept whole
    where the group's GEMMs run concurrently (_concurrent_fns), so the SiTU member's epilogue runs on its stream."""
    return (_group_situ_cfg(x, weights, situ_member)[0] is not None
            or _concurrent_fns(x, weights, situ_member) is not None)


def linear_group_situ_cuda(x, weights, situ_member, beta, linear_beta):
    from . import gemv
    from .prefetch import join_pending
    op = "k3fuse::linear_group_situ"
    cfg, reason = _fused_group_checks(op, *_group_situ_cfg(x, weights, situ_member), x, weights)
    if cfg is None:
        if reason:
            log_fallback(op, reason)
        fns = _concurrent_fns(x, weights, situ_member, beta, linear_beta)
        if fns is not None:
            return _group_concurrently(x, fns, [w.numel() for w in weights])
        outs = linear_group_cuda(x, weights)
        outs[situ_member] = _ref("situ_glu")(outs[situ_member], beta, linear_beta)
        return outs
    join_pending()
    ys = gemv.linear_group(_rows_2d(x), list(weights), cfg, situ=((situ_member,), beta, linear_beta))
    return [y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys]


# ------------------------------------------------------------------------------------------- linear_group_router
def router_topk_enabled() -> bool:
    """The router kernels (router_topk.IMPLS) are registered unless K3FUSE_ROUTER_TOPK=0 (the ATen path)."""
    return knobs.env("K3FUSE_ROUTER_TOPK") != "0"


def _router_in_group_ok():
    """None where the router may run inside the group; else which switch keeps it on its own path."""
    from .router_topk import router_gemv_enabled
    if not router_topk_enabled():
        return "K3FUSE_ROUTER_TOPK=0"
    if not router_gemv_enabled():
        return "K3FUSE_ROUTER_GEMV=0"
    return None if grouped_gemv_enabled() else "K3FUSE_GROUPED_GEMV=0"


def _group_router_cfg(x, weights, router_weight, situ_member):
    """(config, "") where the grouped kernel with the router's fp32 member runs for these shapes, else (None, why)."""
    from . import gemv
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    why = _router_in_group_ok()
    if why:
        return None, why
    if not isinstance(M, int) or not 1 <= M <= MAX_M:
        return None, f"M={M} outside 1..{MAX_M}"
    Ns = [w.shape[0] for w in weights] + [router_weight.shape[0]]
    return gemv.group_router_route(Ns, K, M, (situ_member,) if situ_member >= 0 else ())


def _linear_group_router_applies(x, weights, router_weight, situ_member, beta, linear_beta) -> bool:
    """Where not (the mma buckets, from M = 3-4 on the H200), the lowering inlines the group op + router_logits; kept
    whole where the group's GEMMs and the router's run concurrently (_concurrent_fns)."""
    return (_group_router_cfg(x, weights, router_weight, situ_member)[0] is not None
            or _concurrent_fns(x, weights, situ_member, router_weight=router_weight) is not None)


def linear_group_router_cuda(x, weights, router_weight, situ_member, beta, linear_beta):
    import torch
    from . import gemv
    from .prefetch import join_pending
    op = "k3fuse::linear_group_router"
    ws = list(weights) + [router_weight]
    cfg, reason = _fused_group_checks(op, *_group_router_cfg(x, weights, router_weight, situ_member), x, ws)
    if cfg is None:
        if reason:
            log_fallback(op, reason)
        fns = _concurrent_fns(x, weights, situ_member, beta, linear_beta, router_weight)
        if fns is not None:
            return _group_concurrently(x, fns, [w.numel() for w in ws])
        if situ_member >= 0:
            outs = linear_group_situ_cuda(x, weights, situ_member, beta, linear_beta)
        else:
            outs = linear_group_cuda(x, weights)
        # the dispatcher picks the router's own CUDA impl, or its reference under K3FUSE_ROUTER_TOPK=0
        return outs + [torch.ops.k3fuse.router_logits(x, router_weight)]
    join_pending()
    situ = ((situ_member,), beta, linear_beta) if situ_member >= 0 else None
    ys = gemv.linear_group(_rows_2d(x), ws, cfg, situ=situ, f32=(len(weights),))
    return [y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys[:-1]] + [ys[-1]]


# ------------------------------------------------------------------------------------ linear_group_router_topk
def topk_in_group_enabled() -> bool:
    """K3FUSE_TOPK_IN_GROUP (default 1 since session 10; =0: the group, then the top-k kernel, at every M):
    linear_group_router_topk takes the router's selection in the grouped GEMV's last CTA (one launch) where the
    group's config has TOPK_IN_GROUP_MIN_THREADS. Read at lowering (KERNEL_APPLIES) and at launch: fixed per
    process."""
    return knobs.env("K3FUSE_TOPK_IN_GROUP") != "0"


def router_first() -> bool:
    """K3FUSE_ROUTER_FIRST (default 1; =0: the router member last, as before session 13): linear_group_router_topk
    launches the router as the group's first member. Only the router's CTAs count in for the selection, so with
    its CTAs first in the grid (dispatched in the first wave) the selection runs while the other members' CTAs
    still stream their weights, instead of after the whole grid. Read at every launch."""
    return knobs.env("K3FUSE_ROUTER_FIRST") != "0"


def router_topk_members(n: int, situ_member: int) -> tuple[int, int, int]:
    """The member order linear_group_router_topk launches (router_first()) for n weights + the router:
    (the router's member index, the first weight's index, the SiTU member's index or -1). `k3fuse kernels`
    renders the same order."""
    j, off = (0, 1) if router_first() else (n, 0)
    return j, off, situ_member + off if situ_member >= 0 else -1


# The last CTA selects with the group config's threads. Measured on the H200 (2026-12-01, session 10,
# validate_pending.sh topk_in_group, layer A/B twice, TP16): at M = 1 (R4 W8, 256 threads, like the standalone
# top-k kernel) the same kernel time per layer (KDA 93.0 / 94.7 vs 93.0 / 94.0 us) with one launch fewer; at M = 2
# (R4 W2, 64 threads) the group grew by 37 us (KDA 127 -> 157 us of kernel time). So only from 256 threads.
TOPK_IN_GROUP_MIN_THREADS = 256


def _group_router_topk_cfg(x, weights, router_weight, bias, top_k, situ_member):
    """(config, "") where the grouped kernel takes the router's selection in its last CTA, else (None, why)."""
    from . import gemv
    from .router_topk import supports as topk_supports
    if not topk_in_group_enabled():
        return None, "K3FUSE_TOPK_IN_GROUP=0 (the group, then the top-k kernel)"
    cfg, why = _group_router_cfg(x, weights, router_weight, situ_member)
    if cfg is None:
        return None, why
    if 32 * cfg.get("W", 0) < TOPK_IN_GROUP_MIN_THREADS:
        return None, (f"the group's config has {32 * cfg.get('W', 0)} threads per CTA (the last-CTA selection "
                      f"from {TOPK_IN_GROUP_MIN_THREADS})")
    j, E = len(weights), router_weight.shape[0]
    why = (gemv.group_topk_supports([w.shape[0] for w in weights] + [E], cfg, (j,), (j, top_k))
           or topk_supports(E, top_k) or (None if bias.numel() == E else f"bias of {bias.numel()} for {E} experts"))
    return (None, why) if why else (cfg, "")


def _linear_group_router_topk_applies(x, weights, router_weight, bias, top_k, renormalize, scale, situ_member,
                                      beta, linear_beta) -> bool:
    """Where the kernel takes it (the group's simt config with >= TOPK_IN_GROUP_MIN_THREADS: M = 1 on the H200) and
    K3FUSE_TOPK_IN_GROUP is not 0; elsewhere the lowering splits the op into linear_group_router + topk_from_logits
    (and those further where their kernels do not apply)."""
    return _group_router_topk_cfg(x, weights, router_weight, bias, top_k, situ_member)[0] is not None


def linear_group_router_topk_cuda(x, weights, router_weight, bias, top_k, renormalize, scale, situ_member, beta,
                                  linear_beta):
    import torch
    from . import gemv
    from .prefetch import join_pending
    from .router_topk import bias_fp32
    op = "k3fuse::linear_group_router_topk"
    ws = list(weights) + [router_weight]
    cfg, reason = _fused_group_checks(op, *_group_router_topk_cfg(x, weights, router_weight, bias, top_k,
                                                                  situ_member), x, ws)
    if cfg is not None and bias.device != x.device:
        cfg, reason = None, "bias not on x's device"
    if cfg is None:
        if reason:
            log_fallback(op, reason)
        outs = linear_group_router_cuda(x, weights, router_weight, situ_member, beta, linear_beta)
        # the dispatcher picks the top-k kernel, or its reference under K3FUSE_ROUTER_TOPK=0
        return outs[:-1] + list(torch.ops.k3fuse.topk_from_logits(outs[-1], bias, top_k, renormalize, scale))
    join_pending()
    n = len(weights)
    j, off, si = router_topk_members(n, situ_member)
    ws = list(weights)
    ws.insert(j, router_weight)
    situ = ((si,), beta, linear_beta) if si >= 0 else None
    ys = gemv.linear_group(_rows_2d(x), ws, cfg, situ=situ, f32=(j,), topk=(j, top_k, renormalize, scale),
                           bias=bias_fp32(bias))
    return [y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys[off:off + n]] + ys[n + 1:]


# ------------------------------------------------------------------------------------- fused_residual_norm
def fused_residual_norm_cuda(o, w_o, addend, prefix, blocks, w_mix, norm_w, mix_eps, norm_eps, group_name,
                             fp32_norm, addend_partial=False, w_mix_scale=None):
    from . import fused_residual_norm as frn
    from .prefetch import join_pending
    op = "k3fuse::fused_residual_norm"
    M = o.shape[0]
    if w_mix_scale is not None and not frn.pair_ok(w_mix, w_mix_scale, w_o.shape[0]):
        w_mix, w_mix_scale = w_mix.float() * w_mix_scale.float(), None     # the kernel takes the product
    if group_name:
        # the in-kernel one-shot all-reduce over peer buffers (opt-in: K3FUSE_INKERNEL_COLLECTIVES=1; the same
        # answer on every rank, see peer_buffers.resolve); None leaves the functional path below
        from .mixnorm_allreduce import fused_residual_norm_ar_or_none
        join_pending()
        r = fused_residual_norm_ar_or_none(o, w_o, addend, prefix, blocks, w_mix, norm_w, mix_eps, norm_eps,
                                           group_name, fp32_norm, addend_partial, w_mix_scale)
        if r is not None:
            return r
    reason = None
    if o.dim() != 2:
        reason = "o is not 2-D"
    elif M == 0:
        reason = "empty batch"
    elif M > MAX_M:
        reason = f"M={M} > {MAX_M}"
    else:
        reason = frn.launch_ok(o, w_o, addend, prefix, blocks, norm_w)
    if reason is None and not _env_ok(op, o.device):
        reason = "no kernel environment"
    if reason is not None:
        log_fallback(op, reason)
        return _ref("fused_residual_norm")(o, w_o, addend, prefix, blocks, w_mix, norm_w, mix_eps, norm_eps,
                                           group_name, fp32_norm, addend_partial, w_mix_scale)
    join_pending()
    return frn.fused_residual_norm(o, w_o, addend, prefix, blocks, w_mix, norm_w, mix_eps, norm_eps, group_name,
                                   fp32_norm, addend_partial=addend_partial, w_mix_scale=w_mix_scale)


# ------------------------------------------------------------------------------------------------ all_gather
def all_gather_cuda(x, group_size, group_name):
    """The in-kernel one-shot gather (opt-in: K3FUSE_INKERNEL_COLLECTIVES=1), else the functional collective."""
    from .allgather_oneshot import all_gather_cuda_or_none
    from .prefetch import join_pending
    join_pending()
    r = all_gather_cuda_or_none(x, group_name, group_size)
    return r if r is not None else _ref("all_gather")(x, group_size, group_name)


# ------------------------------------------------------------------------------------------------ prefetch
def prefetch_l2_cuda(token, weights, budget_bytes):
    from . import prefetch
    if not weights or not _env_ok("k3fuse::prefetch_l2", weights[0].device):
        return None
    prefetch.prefetch_l2(token, weights, budget_bytes)
    return None


# ------------------------------------------------------------------ fused GEMVs
# Signatures (rms_norm_linear is in compiler/ops.py, pass fuse_rms_norm_into_linear; the other two are registered
# once ops.py defines them):
#   k3fuse::rms_norm_linear(x, norm_w, eps, weight)                 = linear(rms_norm(x, norm_w, eps, bf16), weight)
#   k3fuse::linear_situ_glu(x, weight, beta, linear_beta)           = situ_glu(linear(x, weight), beta, linear_beta)
#   k3fuse::rms_norm_linear_situ_glu(x, norm_w, eps, weight, beta, linear_beta)
FUSED_MAX_M = 4   # the fused kernels are simt-only; the plain mma GEMV wins from M = 4-8 (RESULTS.md)


def _fused_gemv(op, x, weight, norm_w, eps, act, beta, lbeta):
    import torch
    from . import gemv
    from .prefetch import join_pending
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    reason = None
    if weight.dtype != torch.bfloat16 or x.dtype not in (torch.bfloat16, torch.float32) or \
            (norm_w is None and x.dtype != torch.bfloat16) or (norm_w is not None and norm_w.dtype != torch.bfloat16):
        reason = f"dtypes x {x.dtype}, weight {weight.dtype}"
    elif not 1 <= M <= FUSED_MAX_M:
        reason = f"M={M} outside 1..{FUSED_MAX_M} (fused kernels are CUDA-core only)"
    elif K % 8 or not weight.is_contiguous() or weight.data_ptr() % 16 or \
            (norm_w is not None and (not norm_w.is_contiguous() or norm_w.data_ptr() % 16)):
        reason = "layout (K % 8, contiguity or 16-byte alignment)"
    elif act == "situ" and weight.shape[0] % 2:
        reason = "odd N for [gate; up]"
    if reason is None and not _env_ok(op, x.device):
        reason = "no kernel environment"
    if reason is None:
        join_pending()
        x2 = x.reshape(M, K).contiguous()
        y = gemv.linear_fused(x2, weight, norm_w, eps, act, beta, lbeta)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    log_fallback(op, reason)
    h = _ref("rms_norm")(x, norm_w, eps, weight.dtype) if norm_w is not None else x
    y = linear_cuda(h, weight)
    return _ref("situ_glu")(y, beta, lbeta) if act == "situ" else y


def rms_norm_linear_cuda(x, norm_w, eps, weight):
    # where the lowering would have inlined the op (inner compiler "eager" has no lowering): the parts, as there
    if not _rms_norm_linear_applies(x, norm_w, eps, weight):
        log_fallback("k3fuse::rms_norm_linear", "outside KERNEL_APPLIES (M > 4, or a weight over the size limit)")
        return linear_cuda(_ref("rms_norm")(x, norm_w, eps, weight.dtype), weight)
    return _fused_gemv("k3fuse::rms_norm_linear", x, weight, norm_w, eps, "none", 4.0, 25.0)


def linear_situ_glu_cuda(x, weight, beta, linear_beta):
    return _fused_gemv("k3fuse::linear_situ_glu", x, weight, None, 1e-5, "situ", beta, linear_beta)


def rms_norm_linear_situ_glu_cuda(x, norm_w, eps, weight, beta, linear_beta):
    return _fused_gemv("k3fuse::rms_norm_linear_situ_glu", x, weight, norm_w, eps, "situ", beta, linear_beta)


# The fused RMSNorm GEMV, measured on the H200 at M = 1 (RESULTS.md, session 5), when the norm was a prologue (a
# block reduction over x in every CTA before its weight loads): MLA's q_b (1152 x 1536, 3.5 MB) 3.4 us fused = 3.4 us
# plain; the routed up projection (7168 x 3584, 51 MB) 15.8-19.5 us fused against 13.0-13.2 plain, a loss larger
# than the norm kernel it removes (1.9 us). Session 8 moved the per-row scale into the epilogue (templates/
# gemv_simt.py.jinja): the main loop is the plain one. The routed up (51 MB, fp32 x) then ran 16.7 us fused with the
# plain table's config against 14.5-14.7 plain + a 2.3 us norm kernel and a break in the PDL chain; in the layer (A/B
# twice in one call, session 8) KDA TP16 M = 2 139 / 138 -> 132 / 131 us, MLA M = 1 142 / 133 -> 129 / 129; with its
# own table entry (gemv_norm, R4 W2) 13.9 us. So every K3 weight behind a norm is fused now (the largest is that 51 MB
# one). K3FUSE_NORM_LINEAR_MAX_MB=16 restores the old limit (for A/B runs).
NORM_LINEAR_MAX_WEIGHT_BYTES = int(float(knobs.env("K3FUSE_NORM_LINEAR_MAX_MB")) * 2**20)


def rms_norm_linear_split_reason(M: int, weight_bytes: int, shape=None, gpu=None):
    """None where the fused RMSNorm GEMV runs, else why the op is split back into rms_norm + linear: the fused
    GEMVs exist for 1 <= M <= FUSED_MAX_M (simt only), weights are bounded by NORM_LINEAR_MAX_WEIGHT_BYTES, and the
    GPU's tuning table may split a shape (family gemv.NORM_FAMILY). Also the `k3fuse kernels` plan's reason."""
    if not 1 <= M <= FUSED_MAX_M:
        return f"M = {M} outside 1..{FUSED_MAX_M}: split back into rms_norm + linear"
    if weight_bytes > NORM_LINEAR_MAX_WEIGHT_BYTES:
        return f"weight over {NORM_LINEAR_MAX_WEIGHT_BYTES >> 20} MiB: split back (K3FUSE_NORM_LINEAR_MAX_MB)"
    if shape is not None:
        from . import gemv, tuning
        from .buckets import bucket_for
        t = tuning.lookup(gemv.NORM_FAMILY, tuple(shape), bucket_for(M), gpu)
        if t is not None and t.get("variant") == "torch":
            return f"tuning table: norm kernel + plain GEMV faster for {shape[0]}x{shape[1]} at bucket {bucket_for(M)}"
    return None


def _rms_norm_linear_applies(x, norm_w, eps, weight) -> bool:
    """Where not, the lowering inlines the op's reference, rms_norm (Inductor fuses it) + linear (the tuned GEMV),
    and rms_norm_linear_cuda runs those two parts."""
    M = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return isinstance(M, int) and rms_norm_linear_split_reason(M, weight.numel() * weight.element_size(),
                                                                tuple(weight.shape)) is None


KERNEL_APPLIES = {"rms_norm_linear": _rms_norm_linear_applies, "linear_group_situ": _linear_group_situ_applies,
                  "linear_group_router": _linear_group_router_applies,
                  "linear_group_router_topk": _linear_group_router_topk_applies}


OPTIONAL_IMPLS = {
    "k3fuse::rms_norm_linear": rms_norm_linear_cuda,
    "k3fuse::linear_situ_glu": linear_situ_glu_cuda,
    "k3fuse::rms_norm_linear_situ_glu": rms_norm_linear_situ_glu_cuda,
}


IMPLS = {
    "k3fuse::linear": linear_cuda,
    "k3fuse::linear_group": linear_group_cuda,
    "k3fuse::linear_group_situ": linear_group_situ_cuda,
    "k3fuse::linear_group_router": linear_group_router_cuda,
    "k3fuse::linear_group_router_topk": linear_group_router_topk_cuda,
    "k3fuse::fused_residual_norm": fused_residual_norm_cuda,
    "k3fuse::prefetch_l2": prefetch_l2_cuda,
    "k3fuse::side_linear_situ": streams.side_linear_situ_cuda,
    "k3fuse::stream_join": streams.stream_join_cuda,
    "k3fuse::all_gather": all_gather_cuda,
}


def register() -> bool:
    """Register the CUDA implementations (once). Returns whether they are registered."""
    global _registered
    if _registered:
        return True
    if knobs.env("K3FUSE_KERNELS") == "0":
        return False
    import torch
    import k3fuse.ops  # noqa: F401  (defines the ops)
    from .kda_recurrent import IMPLS as kda
    from .mla_attention import APPLIES as mla_applies
    from .mla_attention import IMPLS as mla
    from .moe_experts import IMPLS as moe
    impls = {**IMPLS, **kda, **mla, **moe}
    if router_topk_enabled():      # on since it ran on the H200; =0: the ATen path
        from .router_topk import IMPLS as topk
        impls.update(topk)
    # OPTIONAL_IMPLS: registered once compiler/ops.py defines those ops
    impls.update({n: f for n, f in OPTIONAL_IMPLS.items() if hasattr(torch.ops.k3fuse, n.split("::")[1])})
    # where a fused op's kernel does not cover a graph's shapes, the lowering splits it back before Inductor
    from k3fuse import lowering
    lowering.KERNEL_APPLIES.update(KERNEL_APPLIES)
    lowering.KERNEL_APPLIES.update(mla_applies)
    # K3FUSE_DISABLE_KERNELS=kda_recurrent,moe_experts keeps those ops on the unfused path (to bisect a layer)
    off = {s.strip() for s in knobs.env("K3FUSE_DISABLE_KERNELS").split(",") if s.strip()}
    for name, fn in impls.items():
        if name.split("::")[1] in off:
            log_fallback(name, "disabled by K3FUSE_DISABLE_KERNELS")
        else:
            torch.library.register_kernel(name, "cuda", fn)
    _registered = True
    return True
