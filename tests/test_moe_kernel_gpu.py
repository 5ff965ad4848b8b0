"""k3fuse::moe_experts kernels (codegen/moe_experts.py) on a GPU against the ops.py reference:
fresh random inputs with experts repeated across tokens (and once within a token), NaN-poisoned outputs, the
K3 per-rank shapes at TP16 and TP8, and replay in a CUDA graph. Skipped without CUDA."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

from _check import rel  # noqa: E402
from k3fuse.codegen.buckets import bucket_for  # noqa: E402

E, D, KT = 896, 3584, 16
I_TP = {16: 192, 8: 384}
BETA, LBETA = 4.0, 25.0


@pytest.fixture(scope="module", params=[16, 8], ids=["tp16", "tp8"])
def experts(request):
    """w13 [E, 2I, D], w2 [E, D, I] for one TP shape (2.5 / 4.9 GB + 1.2 / 2.5 GB at TP16 / TP8)."""
    I = I_TP[request.param]
    g = torch.Generator(device="cuda").manual_seed(request.param)
    w13 = (torch.randn(E, 2 * I, D, device="cuda", generator=g) * D ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, D, I, device="cuda", generator=g) * I ** -0.5).to(torch.bfloat16)
    yield I, w13, w2
    del w13, w2
    torch.cuda.empty_cache()


def routing(M, seed):
    """ids [M, KT] int64 drawn from a small pool of experts (many repeated across tokens; the last token repeats
    the first token's experts in another order; token 0 picks one expert twice), weights [M, KT] fp32 summing to 1."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pool = torch.randperm(E, device="cuda", generator=g)[:max(KT + 8, 2 * M)]
    ids = torch.stack([pool[torch.randperm(pool.numel(), device="cuda", generator=g)[:KT]] for _ in range(M)])
    if M >= 2:
        ids[-1] = ids[0][torch.randperm(KT, device="cuda", generator=g)]
    if M >= 3:
        ids[0, 1] = ids[0, 0]
    w = torch.rand(M, KT, device="cuda", generator=g) + 0.1
    return ids.contiguous(), (w / w.sum(1, keepdim=True)).contiguous()


def reference(z, ids, w, w13, w2, chunk=8):
    """ops.moe_experts' reference, a few tokens at a time (its gather w13[ids] is M * k expert copies)."""
    from k3fuse import ops
    return torch.cat([ops.moe_experts._init_fn(z[i:i + chunk], ids[i:i + chunk], w[i:i + chunk], w13, w2, BETA, LBETA)
                      for i in range(0, z.shape[0], chunk)])


@pytest.mark.parametrize("M", [1, 3, 8, 64])
def test_moe_experts_matches_reference(experts, M):
    from k3fuse.codegen import moe_experts as me
    I, w13, w2 = experts
    z = torch.randn(M, D, device="cuda").to(torch.bfloat16)
    ids, w = routing(M, 1000 * M + I)
    out = torch.full((M, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    a = torch.full((M, KT, I), float("nan"), device="cuda", dtype=torch.bfloat16)
    me.moe_experts(z, ids, w, w13, w2, BETA, LBETA, out=out, scratch=a)
    torch.cuda.synchronize()
    assert torch.isfinite(a.float()).all(), "scratch a has unwritten (token, slot) entries"
    assert rel(out, reference(z, ids, w, w13, w2)) < 1e-2
    # the CUDA implementation (the op's signature) gives the same
    assert torch.equal(me.moe_experts_cuda(z, ids, w, w13, w2, BETA, LBETA), out)


def test_moe_experts_graph_replay(experts):
    from k3fuse.codegen import moe_experts as me
    I, w13, w2 = experts
    M = 8
    z = torch.randn(M, D, device="cuda").to(torch.bfloat16)
    ids, w = routing(M, 7)
    me.moe_experts_cuda(z, ids, w, w13, w2, BETA, LBETA)     # compile + warm up before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = me.moe_experts_cuda(z, ids, w, w13, w2, BETA, LBETA)
    for seed in (11, 12):
        z.copy_(torch.randn(M, D, device="cuda").to(torch.bfloat16))
        ids2, w2_ = routing(M, seed)
        ids.copy_(ids2)
        w.copy_(w2_)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert rel(out, reference(z, ids, w, w13, w2)) < 1e-2


@pytest.mark.parametrize("M", [1, 8])
def test_moe_down_slot_batches_bit_identical(experts, M):
    """The down kernel's slot batches (SB, codegen/moe_experts.default_sb) only reorder loads: SB = 1, 2, 4 give
    the same bits (the sum over slots keeps its order), and match the reference."""
    from k3fuse.codegen import moe_experts as me
    I, w13, w2 = experts
    z = torch.randn(M, D, device="cuda").to(torch.bfloat16)
    ids, w = routing(M, 77 + M)
    outs = []
    for sb in (1, 2, 4):
        cfg = dict(me.config_for(E, I, D, KT, M), SB=sb)
        out = torch.full((M, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        me.moe_experts(z, ids, w, w13, w2, BETA, LBETA, cfg, out=out)
        outs.append(out)
    torch.cuda.synchronize()
    assert rel(outs[0], reference(z, ids, w, w13, w2)) < 1e-2
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("ks,wd", [(1, 8), (2, 4), (4, 8), (4, 2)])
def test_moe_down_slot_groups(experts, M, ks, wd):
    """The down kernel's slot groups (KS, codegen/moe_experts.default_ks): KS sets of WD warps each sum KT / KS slots,
    added in group order through shared memory; every (KS, WD) matches the reference, output poisoned."""
    from k3fuse.codegen import moe_experts as me
    I, w13, w2 = experts
    z = torch.randn(M, D, device="cuda").to(torch.bfloat16)
    ids, w = routing(M, 500 + 10 * ks + wd + M)
    cfg = dict(me.config_for(E, I, D, KT, M), KS=ks, WD=wd, SB=1)
    assert me.supports(E, I, D, KT, M, cfg) is None
    out = torch.full((M, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    me.moe_experts(z, ids, w, w13, w2, BETA, LBETA, cfg, out=out)
    torch.cuda.synchronize()
    assert rel(out, reference(z, ids, w, w13, w2)) < 1e-2


@pytest.mark.parametrize("M", [2, 3, 8, 16, 64])
def test_moe_up_mma_matches_reference(experts, M, monkeypatch):
    """The grouped up kernel on tensor cores (K3FUSE_MOE_UP_MMA=1) against the CUDA-core one (=0): every (token, slot)
    of the scratch a is written (NaN-poisoned) and equals the CUDA-core kernel's up to rounding; the output matches
    the reference. Slot 2 is one expert for every token, so at M = 64 its owner runs 4 passes of 16 members (and the
    last pass of a smaller expert is partial)."""
    from k3fuse.codegen import moe_experts as me
    I, w13, w2 = experts
    z = torch.randn(M, D, device="cuda").to(torch.bfloat16)
    ids, w = routing(M, 3000 + 10 * M + I)
    ids[:, 2] = ids[0, 5]
    outs, scr = [], []
    for on in ("0", "1"):
        monkeypatch.setenv("K3FUSE_MOE_UP_MMA", on)
        assert ("up_mma_kernel(mZ" in me.render_source(E, I, D, KT, bucket_for(M))[0]) == (on == "1")
        out = torch.full((M, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        a = torch.full((M, KT, I), float("nan"), device="cuda", dtype=torch.bfloat16)
        me.moe_experts(z, ids, w, w13, w2, BETA, LBETA, out=out, scratch=a)
        torch.cuda.synchronize()
        assert torch.isfinite(a.float()).all(), f"UP_MMA={on}: scratch a has unwritten (token, slot) entries"
        outs.append(out)
        scr.append(a)
    assert rel(scr[1], scr[0]) < 1e-2
    assert rel(outs[1], reference(z, ids, w, w13, w2)) < 1e-2


def _variant_runs(experts, M, seed, var, values, monkeypatch, rendered):
    """moe_experts on fresh inputs (slot 2 one expert for every token: several passes of 16 members at M = 64) with
    the variable var set to each of values in turn; rendered(value) says whether that value's variant is in the
    kernel. Returns the inputs and the NaN-poisoned outputs, each checked fully written."""
    from k3fuse.codegen import moe_experts as me
    I, w13, w2 = experts
    z = torch.randn(M, D, device="cuda").to(torch.bfloat16)
    ids, w = routing(M, seed)
    ids[:, 2] = ids[0, 5]
    outs = []
    for v in values:
        monkeypatch.setenv(var, v)
        assert rendered(v), f"{var}={v}: the variant is not what was rendered"
        out = torch.full((M, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        me.moe_experts(z, ids, w, w13, w2, BETA, LBETA, out=out)
        torch.cuda.synchronize()
        assert torch.isfinite(out.float()).all(), f"{var}={v}: unwritten output"
        outs.append(out)
    return (z, ids, w, w13, w2), outs


def _graph_replay_equals(args, expected):
    """The op captured in a CUDA graph (its scratch inside), output poisoned, replayed: bitwise expected."""
    from k3fuse.codegen import moe_experts as me
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gout = me.moe_experts_cuda(*args, BETA, LBETA)
    gout.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(gout, expected)


@pytest.mark.parametrize("M", [2, 8, 16, 64])
def test_moe_down_mma_matches_reference(experts, M, monkeypatch):
    """K3FUSE_MOE_DOWN_MMA=1 (the grouped down on tensor cores + the combine; opt-in, written in session 17 after the
    device time ran out): the output (NaN-poisoned) matches the reference and the per-(token, slot) down kernel's up
    to rounding, with slot 2 one expert for every token (4 passes of 16 members at M = 64), in a CUDA graph too."""
    from k3fuse.codegen import moe_experts as me
    I = experts[0]
    args, outs = _variant_runs(experts, M, 4000 + 10 * M + I, "K3FUSE_MOE_DOWN_MMA", ("0", "1"), monkeypatch,
                               lambda on: ("down_mma_kernel(mA" in me.render_source(E, I, D, KT, bucket_for(M))[0])
                               == (on == "1"))
    assert rel(outs[1], outs[0]) < 1e-2
    assert rel(outs[1], reference(*args)) < 1e-2
    _graph_replay_equals(args, outs[1])                          # DOWN_MMA=1 still set: its scratch y inside the graph


@pytest.mark.parametrize("M", [2, 16, 33, 64])
def test_moe_down_mma_warp_epilogue_bit_identical(experts, M, monkeypatch):
    """K3FUSE_MOE_DOWN_WE=1 (the default: the tensor-core down's ballot scan and per-warp y epilogue) computes the
    same MMAs in the same order: the NaN-poisoned output equals the barrier epilogue's bit for bit, matches the
    reference, and a CUDA-graph replay reproduces it."""
    from k3fuse.codegen import moe_experts as me
    I = experts[0]
    monkeypatch.setenv("K3FUSE_MOE_DOWN_MMA", "1")
    args, outs = _variant_runs(experts, M, 7000 + 10 * M + I, "K3FUSE_MOE_DOWN_WE", ("0", "1"), monkeypatch,
                               lambda we: ("DWE:" in me.render_source(E, I, D, KT, bucket_for(M))[0]) == (we == "1"))
    assert torch.equal(outs[1], outs[0])
    assert rel(outs[1], reference(*args)) < 1e-2
    _graph_replay_equals(args, outs[1])                          # DOWN_WE=1 still set


@pytest.mark.parametrize("M", [3, 16, 64])
def test_moe_up_mma_ballot_bit_identical(experts, M, monkeypatch):
    """K3FUSE_MOE_UP_BALLOT=1 (the default: the tensor-core up's member scan by warp ballots) finds the same members
    in the same order: the NaN-poisoned output equals the serial scan's bit for bit and matches the reference."""
    from k3fuse.codegen import moe_experts as me
    I = experts[0]
    monkeypatch.setenv("K3FUSE_MOE_UP_MMA", "1")
    args, outs = _variant_runs(experts, M, 9000 + 10 * M + I, "K3FUSE_MOE_UP_BALLOT", ("0", "1"), monkeypatch,
                               lambda on: ("UBAL" in str(me.up_mma(I, D, KT, bucket_for(M), True))) == (on == "1"))
    assert torch.equal(outs[1], outs[0])
    assert rel(outs[1], reference(*args)) < 1e-2


@pytest.mark.parametrize("M", [17, 64])
def test_moe_member_lists_bit_identical(experts, M, monkeypatch):
    """K3FUSE_MOE_MEMBER_LISTS=1 (the up kernel writes each pair's member list, the down reads it instead of scanning
    ids; the default since session 35): the NaN-poisoned output equals the ids scan's bit for bit with slot 2 one
    expert for every token (2 / 4 passes),
    matches the reference, and replays so in a CUDA graph (the lists rewritten inside it)."""
    from k3fuse.codegen import moe_experts as me
    I = experts[0]
    monkeypatch.setenv("K3FUSE_MOE_UP_MMA", "1")
    monkeypatch.setenv("K3FUSE_MOE_DOWN_MMA", "1")

    def rendered(on):
        return ("mMem[m, j, tidx]" in me.render_source(E, I, D, KT, bucket_for(M))[0]) == (on == "1")
    args, outs = _variant_runs(experts, M, 9700 + 10 * M + I, "K3FUSE_MOE_MEMBER_LISTS", ("0", "1"), monkeypatch,
                               rendered)
    assert torch.equal(outs[1], outs[0])
    assert rel(outs[1], reference(*args)) < 1e-2
    _graph_replay_equals(args, outs[1])                          # MEMBER_LISTS=1 still set


@pytest.mark.parametrize("M", [1, 2, 3])
@pytest.mark.parametrize("ks,wd,axb", [(4, 2, 1), (4, 4, 1), (4, 4, 2), (2, 2, 4)])
def test_moe_down_axb_bit_identical(experts, M, ks, wd, axb, monkeypatch):
    """K3FUSE_MOE_DOWN_AXB=N with AX (the W2 vectors N slots per batch, a CTA barrier between a batch's loads and
    its FMAs): bitwise AX's output (the same sums in slot order), poisoned outputs, near the reference; the batched
    source ran (N < KT / KS, else plain AX)."""
    from k3fuse.codegen import moe_experts as me
    I, w13, w2 = experts
    z = torch.randn(M, D, device="cuda").to(torch.bfloat16)
    ids, w = routing(M, 950 + 10 * ks + M)
    lpr = 16 if ks == 2 and I == 384 else 8
    cfg = dict(me.config_for(E, I, D, KT, bucket_for(M)), KS=ks, WD=wd, SB=1, LPR=lpr, RT=1)
    cfg.pop("DOWNMMA", None)
    monkeypatch.setenv("K3FUSE_MOE_DOWN_AX", "1")
    assert me.down_ax(I, KT, cfg, bucket_for(M))
    outs = {}
    for v in ("0", str(axb)):
        monkeypatch.setenv("K3FUSE_MOE_DOWN_AXB", v)
        assert ("AXB = " in me.render_source(E, I, D, KT, bucket_for(M), cfg=cfg)[0]) == (0 < int(v) < KT // ks)
        out = torch.full((M, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        me.moe_experts(z, ids, w, w13, w2, BETA, LBETA, cfg, out=out)
        outs[v] = out
    torch.cuda.synchronize()
    assert rel(outs[str(axb)], reference(z, ids, w, w13, w2)) < 1e-2
    assert torch.equal(outs["0"], outs[str(axb)])


@pytest.mark.parametrize("M", [1, 2, 3])
@pytest.mark.parametrize("ks,wd", [(4, 2), (4, 4), (2, 2)])
def test_moe_down_ax_bit_identical(experts, M, ks, wd, monkeypatch):
    """K3FUSE_MOE_DOWN_AX=1 (the down's W2 loads all ahead of its FMAs, the token's activations through shared
    memory): only the load order changes, so the bits equal the default kernel's, output poisoned, and match the
    reference."""
    from k3fuse.codegen import moe_experts as me
    I, w13, w2 = experts
    z = torch.randn(M, D, device="cuda").to(torch.bfloat16)
    ids, w = routing(M, 900 + 10 * ks + M)
    lpr = 16 if ks == 2 and I == 384 else 8          # a lane's W2 vectors within MAX_AX_VECTORS
    cfg = dict(me.config_for(E, I, D, KT, bucket_for(M)), KS=ks, WD=wd, SB=1, LPR=lpr, RT=1)
    cfg.pop("DOWNMMA", None)
    assert me.supports(E, I, D, KT, bucket_for(M), cfg) is None
    outs = {}
    for ax in ("0", "1"):
        monkeypatch.setenv("K3FUSE_MOE_DOWN_AX", ax)
        assert me.down_ax(I, KT, cfg, bucket_for(M)) == (ax == "1")
        out = torch.full((M, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        me.moe_experts(z, ids, w, w13, w2, BETA, LBETA, cfg, out=out)
        outs[ax] = out
    torch.cuda.synchronize()
    assert rel(outs["1"], reference(z, ids, w, w13, w2)) < 1e-2
    assert torch.equal(outs["0"], outs["1"])


def test_moe_down_early_after_topk_in_graph(experts, monkeypatch):
    """K3FUSE_MOE_DOWN_EARLY=1 (the down reads the ids, the routing weights and its first W2 batch before its PDL
    wait; the up triggers only after its own): behind the router's top-k kernel that writes those ids and weights
    (both under the PDL chain), in a CUDA graph replayed on fresh logits with the ids zeroed and the weights and
    output NaN-poisoned before each replay (a read that ran ahead of the top-k would use expert 0 or NaN weights):
    bitwise the default kernel's output, and near the reference. At TP8 bucket 1 (AX, AXB = 1) and with AXB = 0."""
    from k3fuse.codegen import moe_experts as me, router_topk as rt
    I, w13, w2 = experts
    M = 1
    monkeypatch.delenv("K3FUSE_PDL_CHAIN", raising=False)
    monkeypatch.setenv("K3FUSE_MOE_DOWN_MMA", "0")
    monkeypatch.setenv("K3FUSE_MOE_DOWN_AX", "1")
    cfg = dict(me.config_for(E, I, D, KT, 1), KS=4, WD=4 if I == 384 else 2, SB=1, LPR=8, RT=1)
    cfg.pop("DOWNMMA", None)
    g0 = torch.Generator(device="cuda").manual_seed(4400 + I)
    z = torch.randn(M, D, device="cuda", generator=g0).to(torch.bfloat16)
    bias = torch.randn(E, device="cuda", generator=g0) * 0.05
    logits = torch.randn(M, E, device="cuda", generator=g0) * 2
    ids = torch.zeros(M, KT, dtype=torch.int64, device="cuda")
    w = torch.zeros(M, KT, device="cuda")
    kt = rt.build(E, KT, True, 2.5)
    for axb in ("1", "0"):
        monkeypatch.setenv("K3FUSE_MOE_DOWN_AXB", axb)
        outs = {}
        for early in ("0", "1"):
            monkeypatch.setenv("K3FUSE_MOE_DOWN_EARLY", early)
            assert ("EARLY=True" in me.render_source(E, I, D, KT, 1, cfg=cfg)[0].split("\n")[1]) == (early == "1")
            out = torch.full((M, D), float("nan"), device="cuda", dtype=torch.bfloat16)

            def body():
                kt(logits, bias, ids, w)
                me.moe_experts(z, ids, w, w13, w2, BETA, LBETA, cfg, out=out)
            body()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                body()
            res = []
            for step in range(3):
                logits.copy_(torch.randn(M, E, device="cuda", generator=torch.Generator(device="cuda").manual_seed(
                    4500 + step)) * 2)
                ids.zero_()
                w.fill_(float("nan"))
                out.fill_(float("nan"))
                g.replay()
                torch.cuda.synchronize()
                rids, rw = rt.topk_from_logits(logits, bias, KT, True, 2.5)
                assert torch.equal(ids, rids)
                assert rel(out, reference(z, rids, rw, w13, w2)) < 1e-2
                res.append(out.clone())
            outs[early] = res
            del g
        for a, b in zip(outs["0"], outs["1"]):
            assert torch.equal(a, b)
