"""split_moe_across_ranks: the MoE's replicated GEMVs computed 1/t per rank, small results gathered.

Where it fires in K3: every MoE layer (1..92) under TP = t > 1. The router (896 x 7168), routed_expert_down_proj
(3584 x 7168) and routed_expert_up_proj (7168 x 3584) are replicated (K3_MODEL.md section 7), so every rank reads
them whole. After this pass rank r reads rows [r E/t, (r+1) E/t) of the router, and 1/t of the down and up
projections' output rows:
  - router: fp32 logits of the rank's experts -> all-gather [M, E] -> sigmoid + bias top-k, once per rank;
  - down:   z shard [M, 3584/t] -> all-gather -> z (every rank needs all of z for its expert slices);
            the two gathers are merged into one (logits bit-cast to the activation dtype, packed beside z);
  - up:     the rank's [M, 7168/t] slice placed in a zero [M, 7168] partial and added to the shared expert's
            partial BEFORE the shared all-reduce that already exists (merged collective: no new collective).
            Without the attention-output fusion the slice is all-gathered instead.
The shared expert's gate_up GEMV + SiTU-GLU depends only on the layer input: it becomes one
`k3fuse.side_linear_situ` (a side stream on CUDA) joined by `k3fuse.stream_join` where the fused down_proj +
all-reduce consumes it, so it overlaps the router, the gathers and the routed experts.

Bytes per MoE layer per rank (bf16 weights, M tokens), from the shapes above:
  read before:  (896 + 3584 + 3584) * 7168 * 2 B = 115.6 MB
  read after:   115.6 MB / t  -> saves 101.2 MB at TP8, 108.4 MB at TP16
  communicated: + one all-gather of the router logits (M x 896 x 4 B) packed with z (M x 3584 x 2 B): 10.8 KB
                per token received per rank; the up-projection rides on the existing [M, 7168] all-reduce.
  collectives per MoE layer: 2 before (routed latent all-reduce, shared all-reduce), 3 after (+ the one
                all-gather; the shared all-reduce now also completes the routed up-projection).
One match per MoE layer. Numerics: identical math; only the order of bf16 additions in the merged all-reduce
changes (routed + shared summed across ranks instead of after).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .base import K3FusePass, PassContext
from torch._inductor.pattern_matcher import stable_topological_sort

from .fuse_attn_out_allreduce_attnres_norm import erase_dead

k3 = torch.ops.k3fuse
aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def tp_group_of(graph: fx.Graph):
    """(group_name, rank, size) of the graph's tensor-parallel all-reduces, or None at TP = 1."""
    names = {n.args[2] for n in graph.find_nodes(op="call_function", target=c10d.all_reduce.default)}
    names |= {n.args[9] for n in graph.find_nodes(op="call_function", target=k3.fused_residual_norm.default)
              if n.args[9]}
    if not names:
        return None
    if len(names) > 1:
        raise RuntimeError(f"k3fuse: several tensor-parallel groups in one graph: {sorted(names)}")
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    name = names.pop()
    pg = _resolve_process_group(name)
    return name, dist.get_rank(pg), dist.get_world_size(pg)


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


