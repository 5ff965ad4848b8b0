"""Generated kernels compile for sm_90a and sm_100a without a GPU (CPU CI), and their PTX has what we meant."""
import json
import re

import pytest

pytest.importorskip("cutlass")

from k3fuse.codegen import compile as kcompile  # noqa: E402
from k3fuse.codegen import fused_residual_norm as frn  # noqa: E402
from k3fuse.codegen import gemv, prefetch  # noqa: E402
from k3fuse.codegen.cache import KernelCache  # noqa: E402

ARCHES = ["sm_90a", "sm_100a"]


pytestmark = pytest.mark.usefixtures("isolated_kernel_cache")


def ptx_of(k):
    return open(k.files["kernel.ptx"]).read()


def global_loads(ptx):
    return set(re.findall(r"ld\.global(?:\.[a-z0-9:_]+)*", ptx))


def is_128bit(load):
    """ld.global[.qualifiers].vN.{b,u,s,f}BITS with N * BITS == 128."""
    m = re.search(r"\.v(\d)\.[bsuf](\d+)$", load)
    return bool(m) and int(m.group(1)) * int(m.group(2)) == 128


# (N, K, bucket, variant): a representative set of K3 per-rank shapes (K3_MODEL.md section 8) x buckets
GEMV_CASES = [(7168, 1536, 1, "simt"), (2304, 1536, 4, "simt"), (6288, 7168, 8, "mma"), (768, 128, 64, "mma")]


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("N,K,b,variant", GEMV_CASES)
def test_gemv_compiles_with_128bit_loads(arch, N, K, b, variant):
    cfg = next(c for c in gemv.candidates(N, K, b) if c["variant"] == variant)
    k = gemv.build(N, K, b, cfg, arch=arch, load=False)
    assert {"kernel.py", "kernel.ptx", "kernel.cubin"} <= set(k.files)
    ptx = ptx_of(k)
    assert f".target {arch}" in ptx
    loads = global_loads(ptx)
    assert loads and all(is_128bit(l) for l in loads), f"non-128-bit global loads: {loads}"
    if variant == "mma":
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx  # no register spills to local memory


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("N,K,b,fusion", [(1536, 7168, 1, dict(norm=True, x_fp32=True, act="situ")),
                                          (2112, 7168, 4, dict(norm=True)), (768, 7168, 2, dict(act="situ")),
                                          (7168, 3584, 1, dict(norm=True, x_fp32=True))])
def test_gemv_fusions_compile(arch, N, K, b, fusion):
    k = gemv.build(N, K, b, fusion=fusion, arch=arch, load=False)
    ptx = ptx_of(k)
    loads = global_loads(ptx)
    assert loads and all(is_128bit(l) for l in loads), f"non-128-bit global loads: {loads}"
    assert "ld.local" not in ptx and "st.local" not in ptx
    if fusion.get("act") == "situ":
        assert "tanh" in ptx or "ex2" in ptx


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("nb,addend,prefix,fp32,pair", [(3, False, True, False, False), (8, True, False, True, False),
                                                        (2, True, True, True, True)])
def test_fused_residual_norm_compiles(arch, nb, addend, prefix, fp32, pair):
    k = frn.build_mix_norm(7168, nb, addend, prefix, True, fp32, 1e-5, 1e-5, arch=arch, load=False, wm_pair=pair)
    ptx = ptx_of(k)
    loads = global_loads(ptx)
    assert loads and all(is_128bit(l) for l in loads), f"non-128-bit global loads: {loads}"
    assert "st.global.v4.b32" in ptx


def _fresh_mix_norm(nb, addend, prefix, arch):
    """The mix-norm kernel (H = 7168, the norm fused in fp32, w_mix as a pair) built with the knobs of the moment:
    the memos cleared before and after (the cluster knobs are read when rendering, not part of the memo key)."""
    kcompile.clear_memo()
    frn._built.clear()
    try:
        return frn.build_mix_norm(7168, nb, addend, prefix, True, True, 1e-5, 1e-5, arch=arch, load=False,
                                  wm_pair=True)
    finally:
        kcompile.clear_memo()
        frn._built.clear()


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("cl,nb,addend,prefix", [(4, 3, False, True), (8, 8, True, True), (4, 0, True, False),
                                                  (7, 2, False, True)])
def test_mix_norm_cluster_compiles(arch, cl, nb, addend, prefix, monkeypatch):
    """K3FUSE_MIXNORM_CLUSTER=cl: one row per cluster of cl CTAs, the reductions summed over DSMEM (mapa +
    ld.shared::cluster) between cluster barriers; the PDL chain's wait still precedes every global access.
    K3FUSE_MIXNORM_CLUSTER=1 renders the one-CTA kernel (no cluster code). The loads' variant
    (K3FUSE_MIXNORM_PUSH=0; the pushes: the test above)."""
    monkeypatch.setenv("K3FUSE_MIXNORM_PUSH", "0")
    monkeypatch.setenv("K3FUSE_MIXNORM_CLUSTER", "1")
    monkeypatch.setenv("K3FUSE_PDL_CHAIN", "1")
    src1 = frn.render_mixnorm(7168, nb, addend, prefix, True, True, 1e-5, 1e-5, wm_pair=True)
    assert "CL =" not in src1 and "cluster" not in src1.split('"""')[-1]
    monkeypatch.setenv("K3FUSE_MIXNORM_CLUSTER", str(cl))
    k = _fresh_mix_norm(nb, addend, prefix, arch)
    assert f"CL = {cl} " in k.source and "cluster=[CL, 1, 1]" in k.source
    ptx = ptx_of(k)
    reads = ptx.count("ld.shared::cluster")
    assert ptx.count("mapa.shared::cluster") == reads == cl * (2 if nb > 0 else 1)
    assert ptx.count("barrier.cluster.arrive") == (3 if nb > 0 else 2) == ptx.count("barrier.cluster.wait")
    wait = ptx.find("griddepcontrol.wait")
    assert 0 <= wait < ptx.find("ld.global") and wait < ptx.find("st.global")
    loads = global_loads(ptx)
    assert loads and all(is_128bit(l) for l in loads), f"non-128-bit global loads: {loads}"
    assert "ld.local" not in ptx and "st.local" not in ptx
    # each CTA takes 7168 / 8 / cl of the row's 16-byte vectors
    assert f"HVC = {896 // cl} " in k.source
    nd = _nvdisasm()
    if nd is not None and arch == "sm_90a":    # no register spills (the one-CTA kernel spills from nb = 5: PERF_NOTES)
        import subprocess
        sass = subprocess.run([nd, "-c", k.files["kernel.cubin"]], capture_output=True, text=True, check=True).stdout
        assert not re.search(r"\b(STL|LDL)\b", sass)
    # no cluster where it does not divide the row or there is no norm: the one-CTA kernel
    assert "CL" not in frn.mixnorm_params(7168, nb, addend, prefix, False, True, 1e-5, 1e-5, cl=cl)
    assert "CL" not in frn.mixnorm_params(7168 - 8, nb, addend, prefix, True, True, 1e-5, 1e-5, cl=cl)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("cl,nb", [(8, 3), (4, 0), (8, 8)])
def test_mix_norm_push_compiles(arch, cl, nb, monkeypatch):
    """K3FUSE_MIXNORM_PUSH=1: the CTAs' totals st.async'd into every peer (CL per gathered value: 2 x NS statistics
    by as many threads, then the norm's sum) on two mbarriers; one relaxed cluster barrier (their init), no
    ld.shared::cluster, no MEMBAR in the SASS."""
    monkeypatch.setenv("K3FUSE_MIXNORM_CLUSTER", str(cl))
    monkeypatch.setenv("K3FUSE_MIXNORM_PUSH", "1")
    monkeypatch.setenv("K3FUSE_PDL_CHAIN", "1")
    k = _fresh_mix_norm(nb, True, True, arch)
    ptx = ptx_of(k)
    assert ptx.count("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32") == cl * (2 if nb > 0 else 1)
    assert "ld.shared::cluster" not in ptx and ptx.count("mbarrier.init") == 2
    assert ptx.count("barrier.cluster.arrive") == 1 == ptx.count("barrier.cluster.arrive.relaxed")
    assert ptx.count("barrier.cluster.wait") == 1
    wait = ptx.find("griddepcontrol.wait")
    assert 0 <= wait < ptx.find("ld.global") and wait < ptx.find("st.global")
    nd = _nvdisasm()
    if nd is not None and arch == "sm_90a":
        import subprocess
        sass = subprocess.run([nd, "-c", k.files["kernel.cubin"]], capture_output=True, text=True, check=True).stdout
        assert "MEMBAR" not in sass and not re.search(r"\b(STL|LDL)\b", sass)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("K,nb,addend,prefix,pair,bm", [(768, 2, False, True, True, 1), (384, 8, True, True, True, 1),
                                                        (1536, 0, True, False, False, 1),
                                                        (768, 2, False, True, True, 2), (384, 8, True, True, True, 4),
                                                        (1536, 5, True, True, False, 4)])
