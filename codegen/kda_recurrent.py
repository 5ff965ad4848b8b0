"""Kernel family: k3fuse::kda_recurrent (KDA decode step: gates, q/k L2 norms, delta-rule state update, readout)
and k3fuse::kda_decode (the same kernel with the causal conv + SiLU, the f_b projection and the gated RMSNorm
inside: FUSED=1 in the template; pass fuse_kda_conv_gated_norm).

One launch on the current stream (templates/kda_recurrent.py.jinja), one CTA per (token, head) row, D * LPR
threads (LPR lanes per row of the [d, d] fp32 state). Memory-bound: S is read once and S_new written once,
64 KB each per (token, head) at d = 128. kda_recurrent and kda_decode are functional (S_new and o are fresh
tensors); k3fuse::kda_decode_ (pass write_kda_state_in_place) is the same kernel writing S and the conv state in place.

Validated on the H200 (2026-11-29, tests/test_kda_kernel_gpu.py); registered by registry.register() (IMPLS).
Measured not to help (so not here): a cluster of CTAs per (token, head) splitting S's rows (session 23, in git at
54d6841: 5.3 us alone at 1, 2, 4 or 8 CTAs per head; the ~5 us are the step's fixed chain, not S's bytes per SM).
"""
from __future__ import annotations

import collections
from typing import Optional

from .render import render
from . import knobs

FAMILY = "kda_recurrent"
TEMPLATE = "kda_recurrent.py.jinja"
OP = "k3fuse::kda_recurrent"
OP_FUSED = "k3fuse::kda_decode"
OP_INPLACE = "k3fuse::kda_decode_"
HEAD_DIMS = (64, 128)
DEFAULT_LPR = 2          # lanes per row of S: 256 threads at d = 128, 64 fp32 registers of state per thread
MAX_STATE_REGS = 128     # d / lpr fp32 of state per thread (d = 128, lpr = 1: 182-188 registers, no spills)


def _dtname(dtype) -> str:
    s = str(dtype).replace("torch.", "")
    return {"bfloat16": "BFloat16", "float32": "Float32", "BFloat16": "BFloat16", "Float32": "Float32"}[s]


def supports(d: int, lpr: int = DEFAULT_LPR) -> Optional[str]:
    if d not in HEAD_DIMS:
        return f"d={d} (kernels for d in {HEAD_DIMS})"
    if lpr not in (1, 2, 4):
        return f"lanes per row {lpr} not in (1, 2, 4)"
    if d // lpr > MAX_STATE_REGS:
        return f"d={d} at {lpr} lane(s) per row holds {d // lpr} fp32 of state per thread"
    return None


def template_params(d: int, a_dtype="bfloat16", b_dtype="bfloat16", lower_bound: float = -5.0,
                    lpr: int = DEFAULT_LPR, min_blocks: int = 1, fused: Optional[dict] = None) -> dict:
    """fused (kda_decode only): dict(kc=conv taps, fk=f_b input width, newest_last, x=q0/k0/v0 + conv state dtype,
    f=fa / f_b dtype, g=go dtype, o=output dtype, eps); a_dtype is then unused (the decay input is computed)."""
    threads = d * lpr
    nwarps = threads // 32
    wq, wk, wg = (0, 1, 2) if nwarps >= 3 else (0, 0, 0)
    p = dict(D=d, LPR=lpr, THREADS=threads, NCH=d // 4 // lpr, WQ=wq, WK=wk, WG=wg,
             LOWER_BOUND=repr(float(lower_bound)), QSCALE=repr(float(d) ** -0.5),
             ADT=_dtname(a_dtype), BDT=_dtname(b_dtype), MIN_BLOCKS=min_blocks, FUSED=bool(fused))
    if fused:
        fdt = _dtname(fused["f"])
        p.update(WV=2, KC=int(fused["kc"]), FK=int(fused["fk"]), FV=8 if fdt == "BFloat16" else 4,
                 NEWEST_LAST=bool(fused["newest_last"]), XDT=_dtname(fused["x"]), FDT=fdt,
                 GDT=_dtname(fused["g"]), ODT=_dtname(fused["o"]), EPS=repr(float(fused["eps"])), ADT=fdt)
        if stamps_on():
            p.update(STAMPS=True)
    return p


