"""k3fuse::moe_experts kernels (codegen/moe_experts.py) render for every batch bucket and compile
for sm_90a and sm_100a without a GPU; their PTX has 128-bit weight loads, two kernels and no local memory; the
CUDA implementation falls back to the reference (one log line) where it has no kernel."""
import functools
import logging
import re

import pytest
import torch

pytest.importorskip("cutlass")

from _check import entries, ptxas_report  # noqa: E402
from k3fuse.codegen import moe_experts as me  # noqa: E402
from k3fuse.codegen.buckets import BUCKETS  # noqa: E402
from k3fuse.codegen.cache import cache_key  # noqa: E402

E, D, KT = 896, 3584, 16
I_TP = {8: 384, 16: 192}


pytestmark = pytest.mark.usefixtures("isolated_kernel_cache")


@pytest.mark.parametrize("tp", [8, 16])
def test_renders_every_bucket_and_key_covers_shape_bucket_arch(tp):
    I = I_TP[tp]
    keys = set()
    for b in BUCKETS:
        assert me.supports(E, I, D, KT, b) is None
        src, cfg = me.render_source(E, I, D, KT, b)
        assert cfg["GROUP"] == int(b > 1)
        compile(src, "<moe>", "exec")                       # valid Python
        for arch in ("sm_90a", "sm_100a"):
            keys.add(cache_key(src, arch))
    assert len(keys) == 2 * len(BUCKETS)
    # every compile-time value reaches the source, hence the key
    base = me.render_source(E, I, D, KT, 8)[0]
    for other in (me.render_source(E // 2, I, D, KT, 8), me.render_source(E, I * 2, D, KT, 8),
                  me.render_source(E, I, D // 2, KT, 8), me.render_source(E, I, D, KT // 2, 8),
                  me.render_source(E, I, D, KT, 8, beta=2.0), me.render_source(E, I, D, KT, 8, lbeta=20.0)):
        assert other[0] != base


def test_supports_reasons():
    assert me.supports(E, 192, D, KT, None)
    assert me.supports(E, 196, D, KT, 1)           # I % 8
    assert me.supports(E, 192, D, 40, 1)           # k too large for the slot bitmask


def _ptx_checks(k, arch, I, b):
    ptx = open(k.files["kernel.ptx"]).read()
    assert f".target {arch}" in ptx
    assert len(re.findall(r"\.entry\s", ptx)) == 2           # up + down
    loads = re.findall(r"ld\.global(?:\.[a-z0-9:_]+)*", ptx)
    vec = [l for l in loads if ".v" in l]
    # 128-bit vectors (v4 x 32 bit, or v2 x 64 bit as ptx emits for the batched down kernel's loads)
    assert vec and all(re.search(r"\.v4\.[buf]32$|\.v2\.[bu]64$", l) for l in vec), set(vec)
    # scalars only for ids (64-bit) and routing weights (32-bit): no 16-bit (per-element bf16) loads
    assert not [l for l in loads if re.search(r"\.(b|u|s)16$|\.bf16$", l)], set(loads)
    cfg = me.default_config(E, I, D, KT, b)
    p = me.template_params(E, I, D, KT, b, cfg, 4.0, 25.0)
    n_up = (2 * p["R"] + 1) * p["ITERS"]                         # weight rows + z, per unrolled step
    n_down = KT // p["KS"] * p["VPL"] * (1 + p["RT"])            # a + W2 per slot (a thread's KT / KS slots)
    assert len(vec) >= n_up + n_down
    assert "ld.local" not in ptx and "st.local" not in ptx       # no spills to local memory
    if b > 1:
        assert "bar.sync" in ptx


# four compiles (~2 s each): both archs, both TP shapes, ungrouped (bucket 1) and grouped (8, 64)
@pytest.mark.parametrize("arch,tp,b", [("sm_90a", 16, 1), ("sm_90a", 8, 64), ("sm_100a", 8, 1), ("sm_100a", 16, 8)])
def test_compiles(arch, tp, b, monkeypatch):
    monkeypatch.setenv("K3FUSE_MOE_DOWN_MMA", "0")    # the per-slot down's PTX (the tensor-core one: test_down_mma_compiles)
    I = I_TP[tp]
    k = me.build(E, I, D, KT, b, arch=arch, load=False)
    assert {"kernel.py", "kernel.ptx", "kernel.cubin"} <= set(k.files)
    _ptx_checks(k, arch, I, b)
    assert me.build(E, I, D, KT, b, arch=arch, load=False) is k  # memoised


def _renders_where_on(monkeypatch, var, markers, min_bucket, I, b):
    """A kernel variant's switch var (no GPU table here): =1 renders the variant (its kernels' markers) at bucket b,
    =0 the default source without them, unset the variant from min_bucket; bucket 1 (ungrouped) never changes.
    Leaves var = 1."""
    monkeypatch.setenv(var, "0")
    plain, plain1 = me.render_source(E, I, D, KT, b)[0], me.render_source(E, I, D, KT, 1)[0]
    monkeypatch.setenv(var, "1")
    src = me.render_source(E, I, D, KT, b)[0]
    assert all(m in src for m in markers) and markers[0] not in plain
    assert me.render_source(E, I, D, KT, 1)[0] == plain1
    monkeypatch.delenv(var)
    assert me.render_source(E, I, D, KT, b)[0] == (src if b >= min_bucket else plain)
    assert me.render_source(E, I, D, KT, 1)[0] == plain1
    monkeypatch.setenv(var, "1")


@pytest.mark.parametrize("arch,tp,b", [("sm_90a", 16, 64), ("sm_90a", 8, 8), ("sm_100a", 16, 16), ("sm_100a", 8, 2)])
def test_up_mma_compiles(arch, tp, b, monkeypatch):
    """The grouped up kernel on tensor cores (the default from bucket UP_MMA_MIN_BUCKET; K3FUSE_MOE_UP_MMA=1 at every
    grouped bucket, 0 never): the sources differ only where it is on; its PTX has the m16n8k16 MMAs of one load group
    (UU k-steps x 2 row tiles x NTG n-tiles x 2), no 16-bit loads and no local memory; bucket 1 (ungrouped) never
    takes it."""
    I = I_TP[tp]
    monkeypatch.setenv("K3FUSE_MOE_DOWN_MMA", "0")          # the up kernel's MMAs alone
    _renders_where_on(monkeypatch, "K3FUSE_MOE_UP_MMA", ("up_mma_kernel(mZ",), me.UP_MMA_MIN_BUCKET, I, b)
    p = me.up_mma(I, D, KT, b, True)
    assert p["NTG"] == (2 if b >= 16 else 1) and (D // 8) % (4 * p["UU"] * p["UW"]) == 0
    assert b * KT * (I // 16) // p["CPC"] <= me.UP_MMA_CTAS and (I // 16) % p["CPC"] == 0
    k = me.build(E, I, D, KT, b, arch=arch, load=False)
    ptx = open(k.files["kernel.ptx"]).read()
    assert len(re.findall(r"\.entry\s", ptx)) == 2
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx)) == \
        p["UU"] * 2 * p["NTG"] * 2
    loads = re.findall(r"ld\.global(?:\.[a-z0-9:_]+)*", ptx)
    assert not [l for l in loads if re.search(r"\.(b|u|s)16$|\.bf16$", l)], set(loads)
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_up_mma_follows_the_table(monkeypatch):
    """The H200 table's UPMMA (measured per shape and bucket) picks the up kernel where the variable is unset: on at
    TP16 buckets 2-8 and 64 and TP8 buckets 2, 4 (session 34) and 64, off at TP8 bucket 8 (measured slower there);
    the variable overrides it."""
    monkeypatch.delenv("K3FUSE_MOE_UP_MMA", raising=False)
    def mma_src(I, b):
        cfg = me.config_for(E, I, D, KT, b, gpu="nvidia_h200")
        return "up_mma_kernel(mZ" in me.render_source(E, I, D, KT, b, cfg=cfg)[0]
    assert me.config_for(E, 192, D, KT, 8, gpu="nvidia_h200")["UPMMA"] == 1
    assert mma_src(192, 8) and mma_src(192, 64) and mma_src(384, 64) and not mma_src(384, 8)
    assert not mma_src(192, 1)
    # buckets 2 and 4: entries holding UPMMA alone (TP16, measured); the knobs stay the heuristic's
    assert mma_src(192, 2) and mma_src(192, 4) and mma_src(384, 2) and mma_src(384, 4)
    assert {k: v for k, v in me.config_for(E, 192, D, KT, 2, gpu="nvidia_h200").items() if k != "UPMMA"} == \
        dict(me.default_config(E, 192, D, KT, 2), KS=2)            # the variant key beside the layer's KS = 2 only
    # TP8 bucket 4: the variant key beside the layer-measured knobs, which stay
    assert me.config_for(E, 384, D, KT, 4, gpu="nvidia_h200")["UPMMA"] == 1
    assert {k: me.config_for(E, 384, D, KT, 4, gpu="nvidia_h200")[k] for k in ("KS", "LPR", "WD")} == \
        dict(KS=2, LPR=16, WD=1)
    monkeypatch.setenv("K3FUSE_MOE_UP_MMA", "1")
    assert mma_src(384, 8)
    monkeypatch.setenv("K3FUSE_MOE_UP_MMA", "0")
    assert not mma_src(192, 64)


@pytest.mark.parametrize("arch,tp,b", [("sm_90a", 16, 64), ("sm_90a", 8, 8), ("sm_100a", 16, 16), ("sm_100a", 8, 2)])
def test_down_mma_compiles(arch, tp, b, monkeypatch):
    """The grouped down projection on tensor cores + the combine, three launches (the default from bucket
    DOWN_MMA_MIN_BUCKET; K3FUSE_MOE_DOWN_MMA=1 at every grouped bucket, 0 never). PTX: the down kernel's UD x DNTG x 2
    MMAs per load group, 128-bit y stores and loads, no local memory; bucket 1 never takes it."""
    I = I_TP[tp]
    monkeypatch.setenv("K3FUSE_MOE_UP_MMA", "0")           # the down kernel's MMAs alone
    _renders_where_on(monkeypatch, "K3FUSE_MOE_DOWN_MMA", ("down_mma_kernel(mA", "combine_kernel(mY"),
                      me.DOWN_MMA_MIN_BUCKET, I, b)
    p = me.down_mma(I, D, KT, b, True)
    nd = D // 128
    assert nd % p["RPC"] == 0 and (b * KT * nd // p["RPC"] <= me.DOWN_CTAS or p["RPC"] == nd)
    assert p["DNTG"] == (2 if b >= 16 else 1) and (I // 8) % (4 * p["UD"]) == 0
    k = me.build(E, I, D, KT, b, arch=arch, load=False)
    ptx = open(k.files["kernel.ptx"]).read()
    assert len(re.findall(r"\.entry\s", ptx)) == 3                  # up, down_mma, combine
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16", ptx)) == p["UD"] * p["DNTG"] * 2
    stores = re.findall(r"st\.global(?:\.[a-z0-9:_]+)*", ptx)
    assert "st.global.v4.b32" in stores                                # y and out, 16 bytes per store
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize("arch,tp,b", [("sm_90a", 16, 64), ("sm_90a", 8, 64), ("sm_100a", 16, 32), ("sm_90a", 8, 8)])
def test_down_mma_warp_epilogue_compiles(arch, tp, b, monkeypatch):
    """K3FUSE_MOE_DOWN_WE=1 (the default): the tensor-core down kernel's member scan by warp ballots and its y tiles
    stored per warp. Unset, the sources are WE = 1's (byte for byte); on, the down kernel has exactly the scan's two CTA
    barriers (the default: the scan's two + two per row block pass), a ballot, warp syncs, the same MMAs, 128-bit y
    stores and no local memory."""
    I = I_TP[tp]
    monkeypatch.setenv("K3FUSE_MOE_DOWN_MMA", "1")
    monkeypatch.setenv("K3FUSE_MOE_MEMBER_LISTS", "0")    # the down's own scan (the lists replace it where the up has one)
    monkeypatch.delenv("K3FUSE_MOE_DOWN_WE", raising=False)
    default = me.render_source(E, I, D, KT, b)[0]
    monkeypatch.setenv("K3FUSE_MOE_DOWN_WE", "0")
    off = me.build(E, I, D, KT, b, arch=arch, load=False)
    assert "DWE" not in open(off.files["kernel.py"]).read()
    monkeypatch.setenv("K3FUSE_MOE_DOWN_WE", "1")
    assert me.down_mma(I, D, KT, b, True)["DWE"] and "DWE" not in (me.up_mma(I, D, KT, b, True) or {})
    on = me.build(E, I, D, KT, b, arch=arch, load=False)
    assert open(on.files["kernel.py"]).read() == default
    assert on.key != off.key
    p = me.down_mma(I, D, KT, b, True)
    d_off = entries(open(off.files["kernel.ptx"]).read())["down_mma_kernel"]
    d_on = entries(open(on.files["kernel.ptx"]).read())["down_mma_kernel"]
    bars = r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+0"
    assert len(re.findall(bars, d_on)) == 2 and len(re.findall(bars, d_off)) == 4
    assert "vote.sync.ballot" in d_on and "vote.sync.ballot" not in d_off
    assert re.search(r"\bbar\.warp\.sync", d_on)
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16", d_on)) == p["UD"] * p["DNTG"] * 2
    assert "st.global.v4.b32" in d_on and "ld.local" not in d_on and "st.local" not in d_on


@pytest.mark.parametrize("arch,tp,b", [("sm_90a", 16, 64), ("sm_100a", 8, 32)])
def test_up_mma_ballot_scan_compiles(arch, tp, b, monkeypatch):
    """K3FUSE_MOE_UP_BALLOT=1 (the default): the tensor-core up kernel's member scan by warp ballots. Unset, the
    source is =1's byte for byte, =0's has no ballot scan; on, the up kernel votes, has its MMAs, no local memory."""
    I = I_TP[tp]
    monkeypatch.setenv("K3FUSE_MOE_UP_MMA", "1")
    monkeypatch.delenv("K3FUSE_MOE_UP_BALLOT", raising=False)
    default = me.render_source(E, I, D, KT, b)[0]
    assert me.up_mma(I, D, KT, b, True)["UBAL"]
    monkeypatch.setenv("K3FUSE_MOE_UP_BALLOT", "0")
    assert "UBAL" not in me.up_mma(I, D, KT, b, True) and me.render_source(E, I, D, KT, b)[0] != default
    monkeypatch.setenv("K3FUSE_MOE_UP_BALLOT", "1")
    p = me.up_mma(I, D, KT, b, True)
    assert p["UBAL"]
    k = me.build(E, I, D, KT, b, arch=arch, load=False)
    assert open(k.files["kernel.py"]).read() == default
    up = entries(open(k.files["kernel.ptx"]).read())["up_mma_kernel"]
    assert "vote.sync.ballot" in up and "vote.sync.ballot" not in entries(
        open(me.build(E, I, D, KT, 1, arch=arch, load=False).files["kernel.ptx"]).read())["up_kernel"]
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16", up)) == p["UU"] * 2 * p["NTG"] * 2
    assert "ld.local" not in up and "st.local" not in up


def _opt_in_builds(var, arch, I, b, monkeypatch, default_on=False):
    """The tensor-core up and down (both forced on) built for arch with the variable var "0" and "1": asserts that
    unset renders the source of "1" where default_on, else of "0"; returns (the source on, the PTX entries on, the PTX
    entries off, the kernel on, the kernel off)."""
    monkeypatch.setenv("K3FUSE_MOE_UP_MMA", "1")
    monkeypatch.setenv("K3FUSE_MOE_DOWN_MMA", "1")
    monkeypatch.delenv(var, raising=False)
    default = me.render_source(E, I, D, KT, b)[0]
    monkeypatch.setenv(var, "0")
    assert (me.render_source(E, I, D, KT, b)[0] == default) != default_on
    off = me.build(E, I, D, KT, b, arch=arch, load=False)
    monkeypatch.setenv(var, "1")
    src = me.render_source(E, I, D, KT, b)[0]
    assert (src == default) == default_on and src != open(off.files["kernel.py"]).read()
    k = me.build(E, I, D, KT, b, arch=arch, load=False)
    ks, ks_off = (entries(open(x.files["kernel.ptx"]).read()) for x in (k, off))
    mma = r"mma\.sync\.aligned\.m16n8k16"
    for name in ("up_mma_kernel", "down_mma_kernel"):
        assert len(re.findall(mma, ks[name])) == len(re.findall(mma, ks_off[name]))
        assert "ld.local" not in ks[name] and "st.local" not in ks[name]
    return src, ks, ks_off, k, off


@pytest.mark.parametrize("arch,tp,b", [("sm_90a", 16, 64), ("sm_100a", 8, 32)])
def test_member_lists_compile(arch, tp, b, monkeypatch):
    """K3FUSE_MOE_MEMBER_LISTS=1 (the default since session 35): the tensor-core up writes the down's member lists,
    the down reads them. Unset, the sources are those of 1 byte for byte; on, the down kernel has no ids scan
    (no ballot, one CTA barrier instead of the scan's two), takes the two list tensors, keeps its MMAs, no local
    memory; the up kernel stores the lists. Not taken without the ballot scans."""
    src, ks, ks_off, k, off = _opt_in_builds("K3FUSE_MOE_MEMBER_LISTS", arch, I_TP[tp], b, monkeypatch,
                                              default_on=True)
    assert "mMem[m, j, tidx] = " in src and "mv = mMem[m, j, tidx]" in src
    assert me._scratch_lists[k.key] and not me._scratch_lists[off.key]
    bars = r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+0"
    d, d_off = ks["down_mma_kernel"], ks_off["down_mma_kernel"]
    assert "vote.sync.ballot" in d_off and "vote.sync.ballot" not in d
    assert len(re.findall(bars, d)) == len(re.findall(bars, d_off)) - 1
    st32 = r"st\.global\.u32|st\.global\.b32"
    assert len(re.findall(st32, ks["up_mma_kernel"])) > len(re.findall(st32, ks_off["up_mma_kernel"]))
    monkeypatch.setenv("K3FUSE_MOE_DOWN_WE", "0")
    assert "mMem" not in me.render_source(E, I_TP[tp], D, KT, b)[0]


def test_down_mma_follows_the_table(monkeypatch):
    """The H200 table's DOWNMMA (measured per shape and bucket) picks the down kernel where the variable is unset: on
    at TP16 buckets 32 and 64 and TP8 buckets 8-64, off at TP16 buckets 8 and 16 (measured slower there; bucket 16 is an
    entry holding DOWNMMA alone, so its knobs stay the heuristic's), with its grid cap (DCTAS) where measured; the
    variable overrides it."""
    monkeypatch.delenv("K3FUSE_MOE_DOWN_MMA", raising=False)
    def mma_src(I, b):
        cfg = me.config_for(E, I, D, KT, b, gpu="nvidia_h200")
        return "down_mma_kernel(mA" in me.render_source(E, I, D, KT, b, cfg=cfg)[0]
    assert mma_src(192, 64) and mma_src(192, 32) and all(mma_src(384, b) for b in (8, 16, 32, 64))
    assert not mma_src(192, 8) and not mma_src(192, 16) and not mma_src(192, 1)
    assert {k: v for k, v in me.config_for(E, 192, D, KT, 16, gpu="nvidia_h200").items() if k != "DOWNMMA"} == \
        dict(me.default_config(E, 192, D, KT, 16), KS=2, WD=2, SB=2)   # the variant key beside the layer's knobs
    assert mma_src(384, 4) == (4 >= me.DOWN_MMA_MIN_BUCKET)          # no entry: the heuristic
    # the grid cap: the table's DCTAS = 16384 at TP8 bucket 64 (RPC 2 of 28 row blocks), 8192 at 8 (RPC 1), else
    # DOWN_CTAS (RPC 4 at TP16 bucket 64, 2 at 32); with K3FUSE_MOE_DOWN_WE=0 UP_CTAS (RPC 14 at TP16 bucket 64)
    def rpc(I, b):
        return me.template_params(E, I, D, KT, b, me.config_for(E, I, D, KT, b, gpu="nvidia_h200"), 4.0, 25.0)["RPC"]
    assert (rpc(384, 64), rpc(384, 8), rpc(192, 64), rpc(192, 32), rpc(384, 32)) == (2, 1, 4, 2, 2)
    monkeypatch.setenv("K3FUSE_MOE_DOWN_WE", "0")
    assert (rpc(384, 64), rpc(192, 64)) == (2, 14)
    monkeypatch.delenv("K3FUSE_MOE_DOWN_WE")
    # the tensor-core up's column blocks per CTA: the table's UCTAS = 16384 at TP8 bucket 64 (CPC 2 of 24), else
    # UP_MMA_CTAS (CPC 2 at TP16 bucket 64, 1 at 32); with K3FUSE_MOE_UP_BALLOT=0 UP_CTAS (CPC 4 at TP16 bucket 64)
    def up_cpc(I, b):
        return me.template_params(E, I, D, KT, b, me.config_for(E, I, D, KT, b, gpu="nvidia_h200"), 4.0, 25.0)["CPC"]
    assert (up_cpc(384, 64), up_cpc(192, 64), up_cpc(192, 32), up_cpc(384, 32)) == (2, 2, 1, 2)
    monkeypatch.setenv("K3FUSE_MOE_UP_BALLOT", "0")
    assert (up_cpc(384, 64), up_cpc(192, 64)) == (2, 4)
    # the launch passes the y scratch exactly where the kernel takes it (decided at build, from the same config)
    for I, b in ((384, 8), (192, 8)):
        k = me.build(E, I, D, KT, b, cfg=me.config_for(E, I, D, KT, b, gpu="nvidia_h200"), arch="sm_90a", load=False)
        assert me._scratch_y[k.key] == mma_src(I, b)
    monkeypatch.setenv("K3FUSE_MOE_DOWN_MMA", "1")
    assert mma_src(192, 8)
    monkeypatch.setenv("K3FUSE_MOE_DOWN_MMA", "0")
    assert not mma_src(384, 64)


def test_down_mma_knobs_say_what_is_wrong(monkeypatch):
    """The down kernel's A/B knobs: a value that is not an integer, or a UD that does not divide the k-steps, is an
    error naming the variable, not a silent fallback."""
    monkeypatch.setenv("K3FUSE_MOE_DOWN_MMA", "1")
    monkeypatch.setenv("K3FUSE_MOE_DOWN_CTAS", "lots")
    with pytest.raises(ValueError, match="K3FUSE_MOE_DOWN_CTAS='lots'"):
        me.down_mma(192, D, KT, 64, True)
    monkeypatch.delenv("K3FUSE_MOE_DOWN_CTAS")
    monkeypatch.setenv("K3FUSE_MOE_DOWN_UD", "12")                  # I / 8 = 24 is not a multiple of 48
    with pytest.raises(ValueError, match="K3FUSE_MOE_DOWN_UD=12"):
        me.down_mma(192, D, KT, 64, True)
    monkeypatch.setenv("K3FUSE_MOE_DOWN_UD", "6")
    assert me.down_mma(192, D, KT, 64, True)["UD"] == 6


def test_config_override_lays_knobs_over_the_table(monkeypatch):
    """K3FUSE_MOE_CONFIG (layer_ab's way to A/B a config): its knobs replace the table's, the rest and the variant
    keys stay; "table" means none; an unknown knob, a non-integer or an unsupported config is an error naming it."""
    table = me.config_for(E, 384, D, KT, 1, gpu="nvidia_h200")
    ks = 4 if table["KS"] == 2 else 2
    monkeypatch.setenv("K3FUSE_MOE_CONFIG", f"KS={ks}:SB=1")
    got = me.config_for(E, 384, D, KT, 1, gpu="nvidia_h200")
    assert got == dict(table, KS=ks, SB=1) and got["KS"] != table["KS"]
    assert me.config_for(E, 192, D, KT, 64, gpu="nvidia_h200")["UPMMA"] == 1      # variant keys kept
    monkeypatch.setenv("K3FUSE_MOE_CONFIG", "table")
    assert me.config_for(E, 384, D, KT, 1, gpu="nvidia_h200") == table
    for bad in ("KS", "XX=1", "KS=two", "KS=2,SB=1"):
        monkeypatch.setenv("K3FUSE_MOE_CONFIG", bad)
        with pytest.raises(ValueError, match="K3FUSE_MOE_CONFIG"):
            me.config_for(E, 384, D, KT, 1, gpu="nvidia_h200")
    monkeypatch.setenv("K3FUSE_MOE_CONFIG", "KS=3")                 # 16 slots do not split into 3 groups
    with pytest.raises(ValueError, match="K3FUSE_MOE_CONFIG='KS=3'"):
        me.config_for(E, 384, D, KT, 1, gpu="nvidia_h200")


def test_fallback_on_cpu_logs_once(caplog):
    from k3fuse import ops
    from k3fuse.codegen import registry
    torch.manual_seed(0)
    M, E_, D_, I_, K_ = 3, 6, 64, 16, 2
    z = torch.randn(M, D_).bfloat16()
    ids = torch.stack([torch.randperm(E_)[:K_] for _ in range(M)])
    w = torch.rand(M, K_)
    w13 = (torch.randn(E_, 2 * I_, D_) * D_ ** -0.5).bfloat16()
    w2 = (torch.randn(E_, D_, I_) * I_ ** -0.5).bfloat16()
    registry._seen.discard(("k3fuse::moe_experts", "tensor on cpu, not CUDA"))
    with caplog.at_level(logging.INFO, logger="k3fuse.codegen"):
        out = me.moe_experts_cuda(z, ids, w, w13, w2, 4.0, 25.0)
        out2 = me.moe_experts_cuda(z, ids, w, w13, w2, 4.0, 25.0)
    ref = ops.moe_experts._init_fn(z, ids, w, w13, w2, 4.0, 25.0)
    assert torch.equal(out, ref) and torch.equal(out2, ref)
    lines = [r for r in caplog.records if "k3fuse::moe_experts" in r.getMessage()]
    assert len(lines) == 1
    assert me.IMPLS == {"k3fuse::moe_experts": me.moe_experts_cuda}


def test_tuned_config_lookup(monkeypatch):
    """codegen/tuning/<gpu>.json entries for moe_experts are used where the kernels take them; a table entry the
    kernels cannot take, or no entry, gives the heuristic default."""
    from k3fuse.codegen import moe_experts as me
    from k3fuse.codegen import tuning
    E, I, D, KT = 896, 384, 3584, 16
    tuned = dict(me.default_config(E, I, D, KT, 64), CPC=4, W=4)
    tables = {"gpu_a": {f"moe_experts:{E}x{I}x{D}x{KT}": {"64": dict(tuned, kernel_us=1.0)}},
              "gpu_b": {f"moe_experts:{E}x{I}x{D}x{KT}": {"64": dict(tuned, R=4, CPC=64)}}}   # I % (R * CPC) != 0
    monkeypatch.setattr(tuning, "load_table", lambda gpu: tables.get(gpu, {}))
    # a fresh memo for the patched tables (restored after the test: no patched answer outlives it)
    monkeypatch.setattr(me, "_config_for", functools.lru_cache(maxsize=None)(me._config_for.__wrapped__))
    assert me.config_for(E, I, D, KT, 64, gpu="gpu_a") == tuned
    assert me.config_for(E, I, D, KT, 64, gpu="gpu_b") == me.default_config(E, I, D, KT, 64)
    assert me.config_for(E, I, D, KT, 8, gpu="gpu_a") == me.default_config(E, I, D, KT, 8)
    assert me.config_for(E, I, D, KT, 64, gpu="no_such_gpu") == me.default_config(E, I, D, KT, 64)
    # knobs A/B'd in the layer (LAYER_KEY) override the sweep's; its "why" is not a knob
    tables["gpu_c"] = {f"moe_experts:{E}x{I}x{D}x{KT}": {"64": dict(tuned, layer={"KS": 4, "why": "layer_ab"})}}
    assert me.config_for(E, I, D, KT, 64, gpu="gpu_c") == dict(tuned, KS=4)
    # an entry with a variant key and layer knobs but no sweep config: the layer knobs go onto the default
    # (session 20: they were dropped with the incomplete config, and the layer ran the default)
    tables["gpu_d"] = {f"moe_experts:{E}x{I}x{D}x{KT}": {"8": dict(UPMMA=1, layer={"KS": 2, "WD": 2, "why": "x"})}}
    assert me.config_for(E, I, D, KT, 8, gpu="gpu_d") == dict(me.default_config(E, I, D, KT, 8), KS=2, WD=2, UPMMA=1)
    # layer knobs the kernels do not take (KT not a multiple of SB x KS) are ignored, the base stays
    tables["gpu_e"] = {f"moe_experts:{E}x{I}x{D}x{KT}": {"64": dict(tuned, layer={"KS": 4, "SB": 8, "why": "x"})}}
    assert me.config_for(E, I, D, KT, 64, gpu="gpu_e") == tuned


def test_layer_measured_knobs_survive_a_sweep(monkeypatch, tmp_path):
    """moe_sweep --write-table rewrites an entry's knobs with the sweep's winner but keeps the variant keys and the
    knobs measured in the layer (the H200 table's TP8 bucket-1 KS = 4: the sweep ranks it slower, the layer faster)."""
    import json
    import pathlib
    import sys
    from k3fuse.codegen import tuning
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import moe_sweep
    assert me.config_for(E, 384, D, KT, 1, gpu="nvidia_h200")["KS"] == 4      # the shipped table's layer knob
    assert me.config_for(E, 384, D, KT, 2, gpu="nvidia_h200")["LPR"] == 16    # on an entry without sweep knobs
    key = f"moe_experts:{E}x384x{D}x{KT}"
    (tmp_path / "gpu_x.json").write_text(json.dumps({"gpu": "GPU X", "entries": {key: {"1": dict(
        me.default_config(E, 384, D, KT, 1), KS=1, UPMMA=0, layer={"KS": 4, "why": "layer_ab"})}}}))
    monkeypatch.setattr(tuning, "TABLE_DIR", tmp_path)
    monkeypatch.setattr(tuning, "gpu_slug", lambda name: "gpu_x")
    win = dict(me.default_config(E, 384, D, KT, 1), KS=1, WD=8)
    trial = lambda cfg, us: dict(tp=8, M=1, cfg=cfg, us_uniform=us, us_model=us, us=2 * us)
    res = {"gpu": "GPU X", "trials": [trial(win, 40.0), trial(me.default_config(E, 384, D, KT, 1), 41.0)],
           "best": {"tp8 M=1": dict(default=me.default_config(E, 384, D, KT, 1), default_us=82.0, best=win,
                                    best_us=80.0, routings=["uniform", "model"])}}
    moe_sweep.write_table(res)
    got = json.loads((tmp_path / "gpu_x.json").read_text())["entries"][key]["1"]
    assert got["WD"] == 8 and got["KS"] == 1 and got["UPMMA"] == 0 and got["layer"] == {"KS": 4, "why": "layer_ab"}


def _down_sass(k, entry="down_kernel"):
    """The SASS ops of kernel entry `entry` (the down kernel unless named; None without nvdisasm)."""
    import subprocess
    from test_codegen_compile import _nvdisasm
    nd = _nvdisasm()
    if nd is None:
        return None
    sass = subprocess.run([nd, "-c", k.files["kernel.cubin"]], capture_output=True, text=True, check=True).stdout
    f = next(part for part in re.split(r"\n\s*\.text\.", sass) if part.startswith(f"kernel_cutlass_{entry}"))
    return re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", f)


@pytest.mark.parametrize("tp,b,ks,wd,lpr", [(16, 1, 4, 2, 8), (8, 1, 4, 4, 8), (8, 2, 2, 2, 16)])
def test_down_ax_loads_ahead(tp, b, ks, wd, lpr, monkeypatch):
    """K3FUSE_MOE_DOWN_AX=1: where a lane's W2 vectors fit MAX_AX_VECTORS, the down kernel stages the token's
    activations in shared memory (one CTA barrier before the FMAs) and, in the SASS, issues every 128-bit load
    before its first FMA (the default kernel: 3-5); beyond the limit (KS = 1 at TP8: 48 vectors) the SB batches
    render as before, as where the CTA's register share is too small. No local memory either way. (AXB = 0: all of
    a lane's slots at once, where AX_MEASURED would batch them.)"""
    monkeypatch.setenv("K3FUSE_MOE_DOWN_MMA", "0")
    monkeypatch.setenv("K3FUSE_MOE_DOWN_AXB", "0")
    I = I_TP[tp]
    cfg = dict(me.default_config(E, I, D, KT, b), KS=ks, WD=wd, SB=1, LPR=lpr, RT=1)     # the H200 table's
    monkeypatch.setenv("K3FUSE_MOE_DOWN_AX", "1")
    assert not me.down_ax(I, KT, dict(cfg, WD=8, KS=4), b)     # 1024 threads: 64 registers each, no room for 12+
    monkeypatch.setenv("K3FUSE_MOE_DOWN_AX", "0")
    plain = me.build(E, I, D, KT, b, cfg=cfg, arch="sm_90a", load=False)
    monkeypatch.setenv("K3FUSE_MOE_DOWN_AX", "1")
    assert me.down_ax(I, KT, cfg, b)
    big = dict(cfg, KS=1)                      # 16 slots x VPL vectors: over the limit, so the SB batches
    assert not me.down_ax(I, KT, big, b)
    with_ax = me.render_source(E, I, D, KT, b, cfg=big)[0]
    monkeypatch.setenv("K3FUSE_MOE_DOWN_AX", "0")
    assert me.render_source(E, I, D, KT, b, cfg=big)[0] == with_ax
    monkeypatch.setenv("K3FUSE_MOE_DOWN_AX", "1")
    k = me.build(E, I, D, KT, b, cfg=cfg, arch="sm_90a", load=False)
    assert "sA = smem.allocate_tensor(BFloat16" in k.source and "sA = smem" not in plain.source
    for kk in (k, plain):
        assert "ld.local" not in open(kk.files["kernel.ptx"]).read()
    ops = _down_sass(k)
    if ops is None:
        pytest.skip("nvdisasm not installed: the SASS order is not checked")
    nvec = (KT // ks) * ((I // 8) // lpr)
    first = next(i for i, o in enumerate(ops) if o.startswith("FFMA"))
    ahead = sum(1 for o in ops[:first] if o.startswith("LDG") and "128" in o)
    assert ahead >= nvec, (ahead, nvec)
    pops = _down_sass(plain)
    pfirst = next(i for i, o in enumerate(pops) if o.startswith("FFMA"))
    assert sum(1 for o in pops[:pfirst] if o.startswith("LDG") and "128" in o) < nvec // 2
    assert not any(o in ("STL", "LDL") for o in ops)


@pytest.mark.parametrize("tp,ks,wd,lpr,axb", [(8, 4, 4, 8, 1), (16, 4, 2, 8, 1), (8, 4, 4, 8, 2)])
def test_down_axb_batches(tp, ks, wd, lpr, axb, monkeypatch, tmp_path, capfd):
    """K3FUSE_MOE_DOWN_AXB=N (with AX): 0, N >= KT / KS or N not dividing it: plain AX; else the down kernel loads all
    ids first, then per batch its W2 vectors behind one CTA barrier each (KSL / N, plus the slot groups' sum); compiled for sm_90a without spills, within 64 registers at N = 1 (two
    512-thread CTAs per SM, where AX takes 122 at TP8) and, with nvdisasm, a round-trip chain of at most KSL / N + 1
    (the SB kernel's at TP8 bucket 1: 23, codegen/sass.py)."""
    from k3fuse.codegen import sass
    monkeypatch.setenv("K3FUSE_MOE_DOWN_MMA", "0")
    monkeypatch.setenv("K3FUSE_MOE_DOWN_AX", "1")
    monkeypatch.setenv("K3FUSE_MOE_DOWN_EARLY", "0")     # the batches' own form (EARLY peels batch 0: its own test)
    I, b, ksl = I_TP[tp], 1, KT // ks
    cfg = dict(me.default_config(E, I, D, KT, b), KS=ks, WD=wd, SB=1, LPR=lpr, RT=1)
    monkeypatch.setenv("K3FUSE_MOE_DOWN_AXB", "0")
    ax = me.render_source(E, I, D, KT, b, cfg=cfg)[0]
    assert "AXB" not in ax
    for v in (str(ksl), "3"):
        monkeypatch.setenv("K3FUSE_MOE_DOWN_AXB", v)
        assert me.down_axb(I, b, ksl) == 0 and me.render_source(E, I, D, KT, b, cfg=cfg)[0] == ax
    monkeypatch.setenv("K3FUSE_MOE_DOWN_AXB", str(axb))
    src = me.render_source(E, I, D, KT, b, cfg=cfg)[0]
    assert f"AXB = {axb} " in src and src != ax
    down = src[src.index("def down_kernel"):src.index("def ENTRY")]
    assert down.count("cute.arch.barrier()") == 1 + (ks > 1)          # one in the batch loop (unrolled), the sum's
    regs, st, ld = ptxas_report(src, f"axb_{tp}_{axb}", "sm_90a", tmp_path, capfd)["down_kernel"]
    assert st == ld == 0 and (regs <= 64 or axb > 1)
    k = me.build(E, I, D, KT, b, cfg=cfg, arch="sm_90a", load=False)
    assert k.source == src and "ld.local" not in open(k.files["kernel.ptx"]).read()
    if sass.find_disassembler() is None:
        pytest.skip("no nvdisasm / cuobjdump: the SASS is not read")
    (r,) = sass.read(k.files["kernel.cubin"], "down_kernel")
    assert r.path <= ksl // axb + 1


def test_down_ax_follows_the_measured_rule(monkeypatch):
    """Unset, K3FUSE_MOE_DOWN_AX takes AX_MEASURED: on at TP8 (I = 384) buckets 1, 2 and 4, where the layer measured it
    faster (bucket 1 with AXB), off at TP16; =1 forces it where the vectors fit, =0 never."""
    monkeypatch.delenv("K3FUSE_MOE_DOWN_AX", raising=False)
    cfg8 = dict(me.default_config(E, 384, D, KT, 2), KS=2, WD=2, LPR=16, RT=1, SB=1)
    cfg16 = dict(me.default_config(E, 192, D, KT, 1), KS=4, WD=2, LPR=8, RT=1, SB=1)
    assert me.down_ax(384, KT, cfg8, 2) and me.down_ax(384, KT, cfg8, 4) and me.down_ax(384, KT, cfg8, 1)
    assert not me.down_ax(192, KT, cfg16, 1) and not me.down_ax(192, KT, cfg16, 2)
    assert "sA = smem" in me.render_source(E, 384, D, KT, 2, cfg=cfg8)[0]
    assert "sA = smem" not in me.render_source(E, 192, D, KT, 1, cfg=cfg16)[0]
    monkeypatch.setenv("K3FUSE_MOE_DOWN_AX", "1")
    assert me.down_ax(192, KT, cfg16, 1)
    monkeypatch.setenv("K3FUSE_MOE_DOWN_AX", "0")
    assert not me.down_ax(384, KT, cfg8, 2)


def test_down_axb_follows_the_measured_rule(monkeypatch):
    """Unset, K3FUSE_MOE_DOWN_AXB takes AX_MEASURED's entry: one slot per batch at TP8 (I = 384) buckets 1 and 2 (session
    41's A/Bs), all at once elsewhere (TP8 bucket 4, TP16); =N forces N. The TP8 bucket-1 down at the H200 table's
    layer config (KS = 4, LPR = 8, WD = 4) renders with AX and AXB = 1; TP16's (WD = 2) without AX."""
    monkeypatch.delenv("K3FUSE_MOE_DOWN_AXB", raising=False)
    monkeypatch.delenv("K3FUSE_MOE_DOWN_AX", raising=False)
    assert me.down_axb(384, 1, 4) == 1 and me.down_axb(384, 2, 4) == 1
    assert me.down_axb(384, 4, 4) == 0 and me.down_axb(192, 1, 4) == 0
    cfg8 = dict(me.default_config(E, 384, D, KT, 1), KS=4, WD=4, LPR=8, RT=1, SB=1)
    cfg16 = dict(me.default_config(E, 192, D, KT, 1), KS=4, WD=2, LPR=8, RT=1, SB=4)
    src8 = me.render_source(E, 384, D, KT, 1, cfg=cfg8)[0]
    assert "AXB = 1 " in src8 and "AXB" not in me.render_source(E, 192, D, KT, 1, cfg=cfg16)[0]
    monkeypatch.setenv("K3FUSE_MOE_DOWN_AXB", "2")
    assert me.down_axb(384, 1, 4) == 2 and me.down_axb(192, 1, 4) == 2
    assert "AXB = 2 " in me.render_source(E, 384, D, KT, 1, cfg=cfg8)[0]
    monkeypatch.setenv("K3FUSE_MOE_DOWN_AXB", "0")
    assert me.down_axb(384, 1, 4) == 0 and "AXB" not in me.render_source(E, 384, D, KT, 1, cfg=cfg8)[0]


@pytest.mark.parametrize("axb", [1, 0])
def test_down_early_loads_before_the_wait(axb, monkeypatch, tmp_path, capfd):
    """K3FUSE_MOE_DOWN_EARLY=1 (the default there since session 46): at TP8 bucket 1 (the H200 table's layer config: KS = 4, WD = 4, LPR = 8,
    AX with AXB = 1, or all at once with AXB = 0) the down kernel issues its ids, routing weights and first W2 batch
    before griddepcontrol.wait, a's loads after it; the simt up waits before it triggers. Checked in the machine code
    (ptxas may sink loads past the wait, CUTEDSL.md pitfall 3): SASS ACQBULK = wait, PREEXIT = trigger. With =0,
    or without the PDL chain, or with the tensor-core up (bucket 2), the sources are AX's; 64 registers at
    AXB = 1 (two 512-thread CTAs per SM), no spills."""
    monkeypatch.setenv("K3FUSE_MOE_DOWN_MMA", "0")
    monkeypatch.setenv("K3FUSE_MOE_DOWN_AX", "1")
    monkeypatch.setenv("K3FUSE_MOE_DOWN_AXB", str(axb))
    monkeypatch.delenv("K3FUSE_PDL_CHAIN", raising=False)
    I, b, ks, lpr = 384, 1, 4, 8
    cfg = dict(me.default_config(E, I, D, KT, b), KS=ks, WD=4, SB=1, LPR=lpr, RT=1)
    monkeypatch.setenv("K3FUSE_MOE_DOWN_EARLY", "0")
    base = me.render_source(E, I, D, KT, b, cfg=cfg)[0]
    monkeypatch.setenv("K3FUSE_MOE_DOWN_EARLY", "1")
    src = me.render_source(E, I, D, KT, b, cfg=cfg)[0]
    assert src != base and "EARLY=True" in src.split("\n")[1] and "EARLY" not in base.split("\n")[1]
    monkeypatch.delenv("K3FUSE_MOE_DOWN_EARLY")
    assert me.render_source(E, I, D, KT, b, cfg=cfg)[0] == src          # the default at TP8 bucket 1 (EARLY_MEASURED)
    monkeypatch.setenv("K3FUSE_MOE_DOWN_EARLY", "1")
    up = src[src.index("def up_kernel"):src.index("def down_kernel")]
    assert up.index("griddepcontrol_wait()") < up.index("griddepcontrol_launch_dependents()")
    down = src[src.index("def down_kernel"):src.index("def ENTRY")]
    assert down.index("griddepcontrol_launch_dependents()") < down.index("mIds[") < down.index("gW[") \
        < down.index("griddepcontrol_wait()") < down.index("gA[")
    # not rendered without the chain, nor where the tensor-core up keeps its trigger at the start
    monkeypatch.setenv("K3FUSE_PDL_CHAIN", "0")
    assert "EARLY" not in me.render_source(E, I, D, KT, b, cfg=cfg)[0].split("\n")[1]
    monkeypatch.delenv("K3FUSE_PDL_CHAIN")
    assert not me.down_early(dict(me.template_params(E, I, D, KT, b, cfg, 4.0, 25.0), UPMMA=True))
    regs, st, ld = ptxas_report(src, f"early_{axb}", "sm_90a", tmp_path, capfd)["down_kernel"]
    assert st == ld == 0 and (regs <= 64 or axb == 0), regs
    k = me.build(E, I, D, KT, b, cfg=cfg, arch="sm_90a", load=False)
    assert k.source == src and "ld.local" not in open(k.files["kernel.ptx"]).read()
    ops = _down_sass(k)
    if ops is None:
        pytest.skip("no nvdisasm / cuobjdump: the SASS is not read")
    wait = ops.index("ACQBULK")
    vpl, ksl = (I // 8) // lpr, KT // ks
    first = vpl * (axb or ksl)                              # batch 0's W2 vectors
    assert sum(1 for o in ops[:wait] if o.startswith("LDG") and "128" in o) == first
    assert sum(1 for o in ops[:wait] if o.startswith("LDG")) == first + 2 * ksl      # + the ids and weights
    assert ops.index("PREEXIT") < wait
    upops = _down_sass(k, "up_kernel")
    assert upops.index("ACQBULK") < upops.index("PREEXIT") and not any(o.startswith("LDG") for o in
                                                                         upops[:upops.index("ACQBULK")])


def test_down_early_follows_the_measured_rule(monkeypatch):
    """Unset, K3FUSE_MOE_DOWN_EARLY takes EARLY_MEASURED: on at TP8 bucket 1 (session 46's A/B), off at TP16 bucket 1
    even with AX forced (AX + EARLY measured noise there) and at TP8 bucket 2 (the tensor-core up); =1 forces it where
    the down is the AX kernel and the up the simt one, =0 never."""
    monkeypatch.delenv("K3FUSE_MOE_DOWN_EARLY", raising=False)
    monkeypatch.delenv("K3FUSE_MOE_DOWN_AX", raising=False)
    monkeypatch.delenv("K3FUSE_MOE_DOWN_AXB", raising=False)
    monkeypatch.delenv("K3FUSE_PDL_CHAIN", raising=False)
    cfg8 = dict(me.default_config(E, 384, D, KT, 1), KS=4, WD=4, LPR=8, RT=1, SB=1)
    cfg16 = dict(me.default_config(E, 192, D, KT, 1), KS=4, WD=2, LPR=8, RT=1, SB=4)

    def early(I, cfg):
        return me.down_early(me.template_params(E, I, D, KT, 1, cfg, 4.0, 25.0))
    assert early(384, cfg8) and not early(192, cfg16)
    monkeypatch.setenv("K3FUSE_MOE_DOWN_AX", "1")
    assert not early(192, cfg16)
    monkeypatch.setenv("K3FUSE_MOE_DOWN_EARLY", "1")
    assert early(192, cfg16)
    monkeypatch.setenv("K3FUSE_MOE_DOWN_AX", "0")
    assert not early(384, cfg8)                       # no AX kernel: nothing to move
    monkeypatch.delenv("K3FUSE_MOE_DOWN_AX")
    monkeypatch.setenv("K3FUSE_MOE_DOWN_EARLY", "0")
    assert not early(384, cfg8)
    monkeypatch.delenv("K3FUSE_MOE_DOWN_EARLY")
    assert not me.down_early(dict(me.template_params(E, 384, D, KT, 2, cfg8, 4.0, 25.0), UPMMA=True))
    # forced on, still not behind the tensor-core up (its trigger stays at its start: session 47 measured the moved
    # trigger and removed it) nor with the tensor-core down
    monkeypatch.setenv("K3FUSE_MOE_DOWN_EARLY", "1")
    p2 = dict(me.template_params(E, 384, D, KT, 2, cfg8, 4.0, 25.0), AX=True)
    assert me.down_early(p2) and not me.down_early(dict(p2, UPMMA=True)) and not me.down_early(dict(p2, DOWNMMA=True))
