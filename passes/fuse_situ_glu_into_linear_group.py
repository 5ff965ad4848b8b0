"""fuse_situ_glu_into_linear_group: `k3fuse.situ_glu` of one `k3fuse.linear_group` output becomes that group's SiTU-GLU
epilogue, `k3fuse.linear_group_situ` (the grouped GEMV CTAs of that member read matching gate and up rows and write
situ(gate, up); each value is computed once, in the producer).

Where it fires in K3: per MoE layer at TP = 1 (92), the shared expert's gate_up, grouped with the routed latent down
projection by `fuse_shared_input_linears`. On the H200 (KDA + MoE at TP16 widths, M = 1) its SiTU-GLU was a separate
Inductor kernel (~1.2 us) that also broke the PDL chain of the generated kernels around it. Under TP > 1 the shared
expert is `side_linear_situ` (a side stream, no group): no match, by design. The SiTU in the consumer instead (the
shared down projection's x prologue) measured slower: every CTA recomputed all of x (benchmarks/PERF_NOTES.md,
session 7).

The grouped epilogue is generated for the simt GEMV only (M <= 2 with the H200 tables): elsewhere the lowering
inlines the op's reference, linear_group + situ_glu (compiler/lowering.py, KERNEL_APPLIES), so the graph after this
pass is the same for every batch size and GPU. One SiTU member per group (K3 has one). Runs after
`fuse_shared_input_linears` and before `insert_prefetch`, which reads the group's weights.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .base import K3FusePass, PassContext

k3 = torch.ops.k3fuse


class FuseSituGluIntoLinearGroup(K3FusePass):
    name = "fuse_situ_glu_into_linear_group"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        matches = 0
        for grp in list(graph.find_nodes(op="call_function", target=k3.linear_group.default)):
            x, ws = grp.args[:2]
            member = _situ_member(grp)
            if member is None:
                continue
            j, item, situ = member
            beta, lbeta = (float(a) for a in situ.args[1:3])
            # the group node becomes the fused op in place; its j-th output is now the SiTU-GLU output
            grp.target = k3.linear_group_situ.default
            grp.args = (x, ws, j, beta, lbeta)
            if "val" in situ.meta and "val" in grp.meta:
                item.meta["val"] = situ.meta["val"]
                grp.meta["val"] = [situ.meta["val"] if i == j else v for i, v in enumerate(grp.meta["val"])]
            situ.replace_all_uses_with(item)
            graph.erase_node(situ)
            matches += 1
        if not matches and graph.find_nodes(op="call_function", target=k3.side_linear_situ.default):
            self.skip_reason = "the shared expert runs as side_linear_situ (TP > 1): no grouped gate_up"
        return matches


def _situ_member(grp: fx.Node):
    """(index, getitem node, situ_glu node) of the first member whose only use is a situ_glu of all of it."""
    if not all(u.target is operator.getitem for u in grp.users):
        return None
    for item in sorted(grp.users, key=lambda u: u.args[1]):
        if len(item.users) != 1:
            continue
        situ = next(iter(item.users))
        if situ.target == k3.situ_glu.default and situ.args[0] is item:
            return item.args[1], item, situ
    return None