def stamps_on() -> bool:
    """K3FUSE_KDA_STAMPS=1 (diagnostic): the fused kernel takes an extra int32 [R, 32] buffer into which thread 0 of
    each CTA writes its phase timestamps (%globaltimer_lo, %clock); kda_decode keeps the last launches' buffers in
    STAMP_BUFS for benchmarks/frn_timeline.py. Read when a kernel is rendered and launched."""
    return knobs.env("K3FUSE_KDA_STAMPS") == "1"


STAMP_BUFS = collections.deque(maxlen=64)   # the stamp buffers of the last launches with stamps, oldest first


def decode_lpr() -> int:
    """K3FUSE_KDA_LPR (default DEFAULT_LPR = 2): lanes per S row of the fused decode kernel, 1, 2 or 4 (128 / 256 /
    512 threads per (token, head) at d = 128). Read at every launch (launch_ok_decode and kda_decode: one
    environment lookup); each value's kernel is built once."""
    return knobs.integer("K3FUSE_KDA_LPR", DEFAULT_LPR)


def supports_fused(d: int, kc: int, fk: int, f_dtype="bfloat16", lpr: int = DEFAULT_LPR) -> Optional[str]:
    why = supports(d, lpr)
    if why:
        return why
    if d * lpr // 32 < 3:
        return f"d={d} at {lpr} lane(s) per row has fewer than 3 warps (q, k, v convs)"
    if not 2 <= kc <= 8:
        return f"conv of {kc} taps (kernels for 2..8)"
    fv = 8 if _dtname(f_dtype) == "BFloat16" else 4
    if fk <= 0 or fk % (fv * lpr):
        return f"f_b input width {fk} is not a multiple of {fv * lpr}"
    return None


def render_source(d: int, a_dtype="bfloat16", b_dtype="bfloat16", lower_bound: float = -5.0,
                  lpr: int = DEFAULT_LPR, min_blocks: int = 1, fused: Optional[dict] = None) -> str:
    """min_blocks > 1 adds launch bounds (minctasm) and a default shared-memory carveout attribute to the launch
    (untested on a GPU). Without it, d = 128 / lpr = 2 already takes 104-119 registers, i.e. 2 CTAs per SM."""
    why = supports_fused(d, fused["kc"], fused["fk"], fused["f"], lpr) if fused else supports(d, lpr)
    if why:
        raise ValueError(why)
    return render(TEMPLATE, **template_params(d, a_dtype, b_dtype, lower_bound, lpr, min_blocks, fused))


_built: dict = {}


def build(d: int = 128, a_dtype="bfloat16", b_dtype="bfloat16", lower_bound: float = -5.0, lpr: int = DEFAULT_LPR,
          arch: Optional[str] = None, load: bool = True, fused: Optional[dict] = None):
    """Compile (through the disk cache) the kernel for head dim d, dtypes of a / b, lower_bound, lanes per row,
    the fused variant's parameters and arch. The rendered source bakes every one of these, so the cache key (sha256
    of source + arch) covers them."""
    from .compile import compile_source, current_arch
    arch = arch or current_arch()
    fkey = tuple(sorted((k, str(v)) for k, v in fused.items())) if fused else None
    memo = (d, _dtname(a_dtype), _dtname(b_dtype), float(lower_bound), lpr, arch, load, fkey,
            knobs.key(FAMILY))
    if memo in _built:
        return _built[memo]
    src = render_source(d, a_dtype, b_dtype, lower_bound, lpr, fused=fused)
    config = dict(lpr=lpr, threads=d * lpr, a=_dtname(a_dtype), b=_dtname(b_dtype), lower_bound=float(lower_bound))
    if fused:
        config["fused"] = {k: (v if isinstance(v, (int, float, bool)) else str(v)) for k, v in fused.items()}
    meta = dict(family=FAMILY, op=OP_FUSED if fused else OP, shape=dict(d=d), template=TEMPLATE, config=config)
    _built[memo] = k = compile_source(src, arch, load=load, meta=meta)
    return k


