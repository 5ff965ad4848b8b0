"""The per-head MLA kernel (templates/mla_attention_heads.py.jinja, codegen/mla_attention.py heads variant) on a GPU:
o against the ops.py reference on fresh random inputs with garbage (nan, inf, huge values) in the cache rows past
seq_lens, outputs poisoned with NaN, rel err < 1e-2; M in 1-3, h in 6 / 12, ragged seq_lens, split counts from 1 to
64 (empty splits included); the append + gate variant; replays in a CUDA graph (the arrival counters re-arm). The
tiles on CUDA cores and on tensor cores (K3FUSE_MLA_HEADS_MMA), the latter also within 1e-4 of the former (its
high / low halves keep fp32's precision). Skipped without CUDA."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

from _check import rel  # noqa: E402
from test_mla_kernel_gpu import C, N, R, SCALE, V, check_append, inputs, reference  # noqa: E402


def run_heads(args, n_split=None, **kw):
    from k3fuse.codegen import mla_attention as ma
    q_nope, _, _, kv_b, _ = args
    M, h, _ = q_nope.shape
    o = torch.full((M, h, V), float("nan"), device="cuda", dtype=kw.get("out_dtype") or torch.float32)
    ma.mla_attention(*args, SCALE, out=o, n_split=n_split, heads=True, **kw)
    return o


def run_arms(monkeypatch, knob, is_on, args):
    """run_heads(args) with knob=0, then knob=1 (is_on() reading each): both outputs, after a sync."""
    outs = []
    for v in ("0", "1"):
        monkeypatch.setenv(knob, v)
        assert is_on() == (v == "1")
        outs.append(run_heads(args))
    torch.cuda.synchronize()
    return outs


CASES = [(1, 1024, [1023]), (1, 1000, [517]), (1, 7, [0]), (2, 300, [299, 31]), (3, 100, [0, 57, 99]),
         (3, 257, [256, 32, 33])]


@pytest.mark.parametrize("M,T,seq_lens", CASES)
@pytest.mark.parametrize("h", [6, 12])
@pytest.mark.parametrize("cl,push,mma", [("16", "0", "0"), ("8", "0", "0"), ("1", "0", "0"), ("16", "1", "0"),
                                         ("8", "1", "0"), ("16", "1", "1"), ("8", "1", "1"), ("8", "0", "1"),
                                         ("1", "0", "1")])
def test_heads_matches_reference(M, T, seq_lens, h, cl, push, mma, seed, monkeypatch):
    """With a cluster of the splits (the default: each CTA its share of the weight rows, merged in distributed
    shared memory; 16: Hopper's non-portable cluster size, where one wave allows it; push: the gathers by st.async
    into the owners, K3FUSE_MLA_PUSH=1) and without (K3FUSE_MLA_HEADS_CL=1: whole rows per CTA, merged by
    counters); the tiles on CUDA cores or tensor cores (mma)."""
    from k3fuse.codegen import mla_attention as ma
    monkeypatch.setenv("K3FUSE_MLA_HEADS_CL", cl)
    monkeypatch.setenv("K3FUSE_MLA_PUSH", push)
    monkeypatch.setenv("K3FUSE_MLA_HEADS_MMA", mma)
    args = inputs(M, h, T, seq_lens)
    assert ma.heads_reason(M, h, N, V, R, C, 132) is None
    o = run_heads(args)
    torch.cuda.synchronize()
    assert rel(o, reference(*args, SCALE)) < 1e-2


@pytest.mark.parametrize("cl,mma", [("16", "0"), ("8", "0"), ("16", "1"), ("8", "1")])
@pytest.mark.parametrize("M,h,T,seq_lens", [(1, 6, 1024, [1023]), (2, 6, 300, [299, 31]), (1, 12, 4000, [2500]),
                                            (1, 6, 40, [39])])
def test_heads_push_is_bitwise_the_loads(cl, mma, M, h, T, seq_lens, seed, monkeypatch):
    """The gathers by st.async (K3FUSE_MLA_PUSH=1, the default) sum and merge the same values in the same rank order
    as the loads between cluster barriers (K3FUSE_MLA_PUSH=0): the outputs are bitwise equal (and match the
    reference; T = 40: a cluster of 2, one tile per split); fresh NaN-poisoned outputs."""
    from k3fuse.codegen import mla_attention as ma
    monkeypatch.setenv("K3FUSE_MLA_HEADS_CL", cl)
    monkeypatch.setenv("K3FUSE_MLA_HEADS_MMA", mma)
    args = inputs(M, h, T, seq_lens)
    outs = run_arms(monkeypatch, "K3FUSE_MLA_PUSH", ma.push_on, args)
    assert not torch.isnan(outs[1]).any()
    assert torch.equal(outs[0], outs[1])
    assert rel(outs[1], reference(*args, SCALE)) < 1e-2


@pytest.mark.parametrize("mma", ["0", "1"])
@pytest.mark.parametrize("n_split", [1, 2, 4, 5, 8, 12, 33, 64])
def test_heads_split_counts(n_split, mma, seed, monkeypatch):
    """Any split count 1..HEADS_MAX_NS (2, 4, 8: one cluster merging in distributed shared memory; the others:
    counters): splits past seq_lens are empty (max -inf, sum 0) and drop out of the merge."""
    monkeypatch.setenv("K3FUSE_MLA_HEADS_MMA", mma)
    args = inputs(2, 6, 1000, [999, 40])
    o = run_heads(args, n_split)
    torch.cuda.synchronize()
    assert rel(o, reference(*args, SCALE)) < 1e-2


@pytest.mark.parametrize("M,T,seq_lens", [(1, 4096, [4095]), (1, 2000, [1234]), (2, 64, [0, 63]),
                                          (3, 1000, [999, 5, 512])])
@pytest.mark.parametrize("h,gated", [(12, True), (6, True), (6, False)])
@pytest.mark.parametrize("mma", ["0", "1"])
def test_heads_append_gate_matches_reference(M, T, seq_lens, h, gated, mma, seed, monkeypatch):
    """The append variant: the new rows written at seq_lens (within one rounding of the reference's norm, every other
    row bitwise untouched), o gated in bf16 (or fp32 ungated) within 1e-2 of the reference on a clean copy."""
    monkeypatch.setenv("K3FUSE_MLA_HEADS_MMA", mma)
    check_append(M, T, seq_lens, h, gated, heads=True)


@pytest.mark.parametrize("cl", ["16", "8", "1"])
@pytest.mark.parametrize("M,T,seq_lens", CASES)
@pytest.mark.parametrize("h", [6, 12])
def test_heads_mma_matches_the_cuda_cores(M, T, seq_lens, h, cl, seed, monkeypatch):
    """The tiles on tensor cores (K3FUSE_MLA_HEADS_MMA=1: the query's and p's bf16 high and low halves as two MMA
    columns, fp32 accumulators) give the fp32 CUDA-core tiles' o within 1e-4 (a bf16 query or p alone would round
    each to 8 bits, 2^-9 ~ 2e-3 per element; the high / low pair leaves ~2^-17);
    fresh NaN-poisoned outputs, garbage in the cache rows past seq_lens."""
    from k3fuse.codegen import mla_attention as ma
    monkeypatch.setenv("K3FUSE_MLA_HEADS_CL", cl)
    args = inputs(M, h, T, seq_lens)
    outs = run_arms(monkeypatch, "K3FUSE_MLA_HEADS_MMA", ma.heads_mma_on, args)
    assert not torch.isnan(outs[1]).any()
    assert rel(outs[1], outs[0]) < 1e-4
    if max(seq_lens) > 0:                                     # (one token: o is its row in both)
        assert not torch.equal(outs[0], outs[1])              # two different kernels ran


@pytest.mark.parametrize("cl,push,mma", [("16", "0", "0"), ("8", "0", "0"), ("1", "0", "0"), ("16", "1", "0"),
                                         ("16", "1", "1"), ("1", "0", "1")])
def test_heads_op_in_a_cuda_graph(cl, push, mma, seed, monkeypatch):
    """k3fuse::mla_append_attention_ through the dispatcher with K3FUSE_MLA_HEADS=1, two launches of different
    (M, h) in one CUDA graph, replayed with new ckv / seq_lens / q: every replay matches the reference; without
    clusters (K3FUSE_MLA_HEADS_CL=1, where the splits merge by the arrival counters) the counters are back at zero."""
    from k3fuse import ops
    from k3fuse.codegen import mla_attention as ma
    from k3fuse.codegen import registry
    monkeypatch.setenv("K3FUSE_MLA_HEADS", "1")
    monkeypatch.setenv("K3FUSE_MLA_HEADS_CL", cl)
    monkeypatch.setenv("K3FUSE_MLA_PUSH", push)
    monkeypatch.setenv("K3FUSE_MLA_HEADS_MMA", mma)
    registry.register()
    launched = []
    real = ma._launch_heads
    monkeypatch.setattr(ma, "_launch_heads", lambda *a: launched.append(a[0].shape) or real(*a))
    bf = torch.bfloat16
    cases = []
    for M, h, T, sl0 in [(2, 12, 300, [10, 200]), (1, 6, 1024, [700])]:
        qn, qp, cache, kv_b, sl = inputs(M, h, T, sl0)
        cache[:, max(sl0) + 1:] = 0
        ckv = torch.randn(M, C + R, device="cuda").to(bf)
        nw = (torch.rand(C, device="cuda") + 0.5).to(bf)
        gate = torch.randn(M, h * V, device="cuda").to(bf)
        cases.append((qn, qp, ckv, nw, cache, kv_b, sl, gate))
    calls = [lambda c=c: torch.ops.k3fuse.mla_append_attention_(c[0], c[1], c[2], c[3], 1e-6, bf, c[4], c[5], c[6],
                                                                 SCALE, c[7], bf) for c in cases]
    for f in calls:
        f()                                                   # compile outside the capture
    assert len(launched) == 2                                 # the knob reaches the op's launcher: the per-head kernel
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [f() for f in calls]
    for step in range(3):
        refs = []
        for (qn, qp, ckv, nw, cache, kv_b, sl, gate), out in zip(cases, outs):
            sl.add_(1)
            ckv.copy_(torch.randn_like(ckv, dtype=torch.float32).to(bf))
            qn.copy_(torch.randn_like(qn, dtype=torch.float32).to(bf))
            out.fill_(float("nan"))
            ref_cache = cache.clone()
            refs.append((ops.mla_append_attention_._init_fn(qn, qp, ckv, nw, 1e-6, bf, ref_cache, kv_b, sl, SCALE,
                                                            gate, bf), ref_cache))
        g.replay()
        torch.cuda.synchronize()
        for (qn, qp, ckv, nw, cache, kv_b, sl, gate), out, (ref, ref_cache) in zip(cases, outs, refs):
            M = sl.numel()
            assert rel(out, ref) < 1e-2, step
            assert rel(cache[torch.arange(M), sl], ref_cache[torch.arange(M), sl]) < 1e-2
        assert int(ma.heads_counters(torch.device("cuda", torch.cuda.current_device())).abs().sum()) == 0


QL = 1536       # K3's q_lora_rank


def qb_inputs(M, h, T, seq_lens):
    """cq (q_a_proj's output, before its norm), q_norm_w, w_qb [h * (n + r), QL] and the append / gate operands."""
    bf = torch.bfloat16
    _, _, cache, kv_b, sl = inputs(M, h, T, seq_lens)
    cq = (torch.randn(M, QL, device="cuda") * 3).to(bf)
    qw = (torch.rand(QL, device="cuda") + 0.5).to(bf)
    w_qb = (torch.randn(h * (N + R), QL, device="cuda") * QL ** -0.5).to(bf)
    ckv = (torch.randn(M, C + R, device="cuda") * 3).to(bf)
    nw = (torch.rand(C, device="cuda") + 0.5).to(bf)
    gate = torch.randn(M, h * V, device="cuda").to(bf)
    return [cq, qw, w_qb, ckv, nw, cache, kv_b, sl, gate]


def qb_reference(cq, qw, w_qb, ckv, nw, cache, kv_b, sl, gate, h):
    """In torch, no k3fuse kernel: q = bf16(bf16(rms(cq)) * qw) @ w_qb^T rounded to bf16 (the q_b GEMV's output),
    the new row appended to a copy of the cache (rows past seq_lens zeroed), ops.py's attention, the gate."""
    from k3fuse import ops
    bf = torch.bfloat16
    M = cq.shape[0]
    q = ((ops._rms(cq, 1e-6).to(bf) * qw).float() @ w_qb.float().T).to(bf).view(M, h, N + R)
    clean = cache.clone()
    rows = torch.arange(M, device="cuda")
    clean[rows, sl] = torch.cat([ops._rms(ckv[:, :C], 1e-6).to(bf) * nw, ckv[:, C:]], -1)
    for m in range(M):
        clean[m, int(sl[m]) + 1:] = 0
    o = ops.mla_attention._init_fn(q[..., :N], q[..., N:], clean, kv_b, sl, SCALE)
    return o * torch.sigmoid(gate.float().view(o.shape))


@pytest.mark.parametrize("cl,push,mma,qfirst", [("16", "0", "0", "0"), ("8", "0", "0", "0"), ("16", "1", "0", "0"),
                                                ("8", "1", "0", "0"), ("16", "1", "1", "0"), ("8", "1", "1", "0"),
                                                ("16", "1", "1", "1"), ("8", "1", "1", "1"), ("8", "1", "0", "1")])
@pytest.mark.parametrize("M,T,seq_lens", [(1, 1024, [1023]), (1, 2000, [1234]), (2, 300, [299, 31])])
def test_qb_op_matches_reference(cl, push, mma, qfirst, M, T, seq_lens, seed, monkeypatch):
    """k3fuse::mla_qb_append_attention_ through the dispatcher with K3FUSE_MLA_HEADS=1 (pass
    fuse_q_b_into_mla_attention's op): the per-head kernel computing q itself (the launcher got q_b's operands),
    captured in a CUDA graph and replayed with new cq / ckv / seq_lens: every replay's o (NaN-poisoned before) within
    1e-2 of the torch reference, the new rows written at seq_lens, every other row bitwise untouched."""
    from k3fuse import ops
    from k3fuse.codegen import mla_attention as ma
    from k3fuse.codegen import registry
    monkeypatch.setenv("K3FUSE_MLA_HEADS", "1")
    monkeypatch.setenv("K3FUSE_MLA_HEADS_CL", cl)
    monkeypatch.setenv("K3FUSE_MLA_PUSH", push)
    monkeypatch.setenv("K3FUSE_MLA_HEADS_MMA", mma)
    monkeypatch.setenv("K3FUSE_MLA_QFIRST", qfirst)
    registry.register()
    launched = []
    real = ma._launch_heads
    monkeypatch.setattr(ma, "_launch_heads", lambda *a, **k: launched.append(k.get("qb") is not None) or real(*a, **k))
    h, bf = 6, torch.bfloat16
    cq, qw, w_qb, ckv, nw, cache, kv_b, sl, gate = args = qb_inputs(M, h, T, seq_lens)
    call = lambda: torch.ops.k3fuse.mla_qb_append_attention_(cq, qw, 1e-6, w_qb, h, ckv, nw, 1e-6, bf, cache, kv_b,
                                                             sl, SCALE, gate, bf)
    sl.sub_(2)
    call()                                                    # compile outside the capture
    assert launched == [True]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = call()
    for step in range(2):
        sl.add_(1)
        cq.copy_((torch.randn_like(cq, dtype=torch.float32) * 3).to(bf))
        ckv.copy_((torch.randn_like(ckv, dtype=torch.float32) * 3).to(bf))
        cache0 = cache.clone()
        ref = qb_reference(*args, h)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert rel(out, ref) < 1e-2
        rows = torch.arange(M, device="cuda")
        untouched = torch.ones(M, T, dtype=torch.bool, device="cuda")
        untouched[rows, sl] = False
        assert torch.equal(cache[untouched].view(torch.int16), cache0[untouched].view(torch.int16))
        assert rel(cache[rows, sl], torch.cat([ops._rms(ckv[:, :C], 1e-6).to(bf) * nw, ckv[:, C:]], -1)) < 1e-2


@pytest.mark.parametrize("cl", ["16", "8"])
@pytest.mark.parametrize("M,T,seq_lens", [(1, 1024, [1023]), (2, 300, [299, 31])])
def test_qb_qfirst_is_bitwise_the_same(cl, M, T, seq_lens, seed, monkeypatch):
    """K3FUSE_MLA_QFIRST=1 (the default) only moves cq's loads ahead of the first tile's: o and the appended rows
    bitwise those of QFIRST=0 on the same inputs."""
    from k3fuse.codegen import registry
    monkeypatch.setenv("K3FUSE_MLA_HEADS", "1")
    monkeypatch.setenv("K3FUSE_MLA_HEADS_CL", cl)
    registry.register()
    h, bf = 6, torch.bfloat16
    cq, qw, w_qb, ckv, nw, cache, kv_b, sl, gate = qb_inputs(M, h, T, seq_lens)
    outs = []
    for qf in ("0", "1"):
        monkeypatch.setenv("K3FUSE_MLA_QFIRST", qf)
        c = cache.clone()
        o = torch.ops.k3fuse.mla_qb_append_attention_(cq, qw, 1e-6, w_qb, h, ckv, nw, 1e-6, bf, c, kv_b, sl, SCALE,
                                                      gate, bf)
        torch.cuda.synchronize()
        outs.append((o.clone(), c))
    assert not outs[0][0].isnan().any()
    for o, c in outs[1:]:
        assert torch.equal(outs[0][0].view(torch.int16), o.view(torch.int16))
        assert torch.equal(outs[0][1].view(torch.int16), c.view(torch.int16))


def test_qb_op_falls_back_to_two_launches(seed, monkeypatch):
    """Where the per-head kernel is not chosen (K3FUSE_MLA_HEADS=0) the op runs the q_b GEMV and the three-launch
    attention through the dispatcher, and still matches the reference."""
    from k3fuse.codegen import mla_attention as ma
    from k3fuse.codegen import registry
    monkeypatch.setenv("K3FUSE_MLA_HEADS", "0")
    registry.register()
    launched = []
    monkeypatch.setattr(ma, "_launch_heads", lambda *a, **k: launched.append(1))
    h, bf = 6, torch.bfloat16
    cq, qw, w_qb, ckv, nw, cache, kv_b, sl, gate = args = qb_inputs(1, h, 1024, [700])
    ref = qb_reference(*args, h)
    assert ma.qb_reason(cq, qw, w_qb, *(torch.empty(1, h, N + R, device="cuda", dtype=bf).split([N, R], -1)), cache,
                        kv_b) is not None
    out = torch.ops.k3fuse.mla_qb_append_attention_(cq, qw, 1e-6, w_qb, h, ckv, nw, 1e-6, bf, cache, kv_b, sl, SCALE,
                                                    gate, bf)
    torch.cuda.synchronize()
    assert not launched and rel(out, ref) < 1e-2
