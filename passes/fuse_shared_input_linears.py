"""fuse_shared_input_linears: bias-free linears that read the same activation become one `k3fuse.linear_group`.

Why: at M = 1 a GEMV's time is its weight bytes plus a fixed ~1.7 us per launch (H200, 2026-11-29): an 11 MB
GEMV reaches ~55% of the copy bandwidth, a >= 40 MB one 87-106%. One launch over the members' rows together
removes G - 1 launches and fixed costs (codegen/gemv.py `linear_group`, on by default, K3FUSE_GROUPED_GEMV=0 opts out).

Where it fires in K3 (one group per layer; members after canonicalize and the earlier passes):
  - KDA layers (69): q, k, v, g (each P/t x 7168), f_a (128 x 7168, replicated) and b (heads/t x 7168) of the
    normed input; f_b reads f_a's output, not x, so it stays a separate linear. TP16: 768 x 4 + 128 + 6 rows
    (3206 x 7168, 46 MB); TP8: 1536 x 4 + 128 + 12 (6284 x 7168, 90 MB).
  - MLA layers (24): q_a (1536), kv_a_proj_with_mqa (576) and g_proj (heads/t * 128) of the normed input; q_b
    reads the normed q_a output. TP16: 1536 + 576 + 768 = 2880 x 7168; TP8: 1536 + 576 + 1536 = 3648 x 7168.
  - MoE layers (92) at TP = 1 only: routed_expert_down_proj (3584) + the shared expert's gate_up (12288). Under
    TP > 1 `split_moe_across_ranks` has already turned the shared gate_up into `side_linear_situ` (a side stream)
    and the router into `router_logits` (fp32 output), so the sliced routed down projection is alone: no group.
  - Dense layer 0 (gate_up only) and the lm_head (final norm only) have a single linear: no group.
So a K3 graph has 93 groups at TP > 1 and 185 at TP = 1.

Members: `k3fuse.linear(x, w)` nodes with the SAME x node, grouped per weight dtype (one GEMV kernel reads one
weight dtype; K is x's last dim, so it is the same for all), at least 2 per group. A linear whose weight is computed
from another member's output would depend on it: such members are left out. The group node is placed where every
operand exists and before the first use of any member's output (the first member's place, or just after the last
operand). Runs after `split_moe_across_ranks` (which matches single linears) and before `insert_prefetch` (which
reads the group's weights like a linear's). Values: the group's reference is the linear's math per weight.
"""
from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx

from .base import K3FusePass, PassContext, logger

k3 = torch.ops.k3fuse


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _ancestors(n: fx.Node) -> set:
    """Nodes n depends on (transitively); placeholders and getattrs end the walk quickly."""
    seen, work = set(), [n]
    while work:
        a = work.pop()
        for i in a.all_input_nodes:
            if i not in seen:
                seen.add(i)
                work.append(i)
    return seen


class FuseSharedInputLinears(K3FusePass):
    name = "fuse_shared_input_linears"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        self.skipped: list[str] = []
        order = {n: i for i, n in enumerate(graph.nodes)}
        by_x: dict = defaultdict(list)
        for n in graph.find_nodes(op="call_function", target=k3.linear.default):
            x, w = n.args[0], n.args[1]
            if n.kwargs or not isinstance(x, fx.Node) or not isinstance(w, fx.Node):
                continue
            xv, wv = _val(x), _val(w)
            if not (isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor)) or wv.dim() != 2:
                continue
            # one kernel reads one weight dtype: mixed-dtype members form separate groups
            by_x[(x, wv.dtype)].append(n)
        matches = 0
        for (x, _), members in by_x.items():
            members = sorted(members, key=order.__getitem__)
            members = self._independent(members)
            if len(members) < 2:
                continue
            if self._rewrite(graph, x, members, order):
                matches += 1
                order = {n: i for i, n in enumerate(graph.nodes)}
        for why in self.skipped:
            logger.debug("k3fuse pass %s left separate: %s", self.name, why)
        return matches

    def _independent(self, members: list) -> list:
        """Drop members whose weight depends on another member's output (they must run after it)."""
        mset = set(members)
        out = []
        for n in members:
            if _ancestors(n.args[1]) & mset:
                self.skipped.append(f"{n.name}: weight depends on another member")
                continue
            out.append(n)
        return out

    def _rewrite(self, graph: fx.Graph, x: fx.Node, members: list, order: dict) -> bool:
        operands = [x] + [m.args[1] for m in members]
        last_operand = max(operands, key=order.__getitem__)
        first_member = members[0]
        users = [u for m in members for u in m.users]
        first_use = min((order[u] for u in users), default=len(order))
        if order[last_operand] < order[first_member]:
            where = graph.inserting_before(first_member)
        elif order[last_operand] < first_use:
            where = graph.inserting_after(last_operand)
        else:   # an operand is produced after a member's output is used: leave them separate
            self.skipped.append(f"{[m.name for m in members]}: no place for one node")
            return False
        with where:
            grp = graph.call_function(k3.linear_group.default, (x, [m.args[1] for m in members]))
        grp.meta["val"] = [_val(m) for m in members]
        outs, prev = [], grp
        for i, m in enumerate(members):
            with graph.inserting_after(prev):
                prev = graph.call_function(operator.getitem, (grp, i))
            prev.meta["val"] = _val(m)
            outs.append(prev)
        for m, o in zip(members, outs):
            m.replace_all_uses_with(o)
            graph.erase_node(m)
        return True
