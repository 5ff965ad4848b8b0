"""Kernel family: k3fuse::prefetch_l2, an L2 prefetch of weights (cp.async.bulk.prefetch.L2) on a side stream.

prefetch_l2(token, weights, budget_bytes) forks a side stream from the current stream, launches the prefetch
kernel there, and leaves the join pending: `join_pending()` makes the launching stream wait for it. The registry
calls join_pending() before every other generated kernel it launches (the prefetch kernel only issues requests,
so it is long finished by then), and a CUDA-graph capture must call it before the capture ends (a forked stream
has to rejoin the capture stream).
"""
from __future__ import annotations

import threading
from typing import Optional

from . import knobs
from .render import render

FAMILY = "prefetch_l2"
TEMPLATE = "prefetch_l2_bulk.py.jinja"
CHUNK = 16 * 1024
PER_CTA = 1

_tables: dict = {}
_side: dict = {}
_pending: list = []
_lock = threading.Lock()


def render_source(chunk: int = CHUNK, per_cta: int = PER_CTA) -> str:
    if chunk % 16 or not 1 <= per_cta <= 32:
        raise ValueError("chunk must be a multiple of 16 and per_cta in 1..32")
    return render(TEMPLATE, CHUNK=chunk, PER_CTA=per_cta)


_built: dict = {}


def build(arch: Optional[str] = None, load: bool = True, chunk: int = CHUNK, per_cta: int = PER_CTA):
    from .compile import compile_source, current_arch
    arch = arch or current_arch()
    memo = (arch, load, chunk, per_cta, knobs.key(FAMILY))
    if memo not in _built:
        _built[memo] = compile_source(render_source(chunk, per_cta), arch, load=load,
                                      meta=dict(family=FAMILY, op="k3fuse::prefetch_l2", template=TEMPLATE,
                                                chunk=chunk, per_cta=per_cta))
    return _built[memo]


def chunk_table(spans: list[tuple[int, int]], budget_bytes: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """(address, bytes) rows covering the spans in order until the budget is spent; 16-byte granules."""
    rows = []
    left = max(0, int(budget_bytes))
    for addr, nbytes in spans:
        start = (addr + 15) // 16 * 16
        n = min(nbytes - (start - addr), left) // 16 * 16
        off = 0
        while off < n:
            step = min(chunk, n - off)
            rows.append((start + off, step))
            off += step
        left -= n
        if left < 16:
            break
    return rows


def _table(weights, budget_bytes, chunk=CHUNK):
    import torch
    spans = tuple((w.data_ptr(), w.numel() * w.element_size()) for w in weights)
    key = (spans, int(budget_bytes), weights[0].device.index if weights else None, chunk)
    t = _tables.get(key)
    if t is None:
        rows = chunk_table(list(spans), budget_bytes, chunk)
        if not rows:
            return None
        # pinned host copy: a copy from pageable memory is refused inside a CUDA-graph capture (seen on the
        # H200, 2026-11-29, when the first prefetch_l2 call of a shape happened during capture)
        host = torch.tensor(rows, dtype=torch.int64).pin_memory()
        t = host.to(weights[0].device, non_blocking=True)
        _tables[key] = (t, host)  # keep the pinned source alive as long as the table
        return t
    return t[0]


def prefetch_l2(token, weights, budget_bytes, chunk: int = CHUNK, per_cta: int = PER_CTA) -> None:
    import torch
    weights = [w for w in weights if w.is_cuda and w.numel() > 0]
    if not weights or budget_bytes <= 0:
        return None
    k = build(chunk=chunk, per_cta=per_cta)
    tab = _table(weights, budget_bytes, chunk)
    if tab is None:
        return None
    dev = weights[0].device
    cur = torch.cuda.current_stream(dev)
    with _lock:
        side = _side.get(dev.index)
        if side is None:
            side = _side[dev.index] = torch.cuda.Stream(dev)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        k(tab)
    ev = torch.cuda.Event()
    ev.record(side)
    with _lock:
        _pending.append((cur, ev))
    return None


def join_pending() -> None:
    """Make each stream that launched a prefetch wait for it (cheap: the prefetch kernel finishes at once)."""
    if not _pending:
        return
    with _lock:
        items = list(_pending)
        _pending.clear()
    for stream, ev in items:
        stream.wait_event(ev)