class SplitMoEAcrossRanks(K3FusePass):
    name = "split_moe_across_ranks"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        tp = tp_group_of(graph)
        if tp is None or tp[2] == 1:
            self.skip_reason = "TP = 1: nothing is replicated across ranks"
            return 0
        self.group, self.rank, self.size = tp
        matches = 0
        for router in list(graph.find_nodes(op="call_function", target=k3.router_topk.default)):
            matches += self._split_layer(graph, router)
        return matches

    # -------------------------------------------------------------------------------------------- helpers
    def _shard_rows(self, graph, w: fx.Node) -> fx.Node:
        n = _val(w).shape[0] // self.size
        return graph.call_function(aten.slice.Tensor, (w, 0, self.rank * n, (self.rank + 1) * n))

    def _gather_ranks(self, graph, x: fx.Node, M, n) -> fx.Node:
        """[M, n] per rank -> [M, t, n] (a view)."""
        # k3fuse.all_gather (the functional pair as its reference) so that the in-kernel gather can replace it
        w = graph.call_function(torch.ops.k3fuse.all_gather.default, (x, self.size, self.group))
        v = graph.call_function(aten.view.default, (w, [self.size, M, n]))
        return graph.call_function(aten.permute.default, (v, [1, 0, 2]))

    def _flat(self, graph, v: fx.Node, M, n) -> fx.Node:
        """[M, t, n/t] view -> contiguous [M, n], rank-major."""
        c = graph.call_function(aten.clone.default, (v,), {"memory_format": torch.contiguous_format})
        return graph.call_function(aten.view.default, (c, [M, n]))

    def _gather_last(self, graph, x: fx.Node, M, n) -> fx.Node:
        """[M, n] per rank -> [M, t * n], rank-major along the last dim."""
        return self._flat(graph, self._gather_ranks(graph, x, M, n), M, self.size * n)

    def _divisible(self, *ws) -> bool:
        return all(_val(w) is not None and _val(w).shape[0] % self.size == 0 for w in ws)

    # -------------------------------------------------------------------------------------------- one layer
    def _split_layer(self, graph: fx.Graph, router: fx.Node) -> int:
        x, w_r, bias, top_k, renorm, scale = router.args
        linears = [u for u in x.users if u.target == k3.linear.default and u.args[0] is x]
        shared = [u for u in linears if any(v.target == k3.situ_glu.default for v in u.users)]
        down = [u for u in linears if u not in shared]
        if len(down) != 1 or len(shared) != 1:
            return 0
        down = down[0]
        w_down = down.args[1]
        # the up projection reads the normed latent: the linear whose weight is [H, D] with D = z's width
        D = _val(w_down).shape[0]
        order = {n: i for i, n in enumerate(graph.nodes)}
        ups = sorted((n for n in graph.find_nodes(op="call_function", target=k3.linear.default)
                      if _val(n.args[1]) is not None and tuple(_val(n.args[1]).shape) == (_val(x).shape[-1], D)
                      and n.args[0].target == k3.rms_norm.default and order[n] > order[down]),
                     key=order.__getitem__)[:1]
        if len(ups) != 1 or not self._divisible(w_r, w_down, ups[0].args[1]):
            return 0
        up = ups[0]
        M = _val(x).shape[0]
        E = _val(w_r).shape[0]
        # router logits (fp32) and the down projection's z shard share the input and both are needed in full by
        # every rank: one all-gather carries both (the fp32 logits reinterpreted in z's dtype: bit-exact).
        first = min((router, down), key=order.__getitem__)
        adt = _val(x).dtype
        per = 4 // _val(x).element_size()            # activation elements per fp32 logit
        e, d = E // self.size, D // self.size
        with graph.inserting_before(first):
            lg = graph.call_function(k3.router_logits.default, (x, self._shard_rows(graph, w_r)))
            zs = graph.call_function(k3.linear.default, (x, self._shard_rows(graph, w_down)))
            lg_bits = graph.call_function(aten.view.dtype, (lg, adt)) if per > 1 else lg
            packed = graph.call_function(aten.cat.default, ([lg_bits, zs], 1))
            g = self._gather_ranks(graph, packed, M, e * per + d)                        # [M, t, e*per + d]
            lg_all = self._flat(graph, graph.call_function(aten.slice.Tensor, (g, 2, 0, e * per)), M, E * per)
            full = graph.call_function(aten.view.dtype, (lg_all, torch.float32)) if per > 1 else lg_all
            z = self._flat(graph, graph.call_function(aten.slice.Tensor, (g, 2, e * per, e * per + d)), M, D)
            new = graph.call_function(k3.topk_from_logits.default, (full, bias, top_k, renorm, scale))
        router.replace_all_uses_with(new)
        down.replace_all_uses_with(z)
        erase_dead(graph, [router, down])
        # routed up projection
        H = _val(up.args[1]).shape[0]
        n = H // self.size
        fused = [u for u in up.users if u.target == k3.fused_residual_norm.default and u.args[2] is up]
        with graph.inserting_before(up):
            ys = graph.call_function(k3.linear.default, (up.args[0], self._shard_rows(graph, up.args[1])))
            if len(up.users) == 1 and fused and fused[0].args[9] == self.group:
                # merged collective: the slice joins the shared expert's partial before its all-reduce
                part = graph.call_function(aten.constant_pad_nd.default,
                                           (ys, [self.rank * n, H - (self.rank + 1) * n], 0.0))
                f = fused[0]
                f.args = f.args[:2] + (part,) + f.args[3:11] + (True,)
                new_up = None
            else:
                new_up = self._gather_last(graph, ys, M, n)
        if new_up is not None:
            up.replace_all_uses_with(new_up)
        erase_dead(graph, [up])
        stable_topological_sort(graph)
        # the shared expert's up half (gate_up GEMV + SiTU-GLU) depends only on the layer input: one op that runs
        # on a side stream, joined where its result is consumed (the fused down_proj + all-reduce)
        sh = shared[0]
        situ = [u for u in sh.users if u.target == k3.situ_glu.default]
        if len(sh.users) == 1 and len(situ) == 1:
            situ = situ[0]
            with graph.inserting_before(sh):
                side = graph.call_function(k3.side_linear_situ.default, (x, sh.args[1]) + tuple(situ.args[1:]))
            first_use = min(situ.users, key=order.__getitem__)
            with graph.inserting_before(first_use):
                joined = graph.call_function(k3.stream_join.default, (side,))
            situ.replace_all_uses_with(joined)
            erase_dead(graph, [situ])
        return 1
