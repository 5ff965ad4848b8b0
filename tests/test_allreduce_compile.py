"""In-kernel all-reduce + mix-norm (templates/mixnorm_allreduce.py.jinja) without a GPU: it renders and compiles for
sm_90a / sm_100a, its PTX has the system-scope release/acquire protocol and the %globaltimer timeout, its math is
the mix-norm template's, and the emulated peer-buffer backend keeps its books."""
import re
import textwrap

import pytest
import torch

from k3fuse import peer_buffers as pbuf
from k3fuse.codegen import mixnorm_allreduce as mar

ARCHES = ["sm_90a", "sm_100a"]
H = 7168


@pytest.fixture(autouse=True, scope="module")
def _fresh_memo():
    """codegen.compile.clear_memo() (used by the shared cache fixture) does not know this family's memo yet."""
    mar._built.clear()
    yield
    mar._built.clear()


def ptx_of(k):
    return open(k.files["kernel.ptx"]).read()


# flag variants rotate over the (W, max_m) grid so every template branch is compiled somewhere
VARIANTS = [dict(nb=3, has_addend=False, has_prefix=True, has_norm=True, fp32_norm=False),
            dict(nb=0, has_addend=True, has_prefix=True, has_norm=True, fp32_norm=True),
            dict(nb=8, has_addend=True, has_prefix=False, has_norm=False, fp32_norm=False)]


@pytest.mark.usefixtures("isolated_kernel_cache")
@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("W", [2, 4, 8])
@pytest.mark.parametrize("M", [1, 8, 64])
def test_allreduce_kernel_compiles_with_protocol(arch, W, M):
    """M is a runtime dim of the kernel (grid = M); it fixes the peer regions' max_m, whose offsets are baked in."""
    pytest.importorskip("cutlass")
    v = VARIANTS[(W + M) % len(VARIANTS)]
    k = mar.build(H, v["nb"], W, v["has_addend"], v["has_prefix"], v["has_norm"], v["fp32_norm"], max_m=M,
                  arch=arch, load=False)
    ptx = ptx_of(k)
    L = pbuf.BufferLayout(H, M)
    assert "fence.acq_rel.sys" in ptx
    # the flag store into a peer's region (flags at FLAG_OFF) and the polling load of our own flags
    assert re.search(rf"st\.release\.sys\.global\.b32\s+\[%rd\d+\+{L.flag_off}\]", ptx), "release flag store"
    assert re.search(rf"ld\.acquire\.sys\.global\.b32\s+%r\d+, \[%rd\d+\+{L.flag_off}\]", ptx), "acquire poll"
    assert "%globaltimer" in ptx
    assert "atom.global.acq_rel.add" in ptx           # the CTA arrival counter
    assert "atom.global.cas.b32" in ptx               # first error wins
    assert "griddepcontrol" not in ptx and "multimem" not in ptx
    # 16-byte loads: one per rank in the sum, plus y_part, the sources and the weights (the fp32 w_mix and the
    # peer-pointer table may come as v2.b64 too, so this is a lower bound)
    loads = len(re.findall(r"ld\.global\.(?:v4\.b32|v2\.b64)", ptx))
    n_src = v["nb"] + int(v["has_addend"]) + int(v["has_prefix"]) + int(v["has_norm"]) + 1
    assert loads >= W + n_src + 1, loads
    assert not re.search(r"ld\.global\.(?:b16|u16|v2\.b32)", ptx), "bf16 rows must be read 16 bytes at a time"


def _tail(src: str, start: str, stop: str) -> str:
    i = src.index(start) + len(start)
    return textwrap.dedent(src[src.index("\n", i) + 1:src.index(stop, i)]).strip()


