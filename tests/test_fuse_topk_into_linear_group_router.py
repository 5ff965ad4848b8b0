"""Pass fuse_topk_into_linear_group_router, its op's reference and lowering split, the last-CTA selection's kernel
(compiled on the CPU) and the CUDA impl's fallback."""
import re

import pytest
import torch

from _check import compiled_steps, lower_with_kernels
from k3fuse.models import KimiK3Config
from k3fuse.passes import PassContext
from k3fuse.passes.fuse_router_into_linear_group import FuseRouterIntoLinearGroup
from k3fuse.passes.fuse_topk_into_linear_group_router import FuseTopkIntoLinearGroupRouter
from k3fuse.pipeline import PASS_NAMES, op_counts

k3 = torch.ops.k3fuse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_unfused(dtype):
    """Tiny K3 at TP = 1: one match per MoE layer, after the router joined the group; bit for bit the same as without
    the pass (the op's reference is linear_group_router + topk_from_logits)."""
    cfg = KimiK3Config.preset("tiny")
    a, _, sa = compiled_steps(cfg, dtype)
    b, _, sb = compiled_steps(cfg, dtype,
                              passes=[p for p in PASS_NAMES[1:] if p != "fuse_topk_into_linear_group_router"])
    m = {p["name"]: p["matches"] for p in sa["passes"]}
    assert m["fuse_topk_into_linear_group_router"] == 5
    assert sa["ops"]["k3fuse.linear_group_router_topk"] == 5
    assert "k3fuse.topk_from_logits" not in sa["ops"] and "k3fuse.linear_group_router" not in sa["ops"]
    assert sb["ops"]["k3fuse.linear_group_router"] == 5 and sb["ops"]["k3fuse.topk_from_logits"] == 5
    assert sa["nodes_without_val"] == []
    assert torch.equal(a, b) and a.abs().sum() > 0


def _graph(M, logits_used_elsewhere=False):
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, wa, wb, wr, bias):
        ys = k3.linear_group_router(x, [wa, wb], wr, 1, 4.0, 25.0)
        ids, w = k3.topk_from_logits(ys[2], bias, 3, True, 2.5)
        out = (ys[0] * 1.5, ys[1], ids, w)
        return out + (ys[2],) if logits_used_elsewhere else out
    bf = torch.bfloat16
    ins = (torch.randn(M, 64, dtype=bf), torch.randn(32, 64, dtype=bf), torch.randn(48, 64, dtype=bf),
           torch.randn(16, 64, dtype=bf), torch.randn(16) * 0.1)
    return make_fx(f, tracing_mode="fake")(*ins), ins


def test_rewrite_values_and_no_match_when_the_logits_are_used_elsewhere():
    gm, ins = _graph(2)
    ref = gm(*ins)
    assert FuseTopkIntoLinearGroupRouter()(gm.graph, PassContext(expect_matches=False)) == 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    ops = op_counts(gm.graph)
    assert ops["k3fuse.linear_group_router_topk"] == 1
    assert "k3fuse.linear_group_router" not in ops and "k3fuse.topk_from_logits" not in ops
    node = next(iter(gm.graph.find_nodes(op="call_function", target=k3.linear_group_router_topk.default)))
    assert node.args[4:] == (3, True, 2.5, 1, 4.0, 25.0)
    out = gm(*ins)
    assert all(torch.equal(o, r) for o, r in zip(out, ref)) and out[2].dtype == torch.int64
    gm, _ = _graph(2, logits_used_elsewhere=True)
    assert FuseTopkIntoLinearGroupRouter()(gm.graph, PassContext(expect_matches=False)) == 0