def _aligned(t) -> bool:
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def launch_ok(q, k, v, a, dt_bias, A_log, b, S) -> Optional[str]:
    """None if the kernel takes these inputs (after the cheap fixes kda_recurrent() makes), else the reason."""
    import torch
    if q.dim() != 3:
        return f"q is {q.dim()}-D, not [M, h, d]"
    M, h, d = q.shape
    why = supports(d)
    if why:
        return why
    if M * h == 0:
        return "empty input"
    if k.shape != q.shape or v.shape != q.shape:
        return "q, k, v shapes differ"
    if a.numel() != M * h * d or dt_bias.numel() != h * d or A_log.numel() != h or b.numel() != M * h:
        return "a / dt_bias / A_log / b sizes do not match q"
    if tuple(S.shape) != (M, h, d, d):
        return f"S shape {tuple(S.shape)} != {(M, h, d, d)}"
    if S.dtype != torch.float32 or not _aligned(S):
        return "S must be fp32, contiguous and 16-byte aligned"
    if a.dtype not in (torch.bfloat16, torch.float32) or b.dtype not in (torch.bfloat16, torch.float32):
        return f"a / b dtypes {a.dtype} / {b.dtype} (kernels take bf16 or fp32)"
    if any(t.device != S.device for t in (q, k, v, a, dt_bias, A_log, b)):
        return "inputs on different devices"
    if M * h >= 2 ** 31:
        return "too many rows"
    return None


def _prep(t, shape, dtype=None):
    """t as a contiguous, 16-byte aligned tensor of `shape` (a copy only when it is not already one)."""
    import torch
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    t = t.reshape(shape)
    if not t.is_contiguous() or t.data_ptr() % 16:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def kda_recurrent(q, k, v, a, dt_bias, A_log, b, S, lower_bound, out=None, S_new=None):
    """Launch the kernel (caller checked launch_ok()). Returns (o [M, h, d] fp32, S_new [M, h, d, d] fp32)."""
    import torch
    M, h, d = q.shape
    R = M * h
    f32 = torch.float32
    kern = build(d, a.dtype, b.dtype, float(lower_bound))
    qq, kk, vv = (_prep(t, (R, d), f32) for t in (q, k, v))
    aa = _prep(a, (R, d))
    dt = _prep(dt_bias, (h, d), f32)
    al = _prep(A_log, (h,), f32)
    bb = _prep(b, (R,))
    if out is None:
        out = torch.empty(M, h, d, dtype=f32, device=q.device)
    if S_new is None:
        S_new = torch.empty(M, h, d, d, dtype=f32, device=q.device)
    kern(qq, kk, vv, aa, dt, al, bb, S.view(R, d, d), out.view(R, d), S_new.view(R, d, d))
    return out, S_new


def _reference(q, k, v, a, dt_bias, A_log, b, S, lower_bound):
    from k3fuse import ops
    return ops.kda_recurrent._init_fn(q, k, v, a, dt_bias, A_log, b, S, lower_bound)


def kda_recurrent_cuda(q, k, v, a, dt_bias, A_log, b, S, lower_bound):
    """CUDA implementation of k3fuse::kda_recurrent (same signature); the reference where the kernel does not apply."""
    from .prefetch import join_pending
    from .registry import _env_ok, log_fallback
    reason = launch_ok(q, k, v, a, dt_bias, A_log, b, S)
    if reason is not None:
        log_fallback(OP, reason)
        return _reference(q, k, v, a, dt_bias, A_log, b, S, lower_bound)
    if not _env_ok(OP, q.device):             # logs its own reason once
        return _reference(q, k, v, a, dt_bias, A_log, b, S, lower_bound)
    join_pending()
    return kda_recurrent(q, k, v, a, dt_bias, A_log, b, S, lower_bound)


