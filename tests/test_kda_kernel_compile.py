"""k3fuse::kda_recurrent kernel (codegen/kda_recurrent.py): renders and compiles for sm_90a and sm_100a without a
GPU; the PTX has 128-bit state loads / stores and ptxas reports no spills."""
import re

import pytest

pytest.importorskip("cutlass")

from k3fuse.codegen import compile as kcompile  # noqa: E402
from k3fuse.codegen import kda_recurrent as kr  # noqa: E402

ARCHES = ["sm_90a", "sm_100a"]


pytestmark = pytest.mark.usefixtures("isolated_kernel_cache")


def is_128bit(op):
    """ld/st.global[.qualifiers].vN.{b,u,s,f}BITS with N * BITS == 128 (sm_100a prints v2.b64)."""
    m = re.search(r"\.v(\d)\.[bsuf](\d+)$", op)
    return bool(m) and int(m.group(1)) * int(m.group(2)) == 128


def ops(ptx, kind):
    return re.findall(rf"\b{kind}\.global(?:\.[a-z0-9:_]+)*", ptx)


# (d, a dtype, b dtype, lanes per row)
CASES = [(128, "bfloat16", "bfloat16", 2), (128, "float32", "float32", 2), (64, "bfloat16", "float32", 2)]


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("d,adt,bdt,lpr", CASES)
def test_kda_kernel_compiles(arch, d, adt, bdt, lpr):
    k = kr.build(d, adt, bdt, -5.0, lpr, arch=arch, load=False)
    assert {"kernel.py", "kernel.ptx", "kernel.cubin"} <= set(k.files)
    ptx = open(k.files["kernel.ptx"]).read()
    assert f".target {arch}" in ptx
    loads, stores = ops(ptx, "ld"), ops(ptx, "st")
    nch = d // 4 // lpr
    # the lane's share of its S row: nch 128-bit loads and nch 128-bit stores, nothing narrower but o and scalars
    assert sum(map(is_128bit, loads)) >= nch, loads
    assert sum(map(is_128bit, stores)) == nch, stores
    assert all(is_128bit(s) or re.search(r"\.[bf]32$", s) for s in stores), stores
    assert len(stores) == nch + 1                        # + the scalar store of o[row]
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "bar.sync" in ptx or "barrier.sync" in ptx


@pytest.mark.parametrize("arch", ARCHES)
def test_kda_kernel_no_spills(arch, tmp_path, capfd):
    """ptxas remarks (remarks{ptx}) for the K3 configuration (d = 128, bf16 a / b): no spills, <= 128 registers
    (so two 256-thread CTAs fit per SM)."""
    import cutlass.cute as cute
    mod = kcompile._import_source(kr.render_source(128, "bfloat16", "bfloat16", -5.0), f"kda_spills_{arch}", tmp_path)
    capfd.readouterr()
    cute.compile(mod.ENTRY, *mod.fake_args(), options=f"--gpu-arch {arch} --enable-tvm-ffi remarks{{ptx}}")
    out = "".join(capfd.readouterr())
    regs = re.findall(r"Used (\d+) registers", out)
    assert regs, out[-2000:]
    assert "0 bytes spill stores, 0 bytes spill loads" in out and "detected register spills" not in out, out[-2000:]
    assert int(regs[0]) <= 128, regs


def test_kda_compile_key_and_supports():
    base = kr.render_source(128)
    variants = [kr.render_source(64), kr.render_source(128, "float32"), kr.render_source(128, b_dtype="float32"),
                kr.render_source(128, lpr=4), kr.render_source(128, lower_bound=-4.0)]
    assert len({base, *variants}) == 1 + len(variants)          # every compile-time value changes the source
    assert kcompile.cache_key(base, "sm_90a") != kcompile.cache_key(base, "sm_100a")
    assert kr.supports(96) and kr.supports(128, 3) and kr.supports(128) is None and kr.supports(64, 1) is None
    with pytest.raises(ValueError):
        kr.render_source(256)


def test_kda_fallback_on_cpu():
    """On CPU tensors (or unsupported shapes) kda_recurrent_cuda returns the reference, with one log line."""
    import torch
    from k3fuse import ops
    M, h, d = 2, 3, 32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(M, h, d, generator=g) for _ in range(3))
    a = torch.randn(M, h * d, generator=g).to(torch.bfloat16)
    dt, A_log, b = torch.randn(h * d, generator=g), torch.rand(h, generator=g), torch.randn(M, h, generator=g)
    S = torch.randn(M, h, d, d, generator=g)
    assert kr.launch_ok(q, k, v, a, dt, A_log, b, S) is not None          # d = 32
    o, Sn = kr.kda_recurrent_cuda(q, k, v, a, dt, A_log, b, S, -5.0)
    ro, rS = ops.kda_recurrent._init_fn(q, k, v, a, dt, A_log, b, S, -5.0)
    assert torch.equal(o, ro) and torch.equal(Sn, rS)
    assert set(kr.IMPLS) == {"k3fuse::kda_recurrent", "k3fuse::kda_decode", "k3fuse::kda_decode_"}


