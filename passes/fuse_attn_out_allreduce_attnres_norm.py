"""fuse_attn_out_allreduce_attnres_norm: row-parallel projection -> all-reduce -> AttnRes prefix update -> depth
mix -> RMSNorm, as one `k3fuse.fused_residual_norm` op returning (normed activation, new prefix).

Where it fires in K3 (K3_MODEL.md section 3), twice per layer:
  - after attention: o_proj -> all-reduce -> prefix = a (block boundary: restart) or prefix + a -> mix(blocks,
    prefix; w_mlp) -> post_attention_layernorm;
  - after the MLP: its reduced output (dense: down_proj -> all-reduce; MoE: routed + all-reduced shared down_proj,
    the routed part entering as `addend`) -> prefix + mlp_out -> mix -> the next layer's input_layernorm, or, after
    the last layer, the final mix -> final norm. At a block boundary the new prefix is also the block snapshot.
So a K3 graph has exactly 2 x num_hidden_layers matches. Layer 0's input norm (over the embedding) does not match.
At TP = 1 there is no all-reduce and the rest is fused. Runs on canonical k3fuse ops (after `canonicalize`).
The mix's score vector, res_norm.weight * res_proj.weight in fp32, goes in as its two factors (w_mix,
w_mix_scale): the kernel multiplies them, so the product is not a separate kernel every step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._inductor.pattern_matcher import stable_topological_sort

from .base import K3FusePass, PassContext

k3 = torch.ops.k3fuse
aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _single_user(n: fx.Node) -> bool:
    return len(n.users) == 1


@dataclass
class _Out:
    """A reduced row-parallel output: linear(o, w) [-> all_reduce -> wait] [+ addend]."""
    o: fx.Node
    w: fx.Node
    group: str
    addend: fx.Node | None
    chain: list          # nodes consumed (must have no other users)


def _match_reduced_linear(n) -> _Out | None:
    if not isinstance(n, fx.Node):
        return None
    group = ""
    chain = [n]
    if n.target == c10d.wait_tensor.default:
        ar = n.args[0]
        if not (isinstance(ar, fx.Node) and ar.target == c10d.all_reduce.default and ar.args[1] == "sum"
                and _single_user(ar)):
            return None
        group, n = ar.args[2], ar.args[0]
        chain += [ar, n]
    if isinstance(n, fx.Node) and n.target == k3.linear.default:
        return _Out(n.args[0], n.args[1], group, None, chain)
    return None


def _match_output(n) -> _Out | None:
    """y = reduced linear, or routed + reduced linear (the MoE: shared expert's down_proj + routed output)."""
    out = _match_reduced_linear(n)
    if out is not None:
        return out
    if isinstance(n, fx.Node) and n.target == aten.add.Tensor and len(n.args) == 2:
        for i in (1, 0):
            out = _match_reduced_linear(n.args[i])
            if out is not None and all(_single_user(c) for c in out.chain):
                out.addend = n.args[1 - i]
                out.chain.insert(0, n)
                return out
    return None


def _weight_factors(w_mix: fx.Node):
    """(a, b, b_shape) for w_mix = fp32(a) * view(fp32(b), b_shape), AttnRes's score vector res_norm.weight *
    res_proj.weight formed every step from two parameters (one more launch per mix on a GPU); None otherwise.
    The fused op then takes the two factors (w_mix, w_mix_scale) and the kernel multiplies them."""
    if not (isinstance(w_mix, fx.Node) and w_mix.target == aten.mul.Tensor and _single_user(w_mix)):
        return None
    out = []
    for f in w_mix.args:
        shape = None
        if isinstance(f, fx.Node) and f.target in (aten.view.default, aten.reshape.default) and _single_user(f):
            f, shape = f.args
        if not (isinstance(f, fx.Node) and f.target == torch.ops.prims.convert_element_type.default
                and f.args[1] == torch.float32 and _single_user(f)):
            return None
        out.append((f.args[0], shape))
    (a, sa), (b, sb) = out
    if sa is not None:
        (a, sa), (b, sb) = (b, sb), (a, sa)
    if sa is not None:
        return None
    return a, b, sb


class FuseAttnOutAllReduceAttnResNorm(K3FusePass):
    name = "fuse_attn_out_allreduce_attnres_norm"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        matches = 0
        for norm in list(graph.find_nodes(op="call_function", target=k3.rms_norm.default)):
            m = self._match(norm)
            if m is None:
                continue
            self._rewrite(graph, norm, *m)
            matches += 1
        if matches:
            stable_topological_sort(graph)
        return matches

    def _match(self, norm: fx.Node):
        x, norm_w, norm_eps, out_dtype = norm.args
        fp32_norm = True
        if x.target == torch.ops.prims.convert_element_type.default and x.args[0].target == k3.attnres_mix.default:
            fp32_norm, x = False, x.args[0]          # HF variant: the mix rounded before the norm
        # A mix of one source (the prefix itself) only occurs at layer 0's input norm, over the embedding: no
        # output to fuse there. Requiring the mix op also keeps plain norm(linear(x)) (MLA LoRA norms) out.
        if x.target != k3.attnres_mix.default or not _single_user(x):
            return None
        sources, w_mix, mix_eps = x.args
        blocks, new_prefix = list(sources[:-1]), sources[-1]
        if not isinstance(new_prefix, fx.Node):
            return None
        out, prefix = None, None
        if new_prefix.target == aten.add.Tensor:      # prefix + output (tried first: add(a, b) is ambiguous)
            for i in (1, 0):
                out = _match_output(new_prefix.args[i])
                if out is not None:
                    prefix = new_prefix.args[1 - i]
                    break
        if out is None:                               # restart at a block boundary: the prefix is the output
            out = _match_output(new_prefix)
        if out is None or not all(_single_user(c) for c in out.chain if c is not new_prefix):
            return None
        return new_prefix, out, prefix, blocks, w_mix, mix_eps, norm_w, norm_eps, fp32_norm

    def _rewrite(self, graph, norm, new_prefix, out, prefix, blocks, w_mix, mix_eps, norm_w, norm_eps, fp32_norm):
        kwargs = {}
        with graph.inserting_before(norm):
            factors = _weight_factors(w_mix)
            if factors is not None:
                a, b, b_shape = factors
                w_mix = a
                kwargs["w_mix_scale"] = b if b_shape is None else graph.call_function(aten.view.default, (b, b_shape))
            fused = graph.call_function(k3.fused_residual_norm.default, (
                out.o, out.w, out.addend, prefix, blocks, w_mix, norm_w, float(mix_eps), float(norm_eps),
                out.group, fp32_norm), kwargs)
            normed = graph.call_function(lambda_getitem(), (fused, 0))
            prefix_out = graph.call_function(lambda_getitem(), (fused, 1))
        fused.meta["val"] = (norm.meta.get("val"), new_prefix.meta.get("val"))
        normed.meta["val"], prefix_out.meta["val"] = norm.meta.get("val"), new_prefix.meta.get("val")
        norm.replace_all_uses_with(normed)
        new_prefix.replace_all_uses_with(prefix_out)
        # Erase the old chain explicitly: DCE keeps collectives (they are side-effecting), and a stale
        # all-reduce would still run.
        erase_dead(graph, [norm, new_prefix, *out.chain])


def erase_dead(graph: fx.Graph, nodes) -> None:
    """Erase nodes (and their producers, transitively) that no longer have users."""
    work = list(nodes)
    while work:
        n = work.pop()
        if isinstance(n, fx.Node) and n.op == "call_function" and not n.users and not n._erased:
            inputs = n.all_input_nodes
            graph.erase_node(n)
            work.extend(inputs)


def lambda_getitem():
    import operator
    return operator.getitem
