"""Kernel family: k3fuse::fused_residual_norm (o_proj + [all-reduce] + AttnRes prefix update + mix + RMSNorm).

At M = 1 (M <= 4 with K3FUSE_FRN_ONE_MAX_M=4) without a group (one_kernel_reason() is None): ONE launch, templates/fused_residual_norm_onekernel.py.jinja
(the projection, then a grid barrier, then the mix-norm of y in the same CTAs). Otherwise two launches on the
current stream:
  1. the o_proj GEMV (family gemv; tuned per shape and bucket, or cuBLAS where the table says it is faster),
  2. the mix-norm kernel (templates/fused_residual_norm_mixnorm.py.jinja), a cluster of CTAs per batch row.
The all-reduce (group_name != "") is not generated yet: at TP > 1 it runs as the functional collective between
the two launches. The mix-norm kernel is written so that its single load of the GEMV output is the place where a
one-shot in-kernel all-reduce goes (see the template's docstring).
"""
from __future__ import annotations

import collections
import functools
from typing import Optional

from .buckets import bucket_for
from .render import render
from . import knobs

FAMILY = "fused_residual_norm"
TEMPLATE = "fused_residual_norm_mixnorm.py.jinja"
MAX_BLOCKS = 8


def mixnorm_cluster() -> int:
    """K3FUSE_MIXNORM_CLUSTER=C (1..8, default 8): the mix-norm kernel runs each row on a cluster of C CTAs, its
    reductions summed over distributed shared memory, so C SMs load the row's source rows (one SM's load bandwidth
    bounded the one-CTA kernel, C = 1). Measured on the H200 (session 9, benchmarks/mixnorm_bench.py, M = 1):
    3.96 -> 3.02 us at 3 blocks, 8.76 -> 3.74 us at 8; the layer 0.4-3 us faster than C = 1. Read when a kernel is
    rendered (and part of build_mix_norm's memo key)."""
    c = knobs.integer("K3FUSE_MIXNORM_CLUSTER", 8)
    if not 1 <= c <= 8:
        raise ValueError(f"K3FUSE_MIXNORM_CLUSTER={c}: a cluster of 1..8 CTAs")
    return c


def mixnorm_push() -> bool:
    """K3FUSE_MIXNORM_PUSH (default 1): the cluster variant's two gathers of the CTAs' totals by st.async into every
    peer's shared memory, completing on its mbarriers (one relaxed cluster barrier for their init); 0:
    ld.shared::cluster between three cluster barriers (each arrive a MEMBAR.ALL.GPU in the SASS). The sums keep
    their rank order: bitwise the same. H200 paired A/Bs (PERF_NOTES "Session 27"): TP16 M = 2 KDA -0.71 us, MLA
    -1.42, M = 8 KDA -0.78. Read when a kernel is rendered, like mixnorm_cluster() (also in the memo key)."""
    return knobs.env("K3FUSE_MIXNORM_PUSH") != "0"


