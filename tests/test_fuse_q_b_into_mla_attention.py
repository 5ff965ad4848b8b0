"""Pass fuse_q_b_into_mla_attention: the query's rms_norm_linear (q_a_layernorm + q_b_proj) whose slices only feed
k3fuse.mla_append_attention_ -> k3fuse.mla_qb_append_attention_ (CPU: the op's reference; the kernel in
tests/test_mla_heads_gpu.py)."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from _check import compiled_steps
from k3fuse.models import KimiK3Config
from k3fuse.passes.fuse_q_b_into_mla_attention import FuseQbIntoMlaAttention
from k3fuse.pipeline import PASS_NAMES

k3 = torch.ops.k3fuse
PASS = "fuse_q_b_into_mla_attention"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_unfused(dtype):
    """Tiny K3 (2 MLA layers), 3 steps, M = 3: with the pass == without it, bit for bit (logits and every latent
    cache); one match per MLA layer; the MLA's rms_norm_linear and mla_append_attention_ gone."""
    cfg = KimiK3Config.preset("tiny")
    n_mla = sum(cfg.layer_kind(l) == "mla" for l in range(cfg.num_hidden_layers))
    a, ca, sa = compiled_steps(cfg, dtype, M=3, steps=3)
    b, cb, sb = compiled_steps(cfg, dtype, M=3, steps=3, passes=[p for p in PASS_NAMES[1:] if p != PASS])
    m = {p["name"]: p["matches"] for p in sa["passes"]}
    assert m[PASS] == n_mla == 2
    assert sa["ops"]["k3fuse.mla_qb_append_attention_"] == n_mla and "k3fuse.mla_append_attention_" not in sa["ops"]
    assert sb["ops"]["k3fuse.mla_append_attention_"] == n_mla and "k3fuse.mla_qb_append_attention_" not in sb["ops"]
    assert sb["ops"]["k3fuse.rms_norm_linear"] - sa["ops"]["k3fuse.rms_norm_linear"] == n_mla
    assert torch.equal(a, b) and a.abs().sum() > 0
    caches = [(x, y) for x, y in zip(ca.latent_cache, cb.latent_cache) if x is not None]
    assert len(caches) == n_mla
    for x, y in caches:
        assert torch.equal(x, y) and (x[:, :3].abs().sum(-1) > 0).all()


