"""canonicalize_vllm: rewrite vLLM's representation of the K3 decode computations into what `canonicalize` and the
fusion passes match, on the post-grad graph vLLM hands to `post_grad_custom_post_pass` (one piece, one compile
range). Runs before `canonicalize`; `restore_vllm` undoes, after fusion, what no fusion consumed.

What a vLLM post-grad piece of K3 contains at the fusion sites (vLLM 0.32, checked on the installed source) and what
becomes of it here:

  vLLM                                                    here
  vllm_ir.rms_norm(x, w, eps)              (x.dtype == w)   k3fuse.rms_norm(x, w, eps, x.dtype)       same math
  vllm_ir.rms_norm(x fp32, w, eps)         (w not fp32)     k3fuse.rms_norm(x, w, eps, w.dtype) -> fp32  same math
  vllm.all_reduce(x, group_name=U)                          _c10d_functional.all_reduce(x, "sum", G) -> wait_tensor,
                                                            G = the c10d name of vLLM group U's device group
  aten.addmm(prefix, o, permute(W, [1, 0]))                 prefix + aten.mm(o, permute(W))  (Inductor's own post-grad
                                                            patterns fold the prefix add into the o_proj GEMM)
  aten.reshape(x, s), x contiguous                          aten.view(x, s)  (Inductor's view_to_reshape ran before
                                                            the hook; the traced patterns use views)

Left alone: vllm_ir.rms_norm with variance_size or without weight; vllm_ir.fused_add_rms_norm (residual add + norm:
not K3's AttnRes form, and vLLM computes the norm from the unrounded sum); vllm.all_gather / vllm.reduce_scatter;
vllm.moe_forward / moe_forward_shared (routing and experts are inside the op); the attention ops (vLLM splits the
graph there, they never reach a piece's pass); vLLM's CPU GEMM ops (_C.onednn_mm, weight_packed_linear_cpu: the
weight is prepacked into a handle, there is no weight tensor to hand to k3fuse.linear).

`restore_vllm` gives vLLM back its own ops where no fusion consumed them: translated all-reduces become
vllm.all_reduce again (vLLM keeps its communicators: custom all-reduce, pynccl, CPU shared memory), norms become
vllm_ir.rms_norm again (vLLM's IR lowering picks their kernel), views become reshapes again. What came from ATen
(the addmm split, linears, SiTU-GLU) stays in k3fuse ops, as in k3fuse's own backend.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.fx as fx

from .base import K3FusePass, PassContext

logger = logging.getLogger("k3fuse.passes")

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

VLLM_ALL_REDUCE = "vllm::all_reduce"
VLLM_RMS_NORM = "vllm_ir::rms_norm"
_TAG_AR = "k3fuse_vllm_all_reduce"       # node.meta: the vLLM group name of a translated all-reduce
_TAG_VIEW = "k3fuse_vllm_reshape"        # node.meta: a view that was a reshape
_TAG_RMS = "k3fuse_vllm_rms_norm"        # node.meta: (vLLM target, cast) of a k3fuse.rms_norm made from vllm_ir


def _op_name(n: fx.Node) -> str | None:
    t = n.target
    return t.name() if n.op == "call_function" and isinstance(t, torch._ops.OpOverload) else None


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def vllm_group_to_c10d(group_name: str) -> Optional[str]:
    """The c10d name (what functional collectives take) of vLLM's GroupCoordinator `group_name`'s device group,
    or None where there is no such live group in this process."""
    try:
        from vllm.distributed import parallel_state as ps
    except ImportError:
        return None
    ref = ps._groups.get(group_name)
    gc = ref() if ref is not None else None
    pg = getattr(gc, "device_group", None)
    return getattr(pg, "group_name", None) if pg is not None else None


def _fake_val(target, args, kwargs=None):
    """meta['val'] for a new node, by running the op on the inputs' fake values."""
    kwargs = kwargs or {}
    vals = fx.node.map_arg((args, kwargs), lambda a: a.meta.get("val"))
    flat = [v for v in torch.utils._pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)]
    if any(v is None for v in torch.utils._pytree.tree_leaves(vals)) or not flat:
        return None
    mode = torch._guards.detect_fake_mode(flat)
    if mode is None:
        return None
    with mode:
        return target(*vals[0], **vals[1])


def _call(graph: fx.Graph, target, args, kwargs=None) -> fx.Node:
    n = graph.call_function(target, tuple(args), kwargs or {})
    v = _fake_val(target, args, kwargs)
    if v is not None:
        n.meta["val"] = v
    return n


