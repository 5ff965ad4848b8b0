"""Pass fuse_situ_glu_into_linear_group and the lowering's split of the fused op where its kernel does not apply."""
import pytest
import torch

from _check import compiled_steps, lower_with_kernels
from k3fuse.models import KimiK3Config
from k3fuse.passes import PassContext
from k3fuse.passes.fuse_situ_glu_into_linear_group import FuseSituGluIntoLinearGroup
from k3fuse.pipeline import PASS_NAMES, op_counts

k3 = torch.ops.k3fuse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_unfused(dtype):
    """Tiny K3 at TP = 1: one match per MoE layer (the shared gate_up grouped with the routed down projection);
    compiled with the pass == without it, bit for bit (the fused op's reference is linear_group + situ_glu)."""
    cfg = KimiK3Config.preset("tiny")
    n_moe = sum(cfg.is_moe_layer(l) for l in range(cfg.num_hidden_layers))
    # without the router pass after it, which turns the fused group into linear_group_router
    keep = [p for p in PASS_NAMES[1:] if p != "fuse_router_into_linear_group"]
    a, ca, sa = compiled_steps(cfg, dtype, passes=keep)
    b, cb, sb = compiled_steps(cfg, dtype, passes=[p for p in keep if p != "fuse_situ_glu_into_linear_group"])
    m = {p["name"]: p["matches"] for p in sa["passes"]}
    assert m["fuse_situ_glu_into_linear_group"] == n_moe == 5
    assert sa["ops"]["k3fuse.linear_group_situ"] == 5 and "k3fuse.linear_group_situ" not in sb["ops"]
    assert sb["ops"]["k3fuse.linear_group"] - sa["ops"]["k3fuse.linear_group"] == 5
    assert sb["ops"]["k3fuse.situ_glu"] - sa["ops"]["k3fuse.situ_glu"] == 5 and sa["ops"]["k3fuse.situ_glu"] == 1
    assert torch.equal(a, b)


def _group_graph(M, situ_member=1, extra_use=False):
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, wa, wb, wc):
        ys = list(k3.linear_group(x, [wa, wb, wc]))
        gate_up = ys[situ_member]
        ys[situ_member] = k3.situ_glu(gate_up, 4.0, 25.0)
        return (*ys, gate_up) if extra_use else tuple(ys)
    ins = (torch.randn(M, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16),
           torch.randn(48, 64, dtype=torch.bfloat16), torch.randn(16, 64, dtype=torch.bfloat16))
    return make_fx(f, tracing_mode="fake")(*ins), ins


def test_rewrite_and_no_match_when_the_output_has_other_users():
    gm, ins = _group_graph(2)
    ref = gm(*ins)
    assert FuseSituGluIntoLinearGroup()(gm.graph, PassContext(expect_matches=False)) == 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    ops = op_counts(gm.graph)
    assert ops["k3fuse.linear_group_situ"] == 1 and "k3fuse.linear_group" not in ops and "k3fuse.situ_glu" not in ops
    node = next(iter(gm.graph.find_nodes(op="call_function", target=k3.linear_group_situ.default)))
    assert node.args[2:] == (1, 4.0, 25.0)
    out = gm(*ins)
    assert all(torch.equal(o, r) for o, r in zip(out, ref)) and out[1].shape == (2, 24)
    # the gate_up output also read elsewhere: the SiTU stays separate (the fused op no longer returns gate_up)
    gm, _ = _group_graph(2, extra_use=True)
    assert FuseSituGluIntoLinearGroup()(gm.graph, PassContext(expect_matches=False)) == 0


@pytest.mark.parametrize("M,applies", [(1, True), (8, False)])
def test_lowering_splits_where_the_kernel_does_not_apply(monkeypatch, M, applies):
    """With a kernel registered for the fused op, the lowering keeps it where KERNEL_APPLIES says yes and otherwise
    splits it into linear_group (kept: it has a kernel) + situ_glu (inlined to ATen: no kernel); same bits."""
    gm, ins = _group_graph(M, situ_member=0)
    ref = gm(*ins)
    assert FuseSituGluIntoLinearGroup()(gm.graph, PassContext(expect_matches=False)) == 1
    gm.recompile()
    lowered, ops = lower_with_kernels(gm, monkeypatch, {"k3fuse::linear_group_situ", "k3fuse::linear_group"},
                                      "linear_group_situ", lambda x, *a: x.shape[0] <= 2)
    if applies:
        assert lowered == [] and ops["k3fuse.linear_group_situ"] == 1
    else:
        assert lowered == ["linear_group_situ", "situ_glu"]
        assert "k3fuse.linear_group_situ" not in ops and ops["k3fuse.linear_group"] == 1
        assert "k3fuse.situ_glu" not in ops
    out = gm(*ins)
    assert all(torch.equal(o, r) for o, r in zip(out, ref)) and ref[0].abs().sum() > 0


def test_kernel_applies_on_the_simt_buckets_only(monkeypatch):
    """codegen's predicate for the lowering, on the K3 TP16-width MoE group (routed down 3584 + shared gate_up 768,
    K = 7168) with the H200 table: the simt buckets (M <= 2) yes, the mma ones no; an odd gate_up no."""
    from k3fuse.codegen import registry, tuning
    bf = torch.bfloat16
    ws = [torch.empty(3584, 7168, dtype=bf), torch.empty(768, 7168, dtype=bf)]
    monkeypatch.setattr(tuning, "current_gpu", lambda: "nvidia_h200")
    applies = registry.KERNEL_APPLIES["linear_group_situ"]
    assert applies(torch.empty(1, 7168, dtype=bf), ws, 1, 4.0, 25.0)
    assert applies(torch.empty(2, 7168, dtype=bf), ws, 1, 4.0, 25.0)
    assert not applies(torch.empty(8, 7168, dtype=bf), ws, 1, 4.0, 25.0)
    assert not applies(torch.empty(1, 7168, dtype=bf), [ws[0], torch.empty(767, 7168, dtype=bf)], 1, 4.0, 25.0)
    # the table's own entry for the SiTU group (benchmarks/group_situ_tune.py), else the plain group's R made even
    from k3fuse.codegen import gemv
    assert gemv.group_situ_route([3584, 768], 7168, 1, (1,))[0] == {"variant": "simt", "R": 4, "W": 4}
    assert gemv.group_situ_route([3584, 768], 7168, 2, (1,))[0] == {"variant": "simt", "R": 2, "W": 4}
    assert gemv.group_situ_route([1000, 768], 7168, 1, (1,))[0]["R"] % 2 == 0
    assert gemv.group_situ_route([3584, 768], 7168, 8, (1,))[0] is None        # mma bucket
