"""Lowering after the passes: a k3fuse op with no generated kernel for the graph's device goes back to ATen.

Canonical ops are opaque to Inductor; if one only runs its reference implementation it costs a separate launch per
ATen op inside it and blocks Inductor's fusion of everything around it (measured on the H200, one K3 layer at TP16
M=1: 95 kernels, 349 us, against 56 kernels, 271 us for plain Inductor). So, for the Inductor inner compiler,
every k3fuse op whose device has no kernel registered is replaced by its reference implementation, traced into
ATen with the same decompositions the graph was captured with. Ops with kernels stay as extern calls.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import k3fuse.ops as k3ops


def _device(n: fx.Node):
    for a in n.all_input_nodes:
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")


def _has_kernel(op: torch._ops.OpOverload, device: torch.device) -> bool:
    key = {"cuda": "CUDA", "cpu": "CPU"}.get(device.type)
    if key is None:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key)


# op name -> predicate on the node's input values: does its generated kernel apply to this graph's shapes? Filled by
# k3fuse.codegen.registry.register() for fused ops whose kernels cover only some shapes (the fused RMSNorm GEMV:
# M <= 4; the grouped GEMV with a SiTU-GLU or router member: the simt buckets; the router's selection in the group:
# where the group's config has 256 threads). Where it says no, the op is inlined like one
# without a kernel; its reference is written in the k3fuse ops it fuses, and those are lowered in turn.
KERNEL_APPLIES: dict = {}
# mutating ops whose reference is k3fuse ops only (the mutation inside one of them): where KERNEL_APPLIES says no, the
# lowering inlines the reference like a functional op's, so its parts lower on their own (mla_qb_append_attention_
# -> rms_norm_linear + mla_append_attention_, which stays one call)
INLINE_MUTABLE = {"mla_qb_append_attention_"}


def _applies(n: fx.Node, name: str) -> bool:
    pred = KERNEL_APPLIES.get(name)
    if pred is None:
        return True
    args, kwargs = torch.utils._pytree.tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a,
                                                (n.args, n.kwargs))
    return bool(pred(*args, **kwargs))


def _inline(graph: fx.Graph, n: fx.Node, decomps) -> list[fx.Node]:
    """Replace node n by a trace of its op's reference implementation. Returns the nodes of the trace."""
    ref = getattr(k3ops, n.target._schema.name.split("::")[-1])._init_fn
    flat, spec = torch.utils._pytree.tree_flatten((n.args, n.kwargs))
    tensor_pos = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]
    missing = [flat[i].name for i in tensor_pos if "val" not in flat[i].meta]
    if missing:     # passes fill every value (passes/base.fill_missing_vals); say which node broke that
        raise RuntimeError(f"k3fuse lowering: inputs {missing} of {n.name} carry no meta['val'] to trace with")
    vals = [flat[i].meta["val"] for i in tensor_pos]

    def fn(*ts):
        leaves = list(flat)
        for i, t in zip(tensor_pos, ts):
            leaves[i] = t
        args, kwargs = torch.utils._pytree.tree_unflatten(leaves, spec)
        return ref(*args, **kwargs)

    fake_mode = torch._guards.detect_fake_mode(vals)
    with fake_mode:
        sub = make_fx(fn, decomposition_table=decomps, tracing_mode="real")(*vals)
    prev = n.prev
    with graph.inserting_before(n):
        out = graph.graph_copy(sub.graph, dict(zip(sub.graph.find_nodes(op="placeholder"),
                                                   [flat[i] for i in tensor_pos])))
    new, m = [], prev.next
    while m is not n:
        new.append(m)
        m = m.next
    if isinstance(out, (tuple, list)):
        for u in list(n.users):
            assert u.target is operator.getitem
            u.replace_all_uses_with(out[u.args[1]])
            graph.erase_node(u)
    else:
        n.replace_all_uses_with(out)
    graph.erase_node(n)
    return new


def lower_unkerneled_ops(gm: fx.GraphModule, decomps) -> list[str]:
    """Inline every k3fuse op without a kernel for its device, or whose kernel does not apply to its shapes
    (KERNEL_APPLIES); prefetch, a pure hint, is dropped instead. k3fuse ops that an inlined reference calls (a fused
    op's parts) are lowered the same way in the next round. Returns the names of the ops lowered."""
    lowered = []
    todo = list(gm.graph.nodes)
    while todo:
        new_nodes = []
        for n in todo:
            if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
                continue
            if n.target.namespace != "k3fuse":
                continue
            name = n.target._schema.name.split("::")[-1]
            if _has_kernel(n.target, _device(n)) and _applies(n, name):
                continue
            if name == "prefetch_l2":               # a pure hint (it "mutates" only its ordering token)
                gm.graph.erase_node(n)
            elif n.target._schema.is_mutable and name not in INLINE_MUTABLE:
                continue    # a mutating op (an in-place state write) stays one call: its reference writes the state
            else:
                new_nodes += _inline(gm.graph, n, decomps)
            lowered.append(name)
        todo = new_nodes
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return lowered
