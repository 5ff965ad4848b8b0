"""k3fuse::mla_attention kernels (codegen/mla_attention.py) on a GPU: o against the ops.py reference on fresh random
inputs with garbage (nan, inf, huge values) in the cache rows past seq_lens, outputs poisoned with NaN, rel err
< 1e-2; M in 1, 3, 8; several T and ragged seq_lens; several split counts; replay in a CUDA graph.
Skipped without CUDA."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

from _check import rel  # noqa: E402

SCALE = 192 ** -0.5
N, V, R, C = 128, 128, 64, 512


def inputs(M, h, T, seq_lens, qdtype=torch.bfloat16):
    """q_nope / q_pe as strided slices of one [M, h, n + r] tensor (as the model produces them)."""
    dev = "cuda"
    q = torch.randn(M, h, N + R, device=dev).to(qdtype)
    cache = torch.randn(M, T, C + R, device=dev).to(torch.bfloat16)
    kv_b = (torch.randn(h * (N + V), C, device=dev) * C ** -0.5).to(torch.bfloat16)
    sl = torch.tensor(seq_lens, dtype=torch.int64, device=dev)
    garbage(cache, sl)
    return q[..., :N], q[..., N:], cache, kv_b, sl


def garbage(cache, sl):
    for m in range(cache.shape[0]):
        tail = cache[m, int(sl[m]) + 1:]
        if tail.numel():
            tail.copy_(torch.randn(tail.shape, device=cache.device) * 1e4)
            tail.view(-1)[0] = float("nan")
            tail.view(-1)[-1] = float("inf")


def reference(q_nope, q_pe, cache, kv_b, seq_lens, scale):
    """ops.py's reference on a copy of the cache with the rows past seq_lens zeroed (the reference multiplies masked
    rows by p = 0, which turns nan / inf garbage into nan; the kernels never read those rows)."""
    from k3fuse import ops
    clean = cache.clone()
    for m in range(cache.shape[0]):
        clean[m, int(seq_lens[m]) + 1:] = 0
    return ops.mla_attention._init_fn(q_nope, q_pe, clean, kv_b, seq_lens, scale)


def run_kernel(args, n_split=None):
    from k3fuse.codegen import mla_attention as ma
    q_nope, _, _, kv_b, _ = args
    M, h, _ = q_nope.shape
    assert ma.launch_ok(*args) is None
    o = torch.full((M, h, V), float("nan"), device="cuda")
    ma.mla_attention(*args, SCALE, out=o, n_split=n_split, heads=False)   # the per-head one: its own file
    return o


CASES = [  # (M, T, seq_lens)
    (1, 1, [0]), (1, 33, [32]), (1, 4096, [4095]), (1, 2000, [1234]),
    (3, 64, [0, 31, 63]), (3, 1000, [999, 5, 512]), (3, 3000, [100, 2999, 1999]),
    (8, 257, [256, 0, 1, 31, 32, 33, 200, 128]), (8, 2048, [2047, 1, 1000, 64, 2000, 33, 777, 1500]),
]


@pytest.mark.parametrize("M,T,seq_lens", CASES)
@pytest.mark.parametrize("h", [6, 12])
def test_mla_matches_reference(M, T, seq_lens, h, seed):
    args = inputs(M, h, T, seq_lens)
    cache0 = args[2].clone()
    o = run_kernel(args)
    torch.cuda.synchronize()
    assert torch.equal(args[2].view(torch.int16), cache0.view(torch.int16)), "the kernel wrote its input cache"  # bitwise: the garbage has NaN
    assert rel(o, reference(*args, SCALE)) < 1e-2


@pytest.mark.parametrize("n_split", [1, 2, 7, 64])
def test_mla_split_counts(n_split, seed):
    """Any split count gives the same answer (empty splits included: 64 splits of 40 tiles)."""
    args = inputs(3, 12, 1280, [1279, 300, 0])
    o = run_kernel(args, n_split)
    torch.cuda.synchronize()
    assert rel(o, reference(*args, SCALE)) < 1e-2


def test_mla_fp32_q_and_odd_heads(seed):
    args = inputs(3, 3, 500, [499, 17, 250], qdtype=torch.float32)   # h = 3: one padded head
    o = run_kernel(args)
    torch.cuda.synchronize()
    assert rel(o, reference(*args, SCALE)) < 1e-2


def test_mla_cuda_impl_and_fallback(seed):
    from k3fuse.codegen import mla_attention as ma
    args = inputs(4, 12, 700, [699, 10, 350, 0])
    o = ma.mla_attention_cuda(*args, SCALE)
    assert rel(o, reference(*args, SCALE)) < 1e-2
    # seq_lens as int32 and contiguous q go through the kernel too
    args2 = (args[0].contiguous(), args[1].contiguous(), args[2], args[3], args[4].to(torch.int32))
    assert ma.launch_ok(*args2) is None
    assert rel(ma.mla_attention_cuda(*args2, SCALE), reference(*args, SCALE)) < 1e-2
    # unsupported shape (C = 128): the reference, exactly
    from k3fuse import ops
    q = torch.randn(2, 4, 24, device="cuda").to(torch.bfloat16)
    small = (q[..., :16], q[..., 16:], torch.randn(2, 5, 136, device="cuda").to(torch.bfloat16),
             torch.randn(4 * 32, 128, device="cuda").to(torch.bfloat16),
             torch.tensor([4, 4], device="cuda"))
    assert ma.launch_ok(*small) is not None
    assert torch.equal(ma.mla_attention_cuda(*small, SCALE), ops.mla_attention._init_fn(*small, SCALE))


@pytest.mark.parametrize("splits", [(1, 1), (2, 2), (4, 1), (4, 8), (16, 32), (32, 8), (8, 32), (8, 16)])
@pytest.mark.parametrize("M,T,seq_lens", [CASES[1], CASES[5], CASES[8]])
def test_mla_splits_match_reference(splits, M, T, seq_lens, seed):
    """QS qabsorb column splits / VS combine splits (mla_attention.SPLITS_BY_BUCKET), the W_UV loads hoisted (VS >=
    4) or not: the same answer as the reference."""
    from k3fuse.codegen import mla_attention as ma
    args = inputs(M, 6, T, seq_lens)
    o = torch.full((M, 6, V), float("nan"), device="cuda")
    ma.mla_attention(*args, SCALE, out=o, splits=splits)
    torch.cuda.synchronize()
    assert rel(o, reference(*args, SCALE)) < 1e-2


@pytest.mark.parametrize("h", [24, 48])
def test_mla_head_groups_above_max_heads(h, seed):
    """TP2 / TP4 have 48 / 24 heads per rank, more than one launch takes: the CUDA impl runs equal head groups."""
    from k3fuse.codegen import mla_attention as ma
    args = inputs(3, h, 600, [599, 7, 300])
    assert ma.launch_ok(*args) is not None                  # one launch cannot take it
    o = ma.mla_attention_cuda(*args, SCALE)
    torch.cuda.synchronize()
    assert o.shape == (3, h, V) and o.is_contiguous()
    assert rel(o, reference(*args, SCALE)) < 1e-2


@pytest.mark.parametrize("M", [1, 8])
def test_mla_cuda_graph_replay(M, seed):
    """Capture the kernels in a CUDA graph; replay on new q, cache contents and seq_lens."""
    from k3fuse.codegen import mla_attention as ma
    h, T = 12, 1024
    args = inputs(M, h, T, [T - 1] * M)
    q_nope, q_pe, cache, kv_b, sl = args
    ma.mla_attention(*args, SCALE)                              # compile / load before capture
    torch.cuda.synchronize()
    o = torch.empty(M, h, V, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o.copy_(ma.mla_attention(q_nope, q_pe, cache, kv_b, sl, SCALE))
    for it in range(3):
        new_sl = torch.randint(0, T, (M,)).tolist()
        new_sl[0] = [T - 1, 0, 517][it]
        fresh = inputs(M, h, T, new_sl)
        q_nope.copy_(fresh[0])
        q_pe.copy_(fresh[1])
        cache.copy_(fresh[2])
        sl.copy_(fresh[4])
        o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert rel(o, reference(q_nope, q_pe, cache, kv_b, sl, SCALE)) < 1e-2


APPEND_CASES = [(1, 4096, [4095]), (1, 2000, [1234]), (2, 64, [0, 63]), (3, 1000, [999, 5, 512]),
                (8, 257, [256, 0, 1, 31, 32, 33, 200, 128])]


@pytest.mark.parametrize("M,T,seq_lens", APPEND_CASES)
@pytest.mark.parametrize("h,gated", [(12, True), (6, True), (12, False)])
def test_mla_append_attention_matches_reference(M, T, seq_lens, h, gated, seed):
    """k3fuse::mla_append_attention_ through its CUDA impl (pass fuse_mla_append_and_gate): the new rows written
    at seq_lens (bf16 within one rounding of the reference's norm, every other row bitwise untouched, garbage
    included), o (bf16 gated / fp32 ungated, NaN-poisoned before the launch) within 1e-2 of the
    op's reference on a clean copy of the cache. The three launches (the per-head kernel: test_mla_heads_gpu.py)."""
    check_append(M, T, seq_lens, h, gated, heads=False)


