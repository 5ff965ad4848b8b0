"""Kernel family: k3fuse::fused_residual_norm at TP > 1 with the all-reduce inside the mix-norm kernel.

Two launches on the current stream, per rank:
  1. the o_proj GEMV of this rank's K-slice (family gemv, unchanged; or cuBLAS where gemv.route says so) into the
     PeerBuffers' local `partial` scratch (a fixed address, so a CUDA graph can bake it in),
  2. templates/mixnorm_allreduce.py.jinja: publishes that row into the peer-mapped slot of the current epoch,
     flags every peer, waits for every peer's flag, sums the W partial rows in rank order and runs the mix-norm
     of templates/fused_residual_norm_mixnorm.py.jinja (same math, same rounding points).
Why the kernel copies the partial into the slot instead of the GEMV writing there: the slot alternates with the
device-side epoch (graph replays advance it without the host), and the unchanged GEMV takes a fixed output address.
The copy is 2 * H bytes per row from L2 (the GEMV just wrote it).

Peer regions, epochs, flags and the timeout are described in compiler/peer_buffers.py and the template docstring.
`check_error(peer)` raises if a kernel on this rank gave up waiting (then `peer.reset()` on every rank).

Wired: codegen/registry.py's fused_residual_norm CUDA impl calls `fused_residual_norm_ar_or_none(<the op's args>)`
first when group_name != "" (opt-in: K3FUSE_INKERNEL_COLLECTIVES=1) and uses its result unless None (None: the
functional all-reduce path). It resolves the group and the peer buffers (collective at the first call, so the first
call must be an eager one, not inside a graph capture). codegen.compile.clear_memo() clears this module's `_built`.
"""
from __future__ import annotations

from typing import Optional

from . import knobs
from .render import render

FAMILY = "mixnorm_allreduce"
TEMPLATE = "mixnorm_allreduce.py.jinja"
MAX_WORLD = 8
TIMEOUT_NS = 2_000_000_000      # a rank that never arrives: give up after 2 s (then check_error raises)


def params(H: int, nb: int, world: int, has_addend: bool, has_prefix: bool, has_norm: bool, fp32_norm: bool,
           mix_eps: float, norm_eps: float, max_m: int = 64, timeout_ns: int = TIMEOUT_NS,
           has_paddend: bool = False) -> dict:
    from k3fuse.peer_buffers import BufferLayout
    from .fused_residual_norm import mixnorm_params
    p = mixnorm_params(H, nb, has_addend, has_prefix, has_norm, fp32_norm, mix_eps, norm_eps)
    p.pop("ALLREDUCE", None)
    p.update(BufferLayout(H, max_m, MAX_WORLD).template_params())
    if has_paddend and has_addend:
        raise ValueError("one addend: either complete (added after the reduction) or partial (before)")
    p.update(W=int(world), TIMEOUT_NS=int(timeout_ns), HAS_PADDEND=bool(has_paddend))
    return p


def supports(H: int, nb: int, world: int) -> Optional[str]:
    from .fused_residual_norm import supports as mixnorm_supports
    why = mixnorm_supports(H, nb)
    if why:
        return why
    if not 1 <= world <= MAX_WORLD:
        return f"world size {world} outside 1..{MAX_WORLD}"
    return None


def render_source(H, nb, world, has_addend=False, has_prefix=True, has_norm=True, fp32_norm=False, mix_eps=1e-5,
                  norm_eps=1e-5, max_m: int = 64, timeout_ns: int = TIMEOUT_NS, has_paddend: bool = False) -> str:
    why = supports(H, nb, world)
    if why:
        raise ValueError(why)
    return render(TEMPLATE, **params(H, nb, world, has_addend, has_prefix, has_norm, fp32_norm, mix_eps, norm_eps,
                                     max_m, timeout_ns, has_paddend))


_built: dict = {}


