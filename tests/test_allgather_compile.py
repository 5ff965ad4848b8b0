"""One-shot in-kernel all-gather (templates/allgather_oneshot.py.jinja, codegen/allgather_oneshot.py) without a GPU:
it renders and compiles for sm_90a / sm_100a at the byte widths the MoE split gathers, its PTX has the
system-scope protocol, the %globaltimer timeout and 16-byte moves only; the peer buffers' gather region keeps its
books; the host API's views put rank p's row m where all_gather_into_tensor / torch.cat put it (checked by
running the protocol in Python over emulated CPU regions, at the template's own offsets)."""
import re

import pytest
import torch

from k3fuse import peer_buffers as pbuf
from k3fuse.codegen import allgather_oneshot as ag
from k3fuse.codegen import mixnorm_allreduce as mar
from k3fuse.models.config import KimiK3Config

ARCHES = ["sm_90a", "sm_100a"]
CFG = KimiK3Config()
H = CFG.hidden_size


def packed_row_bytes(t: int) -> int:
    """The split pass's merged gather at TP = t: fp32 router logits of E/t experts bit-cast to bf16, then the
    z shard [D/t] bf16 (passes/split_moe_across_ranks.py)."""
    return CFG.num_experts // t * 4 + CFG.routed_expert_hidden_size // t * 2


def up_row_bytes(t: int) -> int:
    """The up-projection slice the pass gathers when the attention-output fusion is absent: [H/t] bf16."""
    return H // t * 2


def test_k3_widths():
    # 896 experts, latent 3584: 112 * 4 + 448 * 2 at TP8, 56 * 4 + 224 * 2 at TP16
    assert packed_row_bytes(8) == 1344 and packed_row_bytes(16) == 672
    assert packed_row_bytes(2) == 5376 and packed_row_bytes(4) == 2688
    for t in (2, 4, 8, 16):
        assert packed_row_bytes(t) % 16 == 0 and up_row_bytes(t) % 16 == 0
        assert max(packed_row_bytes(t), up_row_bytes(t)) <= pbuf.BufferLayout(H).ag_row_cap


@pytest.fixture(autouse=True, scope="module")
def _fresh_memo():
    ag._built.clear()
    mar._built.clear()
    yield
    ag._built.clear()
    mar._built.clear()


def ptx_of(k):
    return open(k.files["kernel.ptx"]).read()


WS, MS = [2, 4, 8], [1, 8, 64]


@pytest.mark.usefixtures("isolated_kernel_cache")
@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("W", WS)
@pytest.mark.parametrize("M", MS)
def test_gather_kernel_compiles_with_protocol(arch, W, M):
    """The packed widths at TP8 and TP16 (and at TP = W where that differs) at every (W, M) (M is runtime; it fixes
    max_m, whose offsets are baked in), plus the up-projection slice's width at TP = W for M = 64."""
    pytest.importorskip("cutlass")
    widths = sorted({packed_row_bytes(8), packed_row_bytes(16), packed_row_bytes(W)})
    for row_bytes in widths + ([up_row_bytes(W)] if M == 64 else []):
        k = ag.build(row_bytes, W, H, max_m=M, arch=arch, load=False)
        ptx = ptx_of(k)
        L = pbuf.BufferLayout(H, M)
        p = ag.params(row_bytes, W, L)
        assert "fence.acq_rel.sys" in ptx
        assert re.search(rf"st\.release\.sys\.global\.b32\s+\[%rd\d+\+{L.ag_flag_off}\]", ptx), "release flag store"
        assert re.search(rf"ld\.acquire\.sys\.global\.b32\s+%r\d+, \[%rd\d+\+{L.ag_flag_off}\]", ptx), "acquire poll"
        assert "%globaltimer" in ptx
        assert "atom.global.acq_rel.add" in ptx and "atom.global.cas.b32" in ptx
        assert "griddepcontrol" not in ptx and "multimem" not in ptx
        # every row byte moves as a 16-byte vector: one load per publish round and per read round
        loads = len(re.findall(r"ld\.global\.v4\.b32", ptx))
        stores = len(re.findall(r"st\.global\.v4\.b32", ptx))
        assert loads == p["VPT_PUB"] + p["VPT_OUT"] and stores == loads, (loads, stores, p)
        assert not re.search(r"ld\.global\.(?:b16|u16|b8|u8|v2\.b32|v2\.b16|v4\.b16)", ptx)
        # the only scalar global loads: the counters (epoch, rank) and the peer-pointer table
        assert set(re.findall(r"ld\.global\.(\w+)", ptx)) <= {"v4", "b32", "b64"}


