"""fuse_q_b_into_mla_attention: the query's projection (`k3fuse.rms_norm_linear`: q_a_layernorm + q_b_proj) whose
output only feeds `k3fuse.mla_append_attention_` as q_nope / q_pe goes into the attention op, which becomes
`k3fuse.mla_qb_append_attention_`.

Where it fires in K3: once per MLA layer (24 of 93), on `q = q_b_proj(q_a_layernorm(cq)).view(M, h, n + r)` and its
two slices at n. On the H200 the q_b GEMV is its own launch (3.4-3.6 us at TP16 M = 1 for 3.5 MB of weights) whose
output is read by nothing but the attention; the per-head attention kernel (codegen/mla_attention.py, clusters of
the splits of one (head, row)) computes its head's 192 query rows itself, each CTA of the cluster its share, from
weight rows it copies into shared memory before the chain's wait: one launch fewer per MLA layer. Where that kernel
does not run (its batch buckets, cluster sizes, shapes) the op's CUDA implementation launches the two kernels it
replaces, so the graph after this pass is the same for every batch size and GPU.

Fires only on the exact shape of that slice pair (a view [M, h, n + r] of the GEMV's output, sliced on the last dim
at [0, n) and [n, end), both slices used only by the attention op, the view only by them, the GEMV only by the
view). Runs after `fuse_mla_append_and_gate` (it matches that pass's op) and `fuse_rms_norm_into_linear`.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .base import K3FusePass, PassContext, logger

aten, k3 = torch.ops.aten, torch.ops.k3fuse
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _last_dim_slice(n, src):
    """(start, end) of aten.slice(src, last dim, start, end, step 1), else None."""
    if not isinstance(n, fx.Node) or n.target is not aten.slice.Tensor or n.args[0] is not src:
        return None
    names = ("dim", "start", "end", "step")
    a = dict(zip(names, n.args[1:]), **n.kwargs)
    dim, s, e, step = (a.get(k) for k in names)
    val = src.meta.get("val")
    if val is None or dim not in (val.dim() - 1, -1) or (step or 1) != 1:
        return None
    w = val.shape[-1]
    return (s or 0), min(w, e if e is not None else w)


def _site(a: fx.Node):
    """(the rms_norm_linear node, heads, dead nodes) feeding attention node `a` as q_nope / q_pe, or why not."""
    qn, qp = a.args[:2]
    view = qn.args[0] if isinstance(qn, fx.Node) and qn.target is aten.slice.Tensor else None
    if view is None or not isinstance(view, fx.Node) or view.target not in _VIEWS:
        return "q_nope is not a slice of a view"
    lin = view.args[0]
    if not isinstance(lin, fx.Node) or lin.target is not k3.rms_norm_linear.default:
        return "q is not a k3fuse.rms_norm_linear output"
    vv = view.meta.get("val")
    if vv is None or vv.dim() != 3:
        return "q's view is not [M, h, n + r]"
    sn, sp = _last_dim_slice(qn, view), _last_dim_slice(qp, view)
    w = vv.shape[-1]
    if sn is None or sp is None or sn[0] != 0 or sp != (sn[1], w) or not 0 < sn[1] < w:
        return "q_nope / q_pe are not q[..., :n] / q[..., n:]"
    if set(qn.users) != {a} or set(qp.users) != {a} or set(view.users) != {qn, qp} or set(lin.users) != {view}:
        return "the query is used elsewhere"
    if a.args[0] is a.args[1]:
        return "q_nope is q_pe"
    return lin, int(vv.shape[1]), [qn, qp, view, lin]


class FuseQbIntoMlaAttention(K3FusePass):
    name = "fuse_q_b_into_mla_attention"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        matches = 0
        sites = list(graph.find_nodes(op="call_function", target=k3.mla_append_attention_.default))
        for a in sites:
            site = _site(a)
            if isinstance(site, str):
                logger.debug("k3fuse pass %s: %s left unfused: %s", self.name, a.name, site)
                continue
            lin, heads, dead = site
            cq, qw, qeps, w_qb = lin.args
            with graph.inserting_before(a):
                op = graph.call_function(k3.mla_qb_append_attention_.default,
                                         (cq, qw, float(qeps), w_qb, heads) + tuple(a.args[2:]))
            op.meta.update(a.meta)
            a.replace_all_uses_with(op)
            graph.erase_node(a)
            for n in dead:
                if not n.users:
                    graph.erase_node(n)
            matches += 1
        if not sites:
            self.skip_reason = "no k3fuse.mla_append_attention_ in the graph"
        return matches