def build(H, nb, world, has_addend=False, has_prefix=True, has_norm=True, fp32_norm=False, mix_eps=1e-5,
          norm_eps=1e-5, max_m: int = 64, timeout_ns: int = TIMEOUT_NS, arch: Optional[str] = None,
          load: bool = True, has_paddend: bool = False):
    from .compile import compile_source, current_arch
    arch = arch or current_arch()
    memo = (H, nb, world, bool(has_addend), bool(has_prefix), bool(has_norm), bool(fp32_norm), float(mix_eps),
            float(norm_eps), max_m, int(timeout_ns), arch, load, bool(has_paddend),
            knobs.key(FAMILY))
    k = _built.get(memo)
    if k is None:
        src = render_source(H, nb, world, has_addend, has_prefix, has_norm, fp32_norm, mix_eps, norm_eps, max_m,
                            timeout_ns, has_paddend)
        meta = dict(family=FAMILY, op="k3fuse::fused_residual_norm", part="mixnorm_allreduce",
                    shape=dict(H=H, blocks=nb, world=world),
                    flags=dict(addend=has_addend, prefix=has_prefix, norm=has_norm, fp32_norm=fp32_norm,
                               addend_partial=has_paddend),
                    template=TEMPLATE)
        k = _built[memo] = compile_source(src, arch, load=load, meta=meta)
    return k


def launch_ok(o, w_o, addend, prefix, blocks, norm_w, peer) -> Optional[str]:
    from .fused_residual_norm import launch_ok as mixnorm_launch_ok
    why = mixnorm_launch_ok(o, w_o, addend, prefix, blocks, norm_w)
    if why:
        return why
    if o.shape[0] > peer.layout.max_m:
        return f"M={o.shape[0]} > the peer buffers' max_m={peer.layout.max_m}"
    if w_o.shape[0] != peer.layout.hidden:
        return f"hidden {w_o.shape[0]} != the peer buffers' hidden {peer.layout.hidden}"
    return supports(w_o.shape[0], len(blocks), peer.world)


def gemv_into(o, w_o, y) -> None:
    """y[:] = o @ w_o^T with the generated GEMV where gemv.route has one, else cuBLAS (both write y in place)."""
    import torch
    from . import gemv
    cfg, _ = gemv.route(w_o.shape[0], w_o.shape[1], o.shape[0])
    if cfg is not None and o.is_contiguous() and w_o.is_contiguous() and o.data_ptr() % 16 == 0 \
            and w_o.data_ptr() % 16 == 0:
        gemv.linear(o, w_o, cfg, out=y)
    else:
        torch.matmul(o, w_o.t(), out=y)


def mixnorm_allreduce(y_part, addend, prefix, blocks, w_mix, norm_w, mix_eps, norm_eps, peer, fp32_norm=False,
                      out=None, new_prefix=None, timeout_ns: int = TIMEOUT_NS, addend_partial: bool = False):
    """Launch the all-reduce + mix-norm kernel on this rank's partial y_part [M, H] bf16 (rows 16-byte aligned).
    With addend_partial the kernel publishes bf16(addend + y_part) (this rank's share, reduced with the rest)."""
    import torch
    M, H = y_part.shape
    paddend = addend if (addend is not None and addend_partial) else None
    if paddend is not None:
        addend = None
    k = build(H, len(blocks), peer.world, addend is not None, prefix is not None, norm_w is not None, fp32_norm,
              mix_eps, norm_eps, peer.layout.max_m, timeout_ns, has_paddend=paddend is not None)
    dev = y_part.device
    if out is None:
        out = torch.empty(M, H, dtype=torch.bfloat16 if norm_w is not None else torch.float32, device=dev)
    if new_prefix is None:
        new_prefix = torch.empty(M, H, dtype=torch.bfloat16, device=dev)
    wm = w_mix if (w_mix.dtype == torch.float32 and w_mix.is_contiguous()) else w_mix.float().contiguous()
    args = [y_part] + [t for t in (paddend, addend, prefix) if t is not None] + list(blocks) + [wm]
    if norm_w is not None:
        args.append(norm_w)
    k(*args, out, new_prefix, peer.ptrs, peer.counters())
    return out, new_prefix