def test_render_constants_match_layout():
    L = pbuf.BufferLayout(H, 8)
    src = ag.render_source(1344, 4, H, max_m=8)
    for name, val in [("SLOT_OFF", L.ag_off), ("SLOT_BYTES", L.ag_slot_bytes), ("ROW_BYTES", 1344),
                      ("FLAG_OFF", L.ag_flag_off), ("MAX_M", 8), ("W", 4), ("CV", 84), ("TIMEOUT_NS", ag.TIMEOUT_NS)]:
        assert re.search(rf"^{name} = {val}\b", src, re.M), name
    m = re.search(r"^C_EPOCH, .* = (.*)$", src, re.M)
    assert [int(x) for x in m.group(1).split(",")] == [pbuf.C_EPOCH, pbuf.C_ARRIVE, pbuf.C_ERR, pbuf.C_ERR_RANK,
                                                       pbuf.C_ERR_ROW, pbuf.C_ERR_SRC, pbuf.C_ERR_EPOCH, pbuf.C_RANK]
    compile(src, "<rendered>", "exec")


def test_shared_protocol_text():
    """The all-reduce and the all-gather emit the same flag / wait / timeout / arrive code (one macro file)."""
    def block(src, a, b):
        return src[src.index(a):src.index(b, src.index(a))]
    g = ag.render_source(1344, 4, H)
    r = mar.render_source(H, 3, 4)
    a, b = "    if tidx < W:\n        cute.arch.fence_acq_rel_sys()", "    cute.arch.barrier()\n\n    if sFail[0] == 0:"
    assert block(g, a, b) == block(r, a, b)
    a, b = "    # -- 4. arrive", "@cute.jit"
    assert block(g, a, b) == block(r, a, b)


def test_render_rejects():
    with pytest.raises(ValueError):
        ag.render_source(1344, 9)                    # world > MAX_WORLD
    with pytest.raises(ValueError):
        ag.render_source(1000, 2)                    # not a multiple of 16
    with pytest.raises(ValueError):
        ag.render_source(H * 2 + 16, 2)              # wider than the gather slots
    ag.render_source(2 * H * 2, 2, gather_row_bytes=2 * H * 2)     # unless the layout makes room


# ------------------------------------------------------------------------------------------- buffer layout
@pytest.mark.parametrize("hidden,max_m,grb", [(7168, 64, 0), (7168, 8, 0), (256, 4, 8192), (64, 1, 0)])
def test_layout_regions_disjoint_and_aligned(hidden, max_m, grb):
    L = pbuf.BufferLayout(hidden, max_m, gather_row_bytes=grb)
    # the all-reduce's offsets are those of the layout before the gather part existed
    assert L.flag_off == 2 * L.slot_bytes and L.cnt_off == L.flag_off + L.flag_bytes
    parts = [(0, 2 * L.slot_bytes), (L.flag_off, L.flag_bytes), (L.cnt_off, pbuf.CNT_WORDS * 4),
             (L.ag_off, 2 * L.ag_slot_bytes), (L.ag_flag_off, L.flag_bytes), (L.ag_cnt_off, pbuf.CNT_WORDS * 4)]
    for (a, n), (b, _) in zip(parts, parts[1:]):
        assert a + n <= b, parts
    assert parts[-1][0] + parts[-1][1] <= L.total_bytes and L.total_bytes % 256 == 0
    assert all(off % 256 == 0 for off, _ in parts)
    assert L.ag_row_cap == (grb or hidden * 2) and L.ag_slot_bytes >= max_m * L.ag_row_cap
    assert L.flag_cnt_offsets("allreduce") == (L.flag_off, L.cnt_off)
    assert L.flag_cnt_offsets("allgather") == (L.ag_flag_off, L.ag_cnt_off)
    with pytest.raises(ValueError):
        L.flag_cnt_offsets("reduce_scatter")
    with pytest.raises(ValueError):
        L.gather_template_params(L.ag_row_cap + 16)


@pytest.mark.parametrize("W", [1, 2, 8])
def test_emulated_world_gather_bookkeeping(W):
    ranks = pbuf.emulated_world(W, hidden=256, max_m=8, device="cpu")
    L = ranks[0].layout
    for r, pb in enumerate(ranks):
        base = pb.region.data_ptr()
        for kind in pbuf.COLLECTIVES:
            c = pb.counters(kind)
            assert c[pbuf.C_EPOCH] == 1 and c[pbuf.C_RANK] == r and c[pbuf.C_ARRIVE] == 0
            assert pb.epoch(kind) == 1 and pb.error(kind) is None and not pb.flags(kind).any()
        assert pb.counters("allgather").data_ptr() == base + L.ag_cnt_off
        assert pb.flags("allgather").data_ptr() == base + L.ag_flag_off
        assert pb.flags("allgather").shape == (pbuf.MAX_WORLD, 8)
        assert pb.gather_slot(1, 3, 48).data_ptr() == base + L.ag_off + L.ag_slot_bytes
        assert pb.gather_slot(0, 8, 512).shape == (8, 512)
        # the default views are still the all-reduce's
        assert pb.counters().data_ptr() == base + L.cnt_off and pb.flags().data_ptr() == base + L.flag_off