def check_append(M, T, seq_lens, h, gated, **launch):
    """The append + gate variant's checks (above), launched with mla_attention(..., **launch)."""
    from k3fuse import ops
    from k3fuse.codegen import mla_attention as ma
    bf = torch.bfloat16
    qn, qp, cache, kv_b, sl = inputs(M, h, T, seq_lens)
    ckv = (torch.randn(M, C + R, device="cuda") * 3).to(bf)
    nw = (torch.rand(C, device="cuda") + 0.5).to(bf)
    gate = torch.randn(M, h * V, device="cuda").to(bf) if gated else None
    odt = bf if gated else None
    cache0 = cache.clone()
    assert ma.launch_ok(qn, qp, cache, kv_b, sl) is None
    assert ma.append_ok(qn, ckv, nw, bf, cache, kv_b, gate, odt) is None
    out = torch.full((M, h, V), float("nan"), device="cuda", dtype=odt or torch.float32)
    o = ma.mla_attention(qn, qp, cache, kv_b, sl, SCALE, out=out, append=(ckv, nw, 1e-6), gate=gate, out_dtype=odt,
                         **launch)
    torch.cuda.synchronize()
    assert o is out and o.dtype == (odt or torch.float32)
    rows = torch.arange(M, device="cuda")
    want = torch.cat([ops._rms(ckv[:, :C], 1e-6).to(bf) * nw, ckv[:, C:]], -1)
    got = cache[rows, sl]
    assert rel(got, want) < 1e-2 and (got != want).float().mean() < 0.02      # rsqrt ulps flip a few roundings
    untouched = torch.ones(M, T, dtype=torch.bool, device="cuda")
    untouched[rows, sl] = False
    assert torch.equal(cache[untouched].view(torch.int16), cache0[untouched].view(torch.int16))
    # the reference on a clean copy with the kernel's row (so the comparison is the attention + gate alone)
    clean = cache.clone()
    for m in range(M):
        clean[m, int(sl[m]) + 1:] = 0
    ref = ops.mla_attention._init_fn(qn, qp, clean, kv_b, sl, SCALE)
    if gated:
        ref = ref * torch.sigmoid(gate.float().view(ref.shape))
    assert rel(o, ref) < 1e-2


