"""fuse_topk_into_linear_group_router: `k3fuse.topk_from_logits` of a `k3fuse.linear_group_router`'s logits becomes
part of that op, `k3fuse.linear_group_router_topk` (the router's selection in the grouped GEMV's last CTA).

Why: the top-k kernel reads 3.5 KB and writes 128 bytes per token, yet took ~6 us in the KDA + MoE layer (TP16
widths, M = 1, H200). In the group's last CTA the logits are in L2 and the launch goes. Measured (session 10): the
selection itself is most of those 6 us (the group grew by 6.0 us), so the gain is the launch only, at the same
kernel time.

Where it fires in K3: per MoE layer at TP = 1 (92), after `fuse_router_into_linear_group`. Under TP > 1 the logits
are all-gathered before the selection: no match, by design. The fused selection runs where the group's simt config
has 256 threads (M = 1 on the H200; with 64 threads at M = 2 it measured +30 us per layer); elsewhere, and with
K3FUSE_TOPK_IN_GROUP=0, the lowering splits the op back into linear_group_router + topk_from_logits
(compiler/lowering.py, KERNEL_APPLIES), so the graph after this pass is the same for every batch size, GPU and
setting. Runs before `insert_prefetch`, which reads the op's weights.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .base import K3FusePass, PassContext

k3 = torch.ops.k3fuse


class FuseTopkIntoLinearGroupRouter(K3FusePass):
    name = "fuse_topk_into_linear_group_router"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        matches = 0
        order = {n: i for i, n in enumerate(graph.nodes)}   # the rewrite below keeps every node's place
        for sel in list(graph.find_nodes(op="call_function", target=k3.topk_from_logits.default)):
            lg, bias, top_k, renorm, scale = sel.args
            if not (isinstance(lg, fx.Node) and lg.target is operator.getitem and len(lg.users) == 1):
                continue
            grp, j = lg.args
            if grp.target != k3.linear_group_router.default or j != len(grp.args[1]):
                continue
            if isinstance(bias, fx.Node) and order[bias] > order[grp]:
                continue
            if not all(u.target is operator.getitem for u in sel.users):
                continue
            x, ws, w_r, situ_member, beta, lbeta = grp.args
            # the group node becomes the fused op in place: its members' getitems stay, ids / weights follow them
            grp.target = k3.linear_group_router_topk.default
            grp.args = (x, ws, w_r, bias, top_k, renorm, scale, situ_member, beta, lbeta)
            grp.meta.pop("val", None)        # recomputed by fill_missing_vals; its getitems' values stay right
            for u in list(sel.users):
                u.args = (grp, j + u.args[1])
            graph.erase_node(sel)
            graph.erase_node(lg)
            matches += 1
        if not matches and graph.find_nodes(op="call_function", target=k3.router_logits.default):
            self.skip_reason = "the router logits are gathered across ranks before the selection (TP > 1)"
        return matches
