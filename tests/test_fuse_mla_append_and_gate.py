"""Pass fuse_mla_append_and_gate: the kv_a norm + cat + cache append around mla_attention, and its output gate + cast,
-> the in-place k3fuse.mla_append_attention_ (CPU: the op's reference; the kernel in tests/test_mla_kernel_gpu.py)."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from _check import compiled_steps, rel
from k3fuse import ops
from k3fuse.models import KimiK3Config
from k3fuse.passes.fuse_mla_append_and_gate import FuseMlaAppendAndGate
from k3fuse.pipeline import PASS_NAMES

k3, aten = torch.ops.k3fuse, torch.ops.aten
PASS = "fuse_mla_append_and_gate"


@pytest.mark.parametrize("inner,dtype", [("eager", torch.float32), ("eager", torch.bfloat16),
                                         ("inductor", torch.float32)])
def test_fused_equals_unfused(inner, dtype):
    """Tiny K3 (2 MLA layers), 3 steps, M = 3: with the pass == without it (logits and every latent cache after the
    steps, so the in-place appends land where the index_put + copy did); one match per MLA layer, the gate taken
    too (in bf16 with its cast); no mla_attention, index_put or cat left."""
    cfg = KimiK3Config.preset("tiny")
    n_mla = sum(cfg.layer_kind(l) == "mla" for l in range(cfg.num_hidden_layers))
    # without fuse_q_b_into_mla_attention, which would take the fused op on
    others = [p for p in PASS_NAMES[1:] if p not in (PASS, "fuse_q_b_into_mla_attention")]
    a, ca, sa = compiled_steps(cfg, dtype, M=3, steps=3, inner_compiler=inner, passes=others + [PASS])
    b, cb, sb = compiled_steps(cfg, dtype, M=3, steps=3, inner_compiler=inner, passes=others)
    m = {p["name"]: p["matches"] for p in sa["passes"]}
    assert m[PASS] == n_mla == 2
    assert sa["ops"]["k3fuse.mla_append_attention_"] == n_mla and "k3fuse.mla_attention" not in sa["ops"]
    assert sb["ops"]["k3fuse.mla_attention"] == n_mla and "k3fuse.mla_append_attention_" not in sb["ops"]
    if inner == "eager":        # the op counts of the graph after the passes (Inductor's are lowered ones)
        assert "aten.index_put" not in sa["ops"] and sb["ops"]["aten.index_put"] == n_mla
        assert sb["ops"]["aten.copy_"] - sa["ops"]["aten.copy_"] == n_mla        # the caches' copies back
        assert sb["ops"]["aten.sigmoid"] - sa["ops"].get("aten.sigmoid", 0) == n_mla   # the gates
    same = torch.equal if inner == "eager" else (lambda x, y: rel(x, y) < 1e-5)
    assert same(a, b) and a.abs().sum() > 0
    caches = [(x, y) for x, y in zip(ca.latent_cache, cb.latent_cache) if x is not None]
    assert len(caches) == n_mla
    for x, y in caches:
        assert same(x, y)
        assert (x[:, :3].abs().sum(-1) > 0).all()        # the three steps' rows were written


def _args(M=2, h=2, n=8, v=8, r=8, C=32, T=6, dtype=torch.float32, seed=0, gate=True):
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g).to(dtype)
    return dict(q_nope=rn(M, h, n), q_pe=rn(M, h, r), ckv=rn(M, C + r) * 3, kv_norm_w=rn(C) * 0.2 + 1,
                cache=rn(M, T, C + r), kv_b=rn(h * (n + v), C) * C ** -0.5,
                seq_lens=torch.randint(0, T, (M,), generator=g), gate=rn(M, h * v) if gate else None)


@pytest.mark.parametrize("dtype,gate", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_op_reference_is_the_unfused_math(dtype, gate):
    """The op on random inputs == the model's unfused steps written out (norm, cat, append, attention, gate, cast):
    the returned o and the whole cache (the new rows at seq_lens, every other row untouched)."""
    a = _args(dtype=dtype, gate=gate)
    C = a["kv_b"].shape[1]
    cache0 = a["cache"].clone()
    odt = torch.bfloat16 if dtype == torch.bfloat16 and gate else None
    out = k3.mla_append_attention_(a["q_nope"], a["q_pe"], a["ckv"], a["kv_norm_w"], 1e-6, dtype, a["cache"],
                                   a["kv_b"], a["seq_lens"], 0.3, a["gate"], odt)
    ref_cache = cache0.clone()
    row = torch.cat([ops._rms(a["ckv"][:, :C], 1e-6).to(dtype) * a["kv_norm_w"], a["ckv"][:, C:]], -1)
    M = row.shape[0]
    ref_cache[torch.arange(M), a["seq_lens"]] = row
    o = ops.mla_attention._init_fn(a["q_nope"], a["q_pe"], ref_cache, a["kv_b"], a["seq_lens"], 0.3)
    if gate:
        o = o * torch.sigmoid(a["gate"].float().view(o.shape))
    if odt is not None:
        o = o.to(odt)
    assert out.dtype == o.dtype and torch.equal(out, o) and o.abs().sum() > 0
    assert torch.equal(a["cache"], ref_cache)
    changed = (a["cache"] != cache0).any(-1)
    assert changed.sum() == M and all(changed[m, a["seq_lens"][m]] for m in range(M))


def _graph(read_old_cache: bool, gate: bool = True, M=2, clone_cast=False):
    """make_fx of the model's MLA step as the captured graph has it (functional append + copy back), optionally
    reading the old cache again afterwards; clone_cast: the gated output cloned contiguous, viewed and cast to bf16
    (what o.reshape(M, h * v).to(x.dtype) traces as on CUDA, where the einsum's output is not contiguous)."""
    a = _args(M=M, gate=gate)
    C = a["kv_b"].shape[1]

    def step(q_nope, q_pe, ckv, kv_norm_w, cache, kv_b, seq_lens, *g):
        lat = k3.rms_norm(ckv[:, :C], kv_norm_w, 1e-6, torch.float32)
        new = torch.index_put(cache, [torch.arange(M), seq_lens], torch.cat([lat, ckv[:, C:]], -1))
        o = k3.mla_attention(q_nope, q_pe, new, kv_b, seq_lens, 0.3)
        if g:
            o = o * torch.sigmoid(g[0].float().view(o.shape))
        extra = (cache.sum(),) if read_old_cache else ()
        cache.copy_(new)
        if clone_cast:
            o = o.clone(memory_format=torch.contiguous_format).view(M, -1)
            return (torch.ops.prims.convert_element_type(o, torch.bfloat16),) + extra     # .to() as decomposed
        return (o.reshape(M, -1),) + extra
    ins = [a[k] for k in ("q_nope", "q_pe", "ckv", "kv_norm_w", "cache", "kv_b", "seq_lens")] + (
        [a["gate"]] if gate else [])
    return make_fx(step, tracing_mode="fake")(*ins), ins


@pytest.mark.parametrize("gate", [True, False])
def test_graph_match_and_result(gate):
    """Hand-built graph: one match; the rewritten graph gives the same o and the same cache as the original."""
    gm, ins = _graph(False, gate)
    ins_a, ins_b = [t.clone() for t in ins], [t.clone() for t in ins]
    ref = gm(*ins_a)[0]
    assert FuseMlaAppendAndGate()(gm.graph) == 1
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes]
    assert k3.mla_append_attention_.default in targets
    assert not {aten.index_put.default, aten.copy_.default, aten.cat.default, k3.mla_attention.default,
                aten.sigmoid.default} & set(targets)
    out = gm(*ins_b)[0]
    assert torch.equal(out, ref) and torch.equal(ins_b[4], ins_a[4]) and not torch.equal(ins_b[4], ins[4])