def fused_params(q0, conv_state, q_taps, fa, go, eps, newest_tap_last, out_dtype) -> dict:
    return dict(kc=q_taps.shape[1], fk=fa.shape[1], newest_last=bool(newest_tap_last), x=q0.dtype, f=fa.dtype,
                g=go.dtype, o=out_dtype, eps=float(eps))


def launch_ok_decode(q0, k0, v0, conv_state, q_taps, k_taps, v_taps, fa, f_b, dt_bias, A_log, b, go, o_norm, S,
                     out_dtype) -> Optional[str]:
    """None if the fused kernel takes these inputs, else the reason."""
    import torch
    if q0.dim() != 2 or A_log.dim() != 1 or A_log.numel() == 0:
        return "q0 is not [M, P] or A_log is not [h]"
    M, P = q0.shape
    h = A_log.numel()
    if M == 0 or P % h:
        return "empty input or P not a multiple of the heads"
    d = P // h
    kc = q_taps.shape[-1] if q_taps.dim() == 2 else 0
    fk = fa.shape[-1] if fa.dim() == 2 else 0
    why = supports_fused(d, kc, fk, fa.dtype, decode_lpr())
    if why:
        return why
    ok = {torch.bfloat16, torch.float32}
    if k0.shape != q0.shape or v0.shape != q0.shape or go.shape != q0.shape:
        return "q0 / k0 / v0 / go shapes differ"
    if len({q0.dtype, k0.dtype, v0.dtype, conv_state.dtype}) != 1 or q0.dtype not in ok:
        return f"q0 / k0 / v0 / conv state dtypes {q0.dtype} {k0.dtype} {v0.dtype} {conv_state.dtype}"
    if tuple(conv_state.shape) != (M, kc - 1, 3 * P):
        return f"conv state {tuple(conv_state.shape)} != {(M, kc - 1, 3 * P)}"
    if any(tuple(w.shape) != (P, kc) for w in (q_taps, k_taps, v_taps)):
        return "conv taps are not [P, K]"
    if tuple(fa.shape) != (M, fk) or tuple(f_b.shape) != (P, fk) or f_b.dtype != fa.dtype or fa.dtype not in ok:
        return f"fa {tuple(fa.shape)} / f_b {tuple(f_b.shape)} ({fa.dtype} / {f_b.dtype})"
    if go.dtype not in ok or out_dtype not in ok or o_norm.numel() != d:
        return f"go {go.dtype} / out {out_dtype} / o_norm of {o_norm.numel()}"
    if dt_bias.numel() != P or b.numel() != M * h or b.dtype not in ok:
        return "dt_bias / b sizes or dtypes"
    if tuple(S.shape) != (M, h, d, d) or S.dtype != torch.float32 or not _aligned(S):
        return "S must be [M, h, d, d] fp32, contiguous and 16-byte aligned"
    dev = S.device
    if any(t.device != dev for t in (q0, k0, v0, conv_state, q_taps, k_taps, v_taps, fa, f_b, dt_bias, A_log, b,
                                     go, o_norm)):
        return "inputs on different devices"
    if M * h >= 2 ** 31:
        return "too many rows"
    return None


