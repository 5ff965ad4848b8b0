"""Pass fuse_situ_glu_into_down_proj: the SiTU-GLU before a fused_residual_norm's GEMV becomes its prologue."""
import pytest
import torch

from _check import compiled_steps
from k3fuse import ops as k3ops
from k3fuse.models import KimiK3Config
from k3fuse.passes.fuse_situ_glu_into_down_proj import FuseSituGluIntoDownProj
from k3fuse.pipeline import PASS_NAMES, op_counts

k3 = torch.ops.k3fuse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_unfused(dtype):
    """Tiny K3 at TP = 1: one match per MoE layer (the shared expert) and the dense layer 0; compiled with the
    pass == without it, bit for bit (the op's reference applies the same situ_glu math first)."""
    cfg = KimiK3Config.preset("tiny")
    n_moe = sum(cfg.is_moe_layer(l) for l in range(cfg.num_hidden_layers))
    a, _, sa = compiled_steps(cfg, dtype)
    b, _, sb = compiled_steps(cfg, dtype, passes=[p for p in PASS_NAMES[1:] if p != "fuse_situ_glu_into_down_proj"])
    m = {p["name"]: p["matches"] for p in sa["passes"]}
    assert m["fuse_situ_glu_into_down_proj"] == 1 + n_moe == 6
    assert "k3fuse.situ_glu" not in sa["ops"] and sb["ops"]["k3fuse.situ_glu"] == 6
    assert sa["ops"]["k3fuse.fused_residual_norm"] == sb["ops"]["k3fuse.fused_residual_norm"]
    assert torch.equal(a, b) and a.abs().sum() > 0


def _graph(situ_users=1):
    from torch.fx.experimental.proxy_tensor import make_fx
    H, K = 64, 32

    def f(gu, w_o, prefix, b0, w_mix, norm_w):
        o = k3.situ_glu(gu, 4.0, 25.0)
        normed, new_prefix = k3.fused_residual_norm(o, w_o, None, prefix, [b0], w_mix, norm_w, 1e-5, 1e-5, "", False)
        return (normed, new_prefix, o * 2) if situ_users == 2 else (normed, new_prefix)
    g = torch.Generator().manual_seed(3)
    bf = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)   # noqa: E731
    ins = (bf(3, 2 * K) * 3, bf(H, K) * K ** -0.5, bf(3, H), bf(3, H), torch.randn(H, generator=g) * 0.1,
           bf(H) * 0.1 + 1)
    return make_fx(f, tracing_mode="fake")(*ins), ins


def test_rewrite_and_values():
    gm, ins = _graph()
    ref = gm(*ins)
    assert FuseSituGluIntoDownProj()(gm.graph) == 1
    gm.recompile()
    ops = op_counts(gm.graph)
    assert "k3fuse.situ_glu" not in ops and ops["k3fuse.fused_residual_norm"] == 1
    (frn,) = [n for n in gm.graph.nodes if n.target == k3.fused_residual_norm.default]
    assert frn.kwargs["situ_beta"] == 4.0 and frn.kwargs["situ_lbeta"] == 25.0
    got = gm(*ins)
    assert all(torch.equal(x, y) for x, y in zip(got, ref)) and ref[0].abs().sum() > 0
    # the reference with the prologue is situ_glu then the op, exactly
    o = k3ops.situ_glu._init_fn(ins[0], 4.0, 25.0)
    want = k3ops.fused_residual_norm._init_fn(o, ins[1], None, ins[2], [ins[3]], ins[4], ins[5], 1e-5, 1e-5, "",
                                              False)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert FuseSituGluIntoDownProj()(gm.graph) == 0          # nothing left to fold


def test_no_match_when_the_situ_output_is_reused():
    gm, _ = _graph(situ_users=2)
    assert FuseSituGluIntoDownProj()(gm.graph) == 0