def test_the_cast_after_a_contiguous_clone_goes_in():
    """gate -> clone -> view -> bf16 cast: the op takes the gate and the cast (out_dtype bf16), the clone goes; the
    same o and cache as the original graph."""
    gm, ins = _graph(False, True, clone_cast=True)
    ins_a, ins_b = [t.clone() for t in ins], [t.clone() for t in ins]
    ref = gm(*ins_a)[0]
    assert any(n.target is aten.clone.default for n in gm.graph.nodes)
    assert FuseMlaAppendAndGate()(gm.graph) == 1
    gm.recompile()
    op = next(n for n in gm.graph.nodes if n.target is k3.mla_append_attention_.default)
    assert op.args[-1] == torch.bfloat16 and op.args[-2] is not None
    assert not {aten.clone.default, aten.sigmoid.default, torch.ops.prims.convert_element_type.default} & {
        n.target for n in gm.graph.nodes}
    out = gm(*ins_b)[0]
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref) and torch.equal(ins_b[4], ins_a[4])


def test_no_match_when_the_old_cache_is_read():
    gm, _ = _graph(True)
    p = FuseMlaAppendAndGate()
    assert p(gm.graph) == 0 and p.skip_reason is None
    assert any(n.target is aten.index_put.default for n in gm.graph.nodes)


def test_skips_a_graph_without_mla():
    gm = make_fx(lambda x: (x * 2,))(torch.randn(3))
    p = FuseMlaAppendAndGate()
    assert p(gm.graph) == 0 and "mla_attention" in p.skip_reason
