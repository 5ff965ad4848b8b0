"""Kernel family: k3fuse::kda_recurrent (KDA decode step: gates, q/k L2 norms, delta-rule state update, readout).

One launch on the current stream (templates/kda_recurrent.py.jinja), one CTA per (token, head) row, D * LPR
threads (LPR lanes per row of the [d, d] fp32 state). Memory-bound: S is read once and S_new written once,
64 KB each per (token, head) at d = 128. The op is functional: S_new and o are fresh tensors.

Validated on the H200 (2026-11-29, tests/test_kda_kernel_gpu.py); registered by registry.register() (IMPLS).
"""
from __future__ import annotations

from typing import Optional

from .render import render

FAMILY = "kda_recurrent"
TEMPLATE = "kda_recurrent.py.jinja"
OP = "k3fuse::kda_recurrent"
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
                    lpr: int = DEFAULT_LPR, min_blocks: int = 1) -> dict:
    threads = d * lpr
    nwarps = threads // 32
    wq, wk, wg = (0, 1, 2) if nwarps >= 3 else (0, 0, 0)
    return dict(D=d, LPR=lpr, THREADS=threads, NCH=d // 4 // lpr, WQ=wq, WK=wk, WG=wg,
                LOWER_BOUND=repr(float(lower_bound)), QSCALE=repr(float(d) ** -0.5),
                ADT=_dtname(a_dtype), BDT=_dtname(b_dtype), MIN_BLOCKS=min_blocks)


def render_source(d: int, a_dtype="bfloat16", b_dtype="bfloat16", lower_bound: float = -5.0,
                  lpr: int = DEFAULT_LPR, min_blocks: int = 1) -> str:
    """min_blocks > 1 adds launch bounds (minctasm) and a default shared-memory carveout attribute to the launch
    (untested on a GPU). Without it, d = 128 / lpr = 2 already takes 104-119 registers, i.e. 2 CTAs per SM."""
    why = supports(d, lpr)
    if why:
        raise ValueError(why)
    return render(TEMPLATE, **template_params(d, a_dtype, b_dtype, lower_bound, lpr, min_blocks))


_built: dict = {}


def build(d: int = 128, a_dtype="bfloat16", b_dtype="bfloat16", lower_bound: float = -5.0, lpr: int = DEFAULT_LPR,
          arch: Optional[str] = None, load: bool = True):
    """Compile (through the disk cache) the kernel for head dim d, dtypes of a / b, lower_bound, lanes per row
    and arch. The rendered source bakes every one of these, so the cache key (sha256 of source + arch) covers them."""
    from .compile import compile_source, current_arch
    arch = arch or current_arch()
    memo = (d, _dtname(a_dtype), _dtname(b_dtype), float(lower_bound), lpr, arch, load)
    if memo in _built:
        return _built[memo]
    src = render_source(d, a_dtype, b_dtype, lower_bound, lpr)
    meta = dict(family=FAMILY, op=OP, shape=dict(d=d), template=TEMPLATE,
                config=dict(lpr=lpr, threads=d * lpr, a=_dtname(a_dtype), b=_dtname(b_dtype),
                            lower_bound=float(lower_bound)))
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


IMPLS = {OP: kda_recurrent_cuda}