def _args(M=2, h=2, n=8, v=8, r=8, C=32, QL=24, T=6, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g).to(dtype)
    return dict(cq=rn(M, QL) * 2, q_norm_w=rn(QL) * 0.2 + 1, w_qb=rn(h * (n + r), QL) * QL ** -0.5,
                ckv=rn(M, C + r) * 3, kv_norm_w=rn(C) * 0.2 + 1, cache=rn(M, T, C + r),
                kv_b=rn(h * (n + v), C) * C ** -0.5, seq_lens=torch.randint(0, T, (M,), generator=g),
                gate=rn(M, h * v)), (h, n, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_reference_is_the_unfused_math(dtype):
    """The op == rms_norm_linear, its view as [M, h, n + r], the slices at n, then mla_append_attention_: the same
    o and the same cache (new rows at seq_lens)."""
    a, (h, n, r) = _args(dtype=dtype)
    c1, c2 = a["cache"].clone(), a["cache"].clone()
    out = k3.mla_qb_append_attention_(a["cq"], a["q_norm_w"], 1e-6, a["w_qb"], h, a["ckv"], a["kv_norm_w"], 1e-6,
                                      dtype, c1, a["kv_b"], a["seq_lens"], 0.3, a["gate"], torch.bfloat16)
    q = k3.rms_norm_linear(a["cq"], a["q_norm_w"], 1e-6, a["w_qb"]).view(2, h, n + r)
    ref = k3.mla_append_attention_(q[..., :n], q[..., n:], a["ckv"], a["kv_norm_w"], 1e-6, dtype, c2, a["kv_b"],
                                   a["seq_lens"], 0.3, a["gate"], torch.bfloat16)
    assert out.shape == (2, h, 8) and out.dtype == torch.bfloat16
    assert torch.equal(out, ref) and out.abs().sum() > 0 and torch.equal(c1, c2) and not torch.equal(c1, a["cache"])


def _graph(q_used_elsewhere=False, swap=False):
    a, (h, n, r) = _args()
    M = a["cq"].shape[0]

    def step(cq, q_norm_w, w_qb, ckv, kv_norm_w, cache, kv_b, seq_lens, gate):
        q = k3.rms_norm_linear(cq, q_norm_w, 1e-6, w_qb).view(M, h, n + r)
        qn, qp = (q[..., r:], q[..., :r]) if swap else (q[..., :n], q[..., n:])
        o = k3.mla_append_attention_(qn, qp, ckv, kv_norm_w, 1e-6, torch.bfloat16, cache, kv_b, seq_lens, 0.3,
                                     gate, torch.bfloat16)
        return (o, q.sum()) if q_used_elsewhere else (o,)
    ins = [a[k] for k in ("cq", "q_norm_w", "w_qb", "ckv", "kv_norm_w", "cache", "kv_b", "seq_lens", "gate")]
    return make_fx(step, tracing_mode="fake")(*ins), ins


def test_graph_match_and_result():
    """Hand-built graph: one match, no rms_norm_linear / mla_append_attention_ left; the same o and cache."""
    gm, ins = _graph()
    ins_a, ins_b = [t.clone() for t in ins], [t.clone() for t in ins]
    ref = gm(*ins_a)[0]
    assert FuseQbIntoMlaAttention()(gm.graph) == 1
    gm.recompile()
    targets = {n.target for n in gm.graph.nodes}
    assert k3.mla_qb_append_attention_.default in targets
    assert not {k3.rms_norm_linear.default, k3.mla_append_attention_.default} & targets
    out = gm(*ins_b)[0]
    assert torch.equal(out, ref) and torch.equal(ins_b[5], ins_a[5])


@pytest.mark.parametrize("kw", [dict(q_used_elsewhere=True), dict(swap=True)])
def test_no_match(kw):
    """q read by something else, or q_nope / q_pe not q[..., :n] / q[..., n:]: the graph stays as it was."""
    gm, _ = _graph(**kw)
    p = FuseQbIntoMlaAttention()
    assert p(gm.graph) == 0 and p.skip_reason is None
    assert any(n.target is k3.rms_norm_linear.default for n in gm.graph.nodes)


def test_skips_a_graph_without_mla():
    gm = make_fx(lambda x: (x * 2,))(torch.randn(3))
    p = FuseQbIntoMlaAttention()
    assert p(gm.graph) == 0 and "mla_append_attention_" in p.skip_reason


@pytest.mark.parametrize("applies", [True, False])
def test_lowering_splits_it_back_where_the_kernel_does_not_compute_q(applies, monkeypatch):
    """Where KERNEL_APPLIES (codegen/mla_attention.qb_applies: the per-head kernel with a cluster at this M) says no,
    the lowering inlines the op's reference although the op mutates the cache (lowering.INLINE_MUTABLE):
    rms_norm_linear (then lowered on its own) + mla_append_attention_; the same o and cache either way."""
    from _check import lower_with_kernels
    gm, ins = _graph()
    ins_a, ins_b = [t.clone() for t in ins], [t.clone() for t in ins]
    ref = gm(*ins_a)[0]
    assert FuseQbIntoMlaAttention()(gm.graph) == 1
    gm.recompile()
    kernels = {"k3fuse::mla_qb_append_attention_", "k3fuse::mla_append_attention_", "k3fuse::rms_norm_linear"}
    lowered, ops = lower_with_kernels(gm, monkeypatch, kernels, "mla_qb_append_attention_", lambda *a: applies)
    if applies:
        assert lowered == [] and ops["k3fuse.mla_qb_append_attention_"] == 1
    else:
        assert lowered == ["mla_qb_append_attention_"] and "k3fuse.mla_qb_append_attention_" not in ops
        assert ops["k3fuse.rms_norm_linear"] == 1 and ops["k3fuse.mla_append_attention_"] == 1
    out = gm(*ins_b)[0]
    assert torch.equal(out, ref) and torch.equal(ins_b[5], ins_a[5]) and not torch.equal(ins_b[5], ins[5])


def test_qb_applies_off_cuda_and_by_shape(monkeypatch):
    """The predicate: kept off CUDA (its reference is the unfused math); on CUDA fake values, only where the per-head
    kernel runs with a cluster that splits W_qb (TP16: buckets 1 and 2 by default; K3FUSE_MLA_QB=0 never)."""
    from k3fuse.codegen import mla_attention as ma
    from torch._subclasses.fake_tensor import FakeTensorMode
    monkeypatch.setattr(ma, "_sm_count", lambda i: 132)
    bf = torch.bfloat16

    def args(M, device):
        e = lambda *s, dtype=bf: torch.empty(*s, dtype=dtype, device=device)
        return (e(M, 1536), e(1536), 1e-6, e(6 * 192, 1536), 6, e(M, 576), e(512), 1e-6, bf, e(M, 1024, 576),
                e(6 * 256, 512), e(M, dtype=torch.int64), 0.07, e(M, 768), bf)
    assert ma.qb_applies(*args(8, "cpu"))
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert ma.qb_applies(*args(2, "cuda")) and ma.qb_applies(*args(1, "cuda"))
        assert not ma.qb_applies(*args(8, "cuda"))
        monkeypatch.setenv("K3FUSE_MLA_HEADS", "0")              # the three launches: q_b stays a GEMV
        assert not ma.qb_applies(*args(1, "cuda"))
        monkeypatch.delenv("K3FUSE_MLA_HEADS")
        monkeypatch.setenv("K3FUSE_MLA_QB", "0")
        assert not ma.qb_applies(*args(2, "cuda"))
