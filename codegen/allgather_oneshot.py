"""Kernel family: a one-shot in-kernel all-gather over the peer-mapped regions (compiler/peer_buffers.py), the
same protocol as codegen/mixnorm_allreduce.py (shared PTX helpers: templates/_peer_protocol.jinja) on its own
slots, flags and epoch counter, so the two collectives of one step cannot interfere in any interleaving.

What it replaces: the MoE split's gathers (passes/split_moe_across_ranks.py): `all_gather_into_tensor` of the
packed [router logits (fp32 bit-cast to bf16) | z shard] rows, [M, E/t * 2 + D/t] bf16 per rank, and, without the
attention-output fusion, of the up-projection slice [M, H/t]. The kernel is dtype-agnostic: rows are bytes
(a multiple of 16, moved as 16-byte vectors; the host views them as int32 words), so the gathered bits are the
ranks' bits. Output layouts:
  "rank_major"  [W * M, C]: exactly all_gather_into_tensor's result (the pass views it as [t, M, n]);
  "row_major"   [M, W * C]: torch.cat of the ranks' chunks along the last dim (the pass's `_gather_last`
                result without its clone).
One launch, grid = M CTAs (one per row: flags are per (src, row)).

Wired: split_moe_across_ranks emits k3fuse::all_gather (compiler/ops.py, the functional pair as its reference);
its CUDA impl (codegen/registry.py) calls all_gather_cuda_or_none(x, group_name, group_size), which returns the
all_gather_into_tensor result, or None (then the functional collective runs). Opt-in: K3FUSE_INKERNEL_COLLECTIVES=1.
"""
from __future__ import annotations

from typing import Optional

from . import knobs
from .render import render

FAMILY = "allgather_oneshot"
TEMPLATE = "allgather_oneshot.py.jinja"
MAX_WORLD = 8
TIMEOUT_NS = 2_000_000_000      # as the all-reduce's: a rank that never arrives -> give up after 2 s
LAYOUTS = ("rank_major", "row_major")