@pytest.mark.parametrize("v", VARIANTS)
def test_math_is_the_mixnorm_templates(v, monkeypatch):
    """After y (the reduced row) the all-reduce kernel runs the one-CTA mix-norm template's code verbatim: same math,
    same rounding points, so its outputs match the TP = 1 path (K3FUSE_MIXNORM_CLUSTER=1) to the bit for the same y."""
    from k3fuse.codegen import fused_residual_norm as frn
    monkeypatch.setenv("K3FUSE_MIXNORM_CLUSTER", "1")
    args = (H, v["nb"], v["has_addend"], v["has_prefix"], v["has_norm"], v["fp32_norm"], 1e-5, 1e-6)
    ref = _tail(frn.render_mixnorm(*args), "y = t.load().to(Float32)", "@cute.jit")
    ours = _tail(mar.render_source(H, v["nb"], 4, *args[2:]), "y = acc.to(BFloat16).to(Float32)", "# -- 4. arrive")
    assert ours == ref


def test_render_rejects_bad_world():
    with pytest.raises(ValueError):
        mar.render_source(H, 3, 9)
    with pytest.raises(ValueError):
        mar.render_source(H, 9, 2)


def test_layout_offsets_in_rendered_source():
    src = mar.render_source(H, 3, 4, max_m=8)
    L = pbuf.BufferLayout(H, 8)
    for name, val in [("SLOT_BYTES", L.slot_bytes), ("ROW_BYTES", L.row_bytes), ("FLAG_OFF", L.flag_off),
                      ("MAX_M", 8), ("W", 4), ("TIMEOUT_NS", mar.TIMEOUT_NS)]:
        assert re.search(rf"^{name} = {val}\b", src, re.M), name
    # the counter word indices the template hard-codes are the runtime's
    m = re.search(r"^C_EPOCH, .* = (.*)$", src, re.M)
    assert [int(x) for x in m.group(1).split(",")] == [pbuf.C_EPOCH, pbuf.C_ARRIVE, pbuf.C_ERR, pbuf.C_ERR_RANK,
                                                       pbuf.C_ERR_ROW, pbuf.C_ERR_SRC, pbuf.C_ERR_EPOCH, pbuf.C_RANK]


# ------------------------------------------------------------------------------------------- peer buffers
def test_env_defaults_disable_multicast():
    import os
    assert os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") is not None
    assert os.environ.get("NCCL_NVLS_ENABLE") is not None


@pytest.mark.parametrize("W", [1, 2, 4, 8])
def test_emulated_world_bookkeeping(W):
    ranks = pbuf.emulated_world(W, hidden=256, max_m=8, device="cpu")
    L = ranks[0].layout
    assert L.flag_off >= 2 * 8 * 256 * 4 and L.cnt_off >= L.flag_off + 8 * 8 * 4
    assert L.total_bytes % 256 == 0 and L.slot_bytes % 256 == 0
    bases = [r.region.data_ptr() for r in ranks]
    assert len(set(bases)) == W
    for r, pb in enumerate(ranks):
        assert (pb.world, pb.rank, pb.backend) == (W, r, "emulated")
        assert pb.ptrs.dtype == torch.int64 and pb.ptrs.tolist() == bases      # one table, every rank's view
        c = pb.counters()
        assert c[pbuf.C_EPOCH] == 1 and c[pbuf.C_RANK] == r and c[pbuf.C_ARRIVE] == 0
        assert pb.epoch() == 1 and pb.error() is None
        assert pb.flags().shape == (pbuf.MAX_WORLD, 8) and not pb.flags().any()
        assert pb.partial.shape == (8, 256) and pb.partial.dtype == torch.bfloat16
        # views sit where the kernel expects them, inside this rank's region, without overlapping
        s0, s1 = pb.slot(0, 8), pb.slot(1, 3)
        assert s0.data_ptr() == bases[r] and s1.data_ptr() == bases[r] + L.slot_bytes and s1.shape == (3, 256)
        assert pb.flags().data_ptr() == bases[r] + L.flag_off
        assert c.data_ptr() == bases[r] + L.cnt_off
        assert c.data_ptr() + 4 * pbuf.CNT_WORDS <= bases[r] + L.total_bytes