def test_mla_append_attention_op_in_a_cuda_graph(seed):
    """The op through the dispatcher (its registered CUDA impl), captured in a CUDA graph and replayed with new
    ckv / seq_lens: each replay appends its row and matches the op's reference run on a copy."""
    from k3fuse import ops
    from k3fuse.codegen import registry
    registry.register()
    bf = torch.bfloat16
    M, h, T = 2, 12, 300
    qn, qp, cache, kv_b, sl = inputs(M, h, T, [10, 200])
    cache[:, 201:] = 0
    ckv = torch.randn(M, C + R, device="cuda").to(bf)
    nw = (torch.rand(C, device="cuda") + 0.5).to(bf)
    gate = torch.randn(M, h * V, device="cuda").to(bf)
    call = lambda: torch.ops.k3fuse.mla_append_attention_(qn, qp, ckv, nw, 1e-6, bf, cache, kv_b, sl, SCALE, gate, bf)
    call()                                                   # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = call()
    for step in range(3):
        sl.add_(1)
        ckv.copy_(torch.randn(M, C + R, device="cuda").to(bf))
        out.fill_(float("nan"))
        ref_cache = cache.clone()
        ref = ops.mla_append_attention_._init_fn(qn, qp, ckv, nw, 1e-6, bf, ref_cache, kv_b, sl, SCALE, gate, bf)
        g.replay()
        torch.cuda.synchronize()
        assert rel(out, ref) < 1e-2, step
        assert rel(cache, ref_cache) < 1e-2 and rel(cache[torch.arange(M), sl], ref_cache[torch.arange(M), sl]) < 1e-2