def fused_residual_norm_ar(o, w_o, addend, prefix, blocks, w_mix, norm_w, mix_eps, norm_eps, peer,
                           fp32_norm: bool = False, addend_partial: bool = False, out=None, new_prefix=None,
                           timeout_ns: int = TIMEOUT_NS):
    """k3fuse::fused_residual_norm on one rank of peer's group (group_name != ""): o [M, K/W] this rank's slice of
    the o_proj input, w_o [H, K/W] its weight slice; the rest as in compiler/ops.py. Returns (normed, new_prefix),
    equal on every rank. With addend_partial the addend is this rank's share, added before the reduction (inside
    the kernel, at the publish: bf16(addend + y) as the reference rounds it).
    The caller checked launch_ok(); call check_error(peer) where a failed wait should surface (it syncs)."""
    M = o.shape[0]
    y = peer.partial[:M]
    gemv_into(o, w_o, y)
    return mixnorm_allreduce(y, addend, prefix, list(blocks), w_mix, norm_w, mix_eps, norm_eps, peer, fp32_norm,
                             out, new_prefix, timeout_ns, addend_partial)


def fused_residual_norm_ar_or_none(o, w_o, addend, prefix, blocks, w_mix, norm_w, mix_eps, norm_eps, group_name,
                                   fp32_norm, addend_partial=False, w_mix_scale=None):
    """k3fuse::fused_residual_norm's arguments (compiler/ops.py) -> (normed, new_prefix) through the in-kernel
    all-reduce, or None where it does not apply (K3FUSE_INKERNEL_COLLECTIVES != "1", no group, world 1 or
    > MAX_WORLD, not CUDA, shapes / dtypes / alignment the kernels do not take, M > the peer buffers' max_m).
    None leaves the caller's functional path; the answer is the same on every rank (see peer_buffers.resolve).
    addend_partial: the addend is this rank's share (the MoE split's routed slice), reduced with the GEMV partial.
    A recorded timeout is not checked here (that syncs): the caller runs check_error(peer) where it may sync.
    w_mix_scale: the score vector's second factor; this template takes the product, formed here when it runs."""
    from k3fuse import peer_buffers as pbuf
    from .fused_residual_norm import launch_ok as mixnorm_launch_ok
    if not group_name or not pbuf.inkernel_enabled():
        return None
    if o.dim() != 2 or w_o.dim() != 2 or not 0 < o.shape[0] <= pbuf.MAX_M or o.device.type != "cuda":
        return None
    if mixnorm_launch_ok(o, w_o, addend, prefix, blocks, norm_w):
        return None
    peer, _why = pbuf.resolve(group_name, o.device, hidden=w_o.shape[0])
    if peer is None or launch_ok(o, w_o, addend, prefix, blocks, norm_w, peer):
        return None
    if w_mix_scale is not None:
        w_mix = w_mix.float() * w_mix_scale.float()
    return fused_residual_norm_ar(o, w_o, addend, prefix, blocks, w_mix, norm_w, mix_eps, norm_eps, peer, fp32_norm,
                                  addend_partial=addend_partial)


_WHAT = {"allreduce": "all-reduce", "allgather": "all-gather"}


def check_error(peer, kind: str = "allreduce") -> None:
    """Raise RuntimeError if a `kind` kernel ("allreduce" or "allgather") on this rank timed out waiting for a peer
    (synchronizes the device)."""
    e = peer.error(kind)
    if e is not None:
        raise RuntimeError(
            f"in-kernel {_WHAT[kind]} timed out on rank {e['rank']} of {peer.world}: row {e['row']} never got peer "
            f"{e['missing_src']}'s flag for epoch {e['epoch']} (peer.reset() on every rank before the next step)")
