"""Pass fuse_router_into_linear_group, its op's reference, the lowering's split and the kernel's fp32 member (CPU)."""

import pytest
import torch

from _check import compiled_steps, lower_with_kernels
from k3fuse.models import KimiK3Config
from k3fuse.passes import PassContext
from k3fuse.passes.fuse_router_into_linear_group import FuseRouterIntoLinearGroup
from k3fuse.pipeline import PASS_NAMES, op_counts

k3 = torch.ops.k3fuse
ARCHES = ["sm_90a", "sm_100a"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_unfused(dtype):
    """Tiny K3 at TP = 1: one match per MoE layer (the router joins the MoE group: routed down + shared gate_up with
    its SiTU-GLU); compiled with the pass == without it, bit for bit (the op's reference is the group + router_logits,
    and router_topk's is router_logits + topk_from_logits)."""
    cfg = KimiK3Config.preset("tiny")
    n_moe = sum(cfg.is_moe_layer(l) for l in range(cfg.num_hidden_layers))
    # without the selection pass after it, which turns the op into linear_group_router_topk
    keep = [p for p in PASS_NAMES[1:] if p != "fuse_topk_into_linear_group_router"]
    a, _, sa = compiled_steps(cfg, dtype, passes=keep)
    b, _, sb = compiled_steps(cfg, dtype, passes=[p for p in keep if p != "fuse_router_into_linear_group"])
    m = {p["name"]: p["matches"] for p in sa["passes"]}
    assert m["fuse_router_into_linear_group"] == n_moe == 5
    assert sa["ops"]["k3fuse.linear_group_router"] == 5 and sa["ops"]["k3fuse.topk_from_logits"] == 5
    assert "k3fuse.router_topk" not in sa["ops"] and "k3fuse.linear_group_situ" not in sa["ops"]
    assert sb["ops"]["k3fuse.router_topk"] == 5 and sb["ops"]["k3fuse.linear_group_situ"] == 5
    assert "k3fuse.linear_group_router" not in sb["ops"]
    assert sa["nodes_without_val"] == []
    assert torch.equal(a, b) and a.abs().sum() > 0


def _router_graph(M, kind="group"):
    """A router_topk (or router_logits) reading x next to a group (or lone linear) of x, the router first."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, wa, wb, wr, bias):
        if kind == "linear":
            lg = k3.router_logits(x, wr)
            y = k3.linear(x, wa)
            return lg * 2.0, y
        ids, w = k3.router_topk(x, wr, bias, 3, True, 2.5)
        if kind == "situ":
            ys = k3.linear_group_situ(x, [wa, wb], 1, 4.0, 25.0)
        else:
            ys = k3.linear_group(x, [wa, wb])
        return ids, w, ys[0], ys[1]
    bf = torch.bfloat16
    ins = (torch.randn(M, 64, dtype=bf), torch.randn(32, 64, dtype=bf), torch.randn(48, 64, dtype=bf),
           torch.randn(16, 64, dtype=bf), torch.randn(16) * 0.1)
    return make_fx(f, tracing_mode="fake")(*ins), ins


@pytest.mark.parametrize("kind", ["group", "situ", "linear"])
def test_rewrite_values_and_op_counts(kind):
    """Each shape of match: the router's results, the group's outputs and their values are unchanged; the new node
    takes the earlier place (the router's) and the selection follows it."""
    gm, ins = _router_graph(2, kind)
    ref = gm(*ins)
    assert FuseRouterIntoLinearGroup()(gm.graph, PassContext(expect_matches=False)) == 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    ops = op_counts(gm.graph)
    assert ops["k3fuse.linear_group_router"] == 1
    assert not {"k3fuse.router_topk", "k3fuse.router_logits", "k3fuse.linear", "k3fuse.linear_group",
                "k3fuse.linear_group_situ"} & set(ops)
    node = next(iter(gm.graph.find_nodes(op="call_function", target=k3.linear_group_router.default)))
    assert node.args[3:] == ((1, 4.0, 25.0) if kind == "situ" else (-1, 0.0, 0.0))
    assert len(node.args[1]) == (1 if kind == "linear" else 2)
    assert ops.get("k3fuse.topk_from_logits", 0) == (0 if kind == "linear" else 1)
    out = gm(*ins)
    assert len(out) == len(ref) and all(torch.equal(o, r) for o, r in zip(out, ref))
    assert out[-1].abs().sum() > 0


def test_no_match_without_a_group_or_with_another_weight_dtype():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, wa, wr, bias):
        ids, w = k3.router_topk(x, wr, bias, 3, True, 2.5)
        return ids, w, k3.linear(x.float(), wa)          # the linear reads another node
    bf = torch.bfloat16
    gm = make_fx(f, tracing_mode="fake")(torch.randn(2, 64, dtype=bf), torch.randn(32, 64),
                                         torch.randn(16, 64, dtype=bf), torch.randn(16))
    p = FuseRouterIntoLinearGroup()
    assert p(gm.graph, PassContext(expect_matches=False)) == 0 and "no group" in p.skip_reason

    def g(x, wa, wr, bias):
        ids, w = k3.router_topk(x, wr, bias, 3, True, 2.5)
        return ids, w, k3.linear(x, wa)
    gm = make_fx(g, tracing_mode="fake")(torch.randn(2, 64, dtype=bf), torch.randn(32, 64, dtype=bf),
                                         torch.randn(16, 64), torch.randn(16))     # fp32 router weight
    assert FuseRouterIntoLinearGroup()(gm.graph, PassContext(expect_matches=False)) == 0


@pytest.mark.parametrize("M,applies", [(1, True), (8, False)])
def test_lowering_splits_where_the_kernel_does_not_apply(monkeypatch, M, applies):
    """Where KERNEL_APPLIES says no, the lowering splits the op into its reference: the SiTU group (kept: it has a
    kernel) + router_logits (kept too); same bits either way."""
    from k3fuse import lowering
    gm, ins = _router_graph(M, "situ")
    ref = gm(*ins)
    assert FuseRouterIntoLinearGroup()(gm.graph, PassContext(expect_matches=False)) == 1
    gm.recompile()
    # the SiTU group's own predicate (registry.register() installs the real one) kept out of this test
    monkeypatch.setitem(lowering.KERNEL_APPLIES, "linear_group_situ", lambda *a: True)
    lowered, ops = lower_with_kernels(
        gm, monkeypatch, {"k3fuse::linear_group_router", "k3fuse::linear_group_situ", "k3fuse::router_logits",
                          "k3fuse::topk_from_logits"}, "linear_group_router", lambda x, *a: x.shape[0] <= 2)
    if applies:
        assert lowered == [] and ops["k3fuse.linear_group_router"] == 1
    else:
        assert lowered == ["linear_group_router"]
        assert "k3fuse.linear_group_router" not in ops
        assert ops["k3fuse.linear_group_situ"] == 1 and ops["k3fuse.router_logits"] == 1
    out = gm(*ins)
    assert all(torch.equal(o, r) for o, r in zip(out, ref))


def test_kernel_applies_on_the_simt_buckets_only(monkeypatch):
    """codegen's predicate on the K3 TP16-width MoE group + router (3584 + 768 + 896 rows, K = 7168) with the H200
    table: the simt buckets yes, the mma ones no; the switches that keep the router on its own path say no."""
    from k3fuse.codegen import gemv, registry, tuning
    bf = torch.bfloat16
    ws = [torch.empty(3584, 7168, dtype=bf), torch.empty(768, 7168, dtype=bf)]
    wr = torch.empty(896, 7168, dtype=bf)
    monkeypatch.setattr(tuning, "current_gpu", lambda: "nvidia_h200")
    applies = registry.KERNEL_APPLIES["linear_group_router"]
    for M in (1, 2):
        assert applies(torch.empty(M, 7168, dtype=bf), ws, wr, 1, 4.0, 25.0)
        assert applies(torch.empty(M, 7168, dtype=bf), ws[:1], wr, -1, 0.0, 0.0)
        c = gemv.group_router_route([3584, 768, 896], 7168, M, (1,))[0]
        assert c == gemv.group_situ_route([3584, 768, 896], 7168, M, (1,))[0] and c["variant"] == "simt"
    assert not applies(torch.empty(8, 7168, dtype=bf), ws, wr, 1, 4.0, 25.0)
    assert "simt" in gemv.group_router_route([3584, 896], 7168, 8, ())[1]
    for env in ("K3FUSE_ROUTER_TOPK", "K3FUSE_ROUTER_GEMV", "K3FUSE_GROUPED_GEMV"):
        monkeypatch.setenv(env, "0")
        assert not applies(torch.empty(1, 7168, dtype=bf), ws, wr, 1, 4.0, 25.0)
        monkeypatch.delenv(env)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("Ns,situ,bucket", [([3584, 768, 896], True, 1), ([3584, 768, 896], True, 2),
                                            ([224, 56], False, 1), ([48, 128, 10], True, 2)])
def test_group_router_kernel_compiles(arch, Ns, situ, bucket):
    """The grouped GEMV with the router's fp32 member: one fp32 store (the router's) and one bf16 store path, 128-bit
    weight loads, no local memory; the groups without an fp32 member render as before (no GF32)."""
    from k3fuse.codegen import gemv
    j = len(Ns) - 1
    s = ((j - 1,), 4.0, 25.0) if situ else None
    plain = gemv.render_group_source(Ns, 7168 if Ns[0] > 100 else 64, bucket, situ=s)[1]
    assert "GF32" not in plain and "mYf" not in plain
    k = gemv.build_group(Ns, 7168 if Ns[0] > 100 else 64, bucket, situ=s, f32=(j,), arch=arch, load=False)
    assert "GF32=True" in k.source.split("\n")[1] and f"FI = {[int(i == j) for i in range(len(Ns))]}" in k.source
    ptx = open(k.files["kernel.ptx"]).read()
    assert ptx.count("st.global.b32") == 1 and ptx.count("st.global.b16") == 1
    assert "ld.global.v4" in ptx and "ld.local" not in ptx
    import json
    import os
    meta = json.load(open(os.path.join(os.path.dirname(k.files["kernel.ptx"]), "meta.json")))
    assert meta["op"] == "k3fuse::linear_group_router" and meta["fusion"]["f32_members"] == [j]
    with pytest.raises(ValueError, match="fp32 members"):
        gemv.render_group_source(Ns, 7168, 8, f32=(j,))          # bucket 8: an mma config


def test_cpu_impl_of_the_op_is_the_reference():
    """linear_group_router's own values: the group's (bf16) and the router's fp32 logits, equal to the separate ops."""
    bf = torch.bfloat16
    x, wa, wb, wr = (torch.randn(3, 64, dtype=bf), torch.randn(32, 64, dtype=bf), torch.randn(48, 64, dtype=bf),
                     torch.randn(16, 64, dtype=bf))
    outs = k3.linear_group_router(x, [wa, wb], wr, 1, 4.0, 25.0)
    ref = list(k3.linear_group_situ(x, [wa, wb], 1, 4.0, 25.0)) + [k3.router_logits(x, wr)]
    assert [o.dtype for o in outs] == [bf, bf, torch.float32] and outs[1].shape == (3, 24)
    assert all(torch.equal(o, r) for o, r in zip(outs, ref))
    assert outs[2].shape == (3, 16) and not torch.equal(outs[2], outs[2].to(bf).float())   # not rounded to bf16


def test_cuda_impl_falls_back_off_gpu():
    """registry.linear_group_router_cuda where no kernel can run (CPU tensors): one log line, then the group op's
    and router_logits' own paths, equal to the reference; _rows_2d gives contiguous 16-byte aligned rows."""
    from k3fuse.codegen import registry
    bf = torch.bfloat16
    x, wa, wb, wr = (torch.randn(2, 64, dtype=bf), torch.randn(32, 64, dtype=bf), torch.randn(48, 64, dtype=bf),
                     torch.randn(16, 64, dtype=bf))
    for member in (1, -1):
        outs = registry.linear_group_router_cuda(x, [wa, wb], wr, member, 4.0, 25.0)
        ref = k3.linear_group_router(x, [wa, wb], wr, member, 4.0, 25.0)
        assert [o.shape for o in outs] == [r.shape for r in ref] and outs[-1].dtype == torch.float32
        assert all(torch.equal(o, r) for o, r in zip(outs, ref))
    xt = torch.randn(64, 6, dtype=bf).t()           # not contiguous
    x2 = registry._rows_2d(xt)
    assert x2.is_contiguous() and x2.data_ptr() % 16 == 0 and torch.equal(x2, xt)