@pytest.mark.parametrize("M,T,seq_lens", [CASES[0], CASES[1], CASES[3], CASES[5], CASES[8]])
@pytest.mark.parametrize("h", [6, 12, 16])
@pytest.mark.parametrize("pipe", ["0", "1"])
@pytest.mark.parametrize("mma", ["0", "1"])
def test_mla_mma_scores_match_reference(M, T, seq_lens, h, pipe, mma, monkeypatch, seed):
    """Both score steps (K3FUSE_MLA_MMA=1, the default: m16n8k16 MMAs over bf16 hi + lo query halves; 0: CUDA cores)
    give the reference's answer, with and without the tile pipeline, garbage past seq_lens, outputs NaN-poisoned."""
    from k3fuse.codegen import mla_attention as ma
    monkeypatch.setenv("K3FUSE_MLA_MMA", mma)
    monkeypatch.setenv("K3FUSE_MLA_PIPE", pipe)
    assert ma.mma_scores(ma.padded_heads(h), R, C) == (mma == "1")
    args = inputs(M, h, T, seq_lens)
    o = run_kernel(args)
    torch.cuda.synchronize()
    assert rel(o, reference(*args, SCALE)) < 1e-2


@pytest.mark.parametrize("n_split", [1, 7, 32, 64])
def test_mla_combine_preload_bit_identical(n_split, seed, monkeypatch):
    """K3FUSE_MLA_CPRE=32 (the combine's first 32 splits' partials loaded before its log-sum-exp pass): fewer splits
    than that (1, 7), exactly (32) and more (64, the dynamic loop after the preloaded ones) give the same bits as the
    default combine (the same sums in the same order), poisoned output, and match the reference."""
    from k3fuse.codegen import mla_attention as ma
    args = inputs(3, 12, 2600, [2599, 300, 0])
    outs = {}
    for cpre in ("0", "32"):
        monkeypatch.setenv("K3FUSE_MLA_CPRE", cpre)
        assert ma.combine_preload(C) == int(cpre)
        outs[cpre] = run_kernel(args, n_split)
    torch.cuda.synchronize()
    assert torch.equal(outs["0"], outs["32"])
    assert rel(outs["32"], reference(*args, SCALE)) < 1e-2


@pytest.mark.parametrize("cbatch", ["0", "4", "8"])
@pytest.mark.parametrize("h,gated", [(6, True), (12, True), (6, False)])
def test_mla_combine_batched_rows_at_bucket_64(h, gated, cbatch, monkeypatch, seed):
    """Bucket 64's 4x1 splits (M = 40 here) with the combine's W_UV rows unbatched / in batches of 4 or 8
    (K3FUSE_MLA_CBATCH, read at render): the append + gate checks of check_append."""
    monkeypatch.setenv("K3FUSE_MLA_CBATCH", cbatch)
    sl = [(37 * i + 5) % 700 for i in range(40)]
    check_append(40, 701, sl, h, gated, heads=False, splits=(4, 1))


def _records_builds(monkeypatch):
    """(keyword arguments, rendered source) of every build() the launcher makes from now on: which variant ran."""
    from k3fuse.codegen import mla_attention as ma
    seen, real = [], ma.build

    def build(*a, **k):
        kern = real(*a, **k)
        seen.append((k, kern.source))
        return kern
    monkeypatch.setattr(ma, "build", build)
    return seen


@pytest.mark.parametrize("n_split", [None, 1, 7, 64])
@pytest.mark.parametrize("M,h", [(16, 6), (40, 12), (64, 6)])
def test_mla_combine_mma_matches_reference(M, h, n_split, monkeypatch, seed):
    """K3FUSE_MLA_CMMA=1 (the combine over 8 tokens per CTA with W_UV on tensor cores; the default where
    CMMA_BY_HEADS lists the bucket): ragged seq_lens with garbage past them, M not a multiple of 8 (40), 1 to
    CMMA_MAX_SPLITS splits, NaN-poisoned output against the reference; the launcher built the CMMA kernel."""
    monkeypatch.setenv("K3FUSE_MLA_CMMA", "1")
    seen = _records_builds(monkeypatch)
    args = inputs(M, h, 700, [(37 * i + 5) % 699 for i in range(M)])
    o = run_kernel(args, n_split=n_split)
    torch.cuda.synchronize()
    assert [k.get("cmma") for k, _ in seen] == [True]
    assert torch.isfinite(o).all()
    assert rel(o, reference(*args, SCALE)) < 1e-2


