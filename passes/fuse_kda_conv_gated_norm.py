"""fuse_kda_conv_gated_norm: the KDA decode step around `k3fuse.kda_recurrent` becomes one `k3fuse.kda_decode`.

Where it fires in K3: once per KDA layer (69 of 93), after canonicalize. What it takes in (K3_MODEL.md section 4):
  - the three causal conv steps + SiLU of the pre-conv q0, k0, v0, as the model writes them and functionalization
    records them: a chain of slice -> cat -> (copy, slice_scatter) over ONE conv state [M, K-1, 3P] = [q | k | v]
    and, per projection, (cast) -> mul by the permuted (flipped, if the newest tap is first) taps -> sum -> SiLU
    (decomposed into neg / exp / add / div, or aten.silu);
  - the f_b projection `k3fuse.linear(fa, f_b)` that feeds only the recurrence's decay input;
  - the gated RMSNorm after the readout: `k3fuse.rms_norm(o, o_norm, eps, fp32)` times sigmoid(go) (go: the g
    projection, viewed [M, h, d], cast to fp32 if it is not), viewed [M, P] and cast to o_proj's dtype.
Why: on the H200 these were ~5 separate launches around the recurrence kernel (f_b GEMV, the conv chains, the norm
and gate), each a few us of fixed cost at M = 1; `codegen/kda_recurrent.py` runs them inside the one kernel.

Anything else is left alone (a conv chain with other users of its intermediate states, another norm, an f_b whose
output has other users): the recurrence then stays `kda_recurrent` with the surrounding ops unfused. Runs before
`fuse_shared_input_linears`, which would otherwise group f_b's input with its siblings (it still groups q0, k0, v0,
go and fa, which this pass reads but does not consume).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from .base import K3FusePass, PassContext, logger

aten, prims, k3 = torch.ops.aten, torch.ops.prims, torch.ops.k3fuse
_END = 2 ** 63 - 1


def _is(n, *targets) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _strip_cast(n, dtype=torch.float32):
    """x for `convert_element_type(x, dtype)`, else n itself (an fp32 graph has no casts)."""
    if _is(n, prims.convert_element_type.default) and n.args[1] == dtype:
        return n.args[0]
    return n


def _silu_input(n) -> Optional[fx.Node]:
    """s for SiLU(s): aten.silu(s) or the decomposition s / (1 + exp(-s))."""
    if _is(n, aten.silu.default):
        return n.args[0]
    if _is(n, aten.div.Tensor):
        s, den = n.args
        if _is(den, aten.add.Tensor) and den.args[1] == 1 and _is(den.args[0], aten.exp.default):
            neg = den.args[0].args[0]
            if _is(neg, aten.neg.default) and neg.args[0] is s:
                return s
    return None


def _conv(n) -> Optional[dict]:
    """Match view(SiLU(sum(cast(cat([slice(state, 2, lo, hi), unsqueeze(x0, 1)], 1)) * taps^T[None], [1])))."""
    if not _is(n, aten.view.default):
        return None
    s = _silu_input(n.args[0])
    if not _is(s, aten.sum.dim_IntList) or list(s.args[1]) not in ([1], [-2]) or len(s.args) > 2:
        return None
    mul = s.args[0]
    if not _is(mul, aten.mul.Tensor):
        return None
    for win, tap in (mul.args, mul.args[::-1]):
        if not (_is(tap, aten.unsqueeze.default) and tap.args[1] == 0 and _is(tap.args[0], aten.permute.default)
                and list(tap.args[0].args[1]) == [1, 0]):
            continue
        w, newest_last = tap.args[0].args[0], True
        if _is(w, aten.flip.default):
            w, newest_last = w.args[0], False
        cat = _strip_cast(win)
        if not (_is(cat, aten.cat.default) and len(cat.args[0]) == 2 and cat.args[1] == 1):
            return None
        sl, ux = cat.args[0]
        if not (_is(sl, aten.slice.Tensor) and sl.args[1] == 2 and _is(ux, aten.unsqueeze.default)
                and ux.args[1] == 1):
            return None
        return dict(x0=ux.args[0], taps=w, newest_last=newest_last, src=sl.args[0], lo=sl.args[2], hi=sl.args[3],
                    cat=cat, slice=sl)
    return None


def _state_update(c: dict) -> Optional[fx.Node]:
    """The slice_scatter that writes window[:, 1:] of conv c back into its source state."""
    for u in c["src"].users:
        if _is(u, aten.slice_scatter.default) and u.args[0] is c["src"] and tuple(u.args[2:5]) == (2, c["lo"], c["hi"]):
            cp = u.args[1]
            if _is(cp, aten.copy.default) and cp.args[0] is c["slice"] and _is(cp.args[1], aten.slice.Tensor) \
                    and cp.args[1].args[0] is c["cat"] and tuple(cp.args[1].args[1:3]) == (1, 1):
                return u
    return None


def _gated_norm(o: fx.Node, M: int, P: int):
    """From the readout o (getitem 0 of the recurrence): rms_norm(o, w, eps, fp32) * sigmoid(go) -> view [M, P]
    -> cast. Returns (last node, o_norm weight, eps, go, out dtype) or None."""
    if len(o.users) != 1:
        return None
    rn = next(iter(o.users))
    if not (_is(rn, k3.rms_norm.default) and rn.args[0] is o and rn.args[3] == torch.float32 and len(rn.users) == 1):
        return None
    mul = next(iter(rn.users))
    if not _is(mul, aten.mul.Tensor) or len(mul.users) != 1:
        return None
    sig = mul.args[1] if mul.args[0] is rn else mul.args[0]
    if not _is(sig, aten.sigmoid.default) or not _is(sig.args[0], aten.view.default):
        return None
    go = sig.args[0].args[0]
    go = go.args[0] if _is(go, prims.convert_element_type.default) else go
    gv = _val(go)
    if not isinstance(gv, torch.Tensor) or tuple(gv.shape) != (M, P):
        return None
    view = next(iter(mul.users))
    if not _is(view, aten.view.default) or list(view.args[1]) != [M, P]:
        return None
    last = view
    if len(view.users) == 1 and _is(next(iter(view.users)), prims.convert_element_type.default):
        last = next(iter(view.users))
    return last, rn.args[1], rn.args[2], go, _val(last).dtype


class FuseKdaConvGatedNorm(K3FusePass):
    name = "fuse_kda_conv_gated_norm"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        matches = 0
        for kr in list(graph.find_nodes(op="call_function", target=k3.kda_recurrent.default)):
            why = self._rewrite(graph, kr)
            if why:
                logger.debug("k3fuse pass %s: %s left unfused: %s", self.name, kr.name, why)
            else:
                matches += 1
        if not matches and not graph.find_nodes(op="call_function", target=k3.kda_recurrent.default):
            self.skip_reason = "no k3fuse.kda_recurrent in the graph (an MLA-only graph)"
        return matches

    def _rewrite(self, graph: fx.Graph, kr: fx.Node) -> Optional[str]:
        q, k, v, a, dt_bias, A_log, b, S, lower = kr.args
        qv = _val(q)
        if not isinstance(qv, torch.Tensor) or qv.dim() != 3:
            return "no value for q"
        M, h, d = qv.shape
        P = h * d
        convs = [_conv(x) for x in (q, k, v)]
        if any(c is None for c in convs):
            return "q / k / v are not the causal conv + SiLU"
        base = convs[0]["src"]
        if any(c["newest_last"] != convs[0]["newest_last"] for c in convs):
            return "the taps' orientation differs between q, k, v"
        # one state, updated q -> k -> v: each conv reads the state the previous one wrote
        src, updates = base, []
        for i, c in enumerate(convs):
            hi = (i + 1) * P if i < 2 else c["hi"]
            if c["src"] is not src or c["lo"] != i * P or hi not in ((i + 1) * P, _END):
                return f"conv {'qkv'[i]} does not read channels [{i * P}, {(i + 1) * P}) of the chained state"
            up = _state_update(c)
            if up is None:
                return f"conv {'qkv'[i]}: no state write-back"
            updates.append(up)
            src = up
        for up, nxt in zip(updates[:2], convs[1:]):
            if set(up.users) != {nxt["slice"], updates[updates.index(up) + 1]}:
                return "an intermediate conv state has other users"
        sv = _val(base)
        if not isinstance(sv, torch.Tensor) or sv.dim() != 3 or sv.shape[2] != 3 * P:
            return "conv state is not [M, K-1, 3P]"
        if not _is(a, k3.linear.default) or len(a.users) != 1 or a.kwargs:
            return "the decay input is not a k3fuse.linear (f_b) used only here"
        fa, f_b = a.args
        outs = {u.args[1]: u for u in kr.users if u.target is operator.getitem}
        if set(outs) != {0, 1} or len(kr.users) != 2:
            return "recurrence outputs used other than (o, S)"
        gn = _gated_norm(outs[0], M, P)
        if gn is None:
            return "o is not followed by the gated RMSNorm"
        last, o_norm, eps, go, out_dtype = gn
        operands = [c["x0"] for c in convs] + [base] + [c["taps"] for c in convs] + [fa, f_b, dt_bias, A_log, b,
                                                                                     go, o_norm, S]
        replaced = [last, outs[1], updates[2]]
        order = {n: i for i, n in enumerate(graph.nodes)}
        after = max(operands, key=order.__getitem__)
        first_use = min(order[u] for r in replaced for u in r.users) if any(r.users for r in replaced) else len(order)
        if order[after] >= first_use:
            return "an operand is produced after a result is used"
        with graph.inserting_after(after):
            fused = graph.call_function(k3.kda_decode.default, tuple(operands) + (
                lower, eps, convs[0]["newest_last"], out_dtype))
        fused.meta["val"] = (_val(last), _val(outs[1]), _val(updates[2]))
        prev = fused
        for i, r in enumerate(replaced):
            with graph.inserting_after(prev):
                prev = graph.call_function(operator.getitem, (fused, i))
            prev.meta["val"] = _val(r)
            r.replace_all_uses_with(prev)
        # the old nodes are dead now; the pipeline's dead-code elimination removes them
        return None
