"""The k3fuse pass pipeline: the one place where passes plug in, in a fixed order.

    0. canonicalize                          ATen -> k3fuse ops (RMSNorm, linear, AttnRes mix, SiTU-GLU, router,
                                             experts); all later passes match on k3fuse ops only
    1. fuse_kda_conv_gated_norm              KDA: causal conv + f_b + recurrence + gated RMSNorm -> kda_decode
                                             (before the linear grouping, which would take f_b's input)
    2. fuse_attn_out_allreduce_attnres_norm  o_proj/down_proj + all-reduce + AttnRes update + mix + RMSNorm
    3. split_moe_across_ranks                replicated MoE work split 1/t per rank, results gathered
    4. fuse_shared_input_linears             linears reading the same activation -> one k3fuse.linear_group
                                             (after the split, which matches single linears; before the
                                             prefetch, which reads the group's weights)
    5. fuse_situ_glu_into_linear_group       a SiTU-GLU of one group output -> the group's SiTU-GLU epilogue
    6. fuse_router_into_linear_group         the MoE router's logits -> one more (fp32) member of that group
    7. fuse_topk_into_linear_group_router    the router's selection -> the same op (its last CTA, opt-in on CUDA)
    8. fuse_rms_norm_into_linear             an RMSNorm feeding one GEMV -> the GEMV with the norm fused
    9. insert_prefetch                       L2 prefetch of the next weights while a collective runs
   10. fuse_mla_append_and_gate              MLA: kv_a norm + cache append + output gate -> the in-place
                                             mla_append_attention_ (its copy back goes)
   11. fuse_q_b_into_mla_attention           MLA: q_a_layernorm + q_b_proj (rms_norm_linear) -> that op's query
                                             (mla_qb_append_attention_)
   12. write_kda_state_in_place              kda_decode writes S and the conv state into the cache (its copies
                                             back go); these two last: the graph is no longer functional after them

Canonicalization always runs; `options["passes"]` selects among the others.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import time

import torch
import torch.fx as fx

logger = logging.getLogger("k3fuse")


def pipeline_passes():
    """The pass classes, in order. Imported lazily: passes import torch's pattern matcher."""
    from k3fuse.passes.canonicalize import Canonicalize
    from k3fuse.passes.fuse_attn_out_allreduce_attnres_norm import FuseAttnOutAllReduceAttnResNorm
    from k3fuse.passes.fuse_kda_conv_gated_norm import FuseKdaConvGatedNorm
    from k3fuse.passes.fuse_mla_append_and_gate import FuseMlaAppendAndGate
    from k3fuse.passes.fuse_q_b_into_mla_attention import FuseQbIntoMlaAttention
    from k3fuse.passes.fuse_rms_norm_into_linear import FuseRmsNormIntoLinear
    from k3fuse.passes.fuse_shared_input_linears import FuseSharedInputLinears
    from k3fuse.passes.fuse_router_into_linear_group import FuseRouterIntoLinearGroup
    from k3fuse.passes.fuse_situ_glu_into_linear_group import FuseSituGluIntoLinearGroup
    from k3fuse.passes.fuse_topk_into_linear_group_router import FuseTopkIntoLinearGroupRouter
    from k3fuse.passes.insert_prefetch import InsertPrefetch
    from k3fuse.passes.split_moe_across_ranks import SplitMoEAcrossRanks
    from k3fuse.passes.write_kda_state_in_place import WriteKdaStateInPlace
    return [Canonicalize, FuseKdaConvGatedNorm, FuseAttnOutAllReduceAttnResNorm, SplitMoEAcrossRanks,
            FuseSharedInputLinears, FuseSituGluIntoLinearGroup, FuseRouterIntoLinearGroup,
            FuseTopkIntoLinearGroupRouter, FuseRmsNormIntoLinear, InsertPrefetch, FuseMlaAppendAndGate, FuseQbIntoMlaAttention,
            WriteKdaStateInPlace]


PASS_NAMES = ("canonicalize", "fuse_kda_conv_gated_norm", "fuse_attn_out_allreduce_attnres_norm",
              "split_moe_across_ranks", "fuse_shared_input_linears", "fuse_situ_glu_into_linear_group",
              "fuse_router_into_linear_group", "fuse_topk_into_linear_group_router", "fuse_rms_norm_into_linear",
              "insert_prefetch", "fuse_mla_append_and_gate", "fuse_q_b_into_mla_attention",
              "write_kda_state_in_place")


def op_counts(graph: fx.Graph) -> dict[str, int]:
    """Count call_function targets by name (k3fuse ops as 'k3fuse.<op>', ATen as 'aten.<op>')."""
    c = collections.Counter()
    for n in graph.nodes:
        if n.op == "call_function":
            t = n.target
            if isinstance(t, torch._ops.OpOverload):
                c[f"{t.namespace}.{t._schema.name.split('::')[-1]}"] += 1
            else:
                c[getattr(t, "__name__", str(t))] += 1
    return dict(sorted(c.items()))


class Pipeline:
    def __init__(self, options, graph_id: int = 0):
        from k3fuse.passes.base import PassContext
        self.options = options
        self.graph_id = graph_id
        names = options.passes
        if names is not None:
            unknown = sorted(set(names) - set(PASS_NAMES))
            if unknown:
                raise ValueError(f"k3fuse: unknown pass(es) {unknown}; the pipeline is {list(PASS_NAMES)}")
        self.passes = [cls() for cls in pipeline_passes()
                       if names is None or cls.name == "canonicalize" or cls.name in names]
        self.ctx = PassContext(prefetch_budget_bytes=options.prefetch_budget_bytes)
        self.summary: dict = {}
        self.graph_module: fx.GraphModule | None = None

    def dump(self, gm: fx.GraphModule, fname: str):
        d = self.debug_dir
        if d:
            with open(os.path.join(d, fname), "w") as f:
                f.write(gm.print_readable(print_output=False, include_stride=False, include_device=True))

    @property
    def debug_dir(self):
        if not self.options.debug_dir:
            return None
        d = os.path.join(self.options.debug_dir, f"graph_{self.graph_id:03d}")
        os.makedirs(d, exist_ok=True)
        return d

    def write_summary(self):
        if self.debug_dir:
            with open(os.path.join(self.debug_dir, "summary.json"), "w") as f:
                json.dump(self.summary, f, indent=1)

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        ops_before = op_counts(gm.graph)
        records = []
        for i, p in enumerate(self.passes):
            self.dump(gm, f"{i:02d}.{p.name}.before.py")
            t0 = time.perf_counter()
            p(gm.graph, self.ctx)
            gm.graph.eliminate_dead_code()
            gm.recompile()
            records.append({"name": p.name, "matches": p.matches, "uuid": p.uuid()[:16],
                            "ms": round(1e3 * (time.perf_counter() - t0), 2)})
            self.dump(gm, f"{i:02d}.{p.name}.after.py")
        # Inductor's invariant, relied on by the lowering: every node carries meta["val"] (passes/base.py)
        no_val = [n.name for n in gm.graph.nodes if n.op == "call_function" and "val" not in n.meta]
        self.summary = {"graph_id": self.graph_id, "passes": records, "ops_before": ops_before,
                        "ops": op_counts(gm.graph), "nodes_without_val": no_val}
        self.write_summary()
        logger.info("k3fuse graph %d: %s", self.graph_id,
                    ", ".join(f"{r['name']}={r['matches']}" for r in records))
        self.graph_module = gm      # the post-pass graph (tools: benchmarks/op_ledger.py)
        return gm
