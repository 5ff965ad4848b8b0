"""fuse_situ_glu_into_down_proj: `k3fuse.situ_glu` feeding only the GEMV of a `k3fuse.fused_residual_norm` (as its
`o`) goes into that op as its SiTU-GLU prologue (`situ_beta` / `situ_lbeta`): the down projection's GEMV reads the
gate_up activation and computes bf16(situ(gate, up)) per loaded x vector (codegen/gemv.py, fusion x_situ; simt and
mma variants).

Where it fires in K3: per MoE layer (92) the shared expert's SiTU-GLU before its down projection, which pass
`fuse_attn_out_allreduce_attnres_norm` made the GEMV half of the layer's closing fused_residual_norm; and the dense
layer-0 MLP's SiTU-GLU before its down_proj (1). 93 in K3 at TP = 1. On the H200 each was a separate Inductor kernel
at M <= 8 (a launch, and a break in the PDL chain of the generated kernels around it). Under TP the shared
expert's gate_up + SiTU-GLU runs on the side stream (`side_linear_situ`, pass `split_moe_across_ranks`), so there
is nothing to match; where the GEMV prologue does not apply at run time (cuBLAS-routed shapes, M > 64, a group),
the CUDA implementation applies the SiTU-GLU reference first, as the unfused graph would.
Runs after `split_moe_across_ranks` (which moves the shared expert's SiTU-GLU to the side stream) and
`fuse_shared_input_linears`.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .base import K3FusePass, PassContext

k3 = torch.ops.k3fuse


class FuseSituGluIntoDownProj(K3FusePass):
    name = "fuse_situ_glu_into_down_proj"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        matches = 0
        for frn in list(graph.find_nodes(op="call_function", target=k3.fused_residual_norm.default)):
            situ = frn.args[0]
            if not (isinstance(situ, fx.Node) and situ.target == k3.situ_glu.default and len(situ.users) == 1):
                continue
            if frn.kwargs.get("situ_beta") is not None:
                continue
            gate_up, beta, lbeta = situ.args
            frn.args = (gate_up,) + tuple(frn.args[1:])
            frn.kwargs = dict(frn.kwargs, situ_beta=float(beta), situ_lbeta=float(lbeta))
            graph.erase_node(situ)
            matches += 1
        return matches
