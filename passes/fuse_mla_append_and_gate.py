"""fuse_mla_append_and_gate: the glue around `k3fuse.mla_attention` (the kv_a RMSNorm of the latent, the cat with
k_pe, the cache append at seq_lens, and the sigmoid output gate with its cast) becomes the in-place
`k3fuse.mla_append_attention_`.

Where it fires in K3: once per MLA layer (24 of 93). The captured graph is functional: the new token's row is
`index_put(cache, [arange(M), seq_lens], cat([rms_norm(ckv[:, :C]), ckv[:, C:]]))`, attention reads that new cache,
and AOTAutograd writes it back with a trailing `copy_(cache, new_cache)`; after the attention comes
`o * sigmoid(g.float())` and the cast to bf16 before o_proj. On the H200 (TP16 M = 1, session 9's profile) these
were four Inductor kernels per MLA layer (the norm, the cat, the index_put, the gate), each also a break in the
kernels' programmatic-dependent-launch chain. The fused op's kernel does the append in the attention's first
launch (one CTA per token normalises the latent and writes the row before the split kernel reads the cache) and
the gate in its last (the combine's epilogue), so the attention stays three launches and the glue goes.

Fires only when the cache is a graph input whose only other user is that copy back (nothing else reads the old
cache, so writing it in the op is unobservable), the row is exactly that norm + cat of one ckv tensor split at
C = kv_lora, and the index is (arange(M), the attention's seq_lens). The gate is absorbed when the attention's
only user is that multiply (the cast too when the gated output only feeds a view + cast); otherwise the op is
ungated. Runs after the functional passes (with write_kda_state_in_place: the graph is no longer functional after
it). Mutating ops are never inlined by the lowering (compiler/lowering.py).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .base import K3FusePass, PassContext, logger

aten, prims, k3 = torch.ops.aten, torch.ops.prims, torch.ops.k3fuse
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_BIG = 2 ** 62


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _strip_views(n: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """(the tensor under a chain of views, the view nodes passed)."""
    views = []
    while isinstance(n, fx.Node) and n.target in _VIEWS:
        views.append(n)
        n = n.args[0]
    return n, views


def _is_arange(n, M) -> bool:
    """prims.iota(M, start=0, step=1) or aten.arange(M): the row index of the append."""
    if not isinstance(n, fx.Node):
        return False
    if n.target is prims.iota.default:
        return n.args[0] == M and n.kwargs.get("start", 0) == 0 and n.kwargs.get("step", 1) == 1
    return n.target is aten.arange.default and n.args[0] == M


def _is_slice(n, src, start, stop_min) -> bool:
    """aten.slice(src, last dim, start, end >= stop_min) with step 1."""
    if not isinstance(n, fx.Node) or n.target is not aten.slice.Tensor or n.args[0] is not src:
        return False
    names = ("dim", "start", "end", "step")
    a = dict(zip(names, n.args[1:]), **n.kwargs)
    dim, s, e, step = (a.get(k) for k in names)
    return (dim in (1, -1) and (s or 0) == start and (step or 1) == 1
            and (e if e is not None else _BIG) >= stop_min)


def _append_site(a: fx.Node):
    """(ckv, kv_norm_w, eps, norm_dtype, cache, nodes that die with the fusion) of the append feeding mla_attention
    node `a`, or a string saying why not."""
    qn, qp, new_cache, kv_b, sl = a.args[:5]
    if not isinstance(new_cache, fx.Node) or new_cache.target is not aten.index_put.default:
        return "its cache is not an index_put"
    cache, idx, row = new_cache.args[:3]
    if len(new_cache.args) > 3 and new_cache.args[3]:
        return "an accumulating index_put"
    if cache.op != "placeholder":
        return "the cache is not a graph input"
    copies = [u for u in new_cache.users if u.target is aten.copy_.default and u.args == (cache, new_cache)]
    if set(new_cache.users) != {a, *copies} or len(copies) != 1:
        return "the appended cache has other users than the attention and its copy back"
    if set(cache.users) != {new_cache, copies[0]}:
        return "the old cache is read elsewhere"
    qv, kvb, cv = _val(qn), _val(kv_b), _val(cache)
    if qv is None or kvb is None or cv is None:
        return "no meta values"
    M, C, CR = qv.shape[0], kvb.shape[1], cv.shape[-1]
    if len(idx) != 2 or idx[1] is not sl or not _is_arange(idx[0], M):
        return "the index is not (arange(M), seq_lens)"
    cat, views = _strip_views(row)
    if cat.target is not aten.cat.default or len(cat.args[0]) != 2 or (cat.args[1] if len(cat.args) > 1 else 0) \
            not in (1, -1):
        return "the row is not a cat of two parts on the last dim"
    norm, kpe = cat.args[0]
    if norm.target is not k3.rms_norm.default:
        return "the row's first part is not an rms_norm"
    lat, w, eps, ndt = norm.args
    ckv = lat.args[0] if isinstance(lat, fx.Node) and lat.target is aten.slice.Tensor else None
    cval = _val(ckv)
    if cval is None or cval.dim() != 2 or cval.shape[-1] != CR:
        return "the row does not come from one [M, C + r] tensor"
    if not (_is_slice(lat, ckv, 0, C) and _val(lat).shape[-1] == C and _is_slice(kpe, ckv, C, CR)):
        return f"ckv is not split at C = {C}"
    dead = [copies[0], new_cache] + views + [cat, norm, lat, kpe, idx[0]]
    return ckv, w, float(eps), ndt, cache, dead


def _gate_site(a: fx.Node):
    """(gate tensor node, out_dtype, node whose uses the op's result takes, view shape or None, dead nodes) of the
    output gate after `a`, or None."""
    if len(a.users) != 1:
        return None
    mul = next(iter(a.users))
    if mul.target is not aten.mul.Tensor or len(mul.args) != 2 or a not in mul.args:
        return None
    sig = mul.args[1] if mul.args[0] is a else mul.args[0]
    if not isinstance(sig, fx.Node) or sig.target is not aten.sigmoid.default or len(sig.users) != 1:
        return None
    dead, g = [mul, sig], sig.args[0]
    while isinstance(g, fx.Node) and (g.target in _VIEWS or (
            g.target is prims.convert_element_type.default and g.args[1] == torch.float32)) and len(g.users) == 1:
        dead.append(g)
        g = g.args[0]
    gv, av = _val(g), _val(a)
    if gv is None or av is None or gv.numel() != av.numel() or gv.dim() != 2 or gv.dtype not in (
            torch.bfloat16, torch.float16, torch.float32):
        return None
    # the cast after the gated output's view (o.reshape(M, h * v).to(x.dtype)) goes into the op too, and the
    # contiguous clone that reshape may trace as in front of the view (a copy of the op's already contiguous output:
    # on the H200 an Inductor kernel of its own, ~1 us per MLA layer, until session 25)
    if len(mul.users) == 1:
        view, clone = next(iter(mul.users)), []
        if view.target is aten.clone.default and view.kwargs.get("memory_format", torch.contiguous_format) in (
                torch.contiguous_format, torch.preserve_format) and len(view.users) == 1:
            clone, view = [view], next(iter(view.users))
        if view.target in _VIEWS and len(view.users) == 1:
            cvt = next(iter(view.users))
            if cvt.target is prims.convert_element_type.default and cvt.args[1] in (torch.bfloat16, torch.float16):
                return g, cvt.args[1], cvt, list(view.args[1]), dead + clone + [view, cvt]
    return g, None, mul, None, dead


def _erase_unused(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase the nodes of `nodes` that have no users, until none is left to erase (users before producers)."""
    todo = list(dict.fromkeys(nodes))
    while True:
        gone = [n for n in todo if not n.users]
        if not gone:
            return
        for n in gone:
            graph.erase_node(n)
            todo.remove(n)


class FuseMlaAppendAndGate(K3FusePass):
    name = "fuse_mla_append_and_gate"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        matches = 0
        sites = list(graph.find_nodes(op="call_function", target=k3.mla_attention.default))
        for a in sites:
            site = _append_site(a)
            if isinstance(site, str):
                logger.debug("k3fuse pass %s: %s left unfused: %s", self.name, a.name, site)
                continue
            ckv, w, eps, ndt, cache, dead = site
            gate = _gate_site(a)
            g, odt, tail, shape, gdead = gate if gate else (None, None, a, None, [])
            qn, qp, _, kv_b, sl, scale = a.args
            with graph.inserting_before(tail):
                op = graph.call_function(k3.mla_append_attention_.default,
                                         (qn, qp, ckv, w, eps, ndt, cache, kv_b, sl, float(scale), g, odt))
                res = graph.call_function(aten.view.default, (op, shape)) if shape is not None else op
            tail.replace_all_uses_with(res)
            _erase_unused(graph, [tail, a] + gdead + dead)
            matches += 1
        if not sites:
            self.skip_reason = "no k3fuse.mla_attention in the graph"
        return matches
