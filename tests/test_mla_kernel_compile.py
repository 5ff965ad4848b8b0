"""k3fuse::mla_attention kernels (codegen/mla_attention.py): render and compile for sm_90a and sm_100a without a GPU
(three kernels, 128-bit cache / weight loads, no local memory, no ptxas spills), the compile key, the fallback, and a
torch model of the kernels' tiling / split / online-softmax / combine arithmetic against the ops.py reference."""
import math
import re

import pytest
import torch

from k3fuse.codegen import compile as kcompile
from _check import entries, ptxas_report
from k3fuse.codegen import mla_attention as ma

ARCHES = ["sm_90a", "sm_100a"]
K3 = dict(n=128, v=128, r=64, C=512)
SCALE = 192 ** -0.5


def count(body, pat):
    return len(re.findall(pat, body))


def pipelined(nld, pipe=True):
    """The split kernel's tile pipeline (one round of loads per tile) is rendered."""
    return pipe and nld <= ma.LOADS_IN_FLIGHT


def qabsorb_rows_per_thread(qs, n=K3["n"], C=K3["C"]):
    """W_UK rows per qabsorb thread: C / QS columns = CH 16-byte chunks, 256 / CH n-groups over the n rows."""
    return n // (ma.QABSORB_THREADS // (C // 8 // qs))


@pytest.mark.parametrize("arch,h,pipe,mma", [("sm_90a", 12, True, "1"), ("sm_100a", 12, True, "1"),
                                             ("sm_90a", 6, True, "1"), ("sm_90a", 12, False, "1"),
                                             ("sm_90a", 12, True, "0"), ("sm_90a", 6, False, "0")])
def test_mla_kernel_compiles(arch, h, pipe, mma, isolated_kernel_cache, monkeypatch):
    """Both score steps (mma 1, the default: the query as bf16 hi + lo halves, two 8-byte shared stores per 16-byte
    chunk; 0: fp32 rows, one 16-byte store each)."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("K3FUSE_MLA_MMA", mma)
    k = ma.build(h, **K3, scale=SCALE, arch=arch, load=False, pipe=pipe)
    assert {"kernel.py", "kernel.ptx", "kernel.cubin"} <= set(k.files)
    ptx = open(k.files["kernel.ptx"]).read()
    assert f".target {arch}" in ptx
    ks = entries(ptx)
    assert set(ks) == {"qabsorb_kernel", "split_kernel", "combine_kernel"}, list(ks)
    assert "ld.local" not in ptx and "st.local" not in ptx
    v4 = r"ld\.global(?:\.[a-z0-9:_]+)*\.(?:v4\.[bfsu]32|v2\.[bfsu]64)\b"       # sm_100a prints v2.b64
    # qabsorb (DEFAULT_SPLITS): RPT rows of W_UK[h] per thread, one 16-byte load each
    assert count(ks["qabsorb_kernel"], v4) == qabsorb_rows_per_thread(ma.DEFAULT_SPLITS[0])
    # split: per tile TT * (C + r) / 8 / THREADS 16-byte cache loads per thread, + the scaled queries
    hp = ma.padded_heads(h)
    cr = K3["C"] + K3["r"]
    nld = -(-ma.DEFAULT_TT * cr // 8 // ma.THREADS)
    nq = -(-hp * cr // 4 // ma.THREADS)
    split = ks["split_kernel"]
    pipe = pipelined(nld, pipe)
    assert count(split, v4) == nld * (2 if pipe else 1) + nq      # pipelined: the first tile's loads, then the next's
    st16 = count(split, r"st\.shared(?:\.[a-z0-9:_]+)*\.(?:v4\.[bfsu]32|v2\.[bfsu]64)\b")
    if mma == "1":
        assert st16 >= nld and count(split, r"st\.shared(?:\.[a-z0-9:_]+)*\.v2\.b32\b") >= 2 * nq
    else:
        assert st16 >= nld + nq
    first_bar = min(i for i in (split.find("bar.sync"), split.find("barrier.sync")) if i >= 0)
    # the first tile's cache loads and the queries' loads are all issued before the first barrier
    assert count(split[:first_bar], v4) == (nld if pipe else 0) + nq
    # combine: W_UV rows, C / 256 16-byte loads per lane per row, V / 4 rows per warp
    assert count(ks["combine_kernel"], v4) >= K3["v"] // 4 * (K3["C"] // 256)


@pytest.mark.parametrize("arch,h,splits", [("sm_90a", 6, (4, 8)), ("sm_100a", 12, (16, 32)), ("sm_90a", 12, (2, 1)),
                                           ("sm_90a", 6, (32, 8))])
def test_mla_split_variants_compile(arch, h, splits, isolated_kernel_cache):
    """QS qabsorb splits of W_UK's C columns / VS combine splits of W_UV's rows (mla_attention.SPLITS_BY_BUCKET):
    each qabsorb thread loads its RPT rows of one 16-byte column chunk, the split kernel loads the scaled queries once
    (no partials to add), each combine CTA V / VS rows; where V / VS <= 32 those W_UV loads come before the combine's
    first barrier (under the merge); no local memory."""
    pytest.importorskip("cutlass")
    qs, vs = splits
    k = ma.build(h, **K3, scale=SCALE, arch=arch, load=False, splits=splits, pipe=True)
    ptx = open(k.files["kernel.ptx"]).read()
    ks = entries(ptx)
    assert "ld.local" not in ptx and "st.local" not in ptx
    v4 = r"ld\.global(?:\.[a-z0-9:_]+)*\.(?:v4\.[bfsu]32|v2\.[bfsu]64)\b"
    assert count(ks["qabsorb_kernel"], v4) == qabsorb_rows_per_thread(qs)
    hp, cr = ma.padded_heads(h), K3["C"] + K3["r"]
    nld, nq = -(-ma.DEFAULT_TT * cr // 8 // ma.THREADS), -(-hp * cr // 4 // ma.THREADS)
    assert count(ks["split_kernel"], v4) == nld * (2 if pipelined(nld) else 1) + nq
    comb = ks["combine_kernel"]
    rows = K3["v"] // vs // 4 * (K3["C"] // 256)
    assert count(comb, v4) >= rows
    first_bar = min(i for i in (comb.find("bar.sync"), comb.find("barrier.sync")) if i >= 0)
    # the preloaded partials (K3FUSE_MLA_CPRE, one 16-byte load per split) come before the first barrier too
    pre = ma.combine_preload(K3["C"])
    if K3["v"] // vs <= 32:                                        # hoisted: every W_UV load before the first barrier
        assert count(comb[:first_bar], v4) == rows + pre
    else:                        # not hoisted: the first batch of RB rows (K3FUSE_MLA_CBATCH, default 8), if batched
        rb = ma.combine_batch(K3["v"], splits)
        assert count(comb[:first_bar], v4) == pre + rb * (K3["C"] // 256)
    src = open(k.files["kernel.py"]).read()
    assert "grid=[HP, M, QS]" in src and f"QS = {qs} " in src and f"VS = {vs} " in src
    C = K3["C"]
    assert ma.splits_ok(128, 128, (3, 1), C) and ma.splits_ok(128, 128, (1, 64), C)
    assert ma.splits_ok(128, 128, (64, 1), C)                      # 1 chunk per CTA: 256 n-groups > 128 rows
    assert not ma.splits_ok(128, 128, (32, 32), C) and not ma.splits_ok(128, 128, (1, 1), C)
    assert ma.fit_splits(128, 128, 768, (16, 32)) == (12, 32)       # C = 768: 96 chunks, 16 does not divide them
    with pytest.raises(ValueError, match="splits"):
        ma.render_source(h, **K3, scale=SCALE, splits=(3, 1))


def test_qabsorb_thread_mapping_covers_w_uk_once():
    """The column-split qabsorb's index arithmetic (the template's CH / NG / RPT / PARTS / SPP / COLS_PT, restated):
    for every valid QS, the 256 threads of the QS CTAs load each (n, 16-byte column chunk) of W_UK[h] exactly once,
    and the final sum reads every n-group partial of every output column exactly once and writes each column once."""
    T1 = ma.QABSORB_THREADS
    for C in (256, 512, 1024):
        for n in (64, 128):
            valid = [qs for qs in range(1, 129) if ma.splits_ok(n, 128, (qs, 1), C) is None]
            assert valid and all(C // 8 % qs == 0 for qs in valid)
            for qs in valid:
                ch_, cw = C // 8 // qs, 8 * (C // 8 // qs)
                ng_, rpt = T1 // ch_, n // (T1 // ch_)
                parts, cols_pt = max(1, T1 // cw), max(1, cw // T1)
                spp = ng_ // parts
                loads = {}
                for z in range(qs):
                    for t in range(T1):
                        for i in range(rpt):
                            key = (t // ch_ + ng_ * i, z * ch_ + t % ch_)
                            loads[key] = loads.get(key, 0) + 1
                assert loads == {(r, c): 1 for r in range(n) for c in range(C // 8)}, (C, n, qs)
                reads, writes = {}, {}
                for t in range(T1):
                    for c in range(cols_pt):
                        col, part = t // parts + c * (T1 // parts), t % parts
                        for i in range(spp):
                            reads[(i * parts + part, col)] = reads.get((i * parts + part, col), 0) + 1
                        if part == 0:
                            writes[col] = writes.get(col, 0) + 1
                assert reads == {(g, c): 1 for g in range(ng_) for c in range(cw)}, (C, n, qs)
                assert writes == {c: 1 for c in range(cw)} and parts & (parts - 1) == 0


def test_mla_splits_per_bucket():
    """The launcher's (QS, VS) follows the batch bucket (mla_attention.SPLITS_BY_BUCKET, timed on the H200); every
    entry is valid for K3's n = v = 128; past the last bucket the default."""
    from k3fuse.codegen import mla_attention as ma
    assert [ma.splits_for(m) for m in (1, 2, 3, 8, 9, 33, 64)] == \
        [(8, 8), (8, 8), (8, 8), (8, 8), (8, 8), (4, 1), (4, 1)]
    assert ma.splits_for(65) == ma.DEFAULT_SPLITS
    # K3 TP16 (6 heads per rank) takes 32x8 at buckets 2-8 (timed there), TP8's 12 heads the generic table
    assert [ma.splits_for(m, 6) for m in (1, 2, 4, 8, 16)] == [(8, 8), (32, 8), (32, 8), (32, 8), (8, 8)]
    assert [ma.splits_for(m, 12) for m in (1, 2, 8)] == [(8, 8)] * 3
    assert all(ma.splits_ok(K3["n"], K3["v"], s, K3["C"]) is None for t in ma.SPLITS_BY_HEADS.values()
               for s in t.values())
    assert all(ma.splits_ok(K3["n"], K3["v"], s, K3["C"]) is None for s in ma.SPLITS_BY_BUCKET.values())


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("pipe", [False, True])
def test_mla_kernel_no_spills(arch, pipe, tmp_path, capfd):
    """ptxas remarks for the K3 TP8 configuration (h = 12, the default MMA score step): no spills in any of the three
    kernels; without the tile pipeline the split kernel stays <= 128 registers (min_blocks_per_mp = 2: two 256-thread
    CTAs per SM), with it <= 255 (182-186 measured: one CTA per SM, which is why the launcher takes the pipeline only
    where the grid has at most one CTA per SM)."""
    pytest.importorskip("cutlass")
    import cutlass.cute as cute
    mod = kcompile._import_source(ma.render_source(12, **K3, scale=SCALE, pipe=pipe, arch=arch),
                                  f"mla_spills_{arch}_{pipe}",
                                  tmp_path)
    capfd.readouterr()
    cute.compile(mod.ENTRY, *mod.fake_args(), options=f"--gpu-arch {arch} --enable-tvm-ffi remarks{{ptx}}")
    out = "".join(capfd.readouterr())
    regs = dict(re.findall(r"entry function 'kernel_cutlass_([a-z]+)_kernel.*?Used (\d+) registers", out, re.S))
    assert set(regs) == {"qabsorb", "split", "combine"}, out[-2000:]
    assert out.count("0 bytes spill stores, 0 bytes spill loads") == 3 and "detected register spills" not in out, \
        out[-3000:]
    assert int(regs["split"]) <= (255 if pipe else 128), regs
    # the combine's preloaded partials (K3FUSE_MLA_CPRE = 32: 128 registers) take it to ~160 of 255 (128 threads)
    assert int(regs["combine"]) <= 255 and int(regs["qabsorb"]) <= 128, regs