def test_router_pass_then_this_one_on_a_hand_graph():
    """router_topk + group -> linear_group_router + topk_from_logits -> linear_group_router_topk; same values."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, wa, wb, wr, bias):
        ids, w = k3.router_topk(x, wr, bias, 4, False, 1.0)
        ys = k3.linear_group(x, [wa, wb])
        return ids, w, ys[0], ys[1]
    bf = torch.bfloat16
    ins = (torch.randn(3, 64, dtype=bf), torch.randn(32, 64, dtype=bf), torch.randn(48, 64, dtype=bf),
           torch.randn(16, 64, dtype=bf), torch.randn(16) * 0.1)
    gm = make_fx(f, tracing_mode="fake")(*ins)
    ref = gm(*ins)
    assert FuseRouterIntoLinearGroup()(gm.graph, PassContext(expect_matches=False)) == 1
    assert FuseTopkIntoLinearGroupRouter()(gm.graph, PassContext(expect_matches=False)) == 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert op_counts(gm.graph) == {"k3fuse.linear_group_router_topk": 1, "getitem": 4}
    assert all(torch.equal(o, r) for o, r in zip(gm(*ins), ref))


@pytest.mark.parametrize("M,pred,applies", [(1, "M <= 2", True), (8, "M <= 2", False), (1, "registry", False)])
def test_lowering_splits_where_the_kernel_does_not_apply(monkeypatch, M, pred, applies):
    """Where KERNEL_APPLIES says no, the lowering splits the op into exactly the two ops the pass consumed; with the
    real predicate and K3FUSE_TOPK_IN_GROUP=0 it always does; same values either way."""
    from k3fuse import lowering
    from k3fuse.codegen import registry
    monkeypatch.setenv("K3FUSE_TOPK_IN_GROUP", "0")
    gm, ins = _graph(M)
    ref = gm(*ins)
    assert FuseTopkIntoLinearGroupRouter()(gm.graph, PassContext(expect_matches=False)) == 1
    gm.recompile()
    # the nested ops' own predicates (registry.register() installs the real ones) kept out of this test
    for op in ("linear_group_router", "linear_group_situ"):
        monkeypatch.setitem(lowering.KERNEL_APPLIES, op, lambda *a: True)
    lowered, ops = lower_with_kernels(
        gm, monkeypatch, {"k3fuse::linear_group_router_topk", "k3fuse::linear_group_router",
                          "k3fuse::topk_from_logits"}, "linear_group_router_topk",
        registry._linear_group_router_topk_applies if pred == "registry" else lambda x, *a: x.shape[0] <= 2)
    if applies:
        assert lowered == [] and ops["k3fuse.linear_group_router_topk"] == 1
    else:
        assert lowered == ["linear_group_router_topk"] and "k3fuse.linear_group_router_topk" not in ops
        assert ops["k3fuse.linear_group_router"] == 1 and ops["k3fuse.topk_from_logits"] == 1
    assert all(torch.equal(o, r) for o, r in zip(gm(*ins), ref))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("Ns,bucket,cfg,k", [([3584, 768, 896], 1, {"variant": "simt", "R": 4, "W": 8}, 16),
                                             ([3584, 768, 896], 2, {"variant": "simt", "R": 4, "W": 2}, 16),
                                             ([48, 128, 8], 1, None, 3)])
@pytest.mark.parametrize("first", [False, True])
def test_last_cta_selection_compiles(arch, Ns, bucket, cfg, k, first, monkeypatch):
    """The grouped GEMV with the selection in the router member's last CTA (the router last, or first as the
    launcher orders it): one acq_rel arrival at gpu scope and one acquire fence, 4 redux.sync per round and k + 1
    barriers per row (the top-k kernel's), the ids as 64-bit stores, no local memory; only the router member's CTAs
    count in; without TOPK the same group renders with none of it. The rounds only (K3FUSE_TOPK_RANK=0): the default
    rank path is tests/test_router_topk_compile.py::test_rank_selection_compiles."""
    from k3fuse.codegen import gemv
    monkeypatch.setenv("K3FUSE_TOPK_RANK", "0")
    situ, j = ((1,), 4.0, 25.0), len(Ns) - 1
    if first:
        Ns, situ, j = [Ns[-1]] + list(Ns[:-1]), ((2,), 4.0, 25.0), 0
    tile = (cfg or gemv.group_config_for(Ns, 7168 if max(Ns) > 100 else 64, bucket))["R"]
    src = gemv.render_group_source(Ns, 7168 if max(Ns) > 100 else 64, bucket, cfg, situ, (j,), (j, k, True, 2.5))[1]
    t0 = 0 if first else sum(-(-n // tile) for n in Ns[:-1])
    assert f"TJ0 = {t0} " in src and f"TJN = {-(-Ns[j] // tile)} " in src and "if tile0 == TJ0:" in src
    plain = gemv.render_group_source(Ns, 7168 if max(Ns) > 100 else 64, bucket, cfg, situ, (j,))[1]
    assert "mCtr" not in plain and "atomic_add" not in plain
    kern = gemv.build_group(Ns, 7168 if max(Ns) > 100 else 64, bucket, cfg, arch=arch, load=False, situ=situ, f32=(j,),
                            topk=(j, k, True, 2.5))
    ptx = open(kern.files["kernel.ptx"]).read()
    assert ptx.count("atom.global.acq_rel") == 1 and ptx.count("fence.acq_rel.gpu") == 1
    assert ptx.count("redux.sync.max.s32") == 4 * k * bucket
    assert len(re.findall(r"\bbar\.sync", ptx)) == 1 + 2 + bucket * (k + 2)
    assert ptx.count("st.global.b64") >= 1 and "ld.local" not in ptx
    with pytest.raises(ValueError, match="fp32"):
        gemv.render_group_source(Ns, 64, 1, {"variant": "simt", "R": 2, "W": 1}, situ, (), (j, k, True, 2.5))


def test_topk_supports():
    from k3fuse.codegen import gemv
    c = {"variant": "simt", "R": 4, "W": 8}
    assert gemv.group_topk_supports([3584, 768, 896], c, (2,), (2, 16)) is None
    assert "simt" in gemv.group_topk_supports([3584, 896], {"variant": "mma", "W": 4}, (1,), (1, 16))
    assert "fp32" in gemv.group_topk_supports([3584, 896], c, (), (1, 16))
    assert "top_k" in gemv.group_topk_supports([3584, 896], c, (1,), (1, 33))
    assert "per thread" in gemv.group_topk_supports([3584, 4096], {"variant": "simt", "R": 4, "W": 1}, (1,), (1, 8))


@pytest.mark.parametrize("knob", ["0", "1"])
def test_cuda_impl_falls_back_off_gpu(monkeypatch, knob):
    """registry.linear_group_router_topk_cuda with CPU tensors (no kernel can run), knob on or off: the two ops' own
    paths, equal to the op's reference."""
    from k3fuse.codegen import registry
    monkeypatch.setenv("K3FUSE_TOPK_IN_GROUP", knob)
    bf = torch.bfloat16
    x, wa, wb, wr = (torch.randn(2, 64, dtype=bf), torch.randn(32, 64, dtype=bf), torch.randn(48, 64, dtype=bf),
                     torch.randn(16, 64, dtype=bf))
    bias = torch.randn(16) * 0.1
    outs = registry.linear_group_router_topk_cuda(x, [wa, wb], wr, bias, 4, True, 2.5, 1, 4.0, 25.0)
    ref = k3.linear_group_router_topk(x, [wa, wb], wr, bias, 4, True, 2.5, 1, 4.0, 25.0)
    assert [o.dtype for o in outs] == [bf, bf, torch.int64, torch.float32]
    assert all(torch.equal(o, r) for o, r in zip(outs, ref))
    assert registry.topk_in_group_enabled() is (knob != "0")


def test_kernel_applies_from_256_threads_unless_the_knob_is_0(monkeypatch):
    """The real predicate on the TP16 MoE group + router (H200 table): by default yes at M = 1 (R4 W8: 256 threads,
    measured no slower per layer with one launch fewer) and no at M = 2 (W2: 64 threads, measured +30 us) and on the
    mma buckets; with K3FUSE_TOPK_IN_GROUP=0 never (the group, then the top-k kernel)."""
    from k3fuse.codegen import registry, tuning
    bf = torch.bfloat16
    ws = [torch.empty(3584, 7168, dtype=bf), torch.empty(768, 7168, dtype=bf)]
    wr, bias = torch.empty(896, 7168, dtype=bf), torch.empty(896)
    monkeypatch.setattr(tuning, "current_gpu", lambda: "nvidia_h200")
    applies = registry.KERNEL_APPLIES["linear_group_router_topk"]
    args = lambda M: (torch.empty(M, 7168, dtype=bf), ws, wr, bias, 16, True, 2.5, 1, 4.0, 25.0)
    monkeypatch.delenv("K3FUSE_TOPK_IN_GROUP", raising=False)
    assert applies(*args(1)) and not applies(*args(2)) and not applies(*args(8))
    why = registry._group_router_topk_cfg(*args(2)[:5], 1)[1]
    assert "64 threads" in why
    monkeypatch.setenv("K3FUSE_TOPK_IN_GROUP", "0")
    assert not applies(*args(1)) and not applies(*args(2))


@pytest.mark.parametrize("knob,expect", [("1", (0, 1, 2)), ("0", (2, 0, 1))])
def test_router_topk_member_order(knob, expect, monkeypatch):
    """registry.router_topk_members: the router's member index, the first weight's and the SiTU member's, as the
    launcher and `k3fuse kernels` order the MoE group (two weights, the shared gate_up second): the router first by
    default, last with K3FUSE_ROUTER_FIRST=0; no SiTU member stays -1."""
    from k3fuse.codegen import registry
    monkeypatch.setenv("K3FUSE_ROUTER_FIRST", knob)
    assert registry.router_topk_members(2, 1) == expect
    assert registry.router_topk_members(2, -1)[2] == -1