def test_error_record_and_reset():
    ranks = pbuf.emulated_world(2, hidden=64, max_m=4, device="cpu")
    pb = ranks[1]
    mar.check_error(pb)                  # nothing recorded
    c = pb.counters()
    c[pbuf.C_ERR], c[pbuf.C_ERR_RANK], c[pbuf.C_ERR_ROW], c[pbuf.C_ERR_SRC], c[pbuf.C_ERR_EPOCH] = 1, 1, 3, 0, 7
    c[pbuf.C_EPOCH] = 8
    pb.flags()[0, 3] = 7
    assert pb.error() == dict(code=1, rank=1, row=3, missing_src=0, epoch=7)
    with pytest.raises(RuntimeError, match=r"rank 1 of 2: row 3 never got peer 0's flag for epoch 7"):
        mar.check_error(pb)
    pb.reset()
    assert pb.error() is None and pb.epoch() == 1 and not pb.flags().any() and c[pbuf.C_RANK] == 1


def test_peer_buffers_rejects_bad_args():
    L = pbuf.BufferLayout(64, 4)
    region = torch.empty(L.total_bytes, dtype=torch.uint8)
    ptrs = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError):
        pbuf.PeerBuffers(2, 2, L, region, ptrs, "emulated")
    with pytest.raises(ValueError):
        pbuf.PeerBuffers(9, 0, L, region, ptrs, "emulated")
    with pytest.raises(ValueError):
        pbuf.PeerBuffers(2, 0, L, region[:-1], ptrs, "emulated")


@pytest.mark.parametrize("v", VARIANTS)
def test_host_api_passes_what_the_kernel_takes(v, monkeypatch, tmp_path):
    """fused_residual_norm_ar's argument list against the template's fake_args(): count, dtypes and shapes
    (the compiled function would reject a mismatch only on a GPU)."""
    pytest.importorskip("cutlass")
    from cutlass import BFloat16, Float32, Int32, Int64
    from k3fuse.codegen.compile import _import_source
    W, M = 4, 3
    src = mar.render_source(H, v["nb"], W, v["has_addend"], v["has_prefix"], v["has_norm"], v["fp32_norm"])
    fake = _import_source(src, f"hostapi{v['nb']}", tmp_path).fake_args()[:-1]     # drop the stream
    seen = []
    monkeypatch.setattr(mar, "build", lambda *a, **k: (lambda *args: seen.append(args)))
    monkeypatch.setattr(mar, "gemv_into", lambda o, w, y: y.copy_((o.float() @ w.float().t()).to(y.dtype)))
    peer = pbuf.emulated_world(W, H, device="cpu")[1]
    bf = torch.bfloat16
    blocks_buf = torch.zeros(M, 8, H, dtype=bf)
    out, newp = mar.fused_residual_norm_ar(
        torch.zeros(M, 64, dtype=bf), torch.zeros(H, 64, dtype=bf), torch.zeros(M, H, dtype=bf) if v["has_addend"]
        else None, torch.zeros(M, H, dtype=bf) if v["has_prefix"] else None,
        [blocks_buf[:, i] for i in range(v["nb"])], torch.zeros(H, dtype=bf),
        torch.ones(H, dtype=bf) if v["has_norm"] else None, 1e-5, 1e-5, peer, v["fp32_norm"])
    (args,) = seen
    assert len(args) == len(fake)
    to_cute = {torch.bfloat16: BFloat16, torch.float32: Float32, torch.int32: Int32, torch.int64: Int64}
    for i, (a, f) in enumerate(zip(args, fake)):
        assert to_cute[a.dtype] == f.element_type, (i, a.dtype, f.element_type)
        assert a.dim() == len(f.shape), i
    assert args[-2] is peer.ptrs and args[-1].data_ptr() == peer.counters().data_ptr()
    assert args[0].data_ptr() == peer.partial.data_ptr() and args[0].shape == (M, H)
    assert out.shape == (M, H) and out.dtype == (bf if v["has_norm"] else torch.float32)
    assert args[-4] is out and args[-3] is newp


