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

Not wired yet. The intended wiring (codegen/registry.py's fused_residual_norm CUDA impl, group_name != ""): resolve
the group, `peer = k3fuse.peer_buffers.for_group(group, H)` (collective; happens at the first eager call, so it
must not be first reached inside a graph capture), and if `launch_ok(...)` is None call `fused_residual_norm_ar`,
else keep the functional all-reduce path. codegen.compile.clear_memo() should clear this module's `_built` too.
"""
from __future__ import annotations

from typing import Optional

from .render import render

FAMILY = "mixnorm_allreduce"
TEMPLATE = "mixnorm_allreduce.py.jinja"
MAX_WORLD = 8
TIMEOUT_NS = 2_000_000_000      # a rank that never arrives: give up after 2 s (then check_error raises)


def params(H: int, nb: int, world: int, has_addend: bool, has_prefix: bool, has_norm: bool, fp32_norm: bool,
           mix_eps: float, norm_eps: float, max_m: int = 64, timeout_ns: int = TIMEOUT_NS) -> dict:
    from k3fuse.peer_buffers import BufferLayout
    from .fused_residual_norm import mixnorm_params
    p = mixnorm_params(H, nb, has_addend, has_prefix, has_norm, fp32_norm, mix_eps, norm_eps)
    p.pop("ALLREDUCE", None)
    p.update(BufferLayout(H, max_m, MAX_WORLD).template_params())
    p.update(W=int(world), TIMEOUT_NS=int(timeout_ns))
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
                  norm_eps=1e-5, max_m: int = 64, timeout_ns: int = TIMEOUT_NS) -> str:
    why = supports(H, nb, world)
    if why:
        raise ValueError(why)
    return render(TEMPLATE, **params(H, nb, world, has_addend, has_prefix, has_norm, fp32_norm, mix_eps, norm_eps,
                                     max_m, timeout_ns))


_built: dict = {}


def build(H, nb, world, has_addend=False, has_prefix=True, has_norm=True, fp32_norm=False, mix_eps=1e-5,
          norm_eps=1e-5, max_m: int = 64, timeout_ns: int = TIMEOUT_NS, arch: Optional[str] = None,
          load: bool = True):
    from .compile import compile_source, current_arch
    arch = arch or current_arch()
    memo = (H, nb, world, bool(has_addend), bool(has_prefix), bool(has_norm), bool(fp32_norm), float(mix_eps),
            float(norm_eps), max_m, int(timeout_ns), arch, load)
    k = _built.get(memo)
    if k is None:
        src = render_source(H, nb, world, has_addend, has_prefix, has_norm, fp32_norm, mix_eps, norm_eps, max_m,
                            timeout_ns)
        meta = dict(family=FAMILY, op="k3fuse::fused_residual_norm", part="mixnorm_allreduce",
                    shape=dict(H=H, blocks=nb, world=world),
                    flags=dict(addend=has_addend, prefix=has_prefix, norm=has_norm, fp32_norm=fp32_norm),
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
                      out=None, new_prefix=None, timeout_ns: int = TIMEOUT_NS):
    """Launch the all-reduce + mix-norm kernel on this rank's partial y_part [M, H] bf16 (rows 16-byte aligned)."""
    import torch
    M, H = y_part.shape
    k = build(H, len(blocks), peer.world, addend is not None, prefix is not None, norm_w is not None, fp32_norm,
              mix_eps, norm_eps, peer.layout.max_m, timeout_ns)
    dev = y_part.device
    if out is None:
        out = torch.empty(M, H, dtype=torch.bfloat16 if norm_w is not None else torch.float32, device=dev)
    if new_prefix is None:
        new_prefix = torch.empty(M, H, dtype=torch.bfloat16, device=dev)
    wm = w_mix if (w_mix.dtype == torch.float32 and w_mix.is_contiguous()) else w_mix.float().contiguous()
    args = [y_part] + [t for t in (addend, prefix) if t is not None] + list(blocks) + [wm]
    if norm_w is not None:
        args.append(norm_w)
    k(*args, out, new_prefix, peer.ptrs, peer.counters())
    return out, new_prefix


def fused_residual_norm_ar(o, w_o, addend, prefix, blocks, w_mix, norm_w, mix_eps, norm_eps, peer,
                           fp32_norm: bool = False, addend_partial: bool = False, out=None, new_prefix=None,
                           timeout_ns: int = TIMEOUT_NS):
    """k3fuse::fused_residual_norm on one rank of peer's group (group_name != ""): o [M, K/W] this rank's slice of
    the o_proj input, w_o [H, K/W] its weight slice; the rest as in compiler/ops.py. Returns (normed, new_prefix),
    equal on every rank. With addend_partial the addend is this rank's share, added before the reduction.
    The caller checked launch_ok(); call check_error(peer) where a failed wait should surface (it syncs)."""
    M = o.shape[0]
    y = peer.partial[:M]
    gemv_into(o, w_o, y)
    if addend is not None and addend_partial:
        y.add_(addend)            # bf16(addend + y), as the reference does before its all-reduce
        addend = None
    return mixnorm_allreduce(y, addend, prefix, list(blocks), w_mix, norm_w, mix_eps, norm_eps, peer, fp32_norm,
                             out, new_prefix, timeout_ns)


def check_error(peer) -> None:
    """Raise RuntimeError if a kernel on this rank timed out waiting for a peer (synchronizes the device)."""
    e = peer.error()
    if e is not None:
        raise RuntimeError(
            f"in-kernel all-reduce timed out on rank {e['rank']} of {peer.world}: row {e['row']} never got peer "
            f"{e['missing_src']}'s flag for epoch {e['epoch']} (peer.reset() on every rank before the next step)")
