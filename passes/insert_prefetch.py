"""insert_prefetch: while a collective runs, pull the weights read next into L2.

Where it fires in K3: at every communication point of a TP > 1 decode step (the attention-output and MLP-output
all-reduces, now inside `fused_residual_norm`; the MoE split's all-gathers; the routed latent all-reduce). For
each, the weights of the GEMVs that depend on it (networkx descendants in the dependency graph), in program
order, up to the L2 byte budget (60 MiB on H200), go into one `k3fuse.prefetch_l2` node issued just before the
collective. Weights already prefetched by an earlier collective are not fetched again. Routed-expert weights are
never prefetched: which experts are read depends on the router's output (they reach the graph through indexing,
not through a GEMV weight operand).

On CPU the prefetch op does nothing; on CUDA it launches a bulk L2 prefetch on a side stream.
At TP = 1 there is no communication and the pass does nothing.
"""
from __future__ import annotations

import networkx as nx
import torch
import torch.fx as fx

from .base import K3FusePass, PassContext

k3 = torch.ops.k3fuse
c10d = torch.ops._c10d_functional

# op -> positions of its weight operands (placeholders read from HBM; a list operand: each of its weights)
WEIGHT_ARGS = {
    k3.linear.default: (1,),
    k3.rms_norm_linear.default: (3,),
    k3.linear_group.default: (1,),
    k3.linear_group_situ.default: (1,),
    k3.linear_group_router.default: (1, 2),
    k3.linear_group_router_topk.default: (1, 2),
    k3.router_logits.default: (1,),
    k3.router_topk.default: (1,),
    k3.fused_residual_norm.default: (1,),
    k3.side_linear_situ.default: (1,),
}


def is_comm(n: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target in (c10d.all_reduce.default, c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default,
                    k3.all_gather.default):
        return True
    return n.target == k3.fused_residual_norm.default and bool(n.args[9])


def _weight(n) -> fx.Node | None:
    """The placeholder behind a weight operand (through views/slices, as the MoE split emits)."""
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in (
            torch.ops.aten.slice.Tensor, torch.ops.aten.view.default, torch.ops.aten.t.default,
            torch.ops.aten.permute.default):
        n = n.args[0]
    return n if isinstance(n, fx.Node) and n.op == "placeholder" else None


def _nbytes(n: fx.Node) -> int:
    v = n.meta.get("val")
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def dependency_graph(graph: fx.Graph) -> nx.DiGraph:
    g = nx.DiGraph()
    for n in graph.nodes:
        g.add_node(n)
        for a in n.all_input_nodes:
            g.add_edge(a, n)
    return g


class InsertPrefetch(K3FusePass):
    name = "insert_prefetch"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        comms = [n for n in graph.nodes if is_comm(n)]
        if not comms:
            self.skip_reason = "no communication in the graph (TP = 1)"
            return 0
        order = {n: i for i, n in enumerate(graph.nodes)}
        dep = dependency_graph(graph)
        done: set[fx.Node] = set()
        matches = 0
        for i, c in enumerate(comms):
            # read next = after this collective and before the following one completes
            nxt = nx.descendants(dep, comms[i + 1]) | {comms[i + 1]} if i + 1 < len(comms) else set()
            picked, budget = [], ctx.prefetch_budget_bytes
            for consumer in sorted(nx.descendants(dep, c) - nxt, key=order.__getitem__):
                for i in WEIGHT_ARGS.get(consumer.target, ()):
                    ops_i = consumer.args[i]
                    for w in (ops_i if isinstance(ops_i, (list, tuple)) else [ops_i]):
                        w = _weight(w)
                        if w is None or w in done or _nbytes(w) > budget:
                            continue
                        picked.append(w)
                        done.add(w)
                        budget -= _nbytes(w)
            if not picked:
                continue
            dev = picked[0].meta["val"].device
            with graph.inserting_before(c):
                tok = graph.call_function(torch.ops.aten.empty.memory_format, ([1],),
                                          {"dtype": torch.uint8, "device": dev})
                graph.call_function(k3.prefetch_l2.default, (tok, picked, ctx.prefetch_budget_bytes))
            matches += 1
        return matches