# ------------------------------------------------------------------------------------------- addend_partial
@pytest.mark.usefixtures("isolated_kernel_cache")
@pytest.mark.parametrize("arch", ARCHES)
def test_partial_addend_compiles(arch):
    """addend_partial (the MoE split's routed slice): the kernel adds it to the partial at the publish, so the
    reduction completes it; one more 16-byte load per vector, the protocol unchanged."""
    pytest.importorskip("cutlass")
    W, M = 8, 8
    base = ptx_of(mar.build(H, 3, W, False, True, True, False, max_m=M, arch=arch, load=False))
    k = mar.build(H, 3, W, False, True, True, False, max_m=M, arch=arch, load=False, has_paddend=True)
    ptx = ptx_of(k)
    L = pbuf.BufferLayout(H, M)
    assert re.search(rf"st\.release\.sys\.global\.b32\s+\[%rd\d+\+{L.flag_off}\]", ptx)
    assert re.search(rf"ld\.acquire\.sys\.global\.b32\s+%r\d+, \[%rd\d+\+{L.flag_off}\]", ptx)
    assert "%globaltimer" in ptx and "fence.acq_rel.sys" in ptx and "multimem" not in ptx
    n = len(re.findall(r"ld\.global\.(?:v4\.b32|v2\.b64)", ptx))
    assert n > len(re.findall(r"ld\.global\.(?:v4\.b32|v2\.b64)", base)), "the partial addend's row load"
    assert not re.search(r"ld\.global\.(?:b16|u16|v2\.b32)", ptx)


def test_partial_addend_render(monkeypatch):
    monkeypatch.setenv("K3FUSE_MIXNORM_CLUSTER", "1")      # compared with the one-CTA mix-norm below
    src = mar.render_source(H, 3, 4, has_paddend=True)
    assert "mQ: cute.Tensor" in src and "bf16(addend + y) per rank" in src and "mA: cute.Tensor" not in src
    with pytest.raises(ValueError, match="one addend"):
        mar.render_source(H, 3, 4, has_addend=True, has_paddend=True)
    # after y the math is still the mix-norm template's (no complete addend)
    from k3fuse.codegen import fused_residual_norm as frn
    ref = _tail(frn.render_mixnorm(H, 3, False, True, True, False, 1e-5, 1e-5), "y = t.load().to(Float32)",
                "@cute.jit")
    assert _tail(src, "y = acc.to(BFloat16).to(Float32)", "# -- 4. arrive") == ref


def test_host_api_partial_addend(monkeypatch, tmp_path):
    """fused_residual_norm_ar(addend_partial=True) hands the addend to the kernel right after the partial (fake_args
    order) and leaves the GEMV's partial as it was (no host-side add: the kernel adds it at the publish)."""
    pytest.importorskip("cutlass")
    from k3fuse.codegen.compile import _import_source
    W, M = 4, 3
    src = mar.render_source(H, 3, W, False, True, True, False, has_paddend=True)
    fake = _import_source(src, "hostapi_paddend", tmp_path).fake_args()[:-1]
    seen, built = [], []
    monkeypatch.setattr(mar, "build", lambda *a, **k: (built.append((a, k)), lambda *args: seen.append(args))[1])
    monkeypatch.setattr(mar, "gemv_into", lambda o, w, y: y.copy_((o.float() @ w.float().t()).to(y.dtype)))
    peer = pbuf.emulated_world(W, H, device="cpu")[1]
    bf = torch.bfloat16
    o, w = torch.randn(M, 64).to(bf), torch.randn(H, 64).to(bf)
    a = torch.randn(M, H).to(bf)
    blocks_buf = torch.zeros(M, 8, H, dtype=bf)
    mar.fused_residual_norm_ar(o, w, a, torch.zeros(M, H, dtype=bf), [blocks_buf[:, i] for i in range(3)],
                               torch.zeros(H, dtype=bf), torch.ones(H, dtype=bf), 1e-5, 1e-5, peer,
                               addend_partial=True)
    (args,) = seen
    assert len(args) == len(fake) and args[1] is a and args[0].data_ptr() == peer.partial.data_ptr()
    (bargs, bkw), = built
    assert bargs[3] is False and bkw["has_paddend"] is True        # no complete addend, a partial one
    assert torch.equal(peer.partial[:M], (o.float() @ w.float().t()).to(bf))
