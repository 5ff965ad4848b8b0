"""fuse_router_into_linear_group: the MoE router's logits GEMV joins the grouped GEMV of the linears that read the same
input, as one more member with an fp32 output (`k3fuse.linear_group_router`); the selection stays behind it as
`k3fuse.topk_from_logits`.

Why: the router (896 x 7168, 12.8 MB) ran as its own fp32-output GEMV at 58% of the copy bandwidth (4.9 us in the
KDA + MoE layer at TP16 widths, M = 1, H200), the fixed cost of a launch being most of the gap; inside the 62 MB MoE
group its rows stream at the group's ~96% (about 3.2 us more for the group) and the launch goes.

Where it fires in K3: per MoE layer (92).
  - TP = 1: `router_topk(x, w_router, ...)` and the MoE group (`linear_group_situ`: routed latent down + the shared
    gate_up with its SiTU-GLU epilogue) read the same normed x: one `linear_group_router`, then
    `topk_from_logits(logits, bias, ...)`.
  - TP > 1: `split_moe_across_ranks` leaves `router_logits(x, w_router shard)` next to the sliced routed down
    projection (a single `k3fuse.linear` of the same x): the two become one `linear_group_router` of one member.

The router's weight must have the members' dtype (one kernel reads one weight dtype). The new node goes right after
the last operand of the two (at TP = 1 before the router, which comes first; at TP > 1 after the shard slices of
both weights), which must come before the first use of either. The fp32 member is generated for the simt GEMV only (M <= 2 with
the H200 tables): elsewhere the lowering inlines the op's reference (the group op + router_logits, each with its
own kernel; compiler/lowering.py, KERNEL_APPLIES), so the graph after this pass is the same for every batch size.
Runs after `fuse_situ_glu_into_linear_group` (the group's SiTU member is already in place) and before
`insert_prefetch`, which reads the op's weights.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .base import K3FusePass, PassContext, logger

k3 = torch.ops.k3fuse

_GROUPS = (k3.linear_group.default, k3.linear_group_situ.default, k3.linear.default)
_ROUTERS = (k3.router_topk.default, k3.router_logits.default)


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


class FuseRouterIntoLinearGroup(K3FusePass):
    name = "fuse_router_into_linear_group"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        matches = 0
        skipped = []
        for router in [n for n in graph.nodes if n.op == "call_function" and n.target in _ROUTERS]:
            order = {n: i for i, n in enumerate(graph.nodes)}
            x, w_r = router.args[:2]
            grp = self._group_of(x, w_r, order)
            if grp is None:
                skipped.append(f"{router.name}: no group or linear of its input with its weight dtype")
                continue
            # one node before the earlier of the two, or right after the last operand of both where that comes later
            # (the MoE split's weight slices); either way before the first use of either
            last_in = max(grp.all_input_nodes + router.all_input_nodes, key=order.__getitem__)
            first_use = min((order[u] for u in list(grp.users) + list(router.users)), default=len(order))
            if order[last_in] >= first_use:
                skipped.append(f"{router.name}: an operand of it or of {grp.name} comes after a use of the other")
                continue
            first = min(grp, router, key=order.__getitem__)
            self._rewrite(graph, grp, router, first if order[last_in] < order[first] else last_in)
            matches += 1
        for why in skipped:
            logger.debug("k3fuse pass %s left separate: %s", self.name, why)
        if skipped and not matches:
            self.skip_reason = skipped[0]
        return matches

    @staticmethod
    def _group_of(x, w_r, order):
        """The first group (or lone linear) of x whose weights have the router weight's dtype."""
        wv = _val(w_r)
        if not isinstance(x, fx.Node) or not isinstance(wv, torch.Tensor):
            return None
        for u in sorted(x.users, key=order.__getitem__):
            if u.op != "call_function" or u.target not in _GROUPS or u.args[0] is not x or u.kwargs:
                continue
            ws = u.args[1] if isinstance(u.args[1], (list, tuple)) else [u.args[1]]
            if all(isinstance(_val(w), torch.Tensor) and _val(w).dtype == wv.dtype for w in ws):
                return u
        return None

    @staticmethod
    def _rewrite(graph: fx.Graph, grp: fx.Node, router: fx.Node, where: fx.Node) -> None:
        """The new node goes before `where` (the earlier of the two) or, where that is an operand, after it."""
        x, w_r = router.args[:2]
        if grp.target == k3.linear_group_situ.default:
            ws, situ = grp.args[1], tuple(grp.args[2:5])
        elif grp.target == k3.linear_group.default:
            ws, situ = grp.args[1], (-1, 0.0, 0.0)
        else:
            ws, situ = [grp.args[1]], (-1, 0.0, 0.0)
        # the new nodes get their values from K3FusePass's fill_missing_vals (run on their inputs' fake values)
        ins = graph.inserting_after(where) if where not in (grp, router) else graph.inserting_before(where)
        with ins:
            new = graph.call_function(k3.linear_group_router.default, (x, list(ws), w_r, *situ))
        with graph.inserting_after(new):
            lg = graph.call_function(operator.getitem, (new, len(ws)))
        if grp.target == k3.linear.default:     # the lone linear's value is member 0
            with graph.inserting_after(new):
                y = graph.call_function(operator.getitem, (new, 0))
            grp.replace_all_uses_with(y)
        else:                                   # the group's getitems now read the new node
            grp.replace_all_uses_with(new)
        if router.target == k3.router_logits.default:
            router.replace_all_uses_with(lg)
        else:
            _, _, bias, top_k, renorm, scale = router.args
            with graph.inserting_after(lg):
                sel = graph.call_function(k3.topk_from_logits.default, (lg, bias, top_k, renorm, scale))
            router.replace_all_uses_with(sel)
        graph.erase_node(router)
        graph.erase_node(grp)