def test_fused_residual_norm_one_kernel_compiles(arch, K, nb, addend, prefix, pair, bm, monkeypatch):
    """The one-launch kernel (bucket bm = 1, 2, 4): its weight and x loads 128-bit, ITERS x (RPW + bm) of them (the
    weights once for all rows), all before the PDL trigger and after the wait; the columns' sources of every row
    loaded before the main loop; one fp32 reduction into the accumulators, one release arrival, one acquire poll with
    a nanosleep, no local memory (bm = 4 at 8 blocks: 4 x 54 statistics); 128 CTAs x 8 warps x 7 rows = 7168."""
    monkeypatch.delenv("K3FUSE_PDL_CHAIN", raising=False)
    monkeypatch.setenv("K3FUSE_FRN_PRELOAD", "0")       # the interleaved loop (1 / 2: the test below)
    k = frn.build_one(7168, K, nb, addend, prefix, False, 1e-6, 1e-5, pair, arch=arch, load=False, bm=bm)
    ptx = ptx_of(k)
    v4 = [m.start() for m in re.finditer(r"ld\.global(?:\.[a-z0-9:_]+)*\.v4\.", ptx)]
    iters = -(-(K // 8) // 32)
    assert len(v4) == iters * (7 + bm) and "RPW = 7" in k.source and "G = 128" in k.source
    assert f"BM = {bm} " in k.source and f"ACCT = {frn.ONE_ACCT} " in k.source
    # bucket 1: only the column warps reduce; buckets 2 / 4: the (row, column) pairs over all 8 warps (56 columns
    # padded to 64: 4 rows per pass, so one pass), each warp reducing one row's statistics
    npass = 1 if bm == 1 else -(-bm // (256 // 64))
    if bm == 1:
        assert "NWC = (CR + 31) // 32" in k.source and "if warp < NWC:" in k.source
    else:
        assert "RPP = THREADS // CRP" in k.source and "sRed[warp % NWC, m * NSTAT + i]" in k.source
        assert "if warp < NWC:" not in k.source and npass == 1
    wait, trig = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    first = min(m.start() for m in re.finditer(r"\b(?:ld|st|red|atom)\.", ptx[wait:])) + wait if wait >= 0 else -1
    assert 0 <= wait < first and max(v4) < trig
    scalar = [m.start() for m in re.finditer(r"ld\.global(?:\.nc)?\.[bu]16", ptx)]
    # one row's sources per thread (bucket 1: its only row; 2 / 4: its pass's row)
    assert len(scalar) == npass * (nb + addend + prefix) + (2 if pair else 0) + 1 and max(scalar) < min(v4)
    assert ptx.count("red.relaxed.gpu.global.add.f32") == 1 and ptx.count("red.release.gpu.global.add.s32") == 1
    assert ptx.count("ld.acquire.gpu.global") == 1 and ptx.count("nanosleep") == 1
    assert "ld.local" not in ptx and "st.local" not in ptx
    # the barrier's arithmetic: the base by a mask, the parity by a shift, no signed division of the counter
    assert re.search(r"and\.b32\s+%r\d+, %r\d+, -128;", ptx) and not re.search(r"\b(?:div|rem)\.s32", ptx)


@pytest.mark.parametrize("preload", [1, 2])
@pytest.mark.parametrize("K,bm", [(768, 1), (384, 4), (1536, 4)])
def test_fused_residual_norm_one_kernel_preload(K, bm, preload, monkeypatch):
    """K3FUSE_FRN_PRELOAD=1 / 2: the projection's weight loads all ahead of its first FMA in the SASS (the interleaved
    loop has 5-9 of 21 there at K = 768). 1 stages x in shared memory behind a CTA barrier (the x loads before the
    first FMA too); 2 loads x after a warp sync. No branch around a load, no local memory."""
    monkeypatch.delenv("K3FUSE_PDL_CHAIN", raising=False)
    monkeypatch.setenv("K3FUSE_FRN_PRELOAD", str(preload))
    k = frn.build_one(7168, K, 2, False, True, False, 1e-6, 1e-5, True, arch="sm_90a", load=False, bm=bm)
    monkeypatch.setenv("K3FUSE_FRN_PRELOAD", "0")
    base = ptx_of(frn.build_one(7168, K, 2, False, True, False, 1e-6, 1e-5, True, arch="sm_90a", load=False, bm=bm))
    ptx = ptx_of(k)
    iters, nv = -(-(K // 8) // 32), K // 8
    v4 = len(re.findall(r"ld\.global(?:\.[a-z0-9:_]+)*\.v4\.", ptx))
    sh = len(re.findall(r"ld\.shared(?:\.[a-z0-9:_]+)*\.v4\.", ptx)) - len(
        re.findall(r"ld\.shared(?:\.[a-z0-9:_]+)*\.v4\.", base))      # x's, beyond the statistics' own
    if preload == 1:
        assert v4 == iters * 7 + -(-(bm * nv) // 256) and sh == iters * bm
    else:
        assert v4 == iters * (7 + bm) and sh == 0
    assert "ld.local" not in ptx and "st.local" not in ptx
    # the PDL chain as in the default kernel: the wait before any memory access, every load before the trigger
    wait, trig = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    first = min(m.start() for m in re.finditer(r"\b(?:ld|st|red|atom)\.", ptx[wait:])) + wait
    v4g = [m.start() for m in re.finditer(r"ld\.global(?:\.[a-z0-9:_]+)*\.v4\.", ptx)]
    assert 0 <= wait < first and max(v4g) < trig
    nd = _nvdisasm()
    if nd is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm): the SASS order is not checked")
    import subprocess
    sass = subprocess.run([nd, "-c", k.files["kernel.cubin"]], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    first = next(i for i, o in enumerate(ops) if o.startswith("FFMA"))
    ahead = sum(1 for o in ops[:first] if o.startswith("LDG") and "128" in o)
    assert ahead >= iters * 7 + (-(-(bm * nv) // 256) if preload == 1 else 0), (ahead, iters * 7)
    assert not re.search(r"\b(STL|LDL)\b", sass)


def test_one_kernel_barrier_arithmetic_survives_the_counter_wrap():
    """The template's epoch arithmetic on int32 (what the PTX computes), over launches across the 2^31 wrap: every
    CTA of a launch, whatever count it reads (base .. base + G - 1), gets the same base; the target is the count
    after the launch's G arrivals; parities alternate."""
    G, log2g = frn.ONE_G, frn.ONE_G.bit_length() - 1
    assert G & (G - 1) == 0             # the template's precondition: mask and shift stand for // and %
    i32 = lambda v: (v + 2 ** 31) % 2 ** 32 - 2 ** 31          # two's complement wrap
    pars = []
    for launch in range(6):
        first = 2 ** 31 - 3 * G + launch * G                   # launches 3.. start past the wrap
        bases = {i32(i32(first + j) & -G) for j in (0, 1, G // 2, G - 1)}
        assert len(bases) == 1
        base = bases.pop()
        target = i32(base + G)
        assert i32(i32(first + G) - target) == 0 and i32(i32(first + G - 1) - target) < 0
        pars.append(((base % 2 ** 32) >> log2g) & 1)           # shr.u32, then and 1
    assert pars in ([0, 1, 0, 1, 0, 1], [1, 0, 1, 0, 1, 0])


@pytest.mark.parametrize("arch", ARCHES)
def test_fused_residual_norm_one_kernel_lean_tail_compiles(arch, monkeypatch):
    """The lean tail (default; K3FUSE_FRN_LEAN_TAIL=0 opts out): the kernel without the per-thread fence after the
    barrier, the new prefix stored after the arrival; the opted-out source has the fence and stores it before."""
    frn._built.clear()
    lean = frn.build_one(7168, 768, 2, False, True, False, 1e-6, 1e-5, True, arch=arch, load=False)
    monkeypatch.setenv("K3FUSE_FRN_LEAN_TAIL", "0")
    default = frn.build_one(7168, 768, 2, False, True, False, 1e-6, 1e-5, True, arch=arch, load=False)
    frn._built.clear()
    p0, p1 = ptx_of(default), ptx_of(lean)
    assert "fence.acq_rel.gpu" in p0 and "fence.acq_rel.gpu" not in p1
    st = lambda p: [m.start() for m in re.finditer(r"st\.global(?:\.[a-z0-9]+)*\.b16", p)]
    arrive = lambda p: p.find("red.release.gpu.global.add.s32")
    assert min(st(p0)) < arrive(p0) and min(st(p1)) > arrive(p1)
    assert "ld.local" not in p1


def test_fused_residual_norm_one_kernel_reason(monkeypatch):
    """Where the one launch applies: M <= one_max_m(), no all-reduce, a norm, 7168 outputs, <= 8 blocks, >= 128 SMs,
    knob on."""
    monkeypatch.setenv("K3FUSE_FRN_ONE_MAX_M", "4")
    assert frn.one_kernel_reason(1, 7168, 768, 2, True, "", 132) is None
    assert frn.one_kernel_reason(1, 7168, 384, 8, True, "", None) is None
    assert frn.one_kernel_reason(3, 7168, 384, 8, True, "", 132) is None
    assert frn.one_kernel_reason(4, 7168, 768, 2, True, "", 132) is None
    assert "M = 5 > 4" in frn.one_kernel_reason(5, 7168, 768, 2, True, "", 132)
    monkeypatch.delenv("K3FUSE_FRN_ONE_MAX_M")          # default: M = 1 only (M = 2..4 measured slower, session 21)
    assert "M = 2 > 1" in frn.one_kernel_reason(2, 7168, 768, 2, True, "", 132)
    assert "all-reduce" in frn.one_kernel_reason(1, 7168, 768, 2, True, "tp", 132)
    assert "RMSNorm" in frn.one_kernel_reason(1, 7168, 768, 2, False, "", 132)
    assert "H = 64" in frn.one_kernel_reason(1, 64, 32, 2, True, "", 132)
    assert "9 blocks" in frn.one_kernel_reason(1, 7168, 768, 9, True, "", 132)
    assert "114 SMs" in frn.one_kernel_reason(1, 7168, 768, 2, True, "", 114)
    assert "K = 12288" in frn.one_kernel_reason(1, 7168, 12288, 2, True, "", 132)     # TP = 1's o_proj


def test_fused_residual_norm_one_kernel_knob(monkeypatch):
    monkeypatch.setenv("K3FUSE_FRN_ONE_MAX_M", "1")
    assert "M = 2 > 1" in frn.one_kernel_reason(2, 7168, 768, 2, True, "", 132)
    assert frn.one_kernel_reason(1, 7168, 768, 2, True, "", 132) is None
    monkeypatch.setenv("K3FUSE_FRN_ONE_MAX_M", "8")
    with pytest.raises(ValueError, match="1, 2 or 4"):
        frn.one_kernel_reason(2, 7168, 768, 2, True, "", 132)
    monkeypatch.delenv("K3FUSE_FRN_ONE_MAX_M")
    monkeypatch.setenv("K3FUSE_FRN_ONE_KERNEL", "0")
    assert "K3FUSE_FRN_ONE_KERNEL=0" in frn.one_kernel_reason(1, 7168, 768, 2, True, "", 132)


@pytest.mark.parametrize("arch", ARCHES)
def test_prefetch_compiles_to_bulk_prefetch(arch):
    k = prefetch.build(arch=arch, load=False)
    assert "cp.async.bulk.prefetch.L2.global" in ptx_of(k)


def test_cache_hit_corrupt_rebuild_and_arch_key(tmp_path):
    c = KernelCache(tmp_path)
    _, src, _ = gemv.render_source(1536, 128, 1)
    k1 = kcompile.compile_source(src, "sm_90a", load=False, cache=c)
    assert not k1.cached
    kcompile.clear_memo()
    k2 = kcompile.compile_source(src, "sm_90a", load=False, cache=c)
    assert k2.cached and k2.key == k1.key
    # corrupt the cached PTX: rebuilt, not served
    with open(k2.files["kernel.ptx"], "w") as f:
        f.write("corrupt")
    kcompile.clear_memo()
    k3 = kcompile.compile_source(src, "sm_90a", load=False, cache=c)
    assert not k3.cached and ".target sm_90a" in ptx_of(k3)
    # another arch is another key
    k4 = kcompile.compile_source(src, "sm_100a", load=False, cache=c)
    assert k4.key != k1.key and ".target sm_100a" in ptx_of(k4)


def test_kernels_cli_writes_manifest(tmp_path, monkeypatch):
    from k3fuse.codegen import kernels_cli
    monkeypatch.delenv("K3FUSE_PDL_CHAIN", raising=False)
    monkeypatch.delenv("K3FUSE_MIXNORM_CLUSTER", raising=False)
    monkeypatch.delenv("K3FUSE_MIXNORM_PUSH", raising=False)
    monkeypatch.setenv("K3FUSE_FRN_SPIN_NS", "64")       # set (to its default): the manifest records what was set
    out = tmp_path / "kout"
    rc = kernels_cli.main(["--config", "tiny", "--tp", "1", "--batch", "1,100", "--arch", "sm_90a",
                           "--out", str(out)])
    assert rc == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["knobs"].get("K3FUSE_FRN_SPIN_NS") == "64" and "K3FUSE_PDL_CHAIN" not in m["knobs"]
    assert m["arch"] == "sm_90a" and m["config"] == "tiny"
    assert m["pdl_chain"] is True                      # the default: the layer's kernels launch as a PDL chain
    assert m["mixnorm_cluster"] == 8                   # the default: a mix-norm row on a cluster of 8 CTAs
    assert m["mixnorm_push"] is True                   # ... gathering its totals by st.async
    fams = {k["family"] for k in m["kernels"]}
    # tiny's KDA head dim (16) has no kda_decode kernel: listed as skipped with the reason
    assert fams == {"gemv", "fused_residual_norm", "prefetch_l2", "moe_experts", "router_topk"}
    assert any(s["op"] == "k3fuse::kda_decode" and "d=16" in s["reason"] for s in m["skipped"])
    for k in m["kernels"]:
        assert set(k["files"]) == {"py", "ptx", "cubin"}
        for f in k["files"].values():
            assert (out / f).is_file()
        assert k["op"].startswith("k3fuse::") and "config" in k
    g = [k for k in m["kernels"] if k["family"] == "gemv"]
    assert all(k["bucket"] == 1 for k in g) and len(g) >= 8
    # the KDA and MLA input-projection groups (tiny at TP 1 also has the MoE's routed down + shared gate_up)
    assert sum(k["op"] == "k3fuse::linear_group" for k in g) == 3
    assert any("M=100" in s["reason"] for s in m["skipped"])
    # pass fuse_rms_norm_into_linear: MLA q_b and the routed up projection with the norm prologue (tiny: both small)
    assert sorted(k["uses"][0] for k in g if k["op"] == "k3fuse::rms_norm_linear") == ["mla.q_b", "routed.up"]
    assert all(k["config"]["wm_pair"] for k in m["kernels"] if k["family"] == "fused_residual_norm")
    # default families carry no opt-in note; the router top-k kernel is one of them
    assert [k.get("note") for k in m["kernels"] if k["family"] == "router_topk"] == [None]


def test_kernels_cli_sass(tmp_path, monkeypatch, capsys):
    """`k3fuse kernels --sass`: each kernel's entry functions in the manifest with their global loads, exposed waits
    and longest round-trip chain (codegen/sass.py), and a summary line; without a disassembler, a clear error."""
    from k3fuse.codegen import kernels_cli, sass
    args = ["--config", "tiny", "--tp", "1", "--batch", "1", "--arch", "sm_90a", "--only", "moe_experts,router_topk",
            "--sass"]
    if sass.find_disassembler() is not None:
        assert kernels_cli.main(args + ["--out", str(tmp_path / "a")]) == 0
        m = json.loads((tmp_path / "a" / "manifest.json").read_text())
        assert {k["family"] for k in m["kernels"]} == {"moe_experts", "router_topk"}
        for k in m["kernels"]:
            assert k["sass"] and all(f["global_loads"] > 0 and 0 < f["path"] <= f["waits"] for f in k["sass"].values())
        moe = next(k for k in m["kernels"] if k["family"] == "moe_experts")
        assert set(moe["sass"]) == {"up_kernel", "down_kernel"}
        assert "sass: the longest round-trip chains" in capsys.readouterr().out
    monkeypatch.setattr(sass, "find_disassembler", lambda: None)
    with pytest.raises(SystemExit):
        kernels_cli.main(args + ["--out", str(tmp_path / "b")])
    assert "nvidia-cuda-nvdisasm" in capsys.readouterr().err


def test_kernels_cli_lists_inkernel_collectives_under_tp(tmp_path):
    """TP 2 (tiny): every mix-norm variant has its in-kernel all-reduce twin (+ the partial-addend one for an addend)
    and the MoE split's packed gather has its kernel; all compile."""
    from k3fuse.codegen import kernels_cli
    out = tmp_path / "kout"
    assert kernels_cli.main(["--config", "tiny", "--tp", "2", "--batch", "1", "--arch", "sm_90a", "--out", str(out),
                             "--only", "fused_residual_norm,mixnorm_allreduce,allgather_oneshot"]) == 0
    ks = json.loads((out / "manifest.json").read_text())["kernels"]
    frn = [k for k in ks if k["family"] == "fused_residual_norm"]
    ar = [k for k in ks if k["family"] == "mixnorm_allreduce"]
    assert len(ar) == len(frn) + sum(k["config"]["addend"] for k in frn)
    assert all(k["config"]["world"] == 2 and not (k["config"]["addend"] and k["config"]["paddend"]) for k in ar)
    ag = [k for k in ks if k["family"] == "allgather_oneshot"]
    assert len(ag) == 1 and ag[0]["op"] == "k3fuse::all_gather" and ag[0]["shape"]["row_bytes"] == 8 // 2 * 4 + 48 // 2 * 2


# PDL (config "pdl": 1): both variants, the small K3 shapes it is meant for, one fused simt kernel (2 weight
# regions per CTA) and one mma kernel whose last CTA is partial (PRED_N)
PDL_CASES = [(768, 7168, 1, {"variant": "simt", "R": 1, "W": 8}, None),
             (7168, 768, 1, {"variant": "mma", "W": 8, "U": 2, "WN": 1, "RT": 1, "KB": 1}, None),
             (768, 7168, 8, {"variant": "mma", "W": 16, "U": 8, "WN": 1, "RT": 1, "KB": 0}, None),
             (6288, 7168, 2, {"variant": "mma", "W": 4, "U": 2, "WN": 1, "RT": 2, "KB": 1}, None),
             (768, 7168, 2, {"variant": "simt", "R": 2, "W": 8}, dict(norm=True, act="situ"))]


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("N,K,b,cfg,fusion", PDL_CASES)
def test_gemv_pdl_prefetch_precedes_wait(arch, N, K, b, cfg, fusion):
    k = gemv.build(N, K, b, dict(cfg, pdl=1), arch=arch, load=False, fusion=fusion)
    ptx = ptx_of(k)
    pf, trig, wait = (ptx.find(s) for s in ("cp.async.bulk.prefetch.L2.global", "griddepcontrol.launch_dependents",
                                            "griddepcontrol.wait"))
    assert min(pf, trig, wait) >= 0, "PDL prologue instructions missing"
    # the weight prefetch is issued before the wait: it is what overlaps the previous kernel's tail
    assert pf < wait and trig < wait
    # no global load of x or w ahead of the wait (x may still be written by the previous kernel)
    assert "ld.global" not in ptx[:wait]
    loads = global_loads(ptx)
    assert loads and all(is_128bit(l) for l in loads), f"non-128-bit global loads: {loads}"
    assert "ld.local" not in ptx and "st.local" not in ptx
    if cfg["variant"] == "mma":
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx


def _nvdisasm():
    from k3fuse.codegen.sass import find_tool
    return find_tool("nvdisasm")


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("N,K,b,cfg,fusion", PDL_CASES)
def test_gemv_pdl_sass_order(arch, N, K, b, cfg, fusion):
    """ptxas reorders loads (CUTEDSL.md pitfall 3): check the machine code too. UBLKPF = bulk L2 prefetch,
    PREEXIT = launch_dependents, ACQBULK = griddepcontrol.wait."""
    import subprocess
    nd = _nvdisasm()
    if nd is None:
        pytest.skip("nvdisasm not installed (pip nvidia-cuda-nvdisasm)")
    k = gemv.build(N, K, b, dict(cfg, pdl=1), arch=arch, load=False, fusion=fusion)
    sass = subprocess.run([nd, "-c", k.files["kernel.cubin"]], capture_output=True, text=True, check=True).stdout
    pf, trig, wait = (sass.find(s) for s in ("UBLKPF.L2", "PREEXIT", "ACQBULK"))
    assert min(pf, trig, wait) >= 0 and pf < wait and trig < wait
    assert "LDG" not in sass[:wait] and "LDG.E.128" in sass[wait:]


def test_gemv_pdl_config_keys(monkeypatch):
    monkeypatch.setenv("K3FUSE_PDL_CHAIN", "0")      # the sources without the PDL chain
    base = {"variant": "mma", "W": 8, "U": 2, "WN": 1, "RT": 1, "KB": 1}
    # pdl=0 is the same config, source and cache key as no pdl key at all; pdl=1 is another kernel
    assert gemv._clean(dict(base, pdl=0)) == base
    assert gemv._clean(dict(base, pdl=1)) == dict(base, pdl=1)
    src0 = gemv.render_source(7168, 768, 1, base)[1]
    assert gemv.render_source(7168, 768, 1, dict(base, pdl=0))[1] == src0
    src1 = gemv.render_source(7168, 768, 1, dict(base, pdl=1))[1]
    assert src1 != src0 and "use_pdl=True" in src1 and "use_pdl" not in src0
    assert kcompile.cache_key(src1, "sm_90a") != kcompile.cache_key(src0, "sm_90a")
    assert gemv.supports(7168, 768, 1, dict(base, pdl=2)) is not None
    # default configs never turn PDL on; small shapes get a few pdl copies, large ones none
    for N, K in ((7168, 768), (768, 7168), (20480, 7168)):
        for b in (1, 8, 64):
            assert "pdl" not in gemv.default_config(N, K, b)
            c = gemv.candidates(N, K, b)
            p = [x for x in c if x.get("pdl")]
            assert (not p) if N * K * 2 >= gemv.PDL_MAX_BYTES else 1 <= len(p) <= 4
            assert all({k: v for k, v in x.items() if k != "pdl"} in c for x in p)
            assert all(gemv.supports(N, K, b, x) is None for x in p)
    assert any(x.get("pdl") for x in gemv.candidates(7168, 768, 1))
    assert any(x.get("pdl") for x in gemv.candidates(768, 7168, 8))


@pytest.mark.parametrize("arch", ARCHES)
def test_short_row_candidates_compile(arch):
    """K < 512 (the TP16 shared down projection 7168 x 384): the tuner also times one-warp CTAs with up to 16 rows;
    each compiles with 128-bit loads and no local memory."""
    short = [c for c in gemv.candidates(7168, 384, 1) if c["variant"] == "simt" and not c.get("pdl")]
    assert sorted(c["R"] for c in short) == [1, 2, 4, 8, 16] and all(c["W"] == 1 for c in short)
    assert not any(c["variant"] == "simt" and c["W"] == 1 and c["R"] > 4 for c in gemv.candidates(7168, 7168, 1))
    for c in short[-2:]:
        ptx = ptx_of(gemv.build(7168, 384, 1, c, arch=arch, load=False))
        loads = global_loads(ptx)
        assert loads and all(is_128bit(l) for l in loads) and "ld.local" not in ptx


# Grouped GEMV (k3fuse::linear_group): the K3 groups of fuse_shared_input_linears at TP16 (KDA: q, k, v, g, f_a,
# b; MLA: q_a, kv_a, g) at buckets 1 (simt) and 8 (mma), plus a simt config whose R leaves a partial CTA
GROUP_CASES = [([768, 768, 768, 768, 128, 6], 7168, 1, None), ([768, 768, 768, 768, 128, 6], 7168, 8, None),
               ([1536, 576, 768], 7168, 1, None), ([1536, 576, 768], 7168, 8, None),
               ([768, 128, 6], 7168, 2, {"variant": "simt", "R": 4, "W": 8}),
               ([1536, 1536, 1536, 1536, 128, 12], 7168, 16,          # TP8 KDA, the H200 table's config
                {"variant": "mma", "W": 8, "U": 2, "WN": 2, "RT": 1, "KB": 1}),
               ([40, 8, 24], 7168, 8, {"variant": "mma", "W": 4, "U": 2, "WN": 2, "RT": 2, "KB": 1})]


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("Ns,K,b,cfg", GROUP_CASES)
def test_gemv_group_compiles_with_128bit_loads(arch, Ns, K, b, cfg):
    k = gemv.build_group(Ns, K, b, cfg, arch=arch, load=False)
    ptx = ptx_of(k)
    assert f".target {arch}" in ptx
    loads = global_loads(ptx)
    assert loads and all(is_128bit(l) for l in loads), f"non-128-bit global loads: {loads}"
    assert "ld.local" not in ptx and "st.local" not in ptx
    used = cfg or gemv.group_config_for(Ns, K, b)
    if used["variant"] == "mma":
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    # one launch over every member's CTAs
    src = open(k.files["kernel.py"]).read()
    tile = used.get("R") or 16 * used.get("RT", 1) * used.get("WN", 1)
    assert f"CTAS = {sum(-(-n // tile) for n in Ns)}" in src and src.count("cute.Tensor, ") >= 2 * len(Ns)


# the MoE group at TP = 1 (routed down + shared gate_up at TP16 widths) with the SiTU-GLU epilogue on the gate_up
# (pass fuse_situ_glu_into_linear_group); R = 1 becomes 2; an odd member (partial CTA) and a 4-row CTA
@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("Ns,b,cfg,member", [([3584, 768], 1, None, 1), ([3584, 768], 2, None, 1),
                                             ([768, 1001], 2, {"variant": "simt", "R": 4, "W": 8}, 0)])
def test_gemv_group_situ_compiles(arch, Ns, b, cfg, member):
    k = gemv.build_group(Ns, 7168, b, cfg, arch=arch, load=False, situ=((member,), 4.0, 25.0))
    ptx = ptx_of(k)
    loads = global_loads(ptx)
    assert loads and all(is_128bit(l) for l in loads), f"non-128-bit global loads: {loads}"
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "tanh" in ptx or "ex2" in ptx
    src = open(k.files["kernel.py"]).read()
    R = gemv.group_situ_config(cfg or gemv.group_config_for(Ns, 7168, b))["R"]
    assert R % 2 == 0 and f"R = {R}\n" in src
    # the SiTU member: N / 2 outputs in R / 2-column CTAs; the others ceil(N / R) CTAs of R rows
    ctas = sum((n // 2) // (R // 2) if j == member else -(-n // R) for j, n in enumerate(Ns))
    assert f"CTAS = {ctas}" in src
    assert f"make(BFloat16, (m, {Ns[member] // 2}))" in src.replace(", stride_order=(1, 0), assumed_align=16", "")
    with pytest.raises(ValueError, match="mma"):
        gemv.render_group_source(Ns, 7168, 8, {"variant": "mma", "W": 8, "U": 2, "WN": 1, "RT": 1, "KB": 1},
                                 situ=((member,), 4.0, 25.0))


def test_gemv_group_default_is_groupable_or_routes_per_member(monkeypatch):
    """`k3fuse kernels` for K3 on sm_90a (the H200 table): a group whose concatenation the table gives wgmma (no
    grouped form) is planned as per-member launches, and group_route declines it too, so the runtime never hands
    that config to the grouped kernel; every planned group's config is one the grouped kernel takes. The GPU test
    asserted the default was always groupable and failed at 3216 x 7168 bucket 64 (session 43)."""
    from k3fuse.codegen import kernels_cli
    monkeypatch.setattr(kcompile, "current_arch", lambda: "sm_90a")
    gemv._device_arch.cache_clear()
    per_member = []
    try:
        for tp in (8, 16):
            jobs, skipped = kernels_cli.plan("k3", tp, [1, 2, 4, 8, 16, 32, 64], "sm_90a")
            for j in jobs:
                if j["op"] == "k3fuse::linear_group":
                    assert gemv.group_supports(j["shape"]["N"], j["shape"]["K"], j["bucket"], j["config"]) is None, j
            for s in skipped:
                if s["op"] == "k3fuse::linear_group" and "no grouped form" in s["reason"]:
                    cfg, why = gemv.group_route(s["shape"]["N"], s["shape"]["K"], s["bucket"], gpu="nvidia_h200",
                                                arch="sm_90a")
                    assert cfg is None and "wgmma" in why, (s, cfg)
                    per_member.append((tp, s["name"], s["bucket"]))
    finally:
        monkeypatch.undo()
        gemv._device_arch.cache_clear()
    assert sorted(per_member) == [(16, "kda.q_k_v_g_fa_b", 32), (16, "kda.q_k_v_g_fa_b", 64)]


def test_gemv_group_config_route_and_unchanged_singles(monkeypatch):
    monkeypatch.setenv("K3FUSE_PDL_CHAIN", "0")      # the sources without the PDL chain
    # the KDA group at TP16 takes the config of its 16-row-padded concatenation (3216 x 7168), pdl dropped
    Ns = [768, 768, 768, 768, 128, 6]
    for b in (1, 8, 64):
        assert gemv.group_config_for(Ns, 7168, b) == {k: v for k, v in gemv.config_for(3216, 7168, b).items()
                                                       if k != "pdl"}
    for M in (1, 8, 64):
        cfg, why = gemv.group_route(Ns, 7168, M)
        single, why1 = gemv.route(3216, 7168, M)
        assert (cfg is None) == (single is None) and (cfg is None or why == "")
    assert gemv.group_route([768], 7168, 1)[0] is None                     # one member: not a group
    assert gemv.group_route(Ns, 7164, 1)[0] is None                        # K % 8
    assert gemv.group_route(Ns, 7168, 100)[0] is None                      # outside the buckets
    # single GEMVs render exactly as before GROUP existed (no GROUP text, same source as their own template)
    for variant_cfg in ({"variant": "simt", "R": 2, "W": 8}, {"variant": "mma", "W": 8, "U": 2, "WN": 1, "RT": 1,
                                                              "KB": 1}):
        src = gemv.render_source(3216, 7168, 8, variant_cfg)[1]
        assert "GROUP" not in src and "Grouped" not in src and "toint" not in src
    gsrc = gemv.render_group_source(Ns, 7168, 8)[1]
    assert "GPRED=True" in gsrc and "toint" in gsrc and "use_pdl" not in gsrc


def test_kernels_cli_plans_groups():
    from k3fuse.codegen import kernels_cli
    jobs, skipped = kernels_cli.plan("k3", 16, [1, 8], "sm_90a")
    g = {(tuple(j["shape"]["N"]), j["bucket"]) for j in jobs if j["op"] == "k3fuse::linear_group"}
    assert g == {((768, 768, 768, 768, 128, 6), 1), ((768, 768, 768, 768, 128, 6), 8),
                 ((1536, 576, 768), 1), ((1536, 576, 768), 8)}
    assert all(j["family"] == "gemv" for j in jobs if j["op"] == "k3fuse::linear_group")
    jobs1, _ = kernels_cli.plan("k3", 1, [1], "sm_90a")
    assert ((3584, 12288), 1) in {(tuple(j["shape"]["N"]), j["bucket"]) for j in jobs1
                                  if j["op"] == "k3fuse::linear_group"}
    # where the H200 table names the wgmma variant for the concatenated shape (3216 x 7168 at bucket 64, session 36)
    # the group has no kernel (one launch per member at runtime): listed as skipped with why, not built
    jobs64, skipped64 = kernels_cli.plan("k3", 16, [64], "sm_90a")
    assert not [j for j in jobs64 if j["op"] == "k3fuse::linear_group"
                and tuple(j["shape"]["N"]) == (768, 768, 768, 768, 128, 6)]
    assert [s["reason"] for s in skipped64 if s["op"] == "k3fuse::linear_group"
            and tuple(s["shape"]["N"]) == (768, 768, 768, 768, 128, 6)] == \
        ["the wgmma variant has no grouped form (one launch per member); the members run as k3fuse::linear"]
    assert not [j for j in jobs64 if j["op"].startswith("k3fuse::linear_group") and j["config"]["variant"] == "wgmma"]


def test_plan_follows_runtime_choices(monkeypatch):
    """`k3fuse kernels` lists what runs: the MLA head-group kernel at TP2 (48 heads -> 3 launches of 16), the
    routed-expert config of the H200 table for sm_90a (heuristic for an arch without a table)."""
    from k3fuse.codegen import kernels_cli, moe_experts
    jobs, skipped = kernels_cli.plan("k3", 2, [8], "sm_90a")
    mla = [j for j in jobs if j["family"] == "mla_attention"]
    assert len(mla) == 1 and mla[0]["shape"]["h"] == 16 and mla[0]["note"] == "3 head-group launches per call"
    assert not [s for s in skipped if s["op"] == "k3fuse::mla_attention"]
    assert mla[0]["config"]["splits"] == [8, 8]                   # mla_attention.SPLITS_BY_BUCKET[8]
    jobs3, _ = kernels_cli.plan("k3", 16, [1, 8, 16, 64], "sm_90a")
    three = [j for j in jobs3 if j["family"] == "mla_attention" and j["config"].get("variant") != "heads"]
    got = {(*j["config"]["splits"], j["config"]["pipe"]): j["config"]["buckets"] for j in three}
    # one kernel per distinct split + tile pipeline (TP16; at a 1024-token context M = 16 and 64 have more split CTAs
    # than SMs: no pipeline); bucket 1 takes the per-head kernel (HEADS_BY_HEADS), checked below
    assert got == {(32, 8, True): [8], (8, 8, False): [16], (4, 1, False): [64]}
    # the combine on tensor cores where the launcher takes it (mla_attention.CMMA_BY_HEADS: h = 6 at buckets 32, 64, h = 12
    # from bucket 16), in the job's config and name: the listed kernel is the one that runs
    assert {j["config"]["buckets"][0]: j["config"].get("cmma", False) for j in three} == {8: False, 16: False, 64: True}
    # (and, at h = 6 bucket 64, 4 tokens per combine CTA and the split kernel's cp.async ring: CMMA_TOK_BY_HEADS,
    # ASYNC_BY_HEADS)
    assert [j["name"] for j in three if j["config"].get("cmma")] == ["mla_append_attention_h6_c512_qs4_vs1_cmma_tok4_async"]
    assert {j["config"]["buckets"][0]: j["config"].get("asy", 0) for j in three} == {8: 0, 16: 1, 64: 1}
    tp8 = [j for j in kernels_cli.plan("k3", 8, [8, 16, 32, 64], "sm_90a")[0] if j["family"] == "mla_attention"]
    assert sorted(b for j in tp8 if j["config"].get("cmma") for b in j["config"]["buckets"]) == [16, 32, 64]
    monkeypatch.setenv("K3FUSE_MLA_CMMA", "0")
    assert not [j for j in kernels_cli.plan("k3", 8, [64], "sm_90a")[0] if j["config"].get("cmma")]
    monkeypatch.delenv("K3FUSE_MLA_CMMA")
    # 12 heads with the MMA score step (the default): the pipeline at M = 1 too; with CUDA-core scores, not at M = 1
    jobs8p, _ = kernels_cli.plan("k3", 8, [1, 8], "sm_90a")
    assert {j["config"]["pipe"]: j["config"]["buckets"] for j in jobs8p if j["family"] == "mla_attention"} == \
        {True: [1, 8]}
    monkeypatch.setenv("K3FUSE_MLA_MMA", "0")
    jobs8c, _ = kernels_cli.plan("k3", 8, [1, 8], "sm_90a")
    monkeypatch.delenv("K3FUSE_MLA_MMA")
    assert {j["config"]["pipe"]: j["config"]["buckets"] for j in jobs8c if j["family"] == "mla_attention"} == \
        {False: [1], True: [8]}
    # the per-head kernel where mla_attention.HEADS_BY_HEADS makes it the default (TP16 M = 1: a cluster of 16 splits,
    # HEADS_CL_BY_HEADS; M = 2: 8), computing q itself there (pass fuse_q_b_into_mla_attention's op: the ranks split
    # W_qb's 192 rows per head)
    jobs2, _ = kernels_cli.plan("k3", 16, [1, 2, 4], "sm_90a")
    heads = [j for j in jobs2 if j["config"].get("variant") == "heads"]
    assert [(j["config"]["buckets"], j["config"]["cluster"], j["op"], j["shape"].get("q_lora")) for j in heads] == \
        [([1], 16, "k3fuse::mla_qb_append_attention_", 1536), ([2], 8, "k3fuse::mla_qb_append_attention_", 1536)]
    # ... so the q_b GEMV with its norm is planned at bucket 4 only (skipped at 1 and 2, with the reason)
    qb_n = 6 * 192
    assert [j["bucket"] for j in jobs2 if j["op"] == "k3fuse::rms_norm_linear" and j["shape"]["N"] == qb_n] == [4]
    assert {s["bucket"] for s in kernels_cli.plan("k3", 16, [1, 2, 4], "sm_90a")[1]
            if s["op"] == "k3fuse::rms_norm_linear" and "inside the per-head" in s["reason"]} == {1, 2}
    assert [j["config"]["buckets"] for j in jobs2 if j["family"] == "mla_attention" and j not in heads] == [[4]]
    monkeypatch.setenv("K3FUSE_MLA_HEADS", "0")
    assert not [j for j in kernels_cli.plan("k3", 16, [2], "sm_90a")[0] if j["config"].get("variant") == "heads"]
    monkeypatch.delenv("K3FUSE_MLA_HEADS")
    # one head group (TP16): pass fuse_mla_append_and_gate's op, its append + gate variant; TP2's groups: the plain one
    assert {j["op"] for j in three} == {"k3fuse::mla_append_attention_"}
    assert {j["config"]["gate"] for j in jobs3 if j["family"] == "mla_attention"} == {True}
    assert mla[0]["op"] == "k3fuse::mla_attention" and "append_eps" not in mla[0]["config"]
    E, D, KT = 896, 3584, 16
    jobs8, _ = kernels_cli.plan("k3", 8, [8], "sm_90a")
    moe8 = [j for j in jobs8 if j["family"] == "moe_experts"][0]
    assert moe8["config"]["kernel"]["G"] == 1                    # the tuned bucket-8 entry (RESULTS.md, session 3)
    jobs100, _ = kernels_cli.plan("k3", 8, [8], "sm_100a")
    assert [j for j in jobs100 if j["family"] == "moe_experts"][0]["config"]["kernel"] == \
        moe_experts.default_config(E, 384, D, KT, 8)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_gemv_fp32_output_variant(arch):
    """The router logits' GEMV (fusion y_fp32): fp32 stores, 128-bit weight loads, no local memory; the bf16 GEMV
    of the same shape renders a different source (separate cache key)."""
    import re
    from k3fuse.codegen import gemv
    cfg = gemv.fp32_out_config(896, 7168, 1)
    assert cfg["variant"] == "simt"
    k = gemv.build(896, 7168, 1, cfg, arch=arch, load=False, fusion=dict(y_fp32=True))
    ptx = open(k.files["kernel.ptx"]).read()
    stores = set(re.findall(r"st\.global(?:\.[a-z0-9]+)*", ptx))
    assert stores == {"st.global.b32"} or stores == {"st.global.f32"}, stores
    assert re.search(r"ld\.global(\.[a-z0-9:_]+)*\.v4\.[bu]32", ptx) or "ld.global.v2.b64" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert gemv.render_source(896, 7168, 1, cfg, dict(y_fp32=True))[1] != gemv.render_source(896, 7168, 1, cfg)[1]


def _layer_kernel_sources():
    """One rendered source per kernel template of the single-GPU layer (render.PDL_CHAIN_TEMPLATES)."""
    from k3fuse.codegen import kda_recurrent as kr
    from k3fuse.codegen import mla_attention as mla
    from k3fuse.codegen import moe_experts as mx
    from k3fuse.codegen import router_topk as rt
    from test_kda_kernel_compile import FUSED_K3 as fused_kda
    return {
        "gemv_simt": gemv.render_source(7168, 768, 1, {"variant": "simt", "R": 2, "W": 8})[1],
        "gemv_mma": gemv.render_source(7168, 768, 8, {"variant": "mma", "W": 4, "U": 2, "WN": 1, "RT": 1, "KB": 1})[1],
        "gemv_group": gemv.render_group_source([768, 768, 1536], 7168, 1)[1],
        "gemv_wgmma": gemv.render_source(768, 7168, 64, gemv.wg_default(768, 7168, 64))[1],
        "mixnorm": frn.render_mixnorm(7168, 2, False, True, True, False, 1e-5, 1e-5, wm_pair=True),
        "kda": kr.render_source(128, "bfloat16", "bfloat16", -5.0, 2, fused=fused_kda),
        "topk": rt.render_source(896, 16, True, 2.5),
        "moe": mx.render_source(896, 128, 3584, 16, 1)[0],
        "mla": mla.render_source(8, n=128, v=128, r=64, C=512, scale=192 ** -0.5),
        "mla_heads": mla.render(mla.HEADS_TEMPLATE, **mla.heads_params(6, 128, 128, 64, 512, 192 ** -0.5,
                                                                            append_eps=1e-6, gate=True)),
    }


def test_pdl_chain_knob_renders_wait_first(monkeypatch):
    """PDL chain on (the default, or K3FUSE_PDL_CHAIN=1): every layer kernel launches with use_pdl and its body
    waits (griddepcontrol) before its first tensor access (or phase call); the GEMVs trigger their dependents after their main loop
    (after the last weight load: _pdl_chain.jinja late_trigger), the other kernels before the wait, at their start;
    K3FUSE_PDL_CHAIN=0: no griddepcontrol."""
    import re
    monkeypatch.setenv("K3FUSE_PDL_CHAIN", "0")
    off = _layer_kernel_sources()
    monkeypatch.delenv("K3FUSE_PDL_CHAIN", raising=False)
    on = _layer_kernel_sources()
    monkeypatch.setenv("K3FUSE_PDL_CHAIN", "1")
    assert _layer_kernel_sources() == on
    for name in off:
        assert "griddepcontrol" not in off[name] and "use_pdl" not in off[name], name
        bodies = re.split(r"@cute\.kernel\n", on[name])[1:]
        assert bodies, name
        for body in bodies:
            body = body.split("@cute.jit")[0]
            trig, wait = body.find("griddepcontrol_launch_dependents()"), body.find("griddepcontrol_wait()")
            # a tensor access, or a call of a phase function (mla_attention: its kernels call @cute.jit phases)
            access = [m.start() for m in re.finditer(r"cute\.(?:autovec_)?copy\(|\bm[A-Z]\w*\[|\b\w+_phase\(", body)]
            if name == "mla_heads":     # its weight rows' bulk copies (weights: no kernel writes them) precede the wait
                pre = [a for a in access if a < wait]
                # all on one line: the W_UK rows' copy (its cute.copy and its mW access)
                assert pre and all(body.count("\n", 0, a) == body.count("\n", 0, pre[0]) for a in pre), name
                assert body[pre[0]:].startswith("cute.copy(bulk, mW[hd, lane + 32 * i, None]"), (name, body[:300])
                access = [a for a in access if a > wait]
            if name == "gemv_wgmma":    # the first stages' weight tiles (TMA) are issued before the wait
                pre = [a for a in access if a < wait]
                assert pre and all(body[a:].startswith("cute.copy(tma_w, tWg[") for a in pre), (name, body[:300])
                access = [a for a in access if a > wait]
            assert access, (name, body[:300])
            if name.startswith("gemv"):
                assert body.count("griddepcontrol_launch_dependents()") == 1
                last = max(body.rfind("cute.copy(vec, gW"), body.rfind("cute.copy(tma_x"))     # the main loop's
                assert 0 <= wait < min(access) and trig > last, (name, body[:300])
            else:
                assert 0 <= trig < wait < min(access), (name, body[:300])
        assert on[name].count("use_pdl=True") == len(bodies), name


@pytest.mark.parametrize("arch", ["sm_90a"])
def test_pdl_chain_ptx_waits_before_global_access(arch, monkeypatch):
    """The compiled layer kernels under K3FUSE_PDL_CHAIN=1: griddepcontrol.wait comes before the first global
    load or store of each kernel entry in the PTX (ptxas cannot move memory ops above it)."""
    import re
    from k3fuse.codegen import compile as kcompile
    monkeypatch.delenv("K3FUSE_PDL_CHAIN", raising=False)        # on by default
    for name, src in _layer_kernel_sources().items():
        ptx = kcompile.compile_source(src, arch, load=False).files["kernel.ptx"]
        text = open(ptx).read()
        for entry in re.split(r"\.entry ", text)[1:]:
            wait = entry.find("griddepcontrol.wait")
            mem = [m.start() for m in re.finditer(r"\b(?:ld|st)\.global", entry)]
            assert wait >= 0 and (not mem or wait < min(mem)), name
            if name.startswith("gemv"):     # the late trigger: after every weight / x load of the main loop
                last = entry.rfind("ld.global")
                assert last < entry.find("griddepcontrol.launch_dependents"), name


# the TMA + wgmma variant (sm_90a only): (N, K, bucket, KS, ST, BN); N = 3216 leaves a partial last row tile, KS > 1
# is a cluster whose CTAs sum their partials through distributed shared memory
WG_CASES = [(768, 7168, 64, 8, 8, 64), (7168, 768, 32, 1, 8, 64), (3216, 7168, 16, 4, 4, 64), (7168, 3584, 64, 2, 8, 64),
            (768, 7168, 64, 8, 6, 128), (7168, 768, 32, 1, 4, 128),
            (768, 7168, 64, 16, 7, 64), (768, 7168, 16, 14, 4, 128)]     # non-portable clusters (the tuner's, session 36)


@pytest.mark.parametrize("N,K,b,KS,ST,BN", WG_CASES)
def test_gemv_wgmma_compiles(N, K, b, KS, ST, BN):
    """sm_90a PTX: BN / 64 x BK / 16 wgmma m64n{bucket}k16 bf16 MMAs in the (rolled) k-tile loop; the operands only by 2-D
    TMA tile copies (prologue and main loop; the PDL chain's prologue issues the weights' and x's copies apart), no
    global loads; the bf16 stores predicated per element; with KS > 1 the partials summed in rank order through
    ld.shared::cluster (NACC x KS, each thread taking the entries of its rank) between cluster barriers; no local
    memory."""
    cfg = gemv.wg_config(N, K, b, KS, ST, BN)
    assert cfg == {"variant": "wgmma", "KS": KS, "ST": ST, "BN": BN} and gemv.supports(N, K, b, cfg) is None
    ptx = ptx_of(gemv.build(N, K, b, cfg, arch="sm_90a", load=False))
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.bf16\.bf16", ptx)
    assert mmas == [f"m64n{b}k16"] * (4 * BN // 64), mmas
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global", ptx)) == 4
    assert not global_loads(ptx)
    assert set(re.findall(r"st\.global(?:\.[a-z0-9]+)*", ptx)) == {"st.global.b16"}
    nacc = BN * b // 128
    assert len(re.findall(r"ld\.shared::cluster\.f32", ptx)) == (nacc * KS if KS > 1 else 0)
    assert len(re.findall(r"barrier\.cluster\.wait", ptx)) == (2 if KS > 1 else 0)
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize("N,K,b,KS,ST,BN", [(768, 7168, 64, 8, 6, 128), (3216, 7168, 16, 4, 4, 64), (768, 7168, 64, 16, 7, 64)])
def test_gemv_wgmma_no_spills(N, K, b, KS, ST, BN, tmp_path, capfd):
    """ptxas remarks (sm_90a): no spills, also with the most accumulators (BN = 128 x bucket 64: 64 fp32 per thread)
    and a cluster of 8 summing them."""
    import cutlass.cute as cute
    cfg = gemv.wg_config(N, K, b, KS, ST, BN)
    mod = kcompile._import_source(gemv.render_source(N, K, b, cfg)[1], f"wg_spills_{N}_{K}_{b}_{KS}_{BN}", tmp_path)
    capfd.readouterr()
    cute.compile(mod.ENTRY, *mod.fake_args(), options="--gpu-arch sm_90a --enable-tvm-ffi remarks{ptx}")
    out = "".join(capfd.readouterr())
    assert len(re.findall(r"Used (\d+) registers", out)) == 1 and "0 bytes spill stores, 0 bytes spill loads" in out, \
        out[-2000:]


@pytest.mark.parametrize("N,K,b,KS,BN", [(3584, 7168, 64, 4, 64), (7168, 768, 32, 3, 128), (768, 7168, 16, 16, 64)])
def test_gemv_wgmma_gather_compiles(N, K, b, KS, BN, monkeypatch):
    """K3FUSE_WG_GATHER (default 1): route adds GL = 1 to wgmma configs with KS > 1 (only there); with 0 it adds
    nothing. With it the cluster sum's ld.shared::cluster loads are ceil(NACC / KS) x KS per thread
    (one entry per rank stride), all before the first output store in the PTX; in the SASS (codegen/sass.py) a chain of
    at most 3 round trips where the default has one per entry; the same MMAs; no local memory."""
    from k3fuse.codegen import sass
    cfg = gemv.wg_config(N, K, b, KS, 4, BN)
    on = dict(cfg, GL=1)
    assert gemv._clean(on) == on and gemv._clean(dict(cfg, GL=0)) == cfg
    monkeypatch.setenv("K3FUSE_WG_GATHER", "0")
    assert gemv._with_gather(cfg) == cfg
    monkeypatch.setenv("K3FUSE_WG_GATHER", "")                          # set empty: the default
    assert gemv._with_gather(cfg) == on
    monkeypatch.delenv("K3FUSE_WG_GATHER", raising=False)               # the default
    assert gemv._with_gather(cfg) == on and gemv._with_gather(dict(cfg, KS=1)) == dict(cfg, KS=1)
    assert gemv._with_gather({"variant": "mma", "W": 4}) == {"variant": "mma", "W": 4}
    src0, src = gemv.render_source(N, K, b, cfg)[1], gemv.render_source(N, K, b, on)[1]
    assert "pv[j, q] = ld_cluster_f32" not in src0 and "pv[j, q] = ld_cluster_f32" in src
    k0, k = gemv.build(N, K, b, cfg, arch="sm_90a", load=False), gemv.build(N, K, b, on, arch="sm_90a", load=False)
    ptx0, ptx = ptx_of(k0), ptx_of(k)
    nacc = BN * b // 128
    loads = [m.start() for m in re.finditer(r"ld\.shared::cluster\.f32", ptx)]
    assert len(loads) == -(-nacc // KS) * KS and max(loads) < ptx.find("st.global")
    mma = r"wgmma\.mma_async\.sync\.aligned"
    assert len(re.findall(mma, ptx)) == len(re.findall(mma, ptx0))
    assert "ld.local" not in ptx and "st.local" not in ptx
    if sass.find_disassembler() is None:
        pytest.skip("no nvdisasm / cuobjdump: the SASS is not read")
    (r0,), (r,) = sass.read(k0.files["kernel.cubin"]), sass.read(k.files["kernel.cubin"])
    if nacc > KS:                       # else one entry per thread at most: nothing to gather
        assert r.path <= 3 and r0.path >= nacc // KS > r.path


def test_gemv_wgmma_configs_and_route(monkeypatch):
    """The wgmma variant's rules: buckets 16-64, K a multiple of 64 * KS with KS <= 16, N a multiple of 8, the stages'
    shared memory within 200 KiB, no pdl prologue; sm_90a only (a clear error for other targets); the default takes
    the fewest splits up to 8 that give WG_GRID CTAs; the tuner's wgmma candidates (timed on sm_90 devices only) are all
    supported, with clusters of 9-16 only where 8 splits leave fewer than WG_GRID CTAs; K3FUSE_GEMV_WGMMA=1 routes k3fuse::linear to it only on an sm_90 device, and a grouped GEMV declines
    it."""
    from k3fuse.codegen import compile as kc
    assert gemv.wg_supports(7168, 3584, 8, {"KS": 1, "ST": 8})                        # bucket 8
    assert gemv.wg_supports(7168, 3584, 64, {"KS": 3, "ST": 8})                       # 3584 % 192
    assert gemv.wg_supports(7168, 3584, 64, {"KS": 16, "ST": 4})                      # 3584 % 1024
    assert gemv.wg_supports(768, 7168, 64, {"KS": 16, "ST": 4}) is None               # Hopper's largest cluster
    assert gemv.wg_supports(768, 7168, 64, {"KS": 28, "ST": 4})                       # clusters of <= 16
    assert gemv.wg_supports(7168, 3584, 64, {"KS": 2, "ST": 12})                      # 12 x 16 KB + 16 KB > 200 KiB
    assert gemv.wg_supports(7168, 3584, 64, {"KS": 1, "ST": 8, "pdl": 1})
    assert gemv.wg_supports(7168, 3584, 64, {"KS": 2, "ST": 8}) is None
    assert gemv.wg_supports(7168, 3584, 64, {"KS": 2, "ST": 8, "BN": 96})             # BN one of 64, 128
    assert gemv.wg_supports(7168, 3584, 64, {"KS": 2, "ST": 8, "BN": 128})            # 8 x 24 KB + 32 KB > 200 KiB
    assert gemv.wg_supports(7168, 3584, 64, {"KS": 2, "ST": 6, "BN": 128}) is None
    assert gemv.wg_default(768, 7168, 64) == {"variant": "wgmma", "KS": 8, "ST": 8, "BN": 64}   # 12 x 8
    assert gemv.wg_default(7168, 768, 32) == {"variant": "wgmma", "KS": 1, "ST": 8, "BN": 64}   # 112
    assert gemv.wg_default(7168, 384, 16) == {"variant": "wgmma", "KS": 1, "ST": 6, "BN": 64}   # 6 k-tiles
    assert gemv.wg_default(3584, 7168, 64) == {"variant": "wgmma", "KS": 2, "ST": 8, "BN": 64}
    bns = set()
    for N, K in ((768, 7168), (7168, 3584), (3216, 7168), (2320, 1536)):
        cands = gemv.wg_candidates(N, K, 32)
        assert cands and all(gemv.supports(N, K, 32, c) is None for c in cands)
        bns |= {c["BN"] for c in cands}
    assert bns == {64, 128}     # 128 rows per CTA where the grid still has >= WG_GRID / 2 CTAs
    wide = {c["KS"] for c in gemv.wg_candidates(768, 7168, 64) if c["KS"] > gemv.WG_KS_MAX}
    assert wide == {14, 16}     # 12 row tiles x 8 splits = 96 < WG_GRID: clusters of 14 and 16 (7168 / 64 = 112 k-tiles)
    assert all(c["KS"] <= gemv.WG_KS_MAX for c in gemv.wg_candidates(3216, 7168, 64))   # 51 x 8 >= WG_GRID
    assert not [c for c in gemv.candidates(768, 7168, 64) if c["variant"] == "wgmma"]  # arch-free list: none
    with pytest.raises(ValueError, match="sm_90a only"):
        gemv.build(768, 7168, 64, gemv.wg_default(768, 7168, 64), arch="sm_100a", load=False)
    monkeypatch.setenv("K3FUSE_GEMV_WGMMA", "1")
    monkeypatch.setattr(kc, "current_arch", lambda: "sm_100a")
    gemv._device_arch.cache_clear()                     # asked once per process
    assert (gemv.route(768, 7168, 64)[0] or {}).get("variant") != "wgmma"
    monkeypatch.setattr(kc, "current_arch", lambda: "sm_90a")
    gemv._device_arch.cache_clear()
    assert gemv.route(768, 7168, 64)[0] == dict(gemv.wg_default(768, 7168, 64), GL=1)     # KS 8: WG_GATHER's GL
    assert gemv.route(768, 7168, 17)[0] == dict(gemv.wg_default(768, 7168, 32), GL=1)
    assert (gemv.route(768, 7168, 8)[0] or {}).get("variant") != "wgmma"
    cfg, why = gemv.group_route([3584, 768], 7168, 64)
    assert cfg is None and "wgmma" in why
    monkeypatch.delenv("K3FUSE_GEMV_WGMMA")
    # without the knob the H200 table decides: wgmma where it won in the layer (session 36), not elsewhere
    assert gemv.route(768, 7168, 64, gpu="nvidia_h200")[0] == {"variant": "wgmma", "KS": 8, "ST": 4, "BN": 64, "GL": 1}
    assert (gemv.route(7168, 768, 64, gpu="nvidia_h200")[0] or {}).get("variant") != "wgmma"
    assert (gemv.route(1536, 7168, 64, gpu="nvidia_h200")[0] or {}).get("variant") != "wgmma"   # lost in the layer
    monkeypatch.undo()
    gemv._device_arch.cache_clear()                     # not the patched arch for later tests



def test_gemv_wgmma_table_entry_routes_on_sm90_only(monkeypatch, tmp_path):
    """A tuning-table (here: overlay) entry naming the wgmma variant routes k3fuse::linear to it for sm_90a; for
    another target the route falls back to the unfused path with a reason, instead of failing to compile."""
    import json as _json
    over = tmp_path / "wgmma_overlay.json"
    over.write_text(_json.dumps({"entries": {"gemv:768x7168": {"64": {"variant": "wgmma", "KS": 8, "ST": 4}}}}))
    monkeypatch.setenv("K3FUSE_TUNING_OVERLAY", str(over))
    assert gemv.route(768, 7168, 64, gpu="nvidia_h200", arch="sm_90a")[0] == \
        {"variant": "wgmma", "KS": 8, "ST": 4, "BN": 64, "GL": 1}       # GL: K3FUSE_WG_GATHER's default
    cfg, why = gemv.route(768, 7168, 64, gpu="nvidia_h200", arch="sm_100a")
    assert cfg is None and "sm_90a only" in why
