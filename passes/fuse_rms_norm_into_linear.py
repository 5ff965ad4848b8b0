"""fuse_rms_norm_into_linear: `k3fuse.rms_norm` feeding only one `k3fuse.linear` becomes `k3fuse.rms_norm_linear`
(the GEMV with the RMSNorm fused: every CTA multiplies the x vectors it loads by the norm weight, sums their squares
alongside the dot products, and scales its outputs by the row's rsqrt(mean(x^2) + eps) in the epilogue).

Where it fires in K3: per MoE layer (92) the routed_expert_norm over the routed experts' combined output before the
routed latent up-projection; per MLA layer (24) q_a_layernorm before q_b. 116 in K3. On the H200 each such norm was
a separate Inductor kernel at M = 1 (a launch, ~1-2 us plus its gap). The other norms are taken already: into
`fused_residual_norm` (the AttnRes mix-norms), `kda_decode` (the gated head norm); kv_a_layernorm feeds the latent
cache, not a GEMV.

Only where the norm's weight, its output dtype and the GEMV weight share one dtype (what the fused kernel
computes from x * norm_w). The kernel runs at M <= 4 where the GPU's tuning table does not split the shape (the
routed up at M = 3-4 on the H200) and under codegen/registry.py NORM_LINEAR_MAX_WEIGHT_BYTES (every K3 weight since
session 8 moved the norm from a prologue, which made the 51 MB routed up slower, to the epilogue): elsewhere the
lowering inlines the op's reference, rms_norm + linear (compiler/lowering.py, KERNEL_APPLIES), so the graph after
this pass is the same for every batch size and GPU. Runs after `fuse_shared_input_linears` (a norm
feeding a group stays unfused) and before `insert_prefetch`, which reads the fused op's weight.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .base import K3FusePass, PassContext

k3 = torch.ops.k3fuse


class FuseRmsNormIntoLinear(K3FusePass):
    name = "fuse_rms_norm_into_linear"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        matches = 0
        for norm in list(graph.find_nodes(op="call_function", target=k3.rms_norm.default)):
            x, norm_w, eps, out_dtype = norm.args
            if len(norm.users) != 1:
                continue
            lin = next(iter(norm.users))
            if lin.target != k3.linear.default or lin.args[0] is not norm:
                continue
            w = lin.args[1]
            dts = {out_dtype, _dtype(norm_w), _dtype(w)}
            if len(dts) != 1:
                continue
            with graph.inserting_before(lin):
                fused = graph.call_function(k3.rms_norm_linear.default, (x, norm_w, float(eps), w))
            fused.meta["val"] = lin.meta.get("val")
            lin.replace_all_uses_with(fused)
            graph.erase_node(lin)
            graph.erase_node(norm)
            matches += 1
        return matches


def _dtype(n):
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else None