def test_mla_compile_key_and_supports():
    base = ma.render_source(12, **K3, scale=SCALE)
    variants = [ma.render_source(6, **K3, scale=SCALE), ma.render_source(12, 64, 128, 64, 512, SCALE),
                ma.render_source(12, 128, 64, 64, 512, SCALE), ma.render_source(12, 128, 128, 32, 512, SCALE),
                ma.render_source(12, 128, 128, 64, 256, SCALE), ma.render_source(12, **K3, scale=0.1),
                ma.render_source(12, **K3, scale=SCALE, q_dtype="float32"),
                ma.render_source(12, **K3, scale=SCALE, tt=64)]
    assert len({base, *variants}) == 1 + len(variants)         # every compile-time value changes the source
    pytest.importorskip("cutlass")
    assert kcompile.cache_key(base, "sm_90a") != kcompile.cache_key(base, "sm_100a")
    assert ma.supports(12, **K3) is None and ma.supports(6, **K3) is None and ma.supports(3, **K3) is None
    assert ma.supports(96, **K3) and ma.supports(12, 128, 128, 60, 512) and ma.supports(12, 128, 128, 64, 500)
    assert ma.supports(12, **K3, tt=48)
    with pytest.raises(ValueError):
        ma.render_source(32, **K3, scale=SCALE)


def _inputs(M, h, T, n=16, v=16, r=8, C=32, seq_lens=None, gen=None, dtype=torch.bfloat16):
    q = torch.randn(M, h, n + r, generator=gen).to(dtype)
    cache = torch.randn(M, T, C + r, generator=gen).to(torch.bfloat16)
    kv_b = (torch.randn(h * (n + v), C, generator=gen) * C ** -0.5).to(torch.bfloat16)
    sl = torch.tensor(seq_lens if seq_lens is not None else [T - 1] * M, dtype=torch.int64)
    for m in range(M):                                          # garbage past seq_lens: nan, inf, huge values
        tail = cache[m, int(sl[m]) + 1:]
        if tail.numel():
            tail.copy_(torch.randn(tail.shape, generator=gen) * 1e4)
            tail.view(-1)[0] = float("nan")
            tail.view(-1)[-1] = float("inf")
    return q[..., :n], q[..., n:], cache, kv_b, sl


def reference(q_nope, q_pe, cache, kv_b, seq_lens, scale):
    """ops.py's reference on a copy of the cache with the rows past seq_lens zeroed (the reference multiplies the
    masked rows by p = 0, which turns nan / inf garbage into nan; the kernels never read those rows)."""
    from k3fuse import ops
    clean = cache.clone()
    for m in range(cache.shape[0]):
        clean[m, int(seq_lens[m]) + 1:] = 0
    return ops.mla_attention._init_fn(q_nope, q_pe, clean, kv_b, seq_lens, scale)


