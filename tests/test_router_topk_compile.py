"""k3fuse::topk_from_logits kernel (codegen/router_topk.py): renders and compiles for sm_90a and sm_100a without a
GPU for K3's routers (896 experts, top-16, at TP1 and after the MoE split's gather), and the candidate packing
it relies on orders keys and breaks ties like the reference would."""
import re

import pytest
import torch

pytest.importorskip("cutlass")

from k3fuse.codegen import compile as kcompile  # noqa: E402
from k3fuse.codegen import router_topk as rt  # noqa: E402

pytestmark = pytest.mark.usefixtures("isolated_kernel_cache")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("E,k,renorm", [(896, 16, True), (8, 3, False), (1000, 32, True)])
def test_router_topk_compiles(arch, E, k, renorm, monkeypatch):
    """The k rounds (K3FUSE_TOPK_RANK=0; with the default rank path they are its fallback)."""
    monkeypatch.setenv("K3FUSE_TOPK_RANK", "0")
    kern = rt.build(E, k, renorm, 2.5, arch=arch, load=False)
    ptx = open(kern.files["kernel.ptx"]).read()
    assert f".target {arch}" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx          # candidates stay in registers
    assert len(re.findall(r"\bbar(?:rier)?\.sync", ptx)) == k + 1       # one per round, one before the output
    assert len(re.findall(r"\bredux\.sync\.max\.s32", ptx)) == 4 * k   # two for a warp's best, two for the block's
    # each thread's logits and biases, once: the chosen experts' weights come from the scores in shared memory
    assert len(re.findall(r"\bld\.global", ptx)) == 2 * -(-E // rt.threads_for(E))
    stores = re.findall(r"\bst\.global(?:\.[a-z0-9]+)*", ptx)
    assert sorted(stores) == ["st.global.b32", "st.global.b64"]       # weight (fp32) and id (int64), once each


def test_router_topk_source_and_supports():
    base = rt.render_source(896, 16, True, 2.5)
    others = [rt.render_source(896, 8, True, 2.5), rt.render_source(896, 16, False, 2.5),
              rt.render_source(896, 16, True, 1.0), rt.render_source(512, 16, True, 2.5)]
    assert len({base, *others}) == 5
    assert kcompile.cache_key(base, "sm_90a") != kcompile.cache_key(base, "sm_100a")
    assert rt.supports(896, 16) is None and rt.supports(896, 33) and rt.supports(8, 16) and rt.supports(5000, 8)
    assert rt.threads_for(896) == 224 and rt.threads_for(8) == 32 and rt.threads_for(4096) == 1024
    with pytest.raises(ValueError):
        rt.render_source(896, 0)


def _pack(keys: torch.Tensor) -> torch.Tensor:
    """The template's candidate: order-preserving Int32 of the fp32 key in the high half, E - 1 - e in the low."""
    E = keys.shape[0]
    b = keys.float().view(torch.int32).long()
    ordered = torch.where(b >= 0, b, b ^ 0x7FFFFFFF)
    return (ordered << 32) | (E - 1 - torch.arange(E, dtype=torch.int64))


def test_candidate_packing_orders_like_topk():
    g = torch.Generator().manual_seed(7)
    for keys in (torch.randn(896, generator=g) * 3,                                  # both signs
                 torch.tensor([0.5, 0.0, -1.0, -2.0, 1e-30, -1e-30, 3.0]),           # no -0.0: s + bias, s >= 0
                 torch.full((16,), 0.25)):                                           # all tied
        cand = _pack(keys)
        order = torch.sort(cand, descending=True, stable=True).indices
        assert torch.equal(keys.shape[0] - 1 - (cand[order] & 0xFFFFFFFF), order)     # the low half decodes the id
        # descending keys; equal keys -> ascending ids
        ref = sorted(range(len(keys)), key=lambda e: (-float(keys[e]), e))
        assert order.tolist() == ref


def test_router_topk_fallback_on_cpu():
    import torch
    from k3fuse import ops
    logits, bias = torch.randn(3, 64), torch.randn(64) * 0.1
    ids, w = rt.topk_from_logits_cuda(logits, bias, 6, True, 2.5)
    rids, rw = ops.topk_from_logits._init_fn(logits, bias, 6, True, 2.5)
    assert torch.equal(ids, rids) and torch.equal(w, rw)
    assert rt.launch_ok(logits.double(), bias, 6) and rt.launch_ok(logits, bias[:5], 6)
    assert rt.launch_ok(logits, bias, 6) is None


def test_router_logits_and_topk_fallback_on_cpu():
    import torch
    from k3fuse import ops
    x, w, b = torch.randn(3, 64).bfloat16(), torch.randn(16, 64).bfloat16(), torch.randn(16) * 0.1
    assert torch.equal(rt.router_logits_cuda(x, w), ops.router_logits._init_fn(x, w))
    ids, wt = rt.router_topk_cuda(x, w, b, 4, True, 2.5)
    rids, rwt = ops.router_topk._init_fn(x, w, b, 4, True, 2.5)
    assert torch.equal(ids, rids) and torch.equal(wt, rwt)


def _rank_select_model(keys, threads, k):
    """templates/_topk_select.jinja's RANK path restated in Python (expert e = tid + j * threads, NW warps): each
    warp's R-th best (key, lo) by R rounds, the threshold = the least of the warps' R-th keys, the candidates at or
    above it, each placed at its rank; None where the kernel takes the rounds (more candidates than threads)."""
    E = len(keys)
    nw, vpt = threads // 32, -(-E // threads)
    lo = lambda e: E - 1 - e
    cand = {}
    for w in range(nw):
        mine = [(keys[t + j * threads], lo(t + j * threads)) for t in range(32 * w, 32 * w + 32) for j in range(vpt)
                if t + j * threads < E]
        mine.sort(reverse=True)
        r = -(-k // nw)
        cand[w] = mine[r - 1][0] if len(mine) >= r else float("-inf")
    th = min(cand.values())
    cands = [(keys[e], lo(e)) for e in range(E) if keys[e] >= th]
    if len(cands) > threads:
        return None
    assert len(cands) >= k
    out = [None] * k
    for c in cands:
        rank = sum(1 for u in cands if u > c)
        if rank < k:
            out[rank] = E - 1 - c[1]
    return out


@pytest.mark.parametrize("E,k", [(896, 16), (1000, 32), (8, 3), (200, 16)])
def test_rank_selection_model_matches_the_rounds(E, k):
    """K3FUSE_TOPK_RANK's algorithm (threshold + ranks) gives the rounds' answer (descending keys, the lower id among
    equal keys) on random, tied and bias-skewed keys; flat keys exceed the candidate buffer and take the rounds."""
    g = torch.Generator().manual_seed(E + k)
    threads = rt.threads_for(E)
    cases = [torch.rand(E, generator=g), torch.randn(E, generator=g).round() / 4,
             torch.rand(E, generator=g) + (torch.arange(E) % 7 == 0) * 0.5, torch.zeros(E)]
    took_rank = 0
    for keys in cases:
        ks = keys.tolist()
        want = sorted(range(E), key=lambda e: (-ks[e], e))[:k]
        got = _rank_select_model(ks, threads, k)
        if got is not None:
            took_rank += 1
            assert got == want
    assert _rank_select_model([0.0] * E, threads, k) is None or E <= threads
    assert took_rank >= 2


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_rank_selection_compiles(arch, monkeypatch):
    """The default (K3FUSE_TOPK_RANK unset): the standalone top-k and the MoE group's last CTA render the threshold +
    rank path (two ballots per expert slot, three barriers before the ranks) with the rounds kept as its fallback
    (k more barriers), no local memory; K3FUSE_TOPK_RANK=0 renders without it."""
    from k3fuse.codegen import gemv
    monkeypatch.setenv("K3FUSE_TOPK_RANK", "0")
    plain = rt.render_source(896, 16, True, 2.5)
    monkeypatch.delenv("K3FUSE_TOPK_RANK")
    assert rt.rank_select() and "sCHi" in rt.render_source(896, 16, True, 2.5) and "sCHi" not in plain
    rt._built.clear()
    ptx = open(rt.build(896, 16, True, 2.5, arch=arch, load=False).files["kernel.ptx"]).read()
    rt._built.clear()
    vpt = -(-896 // rt.threads_for(896))
    assert ptx.count("vote.sync.ballot") == 2 * vpt and "ld.local" not in ptx
    assert len(re.findall(r"\bbar(?:rier)?\.sync", ptx)) == 3 + 16 + 1
    kern = gemv.build_group([3584, 768, 896], 7168, 1, {"variant": "simt", "R": 4, "W": 8}, arch=arch, load=False,
                            situ=((1,), 4.0, 25.0), f32=(2,), topk=(2, 16, True, 2.5))
    gptx = open(kern.files["kernel.ptx"]).read()
    assert gptx.count("vote.sync.ballot") == 2 * vpt and "ld.local" not in gptx
    assert "sCHi" in open(kern.files["kernel.py"]).read()