class CanonicalizeVllm(K3FusePass):
    name = "canonicalize_vllm"

    def __init__(self, group_resolver: Callable[[str], Optional[str]] = vllm_group_to_c10d):
        super().__init__()
        self.group_resolver = group_resolver
        self.counts: dict[str, int] = {}

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        self.counts = {"rms_norm": self._rms_norms(graph), "all_reduce": self._all_reduces(graph),
                       "addmm": self._addmms(graph), "reshape": self._reshapes(graph)}
        # the reshape -> view rewrites are bookkeeping for the patterns, not recognitions of vLLM ops
        return self.counts["rms_norm"] + self.counts["all_reduce"] + self.counts["addmm"]

    # ---- vllm_ir.rms_norm(x, weight, epsilon, variance_size=None) -> k3fuse.rms_norm
    def _rms_norms(self, graph: fx.Graph) -> int:
        n_done = 0
        for n in list(graph.nodes):
            if _op_name(n) != VLLM_RMS_NORM:
                continue
            args = list(n.args) + [None] * (4 - len(n.args))
            x, w, eps, var_size = (n.kwargs.get(k, a) for k, a in
                                   zip(("x", "weight", "epsilon", "variance_size"), args))
            xv, wv = _val(x), _val(w)
            if var_size is not None or not isinstance(w, fx.Node) or xv is None or wv is None:
                continue
            if xv.dtype == wv.dtype:
                cast = None
            elif xv.dtype == torch.float32:          # vLLM: ((x * r).to(w.dtype) * w).to(fp32): the same values
                cast = torch.float32
            else:
                continue
            with graph.inserting_before(n):
                new = _call(graph, torch.ops.k3fuse.rms_norm.default, (x, w, float(eps), wv.dtype))
                new.meta[_TAG_RMS] = (n.target, cast)
                if cast is not None:
                    new = _call(graph, torch.ops.prims.convert_element_type.default, (new, cast))
            n.replace_all_uses_with(new)
            graph.erase_node(n)
            n_done += 1
        return n_done

    # ---- vllm.all_reduce(x, group_name) -> _c10d_functional.all_reduce + wait_tensor on the same ranks
    def _all_reduces(self, graph: fx.Graph) -> int:
        n_done = 0
        for n in list(graph.nodes):
            if _op_name(n) != VLLM_ALL_REDUCE:
                continue
            x = n.kwargs.get("tensor", n.args[0] if n.args else None)
            group = n.kwargs.get("group_name", n.args[1] if len(n.args) > 1 else None)
            c10d_name = self.group_resolver(group) if isinstance(group, str) else None
            if c10d_name is None:
                logger.info("k3fuse: vLLM group %r not found in this process; its all-reduce is left to vLLM",
                            group)
                continue
            with graph.inserting_before(n):
                ar = _call(graph, c10d.all_reduce.default, (x, "sum", c10d_name))
                wait = _call(graph, c10d.wait_tensor.default, (ar,))
            ar.meta[_TAG_AR] = (group, n.target)
            n.replace_all_uses_with(wait)
            graph.erase_node(n)
            n_done += 1
        return n_done

    # ---- addmm(prefix, o, permute(W, [1, 0])) -> prefix + mm(o, permute(W))
    def _addmms(self, graph: fx.Graph) -> int:
        n_done = 0
        for n in list(graph.find_nodes(op="call_function", target=aten.addmm.default)):
            if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1 or len(n.args) != 3:
                continue
            bias, m1, m2 = n.args
            bv, ov = _val(bias), _val(n)
            if not (isinstance(m2, fx.Node) and m2.target == aten.permute.default and list(m2.args[1]) == [1, 0]):
                continue
            if bv is None or ov is None or bv.shape != ov.shape or bv.dtype != ov.dtype:
                continue                              # a broadcast bias, not a residual: leave the GEMM alone
            with graph.inserting_before(n):
                mm = _call(graph, aten.mm.default, (m1, m2))
                add = _call(graph, aten.add.Tensor, (bias, mm))
            n.replace_all_uses_with(add)
            graph.erase_node(n)
            n_done += 1
        return n_done

    # ---- reshape of a contiguous tensor -> view (the patterns were traced with views)
    def _reshapes(self, graph: fx.Graph) -> int:
        n_done = 0
        for n in list(graph.find_nodes(op="call_function", target=aten.reshape.default)):
            v = _val(n.args[0])
            if not isinstance(v, torch.Tensor) or not v.is_contiguous():
                continue
            n.target = aten.view.default
            n.meta[_TAG_VIEW] = True
            n_done += 1
        return n_done


def restore_vllm(graph: fx.Graph) -> dict[str, int]:
    """Undo what canonicalize_vllm translated and no later pass consumed: all-reduces back to vllm.all_reduce, norms
    back to vllm_ir.rms_norm, views back to reshapes. Returns how many of each."""
    restored = {"all_reduce": 0, "rms_norm": 0, "reshape": 0}
    for ar in list(graph.find_nodes(op="call_function", target=c10d.all_reduce.default)):
        tag = ar.meta.get(_TAG_AR)
        if tag is None:
            continue
        group, target = tag
        waits = [u for u in ar.users if u.target == c10d.wait_tensor.default]
        if len(waits) != 1 or len(ar.users) != 1:
            continue
        with graph.inserting_before(ar):
            new = graph.call_function(target, (ar.args[0],), {"group_name": group})
        new.meta["val"] = waits[0].meta.get("val")
        waits[0].replace_all_uses_with(new)
        graph.erase_node(waits[0])
        graph.erase_node(ar)
        restored["all_reduce"] += 1
    for n in list(graph.find_nodes(op="call_function", target=torch.ops.k3fuse.rms_norm.default)):
        tag = n.meta.get(_TAG_RMS)
        if tag is None:
            continue
        target, cast = tag
        last = n
        if cast is not None:
            users = list(n.users)
            if len(users) != 1 or users[0].target != torch.ops.prims.convert_element_type.default:
                continue
            last = users[0]
        x, w, eps, _ = n.args
        with graph.inserting_before(n):
            new = graph.call_function(target, (x, w, eps), {})
        new.meta["val"] = last.meta.get("val")
        last.replace_all_uses_with(new)
        graph.erase_node(last)
        if last is not n:
            graph.erase_node(n)
        restored["rms_norm"] += 1
    for n in list(graph.find_nodes(op="call_function", target=aten.view.default)):
        if n.meta.pop(_TAG_VIEW, False):
            n.target = aten.reshape.default
            restored["reshape"] += 1
    return restored