def _bitwise_with_knob(monkeypatch, var, base, value, args, n_split, built_key, marker):
    """The three-launch kernels' output with `var` = `value` against `var` = `base` (the variant off; unset it may be
    the default): bitwise equal, finite, near the reference; the launcher built a kernel with `built_key` whose source
    has `marker` (the variant ran) and, with `base`, one without the marker."""
    monkeypatch.setenv(var, base)
    seen = _records_builds(monkeypatch)
    want = run_kernel(args, n_split=n_split)
    assert len(seen) == 1 and marker not in seen[0][1]
    monkeypatch.setenv(var, value)
    got = run_kernel(args, n_split=n_split)
    torch.cuda.synchronize()
    assert len(seen) == 2 and bool(seen[1][0].get(built_key)) and marker in seen[1][1]
    assert torch.isfinite(got).all() and torch.equal(got, want)
    assert rel(got, reference(*args, SCALE)) < 1e-2


@pytest.mark.parametrize("mode", ["1", "2"])
@pytest.mark.parametrize("n_split", [None, 7])
@pytest.mark.parametrize("M,T,h", [(3, 1000, 6), (17, 700, 12), (40, 700, 6), (64, 1024, 6), (64, 1024, 12)])
def test_mla_async_tiles_bitwise(M, T, h, n_split, mode, monkeypatch, seed):
    """K3FUSE_MLA_ASYNC=1 (the split kernel's cache tiles by cp.async into a two-tile ring; the default where
    ASYNC_BY_HEADS lists the bucket) against K3FUSE_MLA_ASYNC=0: bitwise the register-loaded tiles (both without PIPE, which would take precedence), with nan /
    inf garbage in the cache rows past seq_lens (the ring stores zeros there, never reads them), ragged seq_lens
    (empty and one-tile splits at 7 splits), NaN-poisoned output; against the reference; the ring variant ran. Mode 2:
    two CTAs per SM also at h = 12 (a few spilled words at the register cap)."""
    if mode == "2" and h <= 8:
        pytest.skip("K3FUSE_MLA_ASYNC=2 differs from 1 only at HP > 8 (two CTAs per SM there)")
    monkeypatch.setenv("K3FUSE_MLA_PIPE", "0")
    sl = [(37 * i + 5) % T for i in range(M)]
    args = inputs(M, h, T, sl)                      # the rows past seq_lens: 1e4-scale garbage with a nan and an inf
    _bitwise_with_knob(monkeypatch, "K3FUSE_MLA_ASYNC", "0", mode, args, n_split, "asy", "cpasync.CopyG2SOp")


@pytest.mark.parametrize("n_split", [None, 5])
@pytest.mark.parametrize("M,h", [(16, 6), (17, 12), (40, 12), (64, 6), (64, 12)])
def test_mla_combine_mma_tokens_bitwise(M, h, n_split, monkeypatch, seed):
    """K3FUSE_MLA_CMMA_TOK=4 (the tensor-core combine over 4 tokens per CTA, two warps per token's columns; the
    default where CMMA_TOK_BY_HEADS lists the bucket): bitwise the 8-token combine (K3FUSE_MLA_CMMA_TOK=8) (the same sums in the same order; the MMA's unused columns
    not stored), NaN-poisoned outputs, M not a multiple of 4 or 8 (17, 40); the launcher built the 4-token kernel."""
    monkeypatch.setenv("K3FUSE_MLA_CMMA", "1")
    args = inputs(M, h, 700, [(37 * i + 5) % 699 for i in range(M)])
    _bitwise_with_knob(monkeypatch, "K3FUSE_MLA_CMMA_TOK", "8", "4", args, n_split, "cmma", "MT3 = 4")