def kda_decode(q0, k0, v0, conv_state, q_taps, k_taps, v_taps, fa, f_b, dt_bias, A_log, b, go, o_norm, S,
               lower_bound, eps, newest_tap_last, out_dtype, out=None, S_new=None, conv_new=None):
    """Launch the fused kernel (caller checked launch_ok_decode()). Returns (o [M, P] out_dtype, S_new, conv_new)."""
    import torch
    M, P = q0.shape
    h = A_log.numel()
    d = P // h
    R = M * h
    f32 = torch.float32
    fused = fused_params(q0, conv_state, q_taps, fa, go, eps, newest_tap_last, out_dtype)
    kern = build(d, fa.dtype, b.dtype, float(lower_bound), lpr=decode_lpr(), fused=fused)
    x = [_prep(t, (R, d)) for t in (q0, k0, v0)]
    cs = _prep(conv_state, tuple(conv_state.shape))
    taps = [_prep(t, tuple(t.shape), f32) for t in (q_taps, k_taps, v_taps)]
    if out is None:
        out = torch.empty(M, P, dtype=out_dtype, device=q0.device)
    if S_new is None:
        S_new = torch.empty(M, h, d, d, dtype=f32, device=q0.device)
    if conv_new is None:
        conv_new = torch.empty_like(cs)
    extra = []
    if stamps_on():
        # empty, not zeros: a fill kernel between two launches of the PDL chain would break their programmatic edge
        extra = [torch.empty(R, 32, dtype=torch.int32, device=q0.device)]
        STAMP_BUFS.append(extra[0])
    kern(*x, _prep(fa, tuple(fa.shape)), _prep(dt_bias, (h, d), f32), _prep(A_log, (h,), f32), _prep(b, (R,)),
         S.view(R, d, d), out.view(R, d), S_new.view(R, d, d), cs, conv_new, *taps, _prep(f_b, tuple(f_b.shape)),
         _prep(go, (R, d)), _prep(o_norm, (d,), f32), *extra)
    return out, S_new, conv_new


def _kda_decode_cuda(op, in_place, args, lower_bound, eps, newest_tap_last, out_dtype):
    """The fused kernel where launch_ok_decode() takes the inputs, else the op's reference."""
    from k3fuse import ops
    from .prefetch import join_pending
    from .registry import _env_ok, log_fallback
    reason = launch_ok_decode(*args, out_dtype)
    if reason is not None:
        log_fallback(op, reason)
    if reason is not None or not _env_ok(op, args[0].device):      # _env_ok logs its own reason once
        ref = ops.kda_decode_ if in_place else ops.kda_decode
        return ref._init_fn(*args, lower_bound, eps, newest_tap_last, out_dtype)
    join_pending()
    if not in_place:
        return kda_decode(*args, lower_bound, eps, newest_tap_last, out_dtype)
    # S_new = S (launch_ok_decode checked S contiguous and aligned); a conv state the kernel cannot address
    # directly (a view into a wider buffer) is computed aside and copied in
    S, conv_state = args[14], args[3]
    conv_ok = _aligned(conv_state)
    o, _, conv_new = kda_decode(*args, lower_bound, eps, newest_tap_last, out_dtype, S_new=S,
                                conv_new=conv_state if conv_ok else None)
    if not conv_ok:
        conv_state.copy_(conv_new.view(conv_state.shape))
    return o


def kda_decode_cuda(q0, k0, v0, conv_state, q_taps, k_taps, v_taps, fa, f_b, dt_bias, A_log, b, go, o_norm, S,
                    lower_bound, eps, newest_tap_last, out_dtype):
    """CUDA implementation of k3fuse::kda_decode (same signature); the reference where the kernel does not apply."""
    return _kda_decode_cuda(OP_FUSED, False, (q0, k0, v0, conv_state, q_taps, k_taps, v_taps, fa, f_b, dt_bias, A_log,
                                              b, go, o_norm, S), lower_bound, eps, newest_tap_last, out_dtype)


def kda_decode_inplace_cuda(q0, k0, v0, conv_state, q_taps, k_taps, v_taps, fa, f_b, dt_bias, A_log, b, go, o_norm,
                            S, lower_bound, eps, newest_tap_last, out_dtype):
    """CUDA implementation of k3fuse::kda_decode_ (pass write_kda_state_in_place): the fused kernel with S_new = S and
    conv_new = conv_state. In place is safe because every thread reads its S elements (and its conv columns) before
    it writes them, and no other thread touches them (templates/kda_recurrent.py.jinja, steps 1-4)."""
    return _kda_decode_cuda(OP_INPLACE, True, (q0, k0, v0, conv_state, q_taps, k_taps, v_taps, fa, f_b, dt_bias,
                                               A_log, b, go, o_norm, S), lower_bound, eps, newest_tap_last, out_dtype)


IMPLS = {OP: kda_recurrent_cuda, OP_FUSED: kda_decode_cuda, OP_INPLACE: kda_decode_inplace_cuda}