def _emulate(q_nope, q_pe, cache, kv_b, seq_lens, scale, ns, tt):
    """The kernels' arithmetic in torch (fp32), step by step: qabsorb, split tiles with zero-filled rows past
    seq_lens, per-tile online softmax (running max / sum / alpha), combine with log-sum-exp weights, W_UV."""
    M, h, n = q_nope.shape
    C = kv_b.shape[1]
    T = cache.shape[1]
    w = kv_b.float().view(h, -1, C)
    qs = torch.cat([torch.einsum("mhn,hnc->mhc", q_nope.float(), w[:, :n]), q_pe.float()], -1) * scale
    ntiles = -(-T // tt)
    tps = -(-ntiles // ns)
    o = torch.empty(M, h, w.shape[1] - n)
    for m in range(M):
        nvalid = min(int(seq_lens[m]) + 1, T)
        parts = []
        for s in range(ns):
            mx = torch.full((h,), float("-inf"))
            l = torch.zeros(h)
            acc = torch.zeros(h, C)
            t_begin = s * tps * tt
            for t0 in range(t_begin, min(t_begin + tps * tt, nvalid), tt):
                rows = torch.zeros(tt, cache.shape[2])
                k = min(tt, nvalid - t0)
                rows[:k] = cache[m, t0:t0 + k].float()
                sc = qs[m] @ rows.t()                                            # [h, tt]
                sc[:, k:] = float("-inf")
                m_new = torch.maximum(mx, sc.max(1).values)
                alpha = torch.exp(mx - m_new)
                p = torch.exp(sc - m_new[:, None])
                l = l * alpha + p.sum(1)
                acc = acc * alpha[:, None] + p @ rows[:, :C]
                mx = m_new
            parts.append((mx, l, acc))
        g = torch.stack([p[0] for p in parts]).max(0).values
        wts = [torch.exp(p[0] - g) for p in parts]
        L = sum(wt * p[1] for wt, p in zip(wts, parts))
        olat = sum(wt[:, None] * p[2] for wt, p in zip(wts, parts)) / L[:, None]
        o[m] = torch.einsum("hc,hvc->hv", olat, w[:, n:])
    return o


@pytest.mark.parametrize("M,T,seq_lens,ns,tt", [(1, 7, [6], 1, 32), (3, 100, [0, 57, 99], 2, 32),
                                                 (3, 100, [31, 32, 33], 4, 32), (2, 300, [299, 150], 3, 64),
                                                 (2, 65, [64, 200], 5, 32)])
def test_mla_split_arithmetic_model(M, T, seq_lens, ns, tt, monkeypatch):
    """The split / tile bookkeeping of the kernels (empty splits, tiles cut by seq_lens, garbage rows) reproduces
    the reference; n_splits() keeps every split count valid."""
    g = torch.Generator().manual_seed(M * 1000 + T)
    args = _inputs(M, 4, T, seq_lens=seq_lens, gen=g)
    ref = reference(*args, SCALE)
    out = _emulate(*args, SCALE, ns, tt)
    assert torch.isfinite(out).all()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    for MM in (1, 3, 8, 64):
        for TT in (1, 31, 32, 4096, 8192):
            k = ma.n_splits(MM, TT)
            assert 1 <= k <= max(1, -(-TT // ma.DEFAULT_TT))
    # the measured choice at a 1024-token context (132 SMs): one tile per split at M = 1, two from M = 2; about 2 CTAs
    # per SM (M = 32: 9 splits), 8 at bucket 64 (session 32), the knob over both
    assert [ma.n_splits(m, 1024) for m in (1, 8, 32, 64)] == [32, 16, 9, 16]
    # 4 CTAs per SM at h = 6 bucket 64, where the cp.async ring runs (CTAS_PER_SM_BY_HEADS, session 37)
    assert [ma.n_splits(64, 1024, h=h) for h in (6, 12)] == [9, 16] and ma.n_splits(32, 1024, h=6) == 9
    monkeypatch.setenv("K3FUSE_MLA_CTAS_PER_SM", "2")
    assert ma.n_splits(64, 1024) == 5
    monkeypatch.setenv("K3FUSE_MLA_MIN_TILES", "1")
    monkeypatch.setenv("K3FUSE_MLA_CTAS_PER_SM", "8")
    assert ma.n_splits(64, 1024) == 17


def test_mla_fallback_on_cpu():
    """On CPU tensors (or unsupported shapes) mla_attention_cuda returns the reference."""
    from k3fuse import ops
    g = torch.Generator().manual_seed(0)
    args = _inputs(2, 4, 9, gen=g)                                  # C = 32: no kernel
    assert ma.launch_ok(*args) is not None
    assert torch.equal(ma.mla_attention_cuda(*args, SCALE), ops.mla_attention._init_fn(*args, SCALE))
    args = _inputs(2, 6, 9, n=128, v=128, r=64, C=512, gen=g)
    assert ma.launch_ok(*args) is None                              # the kernel's shape, on CPU: still the reference
    assert torch.equal(ma.mla_attention_cuda(*args, SCALE), ops.mla_attention._init_fn(*args, SCALE))
    assert set(ma.IMPLS) == {"k3fuse::mla_attention", "k3fuse::mla_append_attention_",
                             "k3fuse::mla_qb_append_attention_"}
    assert math.isclose(float(SCALE), 192 ** -0.5)


def test_mla_qb_fallback_on_cpu(monkeypatch):
    """mla_qb_append_attention_cuda on CPU tensors at K3's TP16 M = 2 shapes (where the per-head kernel would compute
    q on a GPU): the op's reference, the cache written the same way."""
    from k3fuse import ops
    g = torch.Generator().manual_seed(2)
    bf = torch.bfloat16
    _, _, cache, kv_b, sl = _inputs(2, 6, 9, n=128, v=128, r=64, C=512, gen=g)
    cq = torch.randn(2, 1536, generator=g).to(bf)
    qw = (torch.rand(1536, generator=g) + 0.5).to(bf)
    w_qb = (torch.randn(6 * 192, 1536, generator=g) * 0.03).to(bf)
    ckv = torch.randn(2, 576, generator=g).to(bf)
    nw = (torch.rand(512, generator=g) + 0.5).to(bf)
    gate = torch.randn(2, 6 * 128, generator=g).to(bf)
    c1, c2 = cache.clone(), cache.clone()
    assert ma.heads_choice(2, 6)
    a = ma.mla_qb_append_attention_cuda(cq, qw, 1e-6, w_qb, 6, ckv, nw, 1e-6, bf, c1, kv_b, sl, SCALE, gate, bf)
    b = ops.mla_qb_append_attention_._init_fn(cq, qw, 1e-6, w_qb, 6, ckv, nw, 1e-6, bf, c2, kv_b, sl, SCALE, gate, bf)
    assert torch.equal(a, b) and a.dtype == bf and a.shape == (2, 6, 128) and torch.equal(c1, c2)
    assert not torch.equal(c1, cache)


def test_mla_append_fallback_on_cpu():
    """mla_append_attention_cuda on CPU tensors: the op's reference (the cache written the same way), and
    append_ok()'s reasons for what the variant does not take."""
    from k3fuse import ops
    g = torch.Generator().manual_seed(1)
    bf = torch.bfloat16
    qn, qp, cache, kv_b, sl = _inputs(2, 6, 9, n=128, v=128, r=64, C=512, gen=g)
    ckv = torch.randn(2, 576, generator=g).to(bf)
    nw = (torch.rand(512, generator=g) + 0.5).to(bf)
    gate = torch.randn(2, 6 * 128, generator=g).to(bf)
    c1, c2 = cache.clone(), cache.clone()
    a = ma.mla_append_attention_cuda(qn, qp, ckv, nw, 1e-6, bf, c1, kv_b, sl, SCALE, gate, bf)
    b = ops.mla_append_attention_._init_fn(qn, qp, ckv, nw, 1e-6, bf, c2, kv_b, sl, SCALE, gate, bf)
    assert torch.equal(a, b) and a.dtype == bf and torch.equal(c1, c2) and not torch.equal(c1, cache)
    assert ma.append_ok(qn, ckv, nw, bf, cache, kv_b, gate, bf) is None
    assert "ckv" in ma.append_ok(qn, ckv[:, :512], nw, bf, cache, kv_b, gate, bf)
    assert "dtypes" in ma.append_ok(qn, ckv, nw, torch.float32, cache, kv_b, gate, bf)
    assert "gate" in ma.append_ok(qn, ckv, nw, bf, cache, kv_b, gate[:, :64], bf)
    assert "out dtype" in ma.append_ok(qn, ckv, nw, bf, cache, kv_b, gate, torch.float16)


def test_head_groups_above_max_heads(monkeypatch):
    """TP2 / TP4 (48 / 24 heads per rank): mla_attention_cuda runs equal head groups of <= MAX_HEADS through the
    kernel launcher and concatenates them (launcher replaced by the reference on CPU; its GPU twin is
    tests/test_mla_kernel_gpu.py::test_mla_head_groups_above_max_heads)."""
    import torch
    from k3fuse import ops
    from k3fuse.codegen import mla_attention as ma
    from k3fuse.codegen import registry
    assert [ma.head_groups(h) for h in (1, 16, 17, 24, 48, 96, 34)] == [1, 1, 0, 2, 3, 6, 0]
    assert ma.head_groups(50) == 0                            # 4 groups of 12.5: no equal split
    calls = []

    def launcher(qn, qp, cache, kb, sl, scale, out=None, n_split=None):
        calls.append(qn.shape[1])
        assert ma.launch_ok(qn, qp, cache, kb, sl) is None
        return ops.mla_attention._init_fn(qn, qp, cache, kb, sl, scale)

    monkeypatch.setattr(ma, "mla_attention", launcher)
    monkeypatch.setattr(registry, "_env_ok", lambda op, dev: True)
    torch.manual_seed(0)
    N, V, R, C, h, M, T = 128, 128, 64, 512, 48, 2, 40
    q = torch.randn(M, h, N + R).to(torch.bfloat16)
    cache = torch.randn(M, T, C + R).to(torch.bfloat16)
    kv_b = (torch.randn(h * (N + V), C) * C ** -0.5).to(torch.bfloat16)
    sl = torch.tensor([T - 1, 7])
    o = ma.mla_attention_cuda(q[..., :N], q[..., N:], cache, kv_b, sl, 0.07)
    ref = ops.mla_attention._init_fn(q[..., :N], q[..., N:], cache, kv_b, sl, 0.07)
    assert calls == [16, 16, 16]
    assert o.shape == (M, h, V) and o.is_contiguous()
    assert ((o.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-6


@pytest.mark.parametrize("arch,h,splits", [("sm_90a", 12, (16, 32)), ("sm_100a", 12, (8, 8)), ("sm_90a", 6, (8, 8))])
def test_mla_append_gate_variant_compiles(arch, h, splits, isolated_kernel_cache):
    """mla_append_attention_'s variant (pass fuse_mla_append_and_gate): qabsorb also loads the new token's ckv row
    (C / 8 + r / 8 16-byte chunks over its C / 8 threads) and kv_norm_w, stores the row into the cache with 16-byte
    stores; combine reads the gate and stores bf16; still three kernels, no local memory."""
    pytest.importorskip("cutlass")
    qs, vs = splits
    k = ma.build(h, **K3, scale=SCALE, arch=arch, load=False, splits=splits, append_eps=1e-6, gate=True,
                 out_dtype=torch.bfloat16)
    ptx = open(k.files["kernel.ptx"]).read()
    ks = entries(ptx)
    assert set(ks) == {"qabsorb_kernel", "split_kernel", "combine_kernel"}, list(ks)
    assert "ld.local" not in ptx and "st.local" not in ptx
    v4 = r"ld\.global(?:\.[a-z0-9:_]+)*\.(?:v4\.[bfsu]32|v2\.[bfsu]64)\b"
    st4 = r"st\.global(?:\.[a-z0-9:_]+)*\.(?:v4\.[bfsu]32|v2\.[bfsu]64)\b"
    # + ckv latent chunk, kv_norm_w chunk, the k_pe chunk
    assert count(ks["qabsorb_kernel"], v4) == qabsorb_rows_per_thread(qs) + 3
    # the latent chunk and the k_pe chunk (the scaled queries are scalar stores, one per output column)
    assert count(ks["qabsorb_kernel"], st4) == 2
    assert "rsqrt" in ks["qabsorb_kernel"]
    assert count(ks["combine_kernel"], r"st\.global(?:\.[a-z0-9:_]+)*\.[bu]16\b") >= 1
    assert count(ks["combine_kernel"], r"st\.global(?:\.[a-z0-9:_]+)*\.f32\b") == 0
    src = open(k.files["kernel.py"]).read()
    assert "EPS = 1e-06" in src and "ODT = BFloat16" in src
    # the plain kernel renders without any of it
    plain = ma.render_source(h, **K3, scale=SCALE, splits=splits)
    assert "mCkv" not in plain and "mG" not in plain and "ODT = Float32" in plain


def test_mla_pipe_choice(monkeypatch):
    """pipe_for: the knob forces it; unset, the measured rule (on with the MMA score step; with CUDA-core scores,
    not at M = 1 with more than 8 heads)."""
    monkeypatch.delenv("K3FUSE_MLA_PIPE", raising=False)
    assert all(ma.pipe_for(M, h) for M in (1, 8) for h in (6, 12))
    assert ma.pipe_for(1, 6, False) and ma.pipe_for(8, 12, False) and not ma.pipe_for(1, 12, False)
    monkeypatch.setenv("K3FUSE_MLA_PIPE", "1")
    assert ma.pipe_for(1, 12, False)
    monkeypatch.setenv("K3FUSE_MLA_PIPE", "0")
    assert not ma.pipe_for(1, 6) and not ma.pipe_for(8, 6)


@pytest.mark.parametrize("arch,h", [("sm_90a", 6), ("sm_100a", 12), ("sm_90a", 16)])
def test_mla_mma_scores_compile(arch, h, monkeypatch, isolated_kernel_cache):
    """The MMA score step (the default; K3FUSE_MLA_MMA=0 is the CUDA-core one): m16n8k16 MMAs, KPW k-steps x 2
    halves x (hi, lo) per warp, no local memory; the knob changes the source (and so the compile key)."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("K3FUSE_MLA_MMA", "0")
    plain = ma.render_source(h, **K3, scale=SCALE)
    monkeypatch.delenv("K3FUSE_MLA_MMA")
    assert ma.mma_scores(ma.padded_heads(h), K3["r"], K3["C"]) and ma.render_source(h, **K3, scale=SCALE) != plain
    k = ma.build(h, **K3, scale=SCALE, arch=arch, load=False, pipe=True)
    ptx = open(k.files["kernel.ptx"]).read()
    ks = entries(ptx)
    ks_steps = (K3["C"] + K3["r"]) // 32
    kh = ma.THREADS // 32 // (ma.DEFAULT_TT // 8)
    pv = K3["C"] // 128 * -(-ma.padded_heads(h) // 8) * 2 * (ma.DEFAULT_TT // 16 if ma.pv_unroll(arch) else 1)
    assert count(ks["split_kernel"], r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32") == \
        -(-ks_steps // kh) * 2 * 2 + pv
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert ma.smem_bytes(h, K3["r"], K3["C"]) < 100 * 1024
    monkeypatch.setenv("K3FUSE_MLA_MMA", "0")
    assert not ma.mma_scores(ma.padded_heads(h), K3["r"], K3["C"])
    monkeypatch.setenv("K3FUSE_MLA_MMA", "1")
    assert not ma.mma_scores(18, K3["r"], K3["C"]) and not ma.mma_scores(6, 60, K3["C"])


def test_mla_mma_score_fragments_emulated():
    """The MMA score step's index arithmetic, restated from the template and run through the PTX m16n8k16 fragment
    layout (a0: row g, k 2t..2t+1; a1: row g + 8; a2 / a3: k + 8; b0: k 2t..2t+1, col g; b1: k + 8; c0, c1: row g,
    cols 2t, 2t + 1; c2, c3: row g + 8) in float64: every (head, token) score is the full 576-long dot product of the
    hi + lo query halves with the cache row, each physical k used once, summed over the k-shares."""
    torch.manual_seed(0)
    CR, TT, HP, NW = K3["C"] + K3["r"], ma.DEFAULT_TT, 6, ma.THREADS // 32
    KS, NTT = CR // 32, TT // 8
    KH = NW // NTT
    KPW = -(-KS // KH)
    q = torch.randn(HP, CR, dtype=torch.float64)
    hi = q.to(torch.bfloat16).double()
    lo = (q - hi).to(torch.bfloat16).double()
    Q = torch.zeros(2, 16, CR, dtype=torch.float64)
    Q[0, :HP], Q[1, :HP] = hi, lo
    Ct = torch.randn(TT, CR, dtype=torch.float64).to(torch.bfloat16).double()
    sPk = torch.full((KH, TT, HP), float("nan"), dtype=torch.float64)
    used = torch.zeros(TT, CR, dtype=torch.int64)
    for warp in range(NW):
        nt, kh = warp % NTT, warp // NTT
        acc = torch.zeros(32, 4, dtype=torch.float64)          # per lane: c0..c3
        for i in range(KPW):
            ks_ = kh * KPW + i
            if ks_ >= KS:
                continue
            for j in range(2):
                for hl in range(2):
                    A = torch.zeros(16, 16, dtype=torch.float64)    # logical (row, k)
                    B = torch.zeros(16, 8, dtype=torch.float64)     # logical (k, col)
                    for lane in range(32):
                        g, t4 = lane // 4, lane % 4
                        c = ks_ * 4 + t4                             # the lane's 16-byte chunk of each row
                        av = [Q[hl, g, 8 * c:8 * c + 8], Q[hl, g + 8, 8 * c:8 * c + 8]]
                        bv = Ct[nt * 8 + g, 8 * c:8 * c + 8]
                        pair = lambda v, p: v[2 * p:2 * p + 2]
                        # mma_16816(ai[2hl, 2j], ai[2hl+1, 2j], ai[2hl, 2j+1], ai[2hl+1, 2j+1], bi[2j], bi[2j+1])
                        A[g, 2 * t4:2 * t4 + 2] = pair(av[0], 2 * j)
                        A[g + 8, 2 * t4:2 * t4 + 2] = pair(av[1], 2 * j)
                        A[g, 2 * t4 + 8:2 * t4 + 10] = pair(av[0], 2 * j + 1)
                        A[g + 8, 2 * t4 + 8:2 * t4 + 10] = pair(av[1], 2 * j + 1)
                        B[2 * t4:2 * t4 + 2, g] = pair(bv, 2 * j)
                        B[2 * t4 + 8:2 * t4 + 10, g] = pair(bv, 2 * j + 1)
                        if hl == 0:
                            used[nt * 8 + g, 8 * c + 4 * j:8 * c + 4 * j + 4] += 1
                    D = A @ B
                    for lane in range(32):
                        g, t4 = lane // 4, lane % 4
                        acc[lane] += torch.stack([D[g, 2 * t4], D[g, 2 * t4 + 1], D[g + 8, 2 * t4], D[g + 8, 2 * t4 + 1]])
        for lane in range(32):
            g, t4 = lane // 4, lane % 4
            for qd in range(4):
                hh = g + 8 * (qd // 2)
                if hh < HP:
                    sPk[kh, nt * 8 + 2 * t4 + qd % 2, hh] = acc[lane, qd]
    assert torch.equal(used, torch.ones_like(used))               # each (token, k) once, over all warps
    scores = sPk.sum(0)                                           # [TT, HP]
    assert torch.isfinite(scores).all()
    assert torch.allclose(scores, Ct @ (hi + lo).T, rtol=0, atol=1e-10)
    assert ((scores - Ct @ q.T).norm() / (Ct @ q.T).norm()).item() < 1e-4


@pytest.mark.parametrize("h", [6, 12])
def test_mla_combine_preload_loads_ahead(h, monkeypatch, isolated_kernel_cache):
    """K3FUSE_MLA_CPRE=32: the combine kernel issues its 32 preloaded partials' 16-byte loads (with its W_UV rows)
    before the log-sum-exp pass, so in the SASS they all precede its first FFMA (the default: the merge's loop loads
    8 at a time, after that pass); no local memory; capped at MAX_CPRE_REGS registers."""
    import subprocess
    from test_codegen_compile import _nvdisasm
    monkeypatch.setenv("K3FUSE_MLA_CPRE", "1000")
    assert ma.combine_preload(512) == ma.MAX_CPRE_REGS // 4
    monkeypatch.setenv("K3FUSE_MLA_CPRE", "32")
    k = ma.build(h, **K3, scale=SCALE, arch="sm_90a", load=False, splits=ma.splits_for(1, h), append_eps=1e-6,
                 gate=True, out_dtype=torch.bfloat16, pipe=True)
    assert "CPRE = 32 " in k.source
    assert "ld.local" not in open(k.files["kernel.ptx"]).read()
    nd = _nvdisasm()
    if nd is None:
        pytest.skip("nvdisasm not installed: the SASS order is not checked")
    sass = subprocess.run([nd, "-c", k.files["kernel.cubin"]], capture_output=True, text=True, check=True).stdout
    f = next(p for p in re.split(r"\n\s*\.text\.", sass) if p.startswith("kernel_cutlass_combine_kernel"))
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", f)
    first = next(i for i, o in enumerate(ops) if o.startswith("FFMA"))
    assert sum(1 for o in ops[:first] if o.startswith("LDG") and "128" in o) >= 32
    assert not any(o in ("STL", "LDL") for o in ops)


@pytest.mark.parametrize("arch,h,append,cl", [("sm_90a", 6, True, 8), ("sm_100a", 12, True, 8), ("sm_90a", 12, False, 1),
                                              ("sm_90a", 6, False, 2), ("sm_100a", 6, True, 1),
                                              ("sm_90a", 6, True, 16)])
def test_mla_heads_kernel_compiles(arch, h, append, cl, isolated_kernel_cache, monkeypatch):
    """The per-head variant: one kernel; weight rows by one bulk copy each on two mbarriers, the first ones before
    the chain's wait (PDL on by default). Without a cluster: all of W_UK, then all of W_UV into the same buffer
    (behind a proxy fence), the splits merged by an acq_rel gpu-scope arrival. With a cluster of cl: rank c copies its
    N / cl + V / cl rows (all before the wait), the partial queries and the splits' partials merged through
    distributed shared memory behind four cluster barriers (each rank merges C / cl columns and stores them in every
    rank: ld / st.shared::cluster; K3FUSE_MLA_PUSH=0, the pushes' test below); no counter. 16-byte cache loads (the
    first tile's and the next tile's CPT chunks per thread); no local memory."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("K3FUSE_MLA_PUSH", "0")
    kw = dict(append_eps=1e-6, gate=True, out_dtype="bfloat16") if append else {}
    k = ma.build_heads(h, **K3, scale=SCALE, arch=arch, load=False, cl=cl, **kw)
    ptx = open(k.files["kernel.ptx"]).read()
    assert f".target {arch}" in ptx
    ks = entries(ptx)
    assert set(ks) == {"heads_kernel"}, list(ks)
    body = ks["heads_kernel"]
    assert "ld.local" not in body and "st.local" not in body and "multicast" not in body
    bulk = [mm.start() for mm in re.finditer(r"cp\.async\.bulk\.shared::c[a-z]+\.global\.mbarrier::complete_tx::bytes ",
                                             body)]
    wait = body.find("griddepcontrol.wait")
    assert count(body, r"mbarrier\.init") == 2
    v4 = r"ld\.global(?:\.[a-z0-9:_]+)*\.(?:v4\.[bfsu]32|v2\.[bfsu]64)\b"
    cpt = (K3["C"] + K3["r"]) // 8 // (ma.THREADS // ma.HEADS_TT)
    assert count(body, v4) >= 2 * cpt
    if cl == 1:
        # 4 + 4 per warp-0 lane; W_UK's before the wait, W_UV's after the absorb
        assert len(bulk) == (K3["n"] + K3["v"]) // 32 and sum(b < wait for b in bulk) == K3["n"] // 32
        assert count(body, r"atom\.global\.acq_rel(?:\.gpu)?\.add") == 1 and count(body, r"fence\.acq_rel\.gpu") == 1
        assert count(body, r"fence\.proxy\.async\.shared::cta") == 1   # W_UK's generic reads before W_UV's copies
        assert "barrier.cluster" not in body and "shared::cluster.f32" not in body
    else:
        # one W_UK and one W_UV copy instruction (a row per thread), both before the wait
        assert len(bulk) == 2 and all(b < wait for b in bulk)
        assert "atom.global" not in body
        # partial queries / the query's columns everywhere / the splits' partials / the merged columns everywhere
        assert count(body, r"barrier\.cluster\.arrive") == 4 and count(body, r"barrier\.cluster\.wait") == 4
        # each rank reads only its C / cl columns: of the partial queries, and of the splits' (max, sum, o_lat), from
        # each of cl CTAs, and stores its merged columns (query, o_lat) in each
        assert count(body, r"ld\.shared::cluster\.f32") == 4 * cl
        assert count(body, r"st\.shared::cluster\.f32") == 2 * cl


@pytest.mark.parametrize("arch,cl", [("sm_90a", 8), ("sm_100a", 16)])
def test_mla_heads_qb_kernel_compiles(arch, cl, isolated_kernel_cache, monkeypatch):
    """The variant computing q itself (mla_qb_append_attention_): a third mbarrier for this rank's W_qb rows, every
    weight row's bulk copy (W_UK, W_UV, W_qb's q_nope and q_pe rows) before the chain's wait, no q_nope / q_pe loads
    from global memory; one more distributed-shared-memory load per thread (q_pe from its owner; K3FUSE_MLA_PUSH=0);
    no local memory."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("K3FUSE_MLA_PUSH", "0")
    k = ma.build_heads(6, **K3, scale=SCALE, arch=arch, load=False, cl=cl, append_eps=1e-6, gate=True,
                       out_dtype="bfloat16", qb=(1536, 1e-6))
    assert "QL = 1536" in k.source and "mQn" not in k.source and "mQp" not in k.source
    body = entries(open(k.files["kernel.ptx"]).read())["heads_kernel"]
    assert "ld.local" not in body and "st.local" not in body
    assert count(body, r"mbarrier\.init") == 3
    bulk = [mm.start() for mm in re.finditer(r"cp\.async\.bulk\.shared::c[a-z]+\.global\.mbarrier::complete_tx::bytes ",
                                             body)]
    assert len(bulk) == 4 and all(b < body.find("griddepcontrol.wait") for b in bulk)
    assert count(body, r"ld\.shared::cluster\.f32") == 4 * cl + 1
    assert count(body, r"barrier\.cluster\.arrive") == 4 and "atom.global" not in body


def _off_and_on(monkeypatch, knob, arch, h, cl, qb):
    """The per-head kernel's source rendered with knob=0, and the kernel built (not loaded) with knob=1: the K3
    widths, the append + gate variant, q inside where qb."""
    kw = dict(append_eps=1e-6, gate=True, out_dtype="bfloat16", qb=(1536, 1e-6) if qb else None)
    monkeypatch.setenv(knob, "0")
    off = ma.render(ma.HEADS_TEMPLATE, **ma.heads_params(h, **K3, scale=SCALE, cl=cl, **kw))
    monkeypatch.setenv(knob, "1")
    return off, ma.build_heads(h, **K3, scale=SCALE, arch=arch, load=False, cl=cl, **kw)


@pytest.mark.parametrize("arch,h,cl,qb", [("sm_90a", 6, 16, True), ("sm_100a", 12, 8, False), ("sm_90a", 12, 8, True)])
def test_mla_heads_push_kernel_compiles(arch, h, cl, qb, monkeypatch, isolated_kernel_cache):
    """K3FUSE_MLA_PUSH=1: the cluster's gathers by st.async into the owners' shared memory on four more mbarriers, no
    distributed shared memory loads or plain remote stores; one cluster barrier, relaxed, for the mbarriers' init
    (barrier.cluster.arrive's release is a MEMBAR.ALL.GPU in the SASS: none left). st.async per thread: its C / THREADS
    partial-query and o_lat columns to their owners, the (max, sum) pair, and the owner's merged columns (and q_pe
    rows) to every rank. Without the knob the source has none of it."""
    pytest.importorskip("cutlass")
    off, k = _off_and_on(monkeypatch, "K3FUSE_MLA_PUSH", arch, h, cl, qb)
    assert "st_async_f32" not in off and "PB =" not in off
    assert "st_async_f32" in k.source
    body = entries(open(k.files["kernel.ptx"]).read())["heads_kernel"]
    assert "ld.local" not in body and "st.local" not in body
    assert "ld.shared::cluster" not in body and "st.shared::cluster" not in body and "atom.global" not in body
    assert count(body, r"mbarrier\.init") == (3 if qb else 2) + 4
    assert count(body, r"barrier\.cluster\.arrive") == 1 == count(body, r"barrier\.cluster\.arrive\.relaxed")
    assert count(body, r"barrier\.cluster\.wait") == 1
    per = 2 * (K3["C"] // ma.THREADS) + 2 + 2 * cl + (cl if qb else 0)
    assert count(body, r"st\.async\.shared::cluster\.mbarrier::complete_tx::bytes\.b32") == per
    from test_codegen_compile import _nvdisasm
    nd = _nvdisasm()
    if nd is not None and arch == "sm_90a":
        import subprocess
        sass = subprocess.run([nd, "-c", k.files["kernel.cubin"]], capture_output=True, text=True, check=True).stdout
        assert "MEMBAR" not in sass and not re.search(r"\b(STL|LDL)\b", sass)


@pytest.mark.parametrize("arch,h,cl,qb", [("sm_90a", 6, 16, True), ("sm_100a", 12, 8, False), ("sm_90a", 12, 1, False)])
def test_mla_heads_mma_kernel_compiles(arch, h, cl, qb, monkeypatch, isolated_kernel_cache):
    """K3FUSE_MLA_HEADS_MMA=1: the tiles on tensor cores, two tiles per loop iteration (the register buffers swap
    roles). Per tile: the score's 2 MMAs per 32-column step of a warp's slots (4 latent + 1 rope; the rope slot's
    behind a warp-uniform branch) and PV's 2 per latent step, each of PV's A registers transposed by one movmatrix
    (4 per MMA). No local memory (SASS too: HMMA / MOVM as counted, no STL / LDL). Off, the source has none of it;
    widths the warp mapping does not cover keep the CUDA-core tiles."""
    pytest.importorskip("cutlass")
    assert ma.heads_mma_supports(64, 512) is None and ma.heads_mma_supports(32, 512) is None
    assert ma.heads_mma_supports(64, 448) and ma.heads_mma_supports(48, 512)
    off, k = _off_and_on(monkeypatch, "K3FUSE_MLA_HEADS_MMA", arch, h, cl, qb)
    assert "movm_t" not in off and "mma_16816" not in off
    assert "movm_t" in k.source and "NDG = " in k.source
    body = entries(open(k.files["kernel.ptx"]).read())["heads_kernel"]
    assert "ld.local" not in body and "st.local" not in body
    ls = K3["C"] // 32 // 4
    per_tile = 2 * (ls + 1) + 2 * ls
    assert count(body, r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32") == 2 * per_tile
    assert count(body, r"movmatrix\.sync\.aligned\.m8n8\.trans\.b16") == 2 * 4 * 2 * ls
    from test_codegen_compile import _nvdisasm
    nd = _nvdisasm()
    if nd is not None and arch == "sm_90a":
        import subprocess
        sass = subprocess.run([nd, "-c", k.files["kernel.cubin"]], capture_output=True, text=True, check=True).stdout
        assert len(re.findall(r"\bHMMA\.16816\.F32\.BF16\b", sass)) == 2 * per_tile
        assert len(re.findall(r"\bMOVM\b", sass)) == 2 * 4 * 2 * ls
        assert not re.search(r"\b(STL|LDL)\b", sass)


def test_mla_heads_qb_supports():
    """W_qb's rows split over the cluster: 16 + 8 rows of 1536 per CTA at 8, 8 + 4 at 16; not without a cluster,
    and not at 4 or 2 (48 / 96 rows of 3 KB do not fit next to W_UK / W_UV's rows)."""
    assert ma.qb_supports(128, 128, 64, 512, 1536, 8) is None and ma.qb_supports(128, 128, 64, 512, 1536, 16) is None
    for cl in (1, 2, 4):
        assert ma.qb_supports(128, 128, 64, 512, 1536, cl)
    assert ma.qb_supports(128, 128, 64, 512, 1000, 8)              # q_lora not a multiple of 256
    with pytest.raises(ValueError):
        ma.heads_params(6, 128, 128, 64, 512, SCALE, cl=4, qb=(1536, 1e-6))


def test_mla_heads_supports_and_splits():
    assert ma.heads_supports(6, **K3) is None and ma.heads_supports(12, **K3) is None
    assert ma.heads_supports(6, n=128, v=64, r=64, C=512)          # the merge maps V = 128 onto the lanes
    assert ma.heads_supports(6, n=128, v=128, r=32, C=512)         # (C + r) / 8 must split over 8 threads per row
    assert ma.heads_reason(1, 6, 128, 128, 64, 512, 132) is None
    assert ma.heads_reason(32, 6, 128, 128, 64, 512, 132)          # 192 (row, head) pairs: more than one wave
    # one wave: M * h * NS <= SMs; one 32-token tile at least per split; at most HEADS_MAX_NS
    # clusters: the largest power of two <= 8 (16 at 6 heads, bucket 1: HEADS_CL_BY_HEADS) that keeps one wave and a
    # tile per split; else counters, one wave
    assert ma.heads_splits(1, 6, 1024) == 16 and ma.heads_splits(1, 12, 1024) == 8
    assert ma.heads_cluster(16, 1, 6) == 16 and ma.heads_cluster(16, 2, 6) == 1 and ma.heads_cluster(16, 1, 12) == 1
    assert ma.heads_cl(1, 6) == 16 and ma.heads_cl(2, 6) == ma.heads_cl() == ma.HEADS_CL == 8
    assert ma.heads_choice(1, 6) and ma.heads_choice(2, 6) and not ma.heads_choice(1, 12) and not ma.heads_choice(4, 6)
    assert ma.heads_splits(2, 6, 1024) == 8 and ma.heads_splits(3, 6, 1024) == 4 and ma.heads_splits(4, 12, 1024) == 2
    assert ma.heads_splits(1, 6, 40) == 2 and ma.heads_splits(1, 6, 7) == 1 and ma.heads_splits(64, 6, 1024) == 1
    assert [ma.heads_cluster(n) for n in (1, 2, 4, 5, 8, 12, 16, 64)] == [1, 2, 4, 1, 8, 1, 1, 1]


def test_mla_heads_cluster_knob(monkeypatch):
    monkeypatch.setenv("K3FUSE_MLA_HEADS_CL", "1")
    assert ma.heads_splits(1, 6, 1024) == 22 and ma.heads_cluster(8) == 1
    assert ma.heads_splits(1, 1, 4096) == ma.HEADS_MAX_NS
    monkeypatch.setenv("K3FUSE_MLA_HEADS_CL", "4")
    assert ma.heads_splits(1, 6, 1024) == 4 and ma.heads_cluster(4) == 4 and ma.heads_cluster(8) == 1
    monkeypatch.setenv("K3FUSE_MLA_HEADS_CL", "16")      # non-portable: only where M * h * 16 fits one wave
    assert ma.heads_splits(1, 6, 1024) == 16 and ma.heads_cluster(16) == 16
    assert ma.heads_splits(1, 12, 1024) == 8 and ma.heads_splits(2, 6, 1024) == 8
    monkeypatch.setenv("K3FUSE_MLA_HEADS_CL", "8")       # the knob over the table's 16
    assert ma.heads_splits(1, 6, 1024) == 8 and ma.heads_cluster(16, 1, 6) == 1
    monkeypatch.setenv("K3FUSE_MLA_HEADS_CL", "32")      # capped at HEADS_CL_MAX
    assert ma.heads_cl() == ma.HEADS_CL_MAX == 16
    with pytest.raises(ValueError):
        ma.heads_params(6, 128, 128, 64, 512, SCALE, cl=3)
    with pytest.raises(ValueError):
        ma.heads_params(6, 128, 128, 64, 512, SCALE, cl=64)      # 2 W_UK rows per CTA: fewer than the n-groups


@pytest.mark.parametrize("M,T,seq_lens,ns", [(1, 7, [6], 1), (3, 100, [0, 57, 99], 4), (2, 1024, [1023, 300], 22),
                                             (2, 65, [64, 200], 5)])
def test_mla_heads_arithmetic_model(M, T, seq_lens, ns):
    """The per-head kernel's arithmetic in torch: 32-token tiles of each split, the running max / sum, W_UV applied
    to each split's unnormalised partial, the log-sum-exp merge of the W_UV outputs (linear, so equal to merging
    o_lat first): matches the reference; empty splits drop out."""
    g = torch.Generator().manual_seed(M * 1000 + T + ns)
    args = _inputs(M, 4, T, seq_lens=seq_lens, gen=g)
    q_nope, q_pe, cache, kv_b, sl = args
    h, n = q_nope.shape[1:]
    C = kv_b.shape[1]
    w = kv_b.view(h, -1, C).double()
    wuk, wuv = w[:, :n], w[:, n:]
    out = torch.empty(M, h, wuv.shape[1], dtype=torch.float64)
    tt = ma.HEADS_TT
    for m in range(M):
        nvalid = min(int(sl[m]) + 1, T)
        tps = -(-(-(-T // tt)) // ns)
        for hd in range(h):
            q = torch.cat([wuk[hd].T @ q_nope[m, hd].double(), q_pe[m, hd].double()]) * SCALE
            parts = []
            for s in range(ns):
                mx, lsum, acc = float("-inf"), 0.0, torch.zeros(C, dtype=torch.float64)
                t_begin, t_end = s * tps * tt, min(s * tps * tt + tps * tt, nvalid)
                for t0 in range(t_begin, t_end, tt):
                    rows = cache[m, t0:min(t0 + tt, t_end)].double()
                    sc = rows @ q
                    m_new = max(mx, sc.max().item())
                    alpha = math.exp(mx - m_new) if mx > float("-inf") else 0.0
                    p = torch.exp(sc - m_new)
                    lsum = lsum * alpha + p.sum().item()
                    acc = acc * alpha + p @ rows[:, :C]
                    mx = m_new
                parts.append((mx, lsum, wuv[hd] @ acc))
            gmax = max(p[0] for p in parts)
            wts = [math.exp(p[0] - gmax) if p[0] > float("-inf") else 0.0 for p in parts]
            out[m, hd] = sum(wt * p[2] for wt, p in zip(wts, parts)) / sum(wt * p[1] for wt, p in zip(wts, parts))
    ref = reference(*args, SCALE).double()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


def test_kernels_cli_builds_the_per_head_job(isolated_kernel_cache):
    """`k3fuse kernels` compiles the per-head kernel where it is the default (K3 TP16, here bucket 2) with the same
    parameters as the launcher: its PTX has the cluster's pushes into the owners' shared memory (st.async) and the
    tiles' MMAs with movmatrix (the defaults), and its manifest entry says so."""
    pytest.importorskip("cutlass")
    from k3fuse.codegen import kernels_cli
    jobs, _ = kernels_cli.plan("k3", 16, [2], "sm_90a")
    (job,) = [j for j in jobs if j["config"].get("variant") == "heads"]
    k = kernels_cli.build_job(job, "sm_90a")
    assert "params: APPEND=True, C=512, CL=8, EPS='1e-06', GATE=True, H=6," in k.source
    ptx = open(k.files["kernel.ptx"]).read()
    assert "PUSH=True" in k.source and "st.async.shared::cluster" in ptx
    # the manifest says which gathers and tiles the kernel has (both read from the environment by build_heads)
    assert job["config"]["push"] is True and job["config"]["mma"] is True
    assert "MMA=True" in k.source and "movmatrix.sync.aligned" in ptx
    # q inside at bucket 2 (clusters of 8): cq first, the default
    assert job["op"] == "k3fuse::mla_qb_append_attention_" and job["config"]["qfirst"] is True
    assert "QFIRST=True" in k.source
    assert ma.heads_choice(2, 6) and ma.heads_choice(1, 6) and not ma.heads_choice(2, 12) and not ma.heads_choice(4, 6)


@pytest.mark.parametrize("arch,cl", [("sm_90a", 16), ("sm_100a", 8)])
def test_mla_heads_qfirst_kernel_compiles(arch, cl, monkeypatch, isolated_kernel_cache):
    """K3FUSE_MLA_QFIRST=1 (the default; q computed in the kernel only): cq and the q_a norm weight are loaded with no
    branch (threads past QCH re-read the last chunk) before the first tile's rows; 0: inside `if tidx < QCH` after
    them. No local memory either way; without q in the kernel the knob renders nothing."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("K3FUSE_MLA_QFIRST", "0")
    kw = dict(append_eps=1e-6, gate=True, out_dtype="bfloat16", qb=(1536, 1e-6))
    off = ma.render(ma.HEADS_TEMPLATE, **ma.heads_params(6, **K3, scale=SCALE, cl=cl, **kw))
    monkeypatch.setenv("K3FUSE_MLA_QFIRST", "1")
    k = ma.build_heads(6, **K3, scale=SCALE, arch=arch, load=False, cl=cl, **kw)
    assert "qi = cutlass.min(tidx, QCH - 1)" in k.source and "qi = cutlass.min" not in off
    src = k.source
    assert src.index("(m, qi)]") < src.index("gC[(0, 0, None), (m, row")
    assert off.index("gC[(0, 0, None), (m, row") < off.index("(m, tidx)], cq8)")
    body = entries(open(k.files["kernel.ptx"]).read())["heads_kernel"]
    assert "ld.local" not in body and "st.local" not in body
    plain = ma.render(ma.HEADS_TEMPLATE, **ma.heads_params(6, **K3, scale=SCALE, cl=cl))
    monkeypatch.setenv("K3FUSE_MLA_QFIRST", "0")
    assert plain == ma.render(ma.HEADS_TEMPLATE, **ma.heads_params(6, **K3, scale=SCALE, cl=cl))


def _combine_sass(k):
    """The combine kernel's SASS of a compiled three-launch MLA kernel (None without nvdisasm)."""
    import subprocess
    from test_codegen_compile import _nvdisasm
    nd = _nvdisasm()
    if nd is None:
        return None
    sass = subprocess.run([nd, "-c", k.files["kernel.cubin"]], capture_output=True, text=True, check=True).stdout
    i = sass.find(".text.kernel_cutlass_combine_kernel")
    j = sass.find("//---------------------", i + 10)
    return sass[i:j if j > 0 else None]


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("rb", [4, 8])
def test_mla_combine_batches_its_w_uv_rows(arch, rb, monkeypatch):
    """K3FUSE_MLA_CBATCH=RB (default 8): bucket 64's 4x1 combine (32 W_UV rows per warp, not hoisted) renders the
    batched row loop and compiles; off, the source is the default's; only where the rows are not hoisted. On sm_90a
    (with nvdisasm): more 16-byte loads issued before the first output store than the unbatched kernel's (whose 32
    rows are one L2 round trip each: a load, 5 shuffles, a store), and no spills."""
    args = dict(h=6, **K3, scale=SCALE, arch=arch, load=False, append_eps=1e-6, gate=True, out_dtype="bfloat16")
    monkeypatch.setenv("K3FUSE_MLA_CBATCH", "0")
    off = ma.build(splits=(4, 1), **args)
    assert "RB3" not in off.source
    monkeypatch.setenv("K3FUSE_MLA_CBATCH", str(rb))
    on = ma.build(splits=(4, 1), **args)
    assert f"RB3 = {rb} " in on.source and on.source != off.source
    assert "RB3" not in ma.render_source(6, **K3, scale=SCALE, splits=(4, 4), append_eps=1e-6, gate=True)
    assert ma.combine_batch(128, (4, 1)) == rb and ma.combine_batch(128, (8, 8)) == 0
    if arch != "sm_90a":
        return
    s_off, s_on = _combine_sass(off), _combine_sass(on)
    if s_off is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm): the SASS is not checked")

    def loads_before_first_store(s):
        return s[:s.find("STG.E.U16")].count("LDG.E.128")

    assert loads_before_first_store(s_on) >= loads_before_first_store(s_off) + 2 * rb
    assert not re.search(r"\b(STL|LDL)\b", s_on)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("h,gated", [(6, True), (12, False)])
def test_mla_combine_mma_compiles(arch, h, gated, monkeypatch):
    """The three launches' combine on tensor cores (K3FUSE_MLA_CMMA). Its choice follows the table (unset), or the
    variable and the bucket; without cmma the sources have the CUDA-core combine; with it, the combine entry has the 8
    tokens' W_UV MMAs (C / 32 k-steps x 2 per 16-row tile), one CTA barrier and no local memory, and only the
    three-launch variant takes it."""
    monkeypatch.delenv("K3FUSE_MLA_CMMA", raising=False)
    assert [m for m in (1, 8, 16, 32, 64) if ma.combine_mma_choice(m, 6)] == [32, 64]
    assert [m for m in (1, 8, 16, 32, 64) if ma.combine_mma_choice(m, 12)] == [16, 32, 64]
    assert not ma.combine_mma_choice(64, 5)
    monkeypatch.setenv("K3FUSE_MLA_CMMA", "0")
    assert not ma.combine_mma_choice(64, 12)
    monkeypatch.setenv("K3FUSE_MLA_CMMA", "1")
    assert ma.combine_mma_choice(64, 6) and ma.combine_mma_choice(17, 5) and not ma.combine_mma_choice(8, 12)
    assert ma.combine_mma_reason(128, 512) is None and ma.combine_mma_reason(96, 512) and ma.combine_mma_reason(128, 384)
    args = dict(h=h, **K3, scale=SCALE, splits=(4, 1), append_eps=1e-6 if gated else None, gate=gated,
                out_dtype="bfloat16" if gated else "float32")
    plain = ma.render_source(**args)
    assert "combine_mma_kernel" not in plain and "def combine_kernel" in plain
    src = ma.render_source(**args, cmma=True)
    assert "def combine_mma_kernel" in src and "def combine_kernel" not in src
    k = ma.build(**args, arch=arch, load=False, cmma=True)
    body = entries(open(k.files["kernel.ptx"]).read())["combine_mma_kernel"]
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16", body)) == K3["C"] // 32 * 2
    assert len(re.findall(r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+0", body)) == 1
    assert "ld.local" not in body and "st.local" not in body
    assert ("ex2.approx" in body) and (("ex2.approx" in body.split("mma.sync")[-1]) == gated)   # the gate's sigmoid


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("h", [6, 12])
def test_mla_async_tiles_compiles(arch, h, monkeypatch, tmp_path, capfd):
    """K3FUSE_MLA_ASYNC=1: the split kernel's cache tiles by cp.async into a ring of two shared-memory tiles. The
    choice: only with the knob, three launches and no PIPE. The source without it is unchanged. With it the split
    entry has 2 x NLD 16-byte cp.async copies (the first tile's before the queries', the next one's in the loop),
    one commit group each, a wait for all but the newest; the same MMAs as without; no local memory, and ptxas
    spills nothing. Only the real query rows are in shared memory (at HP <= 8 the MMA's rows 8-15 are not read: 2 x 9
    fewer 16-byte shared loads), so two CTAs fit per SM at h = 6 and 12; the launch asks for two at HP <= 8, at h = 12
    only with K3FUSE_MLA_ASYNC=2 (ptxas spills a few words at that register cap). Other variants are refused."""
    import cutlass.cute as cute
    hp, r, C = ma.padded_heads(h), K3["r"], K3["C"]
    monkeypatch.delenv("K3FUSE_MLA_ASYNC", raising=False)
    # unset: mode 1 where ASYNC_BY_HEADS lists (h, bucket) (TP16's h = 6 at 16-64), off elsewhere and where PIPE runs
    assert [ma.async_for(M, h, r, C, False) for M in (8, 9, 16, 40, 64)] == \
        ([0, 1, 1, 1, 1] if h == 6 else [0, 0, 0, 0, 0])
    assert ma.async_for(64, h, r, C, True) == 0
    monkeypatch.setenv("K3FUSE_MLA_ASYNC", "1")
    assert ma.async_for(1, h, r, C, False) == 1
    assert ma.async_for(64, h, r, C, True) == 0
    monkeypatch.setenv("K3FUSE_MLA_ASYNC", "0")
    assert ma.async_for(64, h, r, C, False) == 0
    args = dict(h=h, **K3, scale=SCALE, splits=(4, 1))
    with pytest.raises(ValueError, match="cp.async"):
        ma.render_source(**args, pipe=True, asy=1)
    with pytest.raises(ValueError, match="mode 3"):
        ma.render_source(**args, asy=3)
    plain, src = ma.render_source(**args, arch=arch), ma.render_source(**args, arch=arch, asy=1)
    assert "cpasync" not in plain and "cpasync.CopyG2SOp" in src
    def launch(src):
        return [ln for ln in src.splitlines() if "split_kernel(" in ln and ".launch(" in ln][0]
    # 2 x HP x 608 x 2 (q hi / lo) + 2 x 32 x 608 x 2 (the ring) + 3 x 32 x HP x 4 (p, partial scores) + 3 x HP x 4
    assert ma.smem_bytes(h, K3["r"], K3["C"], asy=True) == {6: 94792, 12: 111760}[h]
    assert ma.async_two_ctas(h, K3["r"], K3["C"]) and not ma.async_two_ctas(16, K3["r"], K3["C"])   # 123 KB at 16
    assert ("min_blocks_per_mp=2" in launch(src)) == (hp <= 8)     # h = 12: one CTA per SM unless mode 2
    assert "min_blocks_per_mp=2" in launch(ma.render_source(**args, arch=arch, asy=2))
    monkeypatch.setenv("K3FUSE_MLA_ASYNC", "3")
    with pytest.raises(ValueError, match="K3FUSE_MLA_ASYNC"):
        ma.async_for(64, h, r, C, False)
    k = ma.build(**args, arch=arch, load=False, asy=1)
    k0 = ma.build(**args, arch=arch, load=False)
    body, body0 = (entries(open(x.files["kernel.ptx"]).read())["split_kernel"] for x in (k, k0))
    nld = -(-32 * (K3["C"] + K3["r"]) // 8 // 256)
    assert len(re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^\]]+\], \[[^\]]+\], 16", body)) == 2 * nld
    assert body.count("cp.async.commit_group") == 2 and re.findall(r"cp\.async\.wait_group\s+(\d+)", body) == ["1"]
    mma = r"mma\.sync\.aligned\.m16n8k16"
    assert len(re.findall(mma, body)) == len(re.findall(mma, body0)) > 0
    lds = r"ld\.shared\.v4"
    assert len(re.findall(lds, body)) == len(re.findall(lds, body0)) - (2 * (-(-(K3["C"] + K3["r"]) // 32 // 2))
                                                                         if hp <= 8 else 0)
    assert "ld.local" not in body and "st.local" not in body
    mod = kcompile._import_source(src, f"mla_async_{h}_{arch}", tmp_path)
    capfd.readouterr()
    cute.compile(mod.ENTRY, *mod.fake_args(), options=f"--gpu-arch {arch} --enable-tvm-ffi remarks{{ptx}}")
    out = "".join(capfd.readouterr())
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    assert spills and all(a == "0" and b == "0" for a, b in spills), out[-2000:]


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("h,gated", [(6, True), (12, False)])
def test_mla_combine_mma_tokens_compiles(arch, h, gated, monkeypatch):
    """The tensor-core combine over 4 tokens per CTA (ctok = 4: K3FUSE_MLA_CMMA_TOK=4, or unset where CMMA_TOK_BY_HEADS
    lists the bucket). One merge serves both (session 39; before, 8 tokens had a branch of its own): with 8, one warp a
    token (WPT3 = 1; warps past the 8th, at v > 128, repeat a token's merge and store the same values); with 4, two
    merging warps per token. The combine entry keeps
    the MMAs (C / 32 k-steps x 2), one CTA barrier, no local memory, and predicates the MMA's unused columns off
    the stores; other values are refused; widths the shared columns do not divide are refused with a reason."""
    monkeypatch.delenv("K3FUSE_MLA_CMMA_TOK", raising=False)
    args = dict(h=h, **K3, scale=SCALE, splits=(4, 1), append_eps=1e-6 if gated else None, gate=gated,
                out_dtype="bfloat16" if gated else "float32")
    eight = ma.render_source(**args, cmma=True, arch=arch)
    plain = ma.render_source(**args, arch=arch)
    assert "MT3 = 8 " in eight and "WPT3 = 1 " in eight and "    c0 = lane * CPW3\n" in eight
    # unset: 4 where CMMA_TOK_BY_HEADS lists (h, bucket) (buckets 32, 64 at h = 6, 16-64 at h = 12), else 8
    assert [ma.combine_mma_tokens(M, h) for M in (8, 16, 17, 33, 64)] == \
        ([8, 8, 4, 4, 4] if h == 6 else [8, 4, 4, 4, 4])
    assert ma.combine_tokens_for(64, h, 128, 512) == 4 and ma.combine_tokens_for(64, h, 160, 512) == 8
    monkeypatch.setenv("K3FUSE_MLA_CMMA_TOK", "8")
    assert ma.combine_mma_tokens(64, h) == 8
    monkeypatch.setenv("K3FUSE_MLA_CMMA_TOK", "4")
    assert ma.combine_mma_tokens(16, h) == 4
    four = ma.render_source(**args, cmma=True, arch=arch, ctok=4)
    assert "MT3 = 4 " in four and "WPT3 = NW3 // MT3" in four
    assert four[four.index("def qabsorb_phase"):four.index("def combine_mma_kernel")] == \
        eight[eight.index("def qabsorb_phase"):eight.index("def combine_mma_kernel")]      # qabsorb, split: untouched
    assert ma.render_source(**args, arch=arch) == plain                               # no combine MMA: no change
    assert ma.combine_mma_reason(128, 512, 4) is None and ma.combine_mma_reason(160, 512, 4)   # 10 warps, 4 tokens
    assert ma.combine_mma_reason(160, 512) is None and ma.combine_mma_reason(128, 256, 4)  # 2 x 128 columns: 4 a lane
    k = ma.build(**args, arch=arch, load=False, cmma=True, ctok=4)
    assert k.source == four
    body = entries(open(k.files["kernel.ptx"]).read())["combine_mma_kernel"]
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16", body)) == K3["C"] // 32 * 2
    assert len(re.findall(r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+0", body)) == 1
    assert "ld.local" not in body and "st.local" not in body
    # 8 tokens at v = 160 (10 warps, 2 past the tokens): compiles with the same MMAs, one barrier, no local memory
    if h == 12:
        k10 = ma.build(**dict(args, v=160), arch=arch, load=False, cmma=True, ctok=8)
        body = entries(open(k10.files["kernel.ptx"]).read())["combine_mma_kernel"]
        assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16", body)) == K3["C"] // 32 * 2
        assert len(re.findall(r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+0", body)) == 1
        assert "ld.local" not in body and "st.local" not in body
    with pytest.raises(ValueError, match="2 tokens per tensor-core-combine CTA"):
        ma.render_source(**args, cmma=True, ctok=2)
    monkeypatch.setenv("K3FUSE_MLA_CMMA_TOK", "2")
    with pytest.raises(ValueError, match="K3FUSE_MLA_CMMA_TOK"):
        ma.combine_mma_tokens(64, h)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("h,gated", [(6, True), (12, False)])
def test_mla_combine_mma_pre_compiles(arch, h, gated, monkeypatch, tmp_path, capfd):
    """K3FUSE_MLA_CMMA_PRE=N (default 5; 0 off): only the 4-token tensor-core combine changes (8 tokens per CTA and the
    other kernels keep their source), N is capped at CMMA_PRE_MAX_REGS registers of partials, the key changes; the
    combine keeps its MMAs and one CTA barrier, and ptxas fits it in 128 registers (two 256-thread CTAs per SM)
    without spills. Its round trips: tests/test_sass.py."""
    args = dict(h=h, **K3, scale=SCALE, splits=(4, 1), append_eps=1e-6 if gated else None, gate=gated,
                out_dtype="bfloat16" if gated else "float32", cmma=True, arch=arch)
    monkeypatch.setenv("K3FUSE_MLA_CMMA_PRE", "0")
    four, eight = ma.render_source(**args, ctok=4), ma.render_source(**args, ctok=8)
    assert "PRE3" not in four
    monkeypatch.setenv("K3FUSE_MLA_CMMA_PRE", "64")
    assert ma.combine_mma_pre(128, 512, 4) == ma.CMMA_PRE_MAX_REGS // 8 == 5
    assert ma.combine_mma_pre(128, 512, 8) == 0 and ma.combine_mma_pre(160, 512, 4) == 0
    monkeypatch.delenv("K3FUSE_MLA_CMMA_PRE", raising=False)           # the default
    assert ma.render_source(**args, ctok=8) == eight                    # the 8-token combine: not this variant
    src = ma.render_source(**args, ctok=4)
    assert "PRE3 = 5 " in src and src != four
    monkeypatch.setenv("K3FUSE_MLA_CMMA_PRE", "5")
    assert ma.render_source(**args, ctok=4) == src
    def before_combine(x):     # everything but the combine kernel, the PRE3 constant and the header's parameters
        return [ln for ln in x[:x.index("def combine_mma_kernel")].splitlines()
                if not ln.startswith(("PRE3 = ", "# params:"))]
    assert before_combine(src) == before_combine(four)
    k = ma.build(**args, load=False, ctok=4)
    monkeypatch.setenv("K3FUSE_MLA_CMMA_PRE", "0")
    k0 = ma.build(**args, load=False, ctok=4)
    assert k.source == src and k0.source == four and k.key != k0.key
    body, body0 = (entries(open(x.files["kernel.ptx"]).read())["combine_mma_kernel"] for x in (k, k0))
    mma = r"mma\.sync\.aligned\.m16n8k16"
    assert len(re.findall(mma, body)) == len(re.findall(mma, body0)) == K3["C"] // 32 * 2
    assert len(re.findall(r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+0", body)) == 1
    assert "ld.local" not in body and "st.local" not in body
    regs, spill_st, spill_ld = ptxas_report(src, f"mla_pre_{h}_{arch}", arch, tmp_path, capfd)["combine_mma_kernel"]
    assert regs <= 128 and spill_st == spill_ld == 0


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("h", [6, 12, 16])
def test_mla_pv_mma_compiles(arch, h, monkeypatch):
    """K3FUSE_MLA_PVMMA (default 1): the split kernel's PV step on tensor cores. 0, the sources have no PV MMAs; on
    (unset), the split kernel has the PV MMAs (C / 128
    m-tiles x the heads' n-tiles x TT / 16 k-blocks x hi + lo) beside the score step's, a movmatrix per A block, and
    no local memory; off where the score step is not on tensor cores."""
    hp = ma.padded_heads(h)
    args = dict(h=h, **K3, scale=SCALE, splits=(4, 1))
    name = "split_kernel"

    def split_body(k):
        return entries(open(k.files["kernel.ptx"]).read())[name]

    monkeypatch.setenv("K3FUSE_MLA_PVMMA", "0")
    assert not ma.pv_mma(hp, K3["r"], K3["C"])
    off = ma.build(**args, arch=arch, load=False)
    plain = open(off.files["kernel.py"]).read()
    assert plain == ma.render_source(**args) and "PMT" not in plain
    monkeypatch.delenv("K3FUSE_MLA_PVMMA")
    assert ma.pv_mma(hp, K3["r"], K3["C"])
    monkeypatch.setenv("K3FUSE_MLA_MMA", "0")
    assert not ma.pv_mma(hp, K3["r"], K3["C"])
    monkeypatch.delenv("K3FUSE_MLA_MMA")
    k = ma.build(**args, arch=arch, load=False)
    assert "PMT = " in open(k.files["kernel.py"]).read()
    body, body_off = split_body(k), split_body(off)
    mma = r"mma\.sync\.aligned\.m16n8k16"
    kbs = ma.DEFAULT_TT // 16 if ma.pv_unroll(arch) else 1          # the k-blocks unrolled or a loop
    pv = K3["C"] // 128 * -(-hp // 8) * 2 * kbs
    assert len(re.findall(mma, body)) == len(re.findall(mma, body_off)) + pv
    assert len(re.findall(r"movmatrix", body)) == K3["C"] // 128 * 4 * kbs
    assert "ld.local" not in body and "st.local" not in body