def cluster_for(H: int, has_norm: bool, cl: int) -> int:
    """The cluster size the kernel gets: cl where it divides the row's vectors and the norm is fused (the cluster
    variant's last barrier pairs with the norm's reduction), else 1."""
    return cl if cl > 1 and has_norm and (H // 8) % cl == 0 else 1


def mixnorm_params(H: int, nb: int, has_addend: bool, has_prefix: bool, has_norm: bool, fp32_norm: bool,
                   mix_eps: float, norm_eps: float, wm_pair: bool = False, cl: int = 1, push: bool = False) -> dict:
    hv = H // 8
    cl = cluster_for(H, has_norm, cl)
    hvc = hv // cl                  # vectors per CTA
    threads = min(1024, -(-hvc // 32) * 32)
    vpt = -(-hvc // threads)
    p = dict(H=H, NB=nb, HAS_ADDEND=bool(has_addend), HAS_PREFIX=bool(has_prefix), HAS_NORM=bool(has_norm),
             FP32_NORM=bool(fp32_norm), MIX_EPS=repr(float(mix_eps)), NORM_EPS=repr(float(norm_eps)),
             THREADS=threads, VPT=vpt, PRED_V=hvc % threads != 0, ALLREDUCE=False)
    if wm_pair:     # only when set, so that the other kernels' sources and cache keys stay as they were
        p["WM_PAIR"] = True
    if cl > 1:      # likewise
        p.update(CL=cl, HVC=hvc)
        if push:
            p["PUSH"] = True
    return p


def supports(H: int, nb: int) -> Optional[str]:
    if H % 8:
        return f"H={H} is not a multiple of 8"
    if nb > MAX_BLOCKS:
        return f"{nb} blocks > {MAX_BLOCKS}"
    return None


def pair_ok(w_mix, w_mix_scale, H: int) -> bool:
    """The kernel forms w_mix * w_mix_scale itself (WM_PAIR) from two contiguous, 16-byte aligned bf16 [H]
    vectors (AttnRes's res_norm.weight and res_proj.weight viewed [H])."""
    import torch
    return all(t.dtype == torch.bfloat16 and t.numel() == H and t.is_contiguous() and t.data_ptr() % 16 == 0
               for t in (w_mix, w_mix_scale))


def render_mixnorm(H, nb, has_addend, has_prefix, has_norm, fp32_norm, mix_eps, norm_eps, wm_pair=False) -> str:
    why = supports(H, nb)
    if why:
        raise ValueError(why)
    return render(TEMPLATE, **mixnorm_params(H, nb, has_addend, has_prefix, has_norm, fp32_norm, mix_eps, norm_eps,
                                             wm_pair, cl=mixnorm_cluster(), push=mixnorm_push()))


_built: dict = {}


def build_mix_norm(H, nb, has_addend=False, has_prefix=True, has_norm=True, fp32_norm=False, mix_eps=1e-5,
                   norm_eps=1e-5, arch: Optional[str] = None, load: bool = True, wm_pair: bool = False):
    from .compile import compile_source, current_arch
    arch = arch or current_arch()
    memo = (H, nb, bool(has_addend), bool(has_prefix), bool(has_norm), bool(fp32_norm), float(mix_eps),
            float(norm_eps), arch, load, bool(wm_pair), knobs.key(FAMILY))
    if memo in _built:
        return _built[memo]
    src = render_mixnorm(H, nb, has_addend, has_prefix, has_norm, fp32_norm, mix_eps, norm_eps, wm_pair)
    meta = dict(family=FAMILY, op="k3fuse::fused_residual_norm", part="mixnorm", shape=dict(H=H, blocks=nb),
                flags=dict(addend=has_addend, prefix=has_prefix, norm=has_norm, fp32_norm=fp32_norm,
                           wm_pair=bool(wm_pair)),
                template=TEMPLATE)
    _built[memo] = k = compile_source(src, arch, load=load, meta=meta)
    return k


def _rows_ok(t) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0


def launch_ok(o, w_o, addend, prefix, blocks, norm_w) -> Optional[str]:
    import torch
    ts = [o, w_o] + [t for t in (addend, prefix, norm_w) if t is not None] + list(blocks)
    if any(t.dtype != torch.bfloat16 for t in ts):
        return "fused_residual_norm kernel needs bf16 tensors"
    H = w_o.shape[0]
    why = supports(H, len(blocks))
    if why:
        return why
    if not all(_rows_ok(t) for t in [t for t in (addend, prefix) if t is not None] + list(blocks)):
        return "fused_residual_norm kernel needs [M, H] rows with unit stride and 16-byte alignment"
    if norm_w is not None and not (norm_w.is_contiguous() and norm_w.data_ptr() % 16 == 0):
        return "norm weight not contiguous / 16-byte aligned"
    return None


def _score_vectors(w_mix, w_mix_scale, H: int) -> list:
    """The kernels' score-vector operands: both bf16 factors viewed [H] (pair_ok), or w_mix as a contiguous fp32 [H]."""
    import torch
    if w_mix_scale is not None:
        return [w_mix.view(H), w_mix_scale.view(H)]
    return [w_mix if (w_mix.dtype == torch.float32 and w_mix.is_contiguous()) else w_mix.float().contiguous()]


def mix_norm(y, addend, prefix, blocks, w_mix, norm_w, mix_eps, norm_eps, fp32_norm, out=None, new_prefix=None,
             w_mix_scale=None):
    """Launch the mix-norm kernel on y (the o_proj output, [M, H] bf16). Returns (normed, new_prefix).
    With w_mix_scale (pair_ok) the kernel reads both bf16 factors of the score vector and multiplies them."""
    import torch
    M, H = y.shape
    pair = w_mix_scale is not None
    k = build_mix_norm(H, len(blocks), addend is not None, prefix is not None, norm_w is not None, fp32_norm,
                       mix_eps, norm_eps, wm_pair=pair)
    if out is None:
        out = torch.empty(M, H, dtype=torch.bfloat16 if norm_w is not None else torch.float32, device=y.device)
    if new_prefix is None:
        new_prefix = torch.empty(M, H, dtype=torch.bfloat16, device=y.device)
    args = [y] + [t for t in (addend, prefix) if t is not None] + list(blocks) + _score_vectors(w_mix, w_mix_scale, H)
    if norm_w is not None:
        args.append(norm_w)
    k(*args, out, new_prefix)
    return out, new_prefix


# ------------------------------------------------------------------------------------------ one launch, M <= 4
ONE_TEMPLATE = "fused_residual_norm_onekernel.py.jinja"
ONE_G = 128             # CTAs of the one-launch kernel: all resident at once (<= the SMs of an H100 / H200 / B200);
                        # a power of two (the barrier's wrap-safe bit arithmetic)
ONE_W = 8               # warps per CTA
ONE_ACC = 64            # floats per row of an accumulator set (scores + Gram terms: 9 + 45 at 8 blocks)
ONE_MAX_BM = 4          # the largest batch bucket of the one-launch kernel: its rows' statistics (<= 54 each) fit
                        # the 256 threads' final sums; the accumulator sets are sized for it
ONE_ACCT = ONE_ACC * ONE_MAX_BM     # floats per accumulator set, shared by every launch on the device
ONE_MAX_K = 1536        # measured at K = 384 / 768 (TP16), tested at 1536 (TP8); wider (TP <= 4) keeps two launches
ONE_TIMEOUT_MS = 100     # a barrier this late (CTAs not co-resident) is an error, not a hang


def one_spin_ns() -> int:
    """K3FUSE_FRN_SPIN_NS (default 64): the barrier's sleep between polls. Read when a kernel is rendered."""
    return knobs.integer("K3FUSE_FRN_SPIN_NS", 64)


def one_lean_tail() -> bool:
    """K3FUSE_FRN_LEAN_TAIL (default 1 since session 12): the barrier tail without the per-thread gpu-scope fence
    (thread 0's acquire poll + the CTA barrier order the totals' loads, as in cooperative groups' grid sync) and with
    the new prefix stored after the arrival. H200, TP16 M = 1: both one-launch kernels 0.3-0.4 us shorter
    (RESULTS.md "Session 12"); 0 restores session 11's tail. Read when a kernel is rendered."""
    return knobs.env("K3FUSE_FRN_LEAN_TAIL") != "0"


# 1 since session 22 (H200, layer_ab, M = 1: KDA / MLA -1.3 / -1.7 us per layer at TP16, -3.4 / -3.3 at TP8, 10 / 10
# pairs each; the kernel alone 7.48 -> 6.78 us at K = 768, 5.96 -> 5.27 at K = 384; RESULTS.md "Session 22")
PRELOAD_DEFAULT = "1"


def one_preload() -> int:
    """K3FUSE_FRN_PRELOAD (default PRELOAD_DEFAULT): how the one-launch kernel's projection orders its loads. 0: the
    interleaved loop (ptxas issues 5 of a thread's 21 weight loads at K = 768 before its first FMA); 1: every weight
    load first, x staged in shared memory behind a CTA barrier (which holds the FMAs back); 2: every weight load
    first, x loaded after a warp sync. 1 and 2 clamp indices instead of branching at M = 2..4. Read when a kernel is
    rendered."""
    return knobs.integer("K3FUSE_FRN_PRELOAD", int(PRELOAD_DEFAULT))


def one_kernel_enabled() -> bool:
    """K3FUSE_FRN_ONE_KERNEL (default 1): 0 keeps the GEMV + mix-norm kernel pair at M = 1 too."""
    return knobs.env("K3FUSE_FRN_ONE_KERNEL") != "0"


ONE_MAX_M_DEFAULT = 1   # the one launch at M = 2..4 measured slower in the layer (sessions 21, 23; RESULTS.md): opt-in


def one_max_m() -> int:
    """K3FUSE_FRN_ONE_MAX_M (1, 2 or 4; default ONE_MAX_M_DEFAULT): the largest batch that takes the one-launch
    kernel (its bucket's rows share one pass over the weights and one grid barrier). Read at each launch."""
    v = knobs.integer("K3FUSE_FRN_ONE_MAX_M", ONE_MAX_M_DEFAULT)
    if v not in (1, 2, 4):
        raise ValueError(f"K3FUSE_FRN_ONE_MAX_M={v}: 1, 2 or 4 (<= ONE_MAX_BM = {ONE_MAX_BM})")
    return v


def one_kernel_reason(M: int, H: int, K: int, nb: int, has_norm: bool, group_name: str, sms: Optional[int]
                      ) -> Optional[str]:
    """None where the one-launch kernel applies (shapes only), else why the two launches run."""
    if not one_kernel_enabled():
        return "K3FUSE_FRN_ONE_KERNEL=0"
    if M > one_max_m():
        return f"M = {M} > {one_max_m()} (K3FUSE_FRN_ONE_MAX_M)"
    if group_name:
        return "an all-reduce between the GEMV and the mix-norm"
    if not has_norm:
        return "no RMSNorm (the final mix)"
    why = supports(H, nb)
    if why:
        return why
    if H % (ONE_G * ONE_W) or K % 8:
        return f"H = {H} is not {ONE_G} CTAs x {ONE_W} warps x whole rows, or K = {K} not a multiple of 8"
    if K > ONE_MAX_K:
        return f"K = {K} > {ONE_MAX_K} (not measured: 128 CTAs stream the whole projection)"
    if sms is not None and sms < ONE_G:
        return f"{sms} SMs < {ONE_G} CTAs (the grid barrier needs them all resident)"
    return None


def one_params(H, K, nb, has_addend, has_prefix, fp32_norm, mix_eps, norm_eps, wm_pair, bm: int = 1) -> dict:
    if bm not in (1, 2, 4):
        raise ValueError(f"one-launch fused_residual_norm: bucket {bm} (1, 2 or 4)")
    return dict(H=H, K=K, NB=nb, HAS_ADDEND=bool(has_addend), HAS_PREFIX=bool(has_prefix), FP32_NORM=bool(fp32_norm),
                MIX_EPS=repr(float(mix_eps)), NORM_EPS=repr(float(norm_eps)), WM_PAIR=bool(wm_pair), G=ONE_G,
                W=ONE_W, RPW=H // (ONE_G * ONE_W), ITERS=-(-(K // 8) // 32), ACC=ONE_ACC, ACCT=ONE_ACCT, BM=bm,
                TIMEOUT_MS=ONE_TIMEOUT_MS, SPIN_NS=one_spin_ns(), LEAN=one_lean_tail(), PRELOAD=one_preload(),
                **({"STAMPS": True} if stamps_on() else {}))     # absent when off: the same source


def stamps_on() -> bool:
    """K3FUSE_FRN_STAMPS=1 (diagnostic): the one-launch kernel takes an extra int32 [G, 32] buffer into which thread 0
    of each CTA writes its phase timestamps (%globaltimer_lo, %clock); the launcher keeps the last launches' buffers
    in STAMP_BUFS for benchmarks/frn_timeline.py. Read when a kernel is rendered and launched."""
    return knobs.env("K3FUSE_FRN_STAMPS") == "1"


STAMP_BUFS = collections.deque(maxlen=64)   # the stamp buffers of the last launches with stamps, oldest first


def build_one(H, K, nb, has_addend=False, has_prefix=True, fp32_norm=False, mix_eps=1e-5, norm_eps=1e-5,
              wm_pair=False, arch: Optional[str] = None, load: bool = True, bm: int = 1):
    from .compile import compile_source, current_arch
    arch = arch or current_arch()
    memo = ("one", H, K, nb, bool(has_addend), bool(has_prefix), bool(fp32_norm), float(mix_eps), float(norm_eps),
            bool(wm_pair), arch, load, knobs.key(FAMILY), one_spin_ns(), one_lean_tail(), one_preload(), stamps_on(),
            bm)   # bm last: tests
    if memo in _built:
        return _built[memo]
    src = render(ONE_TEMPLATE, **one_params(H, K, nb, has_addend, has_prefix, fp32_norm, mix_eps, norm_eps, wm_pair,
                                            bm))
    meta = dict(family=FAMILY, op="k3fuse::fused_residual_norm", part="one_kernel", shape=dict(H=H, K=K, blocks=nb),
                bucket=bm,
                flags=dict(addend=has_addend, prefix=has_prefix, fp32_norm=fp32_norm, wm_pair=bool(wm_pair)),
                template=ONE_TEMPLATE)
    _built[memo] = k = compile_source(src, arch, load=load, meta=meta)
    return k


_one_state: dict = {}


def one_state(device):
    """(accumulators fp32 [2 * ONE_ACCT], counter int32 [2]: arrivals, barrier timeouts) of the device's one-launch
    kernels. Shared by every such launch on the device: they must run one after another (one stream). Other work
    holding SMs only delays the barrier; where another tenant can hold SMs for long (MPS), K3FUSE_FRN_ONE_KERNEL=0."""
    import torch
    st = _one_state.get(device)
    if st is None:
        st = _one_state[device] = (torch.zeros(2 * ONE_ACCT, dtype=torch.float32, device=device),
                                   torch.zeros(2, dtype=torch.int32, device=device))
    return st


def one_kernel_errors(device) -> int:
    """Barrier timeouts of the device's one-launch kernels so far (0 unless CTAs were not co-resident: their outputs
    were wrong). Synchronizes the device."""
    st = _one_state.get(device)
    return 0 if st is None else int(st[1][1].item())


@functools.lru_cache(maxsize=None)
def _sms(device) -> int:
    """The device's SM count (asked once per device: fused_residual_norm calls this every launch)."""
    import torch
    return torch.cuda.get_device_properties(device).multi_processor_count


def fused_residual_norm_one(o, w_o, addend, prefix, blocks, w_mix, norm_w, mix_eps, norm_eps, fp32_norm, out=None,
                            new_prefix=None, w_mix_scale=None):
    """The one-launch kernel (caller checked launch_ok and one_kernel_reason). Returns (normed, new_prefix)."""
    import torch
    M, H = o.shape[0], w_o.shape[0]
    pair = w_mix_scale is not None
    k = build_one(H, o.shape[1], len(blocks), addend is not None, prefix is not None, fp32_norm, mix_eps, norm_eps,
                  pair, bm=bucket_for(M))     # M <= ONE_MAX_BM: bucket 1, 2 or 4; rows past M predicated off
    out = out if out is not None else torch.empty(M, H, dtype=torch.bfloat16, device=o.device)
    new_prefix = new_prefix if new_prefix is not None else torch.empty(M, H, dtype=torch.bfloat16, device=o.device)
    acc, ctr = one_state(o.device)
    extra = []
    if stamps_on():
        # empty, not zeros: a fill kernel between two launches of the PDL chain would break their programmatic edge
        extra = [torch.empty(ONE_G, 32, dtype=torch.int32, device=o.device)]
        STAMP_BUFS.append(extra[0])
    k(o, w_o, *[t for t in (addend, prefix) if t is not None], *blocks, *_score_vectors(w_mix, w_mix_scale, H), norm_w,
      out, new_prefix, acc, ctr, *extra)
    return out, new_prefix


def fused_residual_norm(o, w_o, addend, prefix, blocks, w_mix, norm_w, mix_eps, norm_eps, group_name, fp32_norm,
                        out=None, new_prefix=None, addend_partial=False, w_mix_scale=None):
    """CUDA implementation of k3fuse::fused_residual_norm (same signature). Caller checked launch_ok().
    With a group this is GEMV + NCCL all-reduce + the mix-norm kernel (the in-kernel all-reduce is
    mixnorm_allreduce.py); addend_partial: this rank's share of the addend joins y before the reduction."""
    import torch
    from . import gemv
    M = o.shape[0]
    gemv_ok = o.is_contiguous() and w_o.is_contiguous() and o.data_ptr() % 16 == 0 and w_o.data_ptr() % 16 == 0
    if gemv_ok and one_kernel_reason(M, w_o.shape[0], w_o.shape[1], len(blocks), norm_w is not None, group_name,
                                     _sms(o.device)) is None:
        return fused_residual_norm_one(o, w_o, addend, prefix, blocks, w_mix, norm_w, mix_eps, norm_eps, fp32_norm,
                                       out, new_prefix, w_mix_scale)
    cfg, _ = gemv.route(w_o.shape[0], w_o.shape[1], M)
    if cfg is not None and gemv_ok:
        y = gemv.linear(o, w_o, cfg)
    else:
        y = torch.nn.functional.linear(o, w_o)
    if addend is not None and addend_partial:
        y = addend + y                              # ops.py's order: bf16(addend + y), then the reduction
        addend = None
    if group_name:
        y = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(y, "sum", group_name))
    return mix_norm(y, addend, prefix, list(blocks), w_mix, norm_w, mix_eps, norm_eps, fp32_norm, out, new_prefix,
                    w_mix_scale)
