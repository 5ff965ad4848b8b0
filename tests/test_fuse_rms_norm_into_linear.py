"""Pass fuse_rms_norm_into_linear and the lowering's split of the fused op where its kernel does not apply."""
import pytest
import torch

from _check import compiled_steps, lower_with_kernels
from k3fuse.models import KimiK3Config
from k3fuse.passes.fuse_rms_norm_into_linear import FuseRmsNormIntoLinear
from k3fuse.pipeline import PASS_NAMES

k3 = torch.ops.k3fuse


def run(cfg, dtype, passes=None):
    out, _, summary = compiled_steps(cfg, dtype, **({} if passes is None else {"passes": passes}))
    return out, summary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_unfused(dtype):
    """Tiny K3: one match per MoE layer (routed_expert_norm -> routed up) and per MLA layer (q_a norm -> q_b);
    compiled with the pass == without it (the fused op's reference is the same math)."""
    cfg = KimiK3Config.preset("tiny")
    L = cfg.num_hidden_layers
    n_mla = sum(cfg.layer_kind(l) == "mla" for l in range(L))
    n_moe = sum(cfg.is_moe_layer(l) for l in range(L))
    a, sa = run(cfg, dtype)
    b, sb = run(cfg, dtype, passes=[p for p in PASS_NAMES[1:] if p != "fuse_rms_norm_into_linear"])
    m = {p["name"]: p["matches"] for p in sa["passes"]}
    assert m["fuse_rms_norm_into_linear"] == n_moe + n_mla == 7
    # the MLA's then went into its attention op (fuse_q_b_into_mla_attention), which needs this pass's op
    assert m["fuse_q_b_into_mla_attention"] == n_mla and "fuse_q_b_into_mla_attention" not in {
        p["name"] for p in sb["passes"] if p["matches"]}
    assert sa["ops"]["k3fuse.rms_norm_linear"] == n_moe and "k3fuse.rms_norm_linear" not in sb["ops"]
    assert sb["ops"]["k3fuse.rms_norm"] - sa["ops"]["k3fuse.rms_norm"] == 7
    assert sb["ops"]["k3fuse.linear"] - sa["ops"]["k3fuse.linear"] == 7
    assert torch.equal(a, b)


def _norm_linear_graph(M, norm_users=1, w_dtype=torch.bfloat16):
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, nw, w, w2):
        h = k3.rms_norm(x, nw, 1e-5, torch.bfloat16)
        y = k3.linear(h, w)
        return (y, k3.linear(h, w2)) if norm_users == 2 else (y,)
    ins = (torch.randn(M, 64, dtype=torch.bfloat16), torch.rand(64, dtype=torch.bfloat16) + 0.5,
           torch.randn(32, 64).to(w_dtype), torch.randn(16, 64, dtype=torch.bfloat16))
    return make_fx(f, tracing_mode="fake")(*ins), ins


def test_no_match_when_the_norm_has_other_users_or_dtypes_differ():
    for users, wdt in ((2, torch.bfloat16), (1, torch.float32)):
        gm, _ = _norm_linear_graph(1, users, wdt)
        assert FuseRmsNormIntoLinear()(gm.graph) == 0
    gm, _ = _norm_linear_graph(1)
    assert FuseRmsNormIntoLinear()(gm.graph) == 1


@pytest.mark.parametrize("M,applies", [(1, True), (8, False)])
def test_lowering_splits_where_the_kernel_does_not_apply(monkeypatch, M, applies):
    """With a kernel registered for the fused op, the lowering keeps it where KERNEL_APPLIES says yes and otherwise
    splits it into rms_norm (inlined to ATen: no kernel) + linear (kept: it has one); same bits."""
    gm, ins = _norm_linear_graph(M)
    ins = [t.clone() for t in ins]
    ref = gm(*ins)[0]
    assert FuseRmsNormIntoLinear()(gm.graph) == 1
    gm.recompile()
    lowered, ops = lower_with_kernels(gm, monkeypatch, {"k3fuse::rms_norm_linear", "k3fuse::linear"},
                                      "rms_norm_linear", lambda x, *a: x.shape[0] <= 4)
    if applies:
        assert lowered == [] and ops["k3fuse.rms_norm_linear"] == 1
    else:
        assert lowered == ["rms_norm_linear", "rms_norm"]
        assert "k3fuse.rms_norm_linear" not in ops and ops["k3fuse.linear"] == 1 and "k3fuse.rms_norm" not in ops
    assert torch.equal(gm(*ins)[0], ref) and ref.abs().sum() > 0


def test_kernel_applies_per_the_h200_table(monkeypatch):
    """The H200 table's gemv_norm entry for the routed up: fused (simt R = 4, W = 2) at buckets 1-2, split back at
    bucket 4 where the norm kernel + the plain (mma) GEMV measured faster (benchmarks/fused_norm_tune.py)."""
    from k3fuse.codegen import gemv, registry, tuning
    bf = torch.bfloat16
    monkeypatch.setattr(tuning, "current_gpu", lambda: "nvidia_h200")
    applies = registry.KERNEL_APPLIES["rms_norm_linear"]
    up = torch.empty(7168, 3584, dtype=bf)
    assert applies(torch.empty(2, 3584, dtype=bf), None, 1e-5, up)
    assert not applies(torch.empty(4, 3584, dtype=bf), None, 1e-5, up)
    assert gemv.default_fused_config(7168, 3584, 1, dict(norm=True)) == {"variant": "simt", "R": 4, "W": 2}


def test_kernel_applies_where_it_measured_faster():
    """codegen's predicate for the lowering: the fused kernel at M <= 4 and weights up to the measured size limit
    (MLA q_b and, since the norm's scale moved into the epilogue (session 8), the 51 MB routed up projection too;
    K3FUSE_NORM_LINEAR_MAX_MB=16 restores the old limit)."""
    from k3fuse.codegen import registry
    bf = torch.bfloat16
    applies = registry.KERNEL_APPLIES["rms_norm_linear"]
    q_b, up = torch.empty(1152, 1536, dtype=bf), torch.empty(7168, 3584, dtype=bf)
    assert applies(torch.empty(1, 1536, dtype=bf), None, 1e-5, q_b)
    assert applies(torch.empty(4, 1536, dtype=bf), None, 1e-5, q_b)
    assert not applies(torch.empty(8, 1536, dtype=bf), None, 1e-5, q_b)
    assert applies(torch.empty(1, 3584, dtype=bf), None, 1e-5, up)
    assert not applies(torch.empty(8, 3584, dtype=bf), None, 1e-5, up)
    assert not applies(torch.empty(1, 3584, dtype=bf), None, 1e-5, torch.empty(7168 * 5, 3584, dtype=bf))  # 257 MB