def _threads(world: int, cv: int) -> int:
    """Enough threads that the read (world * cv vectors) takes few rounds; a warp at least, 256 at most."""
    n = world * cv
    return max(32, min(256, -(-n // 32) * 32))


def params(row_bytes: int, world: int, layout, timeout_ns: int = TIMEOUT_NS) -> dict:
    """layout: the peers' peer_buffers.BufferLayout (its gather offsets are baked in)."""
    p = layout.gather_template_params(row_bytes)
    cv = row_bytes // 16
    th = _threads(world, cv)
    p.update(W=int(world), CV=cv, THREADS=th, VPT_PUB=-(-cv // th), VPT_OUT=-(-world * cv // th),
             TIMEOUT_NS=int(timeout_ns))
    return p


def supports(row_bytes: int, world: int, layout=None) -> Optional[str]:
    if not 1 <= world <= MAX_WORLD:
        return f"world size {world} outside 1..{MAX_WORLD}"
    if row_bytes <= 0 or row_bytes % 16:
        return f"row of {row_bytes} B is not a positive multiple of 16"
    if layout is not None and row_bytes > layout.ag_row_cap:
        return f"row of {row_bytes} B > the peer buffers' gather row capacity {layout.ag_row_cap} B"
    if layout is not None and world > layout.max_world:
        return f"world size {world} > the peer buffers' max_world {layout.max_world}"
    return None


def _layout_for(hidden: int, max_m: int, gather_row_bytes: int = 0):
    from k3fuse.peer_buffers import BufferLayout
    return BufferLayout(hidden, max_m, MAX_WORLD, gather_row_bytes)


def render_source(row_bytes: int, world: int, hidden: int = 7168, max_m: int = 64, gather_row_bytes: int = 0,
                  timeout_ns: int = TIMEOUT_NS) -> str:
    layout = _layout_for(hidden, max_m, gather_row_bytes)
    why = supports(row_bytes, world, layout)
    if why:
        raise ValueError(why)
    return render(TEMPLATE, **params(row_bytes, world, layout, timeout_ns))


_built: dict = {}


def build(row_bytes: int, world: int, hidden: int = 7168, max_m: int = 64, gather_row_bytes: int = 0,
          timeout_ns: int = TIMEOUT_NS, arch: Optional[str] = None, load: bool = True):
    from .compile import compile_source, current_arch
    arch = arch or current_arch()
    memo = (int(row_bytes), int(world), int(hidden), int(max_m), int(gather_row_bytes), int(timeout_ns), arch, load,
            knobs.key(FAMILY))
    k = _built.get(memo)
    if k is None:
        src = render_source(row_bytes, world, hidden, max_m, gather_row_bytes, timeout_ns)
        meta = dict(family=FAMILY, op="k3fuse::all_gather", part="allgather_oneshot",
                    shape=dict(row_bytes=row_bytes, world=world), template=TEMPLATE)
        k = _built[memo] = compile_source(src, arch, load=load, meta=meta)
    return k


def build_for(peer, row_bytes: int, timeout_ns: int = TIMEOUT_NS, arch: Optional[str] = None, load: bool = True):
    """The kernel for this peer group's layout (compile or load before any rank can spin on a peer's compile)."""
    L = peer.layout
    if L.max_world != MAX_WORLD:
        raise ValueError(f"peer buffers laid out for max_world {L.max_world}, kernels for {MAX_WORLD}")
    return build(row_bytes, peer.world, L.hidden, L.max_m, L.gather_row_bytes, timeout_ns, arch, load)


def row_bytes_of(x) -> int:
    return x.shape[-1] * x.element_size() if x.dim() == 2 else -1


def launch_ok(x, peer) -> Optional[str]:
    """None if all_gather_oneshot takes x [M, C] (any dtype) on peer's group, else why not."""
    if x.dim() != 2:
        return "input is not 2-D"
    M = x.shape[0]
    if not 1 <= M <= peer.layout.max_m:
        return f"M={M} outside 1..{peer.layout.max_m}"
    if x.device != peer.device:
        return f"input on {x.device}, peer buffers on {peer.device}"
    rb = row_bytes_of(x)
    why = supports(rb, peer.world, peer.layout)
    if why:
        return why
    if x.stride(-1) != 1 or (M > 1 and (x.stride(0) * x.element_size()) % 16) or x.data_ptr() % 16:
        return "rows must be unit-stride and 16-byte aligned"
    return None


def _words(t):
    """A [.., C] tensor's bytes as int32 words (a view: same storage)."""
    import torch
    return t.view(torch.int32) if t.dtype != torch.int32 else t


def all_gather_oneshot(x, peer, out=None, layout: str = "rank_major", timeout_ns: int = TIMEOUT_NS):
    """Gather this rank's x [M, C] from every rank of peer's group, in-kernel. layout "rank_major" returns
    [W * M, C] (all_gather_into_tensor's layout), "row_major" [M, W * C] (cat along the last dim). `out` may be
    given (that shape, x's dtype, 16-byte-aligned rows). The caller checked launch_ok(x, peer); a wait that timed
    out leaves its rows unwritten and shows in check_error(peer) (which syncs)."""
    import torch
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} not in {LAYOUTS}")
    M, C = x.shape
    W = peer.world
    shape = (W * M, C) if layout == "rank_major" else (M, W * C)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {shape} {x.dtype} with unit last stride")
    k = build_for(peer, row_bytes_of(x), timeout_ns)
    ow = _words(out)
    cw = ow.shape[-1] // (1 if layout == "rank_major" else W)
    o3 = ow.view(W, M, cw) if layout == "rank_major" else ow.view(M, W, cw).permute(1, 0, 2)
    k(_words(x), o3, peer.ptrs, peer.counters("allgather"))
    return out


def check_error(peer) -> None:
    """Raise RuntimeError if a gather kernel on this rank timed out waiting for a peer (synchronizes)."""
    from .mixnorm_allreduce import check_error as _check
    _check(peer, "allgather")


def all_gather_cuda_or_none(x, group_name: str, group_size: Optional[int] = None, layout: str = "rank_major"):
    """`all_gather_into_tensor(x, group_size, group_name)` + wait through the in-kernel gather, or None where it does
    not apply (K3FUSE_INKERNEL_COLLECTIVES != "1", no group, world 1 or > MAX_WORLD, group_size not the group's,
    not CUDA, M > max_m, rows that are not 16-byte multiples or wider than the gather slots, misaligned).
    The answer is the same on every rank for the same call (peer_buffers.resolve), so no rank spins on a peer that
    took the functional path. Returns the [W * M, C] tensor (layout "row_major": [M, W * C])."""
    import torch
    from k3fuse import peer_buffers as pbuf
    if not group_name or not pbuf.inkernel_enabled():
        return None
    if x.dim() != 2 or x.device.type != "cuda" or not 1 <= x.shape[0] <= pbuf.MAX_M:
        return None
    rb = row_bytes_of(x)
    if supports(rb, 2) is not None:
        return None
    peer, _why = pbuf.resolve(group_name, x.device)
    if peer is None or (group_size is not None and group_size != peer.world):
        return None
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)     # a fresh allocation: contiguous, 16-byte aligned
    if launch_ok(x, peer):
        return None
    return all_gather_oneshot(x, peer, layout=layout)