def test_gather_error_record_and_reset():
    ranks = pbuf.emulated_world(2, hidden=64, max_m=4, device="cpu")
    pb = ranks[0]
    c = pb.counters("allgather")
    c[pbuf.C_ERR], c[pbuf.C_ERR_RANK], c[pbuf.C_ERR_ROW], c[pbuf.C_ERR_SRC], c[pbuf.C_ERR_EPOCH] = 1, 0, 2, 1, 5
    c[pbuf.C_EPOCH] = 6
    pb.counters()[pbuf.C_EPOCH] = 9
    mar.check_error(pb)                          # the all-reduce's record is clean
    with pytest.raises(RuntimeError, match=r"all-gather timed out on rank 0 of 2: row 2 never got peer 1's flag "
                                           r"for epoch 5"):
        ag.check_error(pb)
    pb.reset()                                   # both collectives back to epoch 1
    assert pb.error("allgather") is None and pb.epoch("allgather") == 1 and pb.epoch() == 1


# ------------------------------------------------------------------------------------------- host API
class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def run_gather_python(ranks, calls, row_bytes):
    """Execute recorded kernel calls (x words, out [W, M, words], ptrs, counters) with the protocol's steps."""
    L = ranks[0].layout
    p = L.gather_template_params(row_bytes)
    by_base = {pb.region.data_ptr(): pb for pb in ranks}
    ptr_list = ranks[0].ptrs.tolist()
    # 1. publish + flag (every rank before any reads: the kernels run concurrently on the GPU)
    for pb, (x, out, ptrs, ctr) in zip(ranks, calls):
        assert ptrs is pb.ptrs and ctr.data_ptr() == pb.counters("allgather").data_ptr()
        e = int(ctr[pbuf.C_EPOCH])
        rank = int(ctr[pbuf.C_RANK])
        M = x.shape[0]
        assert out.shape[:2] == (pb.world, M)
        raw = x.contiguous().view(torch.uint8).view(M, row_bytes)
        off = p["SLOT_OFF"] + (e % 2) * p["SLOT_BYTES"]
        pb.region[off:off + M * row_bytes] = raw.reshape(-1)
        for t in range(pb.world):
            peer = by_base[ptr_list[t]]
            peer.flags("allgather")[rank, :M] = e
    # 2-4. wait, read, arrive
    for pb, (x, out, ptrs, ctr) in zip(ranks, calls):
        e = int(ctr[pbuf.C_EPOCH])
        M = x.shape[0]
        assert (pb.flags("allgather")[:pb.world, :M] - e >= 0).all()
        for src in range(pb.world):
            peer = by_base[ptr_list[src]]
            off = p["SLOT_OFF"] + (e % 2) * p["SLOT_BYTES"]
            rows = peer.region[off:off + M * row_bytes].view(M, row_bytes // 4 * 4).view(torch.int32)
            out[src] = rows
        ctr[pbuf.C_EPOCH] = e + 1


@pytest.mark.parametrize("W,M,dtype,C", [(2, 1, torch.bfloat16, 2688), (4, 8, torch.bfloat16, 672),
                                          (8, 3, torch.float32, 112), (4, 2, torch.uint8, 48)])
@pytest.mark.parametrize("layout", ag.LAYOUTS)
def test_host_views_match_all_gather_and_cat(W, M, dtype, C, layout, monkeypatch):
    """Two steps through all_gather_oneshot with the kernel emulated: the rank-major result is
    torch.cat(chunks, 0) (all_gather_into_tensor) and the row-major one torch.cat(chunks, 1), bit for bit, for any
    dtype (bits are bits: random int32 words, NaN payloads included)."""
    ranks = pbuf.emulated_world(W, hidden=H, max_m=8, device="cpu")
    rec = Recorder()
    monkeypatch.setattr(ag, "build_for", lambda *a, **k: rec)
    for step in range(2):
        rec.calls.clear()
        words = [torch.randint(-2**31, 2**31 - 1, (M, C * torch.tensor([], dtype=dtype).element_size() // 4),
                               dtype=torch.int32) for _ in range(W)]
        chunks = [w.view(dtype) for w in words]
        outs = [ag.all_gather_oneshot(x, pb, layout=layout) for x, pb in zip(chunks, ranks)]
        for x, pb in zip(chunks, ranks):
            assert ag.launch_ok(x, pb) is None
        for (xw, o3, ptrs, ctr) in rec.calls:
            assert xw.dtype == torch.int32 and o3.dtype == torch.int32 and o3.dim() == 3 and xw.dim() == 2
            assert o3.stride(-1) == 1 and all(s % 4 == 0 for s in o3.stride()[:2]) and xw.stride(0) % 4 == 0
        run_gather_python(ranks, rec.calls, C * chunks[0].element_size())
        ref = torch.cat(chunks, 0 if layout == "rank_major" else 1)
        for out in outs:
            assert out.dtype == dtype and out.shape == ref.shape
            assert torch.equal(out.view(torch.uint8), ref.contiguous().view(torch.uint8))
        assert all(pb.epoch("allgather") == 2 + step and pb.epoch() == 1 for pb in ranks)


def test_host_api_matches_fake_args(monkeypatch, tmp_path):
    pytest.importorskip("cutlass")
    from cutlass import Int32, Int64
    from k3fuse.codegen.compile import _import_source
    W, M, rb = 4, 3, 1344
    fake = _import_source(ag.render_source(rb, W, H), "agfake", tmp_path).fake_args()[:-1]
    rec = Recorder()
    monkeypatch.setattr(ag, "build_for", lambda *a, **k: rec)
    peer = pbuf.emulated_world(W, H, device="cpu")[2]
    ag.all_gather_oneshot(torch.zeros(M, rb // 2, dtype=torch.bfloat16), peer)
    (args,) = rec.calls
    to_cute = {torch.int32: Int32, torch.int64: Int64}
    assert len(args) == len(fake)
    for a, f in zip(args, fake):
        assert to_cute[a.dtype] == f.element_type and a.dim() == len(f.shape)
        assert all(s == fs for s, fs in zip(a.shape, f.shape) if isinstance(fs, int))


def test_launch_ok_rejects():
    peer = pbuf.emulated_world(2, hidden=256, max_m=4, device="cpu")[0]
    bf = torch.bfloat16
    assert ag.launch_ok(torch.zeros(4, 64, dtype=bf), peer) is None
    assert "M=5" in ag.launch_ok(torch.zeros(5, 64, dtype=bf), peer)
    assert "multiple of 16" in ag.launch_ok(torch.zeros(2, 60, dtype=bf), peer)
    assert "capacity" in ag.launch_ok(torch.zeros(2, 264, dtype=bf), peer)
    assert "unit-stride" in ag.launch_ok(torch.zeros(2, 128, dtype=bf)[:, ::2], peer)
    assert "16-byte" in ag.launch_ok(torch.zeros(2, 72, dtype=bf)[:, 4:68], peer)
    assert ag.launch_ok(torch.zeros(2, 3, 8, dtype=bf), peer) == "input is not 2-D"


# ------------------------------------------------------------------------------------------- *_or_none
def test_or_none_entry_points_decline_without_the_setup(monkeypatch):
    """None (the caller keeps its functional collective) without the env flag, a group, CUDA or torch.distributed."""
    x = torch.zeros(2, 672, dtype=torch.bfloat16)
    args = (torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(H, 64, dtype=torch.bfloat16), None, None, [],
            torch.zeros(H), None, 1e-5, 1e-5)
    monkeypatch.delenv(pbuf.ENV_FLAG, raising=False)
    assert ag.all_gather_cuda_or_none(x, "0") is None
    assert mar.fused_residual_norm_ar_or_none(*args, "0", False, True) is None
    assert pbuf.resolve("0", "cpu")[1] == f"{pbuf.ENV_FLAG} != 1"
    monkeypatch.setenv(pbuf.ENV_FLAG, "1")
    assert ag.all_gather_cuda_or_none(x, "") is None
    assert ag.all_gather_cuda_or_none(x, "0") is None                  # a CPU tensor
    assert mar.fused_residual_norm_ar_or_none(*args, "", False) is None
    assert mar.fused_residual_norm_ar_or_none(*args, "0", False, True) is None
    assert pbuf.resolve("", "cpu")[1] == "no process group (TP = 1)"
    assert pbuf.resolve("0", "cpu")[1] == "not a CUDA tensor"
    import torch.distributed as dist
    if not dist.is_initialized():
        assert pbuf.resolve("0", "cuda")[1] == "torch.distributed not initialised"