FUSED_K3 = dict(kc=4, fk=128, newest_last=True, x="bfloat16", f="bfloat16", g="bfloat16", o="bfloat16", eps=1e-5)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("fused", [FUSED_K3, dict(FUSED_K3, newest_last=False, x="float32", f="float32", o="float32",
                                                  kc=3, fk=64)])
def test_kda_decode_kernel_compiles(arch, fused, capfd, tmp_path, monkeypatch):
    """The fused variant (k3fuse::kda_decode): the S row still moves in 128-bit loads / stores, f_b in 128-bit
    loads, no local memory; the conv state writes are the window shift (K - 1 per channel)."""
    d, lpr = 128, kr.DEFAULT_LPR
    k = kr.build(d, "bfloat16", "bfloat16", -5.0, arch=arch, load=False, fused=fused)
    ptx = open(k.files["kernel.ptx"]).read()
    loads, stores = ops(ptx, "ld"), ops(ptx, "st")
    nch = d // 4 // lpr
    fch = fused["fk"] // (8 if fused["f"] == "bfloat16" else 4) // lpr
    assert sum(map(is_128bit, stores)) == nch, stores
    assert sum(map(is_128bit, loads)) >= nch + 2 * fch, loads         # S row + f_b row and fa chunks
    # conv state: 3 warps x (d / 32 channels per lane) x (K - 1) shifted values, + o[row], + the 128-bit S stores
    assert len(stores) == nch + 3 * (d // 32) * (fused["kc"] - 1) + 1, len(stores)
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert f"KC = {fused['kc']} " in open(k.files["kernel.py"]).read()


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("lpr", [1, 4])
def test_kda_decode_lanes_per_row_knob_compiles(arch, lpr, monkeypatch):
    """K3FUSE_KDA_LPR (decode_lpr()): the fused kernel at 1 or 4 lanes per S row (128 / 512 threads) keeps its S row
    in 128-bit loads / stores (d / 4 / lpr chunks per lane) and no local memory; the knob reaches launch_ok_decode's
    check and the built kernel."""
    monkeypatch.setenv("K3FUSE_KDA_LPR", str(lpr))
    assert kr.decode_lpr() == lpr
    k = kr.build(128, "bfloat16", "bfloat16", -5.0, lpr=kr.decode_lpr(), arch=arch, load=False, fused=FUSED_K3)
    ptx = open(k.files["kernel.ptx"]).read()
    assert sum(map(is_128bit, ops(ptx, "st"))) == 128 // 4 // lpr
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert f"LPR = {lpr} " in open(k.files["kernel.py"]).read()
    monkeypatch.delenv("K3FUSE_KDA_LPR")
    assert kr.decode_lpr() == kr.DEFAULT_LPR


def test_kda_decode_supports_and_fallback_on_cpu():
    """supports_fused says why; on CPU kda_decode_cuda is the reference (one log line)."""
    import torch
    from k3fuse import ops
    assert kr.supports_fused(128, 4, 128) is None and kr.supports_fused(64, 4, 128) is None
    assert "warps" in kr.supports_fused(64, 4, 128, lpr=1) and "taps" in kr.supports_fused(128, 9, 128)
    assert "multiple" in kr.supports_fused(128, 4, 100)
    M, h, d, K = 2, 2, 64, 4
    P = h * d
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    rn = lambda *s, dt=torch.float32: torch.randn(*s, generator=g).to(dt)
    args = (rn(M, P, dt=bf), rn(M, P, dt=bf), rn(M, P, dt=bf), rn(M, K - 1, 3 * P, dt=bf), rn(P, K), rn(P, K),
            rn(P, K), rn(M, 64, dt=bf), rn(P, 64, dt=bf), rn(P), torch.rand(h, generator=g), rn(M, h, dt=bf),
            rn(M, P, dt=bf), rn(d), rn(M, h, d, d))
    assert kr.launch_ok_decode(*args, bf) is None                      # the kernel's shapes; on CPU: the reference
    got = kr.kda_decode_cuda(*args, -5.0, 1e-5, True, bf)
    ref = ops.kda_decode._init_fn(*args, -5.0, 1e-5, True, bf)
    assert all(torch.equal(x, y) for x, y in zip(got, ref))
    assert "conv state" in kr.launch_ok_decode(*args[:3], args[3][:, :2], *args[4:], bf)