@pytest.mark.parametrize("pre", ["1", "5"])
@pytest.mark.parametrize("n_split", [None, 3, 13])
@pytest.mark.parametrize("M,h,gated", [(17, 12, True), (40, 6, True), (64, 6, True), (64, 12, True), (64, 6, False)])
def test_mla_combine_mma_pre_bitwise(M, h, gated, n_split, pre, monkeypatch, seed):
    """K3FUSE_MLA_CMMA_PRE=N (the 4-token tensor-core combine with the gate values and the first N splits' partials
    loaded at its start, each (max, sum) pair in one pass, the rest in chunks of 4 splits): bitwise the same combine
    without it, with the append + gate variant as the layer runs it (and the plain one), NaN-poisoned outputs, M past
    the last CTA's tokens (17, 40), fewer splits than preloaded ones (3) and a partial last chunk (13)."""
    from k3fuse.codegen import mla_attention as ma
    monkeypatch.setenv("K3FUSE_MLA_CMMA", "1")
    monkeypatch.setenv("K3FUSE_MLA_CMMA_TOK", "4")
    bf = torch.bfloat16
    qn, qp, cache, kv_b, sl = inputs(M, h, 701, [(37 * i + 5) % 700 for i in range(M)])
    ckv = (torch.randn(M, C + R, device="cuda") * 3).to(bf)
    nw = (torch.rand(C, device="cuda") + 0.5).to(bf)
    gate = torch.randn(M, h * V, device="cuda").to(bf) if gated else None
    odt = bf if gated else None
    seen = _records_builds(monkeypatch)
    outs = []
    for v in ("0", pre):
        monkeypatch.setenv("K3FUSE_MLA_CMMA_PRE", v)
        out = torch.full((M, h, V), float("nan"), device="cuda", dtype=odt or torch.float32)
        ma.mla_attention(qn, qp, cache.clone(), kv_b, sl, SCALE, out=out, n_split=n_split,
                         append=(ckv, nw, 1e-6) if gated else None, gate=gate, out_dtype=odt, heads=False)
        torch.cuda.synchronize()
        outs.append(out)
    assert [bool(k.get("cmma")) for k, _ in seen] == [True, True]
    assert [("PRE3 = " in src) for _, src in seen] == [False, True]
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[1], outs[0])


@pytest.mark.parametrize("h,gated", [(6, True), (12, True), (6, False)])
def test_mla_combine_mma_append_gate_and_graph(h, gated, monkeypatch, seed):
    """K3FUSE_MLA_CMMA=1 with the append + gate variant at bucket 64's 4x1 splits (M = 40): the checks of
    check_append; then the plain variant captured in a CUDA graph, output poisoned, replayed: bitwise the eager run."""
    from k3fuse.codegen import mla_attention as ma
    monkeypatch.setenv("K3FUSE_MLA_CMMA", "1")
    seen = _records_builds(monkeypatch)
    sl = [(37 * i + 5) % 700 for i in range(40)]
    check_append(40, 701, sl, h, gated, heads=False, splits=(4, 1))
    assert [k.get("cmma") for k, _ in seen] == [True]
    args = inputs(24, h, 300, [(13 * i + 7) % 299 for i in range(24)])
    want = run_kernel(args, n_split=16)
    out = torch.empty_like(want)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ma.mla_attention(*args, SCALE, out=out, n_split=16, heads=False)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.parametrize("M,T,seq_lens", [CASES[1], CASES[3], CASES[5], CASES[8]])
@pytest.mark.parametrize("h", [6, 12, 16])
@pytest.mark.parametrize("pipe", ["0", "1"])
def test_mla_pv_mma_matches_reference(M, T, seq_lens, h, pipe, monkeypatch, seed):
    """K3FUSE_MLA_PVMMA (the split kernel's PV step on tensor cores; default 1 since session 34): the reference's
    answer with and without the tile pipeline, padded heads (12 of an n-tile of 16), ragged
    seq_lens with garbage past them, outputs NaN-poisoned, the launched source with / without the PV MMAs; and within
    1e-4 of the CUDA-core PV step: the cache is bf16 in both and p = hi + lo as bf16 halves is off by <= 2^-18 (~4e-6)
    of p, so the two differ by that and the fp32 sums' order; 1e-4 leaves a ~25x margin."""
    from k3fuse.codegen import mla_attention as ma
    monkeypatch.setenv("K3FUSE_MLA_PIPE", pipe)
    args = inputs(M, h, T, seq_lens)
    outs = []
    seen = _records_builds(monkeypatch)
    for on in ("0", "1"):
        monkeypatch.setenv("K3FUSE_MLA_PVMMA", on)
        assert ma.pv_mma(ma.padded_heads(h), R, C) == (on == "1")
        outs.append(run_kernel(args))
        torch.cuda.synchronize()
    assert [("PMT = " in src) for _, src in seen] == [False, True]
    assert torch.isfinite(outs[1]).all()
    assert rel(outs[1], reference(*args, SCALE)) < 1e-2
    assert rel(outs[1], outs[0]) < 1e-4
