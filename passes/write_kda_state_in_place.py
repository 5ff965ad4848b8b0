"""write_kda_state_in_place: `k3fuse.kda_decode` whose new states are only copied back into the cache becomes the
in-place `k3fuse.kda_decode_`, and the copies go.

Where it fires in K3: once per KDA layer (69 of 93), after `fuse_kda_conv_gated_norm`, last in the pipeline. The
captured graph is functional: kda_decode returns the new recurrent state S [M, h, d, d] fp32 and the new conv state
[M, K-1, 3P], and AOTAutograd writes them back into the cache inputs with trailing `copy_(state, new)` nodes (for S
through an intermediate `copy(state, new)`). Inductor keeps those as two copy kernels per KDA layer (on the H200 at
TP16 M = 1: two launches, ~1 us each plus the launch gap). The kernel already reads every element of S and of the
conv state before the thread that read it writes it (templates/kda_recurrent.py.jinja), so it can write them in
place.

Fires only when the state inputs are graph inputs whose only other users are those copies (nothing else reads the
old value, so mutating it in the op is unobservable); otherwise the functional op and its copies stay. Mutating
ops are never inlined by the lowering (compiler/lowering.py): their reference writes the state too.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .base import K3FusePass, PassContext, logger

aten, k3 = torch.ops.aten, torch.ops.k3fuse
S_ARG, CONV_ARG = 14, 3          # positions of S and conv_state in kda_decode's schema


def _copies_back(state: fx.Node, new: fx.Node) -> list[fx.Node] | None:
    """The nodes that only write `new` back into `state` (copy_(state, new), or copy_(state, copy(state, new))),
    or None if `new` has any other use."""
    out = []
    for u in new.users:
        if u.target is aten.copy_.default and u.args == (state, new):
            out.append(u)
        elif u.target is aten.copy.default and u.args == (state, new) and u.users and all(
                w.target is aten.copy_.default and w.args == (state, u) for w in u.users):
            out += list(u.users) + [u]
        else:
            return None
    return out if out else None


class WriteKdaStateInPlace(K3FusePass):
    name = "write_kda_state_in_place"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        n_done = 0
        for n in list(graph.nodes):
            if n.op != "call_function" or n.target is not k3.kda_decode.default:
                continue
            outs = {u.args[1]: u for u in n.users if u.target is operator.getitem}
            if len(outs) != len(n.users) or 0 not in outs:
                continue
            states = [(n.args[CONV_ARG], outs.get(2)), (n.args[S_ARG], outs.get(1))]
            dead = []
            for state, new in states:
                copies = _copies_back(state, new) if new is not None else None
                others = set(state.users) - {n} - set(copies or ())
                if state.op != "placeholder" or copies is None or others:
                    logger.debug("k3fuse: %s keeps its state functional (%s read elsewhere or not copied back)",
                                 n.name, state.name)
                    break
                dead += copies + [new]
            else:
                with graph.inserting_before(n):
                    m = graph.call_function(k3.kda_decode_.default, n.args, n.kwargs)
                m.meta["val"] = outs[0].meta.get("val")
                outs[0].replace_all_uses_with(m)
                for d in dead + [outs[0], n]:
                    graph.erase_node(d)
                n_done += 1
        if not n_done and not any(n.target is k3.kda_decode.default for n in graph.nodes):
            self.skip_reason = "no k3fuse.kda_decode in the graph"
        return n_done
