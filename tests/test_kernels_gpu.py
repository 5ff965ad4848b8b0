"""Generated kernels on a GPU: values against the op references on fresh random inputs with poisoned outputs.
Skipped without CUDA (CI has none); benchmarks/gpu_kernels.py runs the full check + timing on the H200."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

from _check import rel  # noqa: E402


def bf(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


def graph_replays_poisoned(body, refill, poisoned, check, replays=3):
    """Run body() once, capture it as a CUDA graph, then per replay: refill() the inputs, NaN-poison `poisoned`,
    replay, check(): a kernel that reads ahead of its wait, or leaves an output unwritten, shows up."""
    body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    for _ in range(replays):
        refill()
        for t in poisoned:
            if t.is_floating_point():       # (integer outputs, the expert ids, cannot hold the NaN poison)
                t.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check()


@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 13, 64])
@pytest.mark.parametrize("N,K", [(2304, 1536), (768, 7168)])
def test_gemv_matches_reference(N, K, M):
    from k3fuse.codegen import gemv
    from k3fuse.codegen.buckets import bucket_for
    b = bucket_for(M)
    for cfg in {str(c): c for c in [gemv.default_config(N, K, b), gemv.config_for(N, K, b)]}.values():
        x, w = bf(M, K), bf(N, K, scale=K ** -0.5)
        y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        gemv.linear(x, w, cfg, out=y)
        assert rel(y, x.double() @ w.double().t()) < 1e-2


def _gemv_configs_match_reference(N, K, M, cfgs, graph_cfg):
    """Each config through gemv.linear against fp64, NaN-poisoned output, fresh inputs twice (re-armed state, if
    any); graph_cfg also in a CUDA graph replayed with refilled inputs."""
    from k3fuse.codegen import gemv
    for cfg in cfgs:
        for _ in range(2):
            x, w = bf(M, K), bf(N, K, scale=K ** -0.5)
            y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            gemv.linear(x, w, cfg, out=y)
            assert rel(y, x.double() @ w.double().t()) < 1e-2, cfg
    x, w, y = bf(M, K), bf(N, K, scale=K ** -0.5), torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

    def check():
        assert rel(y, x.double() @ w.double().t()) < 1e-2

    graph_replays_poisoned(lambda: gemv.linear(x, w, graph_cfg, out=y),
                           lambda: (x.copy_(bf(M, K)), w.copy_(bf(N, K, scale=K ** -0.5))), [y], check)


def _hopper():
    return torch.cuda.get_device_capability()[0] == 9


@pytest.mark.parametrize("M", [13, 16, 17, 40, 64])
@pytest.mark.parametrize("N,K", [(768, 7168), (7168, 768), (3216, 7168), (2320, 1536)])
def test_gemv_wgmma_matches_reference(N, K, M):
    """The TMA + wgmma variant (sm_90a; written in session 35 without a GPU, passed in session 36): the default config, one split with 2
    stages (the pipeline's phases wrap around many times), and the most splits (a cluster of 8 summing through
    distributed shared memory; 16 where K allows) with 64 and 128 rows per CTA against fp64, NaN-poisoned output, fresh inputs twice; the most splits in a CUDA graph
    replayed with refilled inputs. M = 13, 17, 40 leave the x tile's last rows to the TMA's zero fill; N = 3216 and
    2320 a partial last row tile."""
    if not _hopper():
        pytest.skip("wgmma is sm_90a only")
    from k3fuse.codegen import gemv
    from k3fuse.codegen.buckets import bucket_for
    b = bucket_for(M)
    ks = [d for d in range(1, gemv.WG_KS_MAX + 1) if K % (64 * d) == 0]
    cands = (gemv.wg_default(N, K, b), gemv.wg_config(N, K, b, 1, 2), gemv.wg_config(N, K, b, ks[-1], 4),
             gemv.wg_config(N, K, b, ks[-1], 4, BN=128))
    assert None not in cands and cands[2]["KS"] > 1
    if K % (64 * gemv.WG_KS_WIDE) == 0:             # a non-portable cluster of 16 (the tuner's, session 36)
        cands += (gemv.wg_config(N, K, b, gemv.WG_KS_WIDE, 4),)
    _gemv_configs_match_reference(N, K, M, list({str(c): c for c in cands}.values()), cands[2])


@pytest.mark.parametrize("M", [13, 17, 64])
@pytest.mark.parametrize("N,K,KS,BN", [(768, 7168, 8, 64), (768, 7168, 8, 128), (7168, 768, 3, 64),
                                       (3216, 7168, 4, 64), (768, 7168, 16, 64)])
def test_gemv_wgmma_gather_bitwise(N, K, KS, BN, M):
    """The wgmma split-K cluster sum with every peer value loaded first (config GL = 1, K3FUSE_WG_GATHER=1): bitwise
    the default sum (the same values in rank order), NaN-poisoned outputs, KS not dividing the thread's accumulators
    (3), a cluster of 16 with fewer accumulators than CTAs (16 at bucket 16: ranks 8-15 store nothing), partial row
    tiles (3216) and x tiles (13, 17); near fp64."""
    if not _hopper():
        pytest.skip("wgmma is sm_90a only")
    from k3fuse.codegen import gemv
    from k3fuse.codegen.buckets import bucket_for
    b = bucket_for(M)
    cfg = gemv.wg_config(N, K, b, KS, 4, BN)
    assert cfg is not None and gemv.supports(N, K, b, dict(cfg, GL=1)) is None
    x, w = bf(M, K), bf(N, K, scale=K ** -0.5)
    ys = []
    for c in (cfg, dict(cfg, GL=1)):
        y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        gemv.linear(x, w, c, out=y)
        torch.cuda.synchronize()
        ys.append(y)
    assert torch.isfinite(ys[1]).all() and torch.equal(ys[1], ys[0])
    assert rel(ys[1], x.double() @ w.double().t()) < 1e-2


@pytest.mark.parametrize("M", [17, 64])
def test_gemv_wgmma_in_a_pdl_chain(M):
    """The wgmma kernel between two generated GEMVs in one CUDA graph under the PDL chain (the default): its weight
    tiles are issued before its griddepcontrol.wait, x's after it. Every intermediate NaN-poisoned before each replay
    and the source refilled: a read of x ahead of the wait, or a successor reading y before it is stored, shows up as
    NaN or as a mismatch against fp64 products of the values each stage read."""
    if not _hopper():
        pytest.skip("wgmma is sm_90a only")
    from k3fuse.codegen import gemv
    from k3fuse.codegen.buckets import bucket_for
    b = bucket_for(M)
    up, mid = gemv.default_config(7168, 768, b), gemv.wg_default(768, 7168, b)
    assert up["variant"] == "mma" and mid["KS"] > 1
    src, wa, wb, wc = bf(M, 768), bf(7168, 768, scale=768 ** -0.5), bf(768, 7168, scale=7168 ** -0.5), \
        bf(7168, 768, scale=768 ** -0.5)
    h, z, o = (torch.empty(M, n, device="cuda", dtype=torch.bfloat16) for n in (7168, 768, 7168))

    def body():
        gemv.linear(src, wa, up, out=h)
        gemv.linear(h, wb, mid, out=z)
        gemv.linear(z, wc, up, out=o)

    def check():
        assert rel(h, src.double() @ wa.double().t()) < 1e-2
        assert rel(z, h.double() @ wb.double().t()) < 1e-2
        assert rel(o, z.double() @ wc.double().t()) < 1e-2

    graph_replays_poisoned(body, lambda: src.copy_(bf(M, 768)), [h, z, o], check)


def test_gemv_wgmma_routes_when_forced(monkeypatch):
    """K3FUSE_GEMV_WGMMA=1 routes k3fuse::linear through the wgmma variant at buckets 16-64 on sm_90; values as the
    reference."""
    if not _hopper():
        pytest.skip("wgmma is sm_90a only")
    from k3fuse.codegen import gemv, registry
    monkeypatch.setenv("K3FUSE_GEMV_WGMMA", "1")
    assert gemv.route(768, 7168, 64)[0]["variant"] == "wgmma"
    assert (gemv.route(768, 7168, 8)[0] or {}).get("variant") != "wgmma"
    x, w = bf(40, 7168), bf(768, 7168, scale=7168 ** -0.5)
    assert rel(registry.linear_cuda(x, w), x.double() @ w.double().t()) < 1e-2


def frn_inputs(M, nb, addend, prefix, H=7168, K=1536):
    """Fresh random inputs of k3fuse::fused_residual_norm: o, w_o, addend, prefix, the nb block snapshots (strided
    views of one [M, 8, H] buffer, returned too), w_mix (fp32) and the norm weight."""
    o, w_o = bf(M, K), bf(H, K, scale=K ** -0.5)
    a = bf(M, H) if addend else None
    p = bf(M, H) if prefix else None
    blocks_buf = bf(M, 8, H)
    blocks = [blocks_buf[:, i] for i in range(nb)]
    return o, w_o, a, p, blocks_buf, blocks, torch.randn(H, device="cuda") * 0.05, bf(H, scale=0.5) + 1


def frn_refill(o, blocks_buf, a, p):
    """The fused residual norm's activations (not its weights) refilled in place with fresh random values."""
    for t in [o, blocks_buf] + [t for t in (a, p) if t is not None]:
        t.copy_(torch.randn_like(t, dtype=torch.float32).to(torch.bfloat16))


@pytest.mark.parametrize("M", [1, 8, 64])
@pytest.mark.parametrize("nb,addend,prefix,fp32", [(3, False, True, False), (0, True, True, True),
                                                  (8, True, False, True)])
def test_fused_residual_norm_matches_reference(M, nb, addend, prefix, fp32):
    from k3fuse import ops
    from k3fuse.codegen import fused_residual_norm as frn
    H = 7168
    o, w_o, a, p, _, blocks, w_mix, norm_w = frn_inputs(M, nb, addend, prefix)
    out = torch.full((M, H), float("nan"), device="cuda", dtype=torch.bfloat16)
    newp = torch.full((M, H), float("nan"), device="cuda", dtype=torch.bfloat16)
    frn.fused_residual_norm(o, w_o, a, p, blocks, w_mix, norm_w, 1e-5, 1e-5, "", fp32, out=out, new_prefix=newp)
    rn, rp = ops.fused_residual_norm._init_fn(o, w_o, a, p, blocks, w_mix, norm_w, 1e-5, 1e-5, "", fp32)
    assert rel(out, rn) < 1e-2 and rel(newp, rp) < 1e-2


@pytest.mark.parametrize("cl,push", [(1, "0"), (4, "0"), (8, "0"), (4, "1"), (8, "1")])
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("nb,addend,prefix,fp32", [(3, False, True, False), (0, True, True, True),
                                                  (8, True, False, True)])
def test_mix_norm_cluster_matches_reference(M, nb, addend, prefix, fp32, cl, push, monkeypatch):
    """K3FUSE_MIXNORM_CLUSTER=cl (a cluster of cl CTAs per row; 1 = one CTA, 8 = the default; push: the totals
    st.async'd into the peers, K3FUSE_MIXNORM_PUSH=1): the fused residual norm against its reference,
    outputs poisoned, replayed in a CUDA graph under the PDL chain with fresh inputs."""
    from k3fuse import ops
    from k3fuse.codegen import compile as kcompile
    from k3fuse.codegen import fused_residual_norm as frn
    monkeypatch.setenv("K3FUSE_MIXNORM_CLUSTER", str(cl))
    monkeypatch.setenv("K3FUSE_MIXNORM_PUSH", push)
    monkeypatch.setenv("K3FUSE_FRN_ONE_KERNEL", "0")     # M = 1 too: the GEMV + this kernel, not the one launch
    kcompile.clear_memo()
    frn._built.clear()
    H = 7168
    o, w_o, a, p, blocks_buf, blocks, w_mix, norm_w = frn_inputs(M, nb, addend, prefix, K=768)
    out = torch.empty((M, H), device="cuda", dtype=torch.bfloat16)
    newp = torch.empty((M, H), device="cuda", dtype=torch.bfloat16)
    try:
        def body():
            frn.fused_residual_norm(o, w_o, a, p, blocks, w_mix, norm_w, 1e-5, 1e-5, "", fp32, out=out,
                                    new_prefix=newp)

        def refill():
            frn_refill(o, blocks_buf, a, p)

        def check():
            rn, rp = ops.fused_residual_norm._init_fn(o, w_o, a, p, blocks, w_mix, norm_w, 1e-5, 1e-5, "", fp32)
            assert rel(out, rn) < 1e-2 and rel(newp, rp) < 1e-2
        k = frn.build_mix_norm(H, nb, addend, prefix, True, fp32, 1e-5, 1e-5)
        assert (f"CL = {cl} " in k.source) if cl > 1 else ("CL =" not in k.source)     # 1: the one-CTA kernel
        assert ("st_async_f32" in k.source) == (push == "1")
        graph_replays_poisoned(body, refill, [out, newp], check)
    finally:
        kcompile.clear_memo()
        frn._built.clear()


@pytest.mark.parametrize("M,nb,addend,prefix,fp32", [(2, 3, False, True, False), (8, 0, True, True, True),
                                                     (4, 8, True, False, True)])
def test_mix_norm_push_is_bitwise_the_loads(M, nb, addend, prefix, fp32, monkeypatch):
    """K3FUSE_MIXNORM_PUSH=1 sums the same totals in the same rank order as the loads between cluster barriers: both
    outputs bitwise equal to the loads' (fresh NaN-poisoned outputs, clusters of 8)."""
    from k3fuse.codegen import compile as kcompile
    from k3fuse.codegen import fused_residual_norm as frn
    monkeypatch.setenv("K3FUSE_MIXNORM_CLUSTER", "8")
    monkeypatch.setenv("K3FUSE_FRN_ONE_KERNEL", "0")
    H = 7168
    o, w_o, a, p, _, blocks, w_mix, norm_w = frn_inputs(M, nb, addend, prefix, K=768)
    res = []
    try:
        for push in ("0", "1"):
            monkeypatch.setenv("K3FUSE_MIXNORM_PUSH", push)
            kcompile.clear_memo()
            frn._built.clear()
            out = torch.full((M, H), float("nan"), device="cuda", dtype=torch.bfloat16)
            newp = torch.full((M, H), float("nan"), device="cuda", dtype=torch.bfloat16)
            frn.fused_residual_norm(o, w_o, a, p, blocks, w_mix, norm_w, 1e-5, 1e-5, "", fp32, out=out,
                                    new_prefix=newp)
            torch.cuda.synchronize()
            res.append((out, newp))
    finally:
        kcompile.clear_memo()
        frn._built.clear()
    assert not torch.isnan(res[1][0].float()).any()
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])


def frn_one_case(M, K, nb, addend, prefix, fp32, pair):
    """One fused_residual_norm case for the one-launch kernel at batch M on fresh inputs: (body, refill, check, out,
    new_prefix); check() compares both outputs with the reference (rel < 1e-2) and asserts no barrier timeout and an
    arrival counter that is a multiple of the grid. pair: w_mix as its two bf16 factors."""
    from k3fuse import ops
    from k3fuse.codegen import fused_residual_norm as frn
    H = 7168
    o, w_o, a, p, blocks_buf, blocks, w_mix, norm_w = frn_inputs(M, nb, addend, prefix, K=K)
    wa, wb = (bf(H, scale=0.5) + 1, bf(H, scale=0.005)) if pair else (w_mix, None)
    wref = wa.float() * wb.float() if pair else w_mix
    out = torch.empty((M, H), device="cuda", dtype=torch.bfloat16)
    newp = torch.empty((M, H), device="cuda", dtype=torch.bfloat16)
    _, ctr = frn.one_state(o.device)

    def body():
        frn.fused_residual_norm(o, w_o, a, p, blocks, wa, norm_w, 1e-6, 1e-5, "", fp32, out=out, new_prefix=newp,
                                w_mix_scale=wb)

    def refill():
        frn_refill(o, blocks_buf, a, p)

    def check():
        rn, rp = ops.fused_residual_norm._init_fn(o, w_o, a, p, blocks, wref, norm_w, 1e-6, 1e-5, "", fp32)
        assert rel(out, rn) < 1e-2 and rel(newp, rp) < 1e-2
        assert frn.one_kernel_errors(o.device) == 0 and ctr[0].item() % frn.ONE_G == 0
    return body, refill, check, out, newp


def frn_one_against_two(case, monkeypatch, var, value):
    """CUDA-graph replays of the one launch with poisoned outputs (checked against the reference), then the same
    inputs through the two-launch path (var=value turns the one launch off): the same normed output (rel < 1e-2)."""
    body, refill, check, out, newp = case
    graph_replays_poisoned(body, refill, [out, newp], check)
    one = out.clone()
    monkeypatch.setenv(var, value)
    body()
    assert rel(one, out) < 1e-2


def frn_one_run(case):
    """refill, poison both outputs, launch, check."""
    body, refill, check, out, newp = case
    refill()
    out.fill_(float("nan"))
    newp.fill_(float("nan"))
    body()
    torch.cuda.synchronize()
    check()


@pytest.mark.parametrize("K,nb,addend,prefix,fp32,pair", [(768, 2, False, True, False, True),
                                                          (384, 2, True, True, False, True),
                                                          (768, 8, True, True, True, True),
                                                          (384, 0, True, False, False, False),
                                                          (1536, 5, False, True, True, False)])
def test_fused_residual_norm_one_kernel(K, nb, addend, prefix, fp32, pair, monkeypatch):
    """M = 1: the projection + grid barrier + mix-norm in one launch (the K3 o_proj / shared down shapes at TP16,
    TP8). Five launches in a row (the accumulator sets alternate by epoch parity) on fresh inputs, then CUDA-graph
    replays with poisoned outputs: normed against the reference (rel < 1e-2), no barrier timeout, the arrival counter
    a multiple of the grid; the same answers as the two-launch path (K3FUSE_FRN_ONE_KERNEL=0)."""
    from k3fuse.codegen import fused_residual_norm as frn
    assert frn.one_kernel_reason(1, 7168, K, nb, True, "", torch.cuda.get_device_properties(0).multi_processor_count) \
        is None
    case = frn_one_case(1, K, nb, addend, prefix, fp32, pair)
    for _ in range(5):
        frn_one_run(case)
    assert any(key[0] == "one" for key in frn._built)
    frn_one_against_two(case, monkeypatch, "K3FUSE_FRN_ONE_KERNEL", "0")


@pytest.mark.parametrize("M", [2, 3, 4])
@pytest.mark.parametrize("K,nb,addend,prefix,fp32,pair", [(768, 2, False, True, False, True),
                                                          (384, 8, True, True, False, True),
                                                          (1536, 5, False, True, True, False)])
def test_fused_residual_norm_one_kernel_rows(M, K, nb, addend, prefix, fp32, pair, monkeypatch):
    """M = 2..4 (K3FUSE_FRN_ONE_MAX_M=4): the one launch's bucket 2 / 4 (rows past M predicated off), each row's
    statistics its own. Launches at M, then 1, then M again on one accumulator state (the sets alternate by parity and
    are zeroed whole, so a bucket-4 launch after a bucket-1 one starts from zeros), then CUDA-graph replays with
    poisoned outputs: normed and new prefix against the reference (rel < 1e-2), no barrier timeout; the same answers
    as the two-launch path (K3FUSE_FRN_ONE_MAX_M=1)."""
    from k3fuse.codegen import fused_residual_norm as frn
    from k3fuse.codegen.buckets import bucket_for
    monkeypatch.setenv("K3FUSE_FRN_ONE_MAX_M", "4")
    assert frn.one_kernel_reason(M, 7168, K, nb, True, "", torch.cuda.get_device_properties(0).multi_processor_count) \
        is None
    cases = {m: frn_one_case(m, K, nb, addend, prefix, fp32, pair) for m in (M, 1)}
    for m in (M, 1, M, M):
        frn_one_run(cases[m])
    assert any(key[0] == "one" and key[-1] == bucket_for(M) for key in frn._built)
    frn_one_against_two(cases[M], monkeypatch, "K3FUSE_FRN_ONE_MAX_M", "1")


@pytest.mark.parametrize("preload", ["1", "2"])
@pytest.mark.parametrize("M", [1, 3, 4])
@pytest.mark.parametrize("K,nb,addend,prefix,fp32,pair", [(768, 2, False, True, False, True),
                                                          (1536, 5, True, True, True, False)])
def test_fused_residual_norm_one_kernel_preload(M, K, nb, addend, prefix, fp32, pair, preload, monkeypatch):
    """K3FUSE_FRN_PRELOAD=1 / 2 (the weight loads ahead of the FMAs; x through shared memory or after a warp sync,
    rows past M clamped, not branched): as the default kernel, against the reference with poisoned outputs in graph
    replays, and the same answers as the two-launch path."""
    from k3fuse.codegen import fused_residual_norm as frn
    monkeypatch.setenv("K3FUSE_FRN_ONE_MAX_M", "4")
    monkeypatch.setenv("K3FUSE_FRN_PRELOAD", preload)
    case = frn_one_case(M, K, nb, addend, prefix, fp32, pair)
    for _ in range(3):
        frn_one_run(case)
    # build_one's memo ends (..., one_preload(), stamps_on(), bm)
    assert any(key[0] == "one" and key[-3] == int(preload) and key[-2] is False for key in frn._built)
    frn_one_against_two(case, monkeypatch, "K3FUSE_FRN_ONE_KERNEL", "0")


@pytest.mark.parametrize("M", [1, 8, 64])
def test_fused_residual_norm_weight_pair(M):
    """w_mix given as its two bf16 factors (pass fuse_attn_out_allreduce_attnres_norm: res_norm.weight and
    res_proj.weight): the kernel's product == the reference's fp32 product; through the registered CUDA op."""
    from k3fuse import ops
    from k3fuse.codegen import registry
    registry.register()
    H, K, nb = 7168, 1536, 2
    o, w_o = bf(M, K), bf(H, K, scale=K ** -0.5)
    a, p = bf(M, H), bf(M, H)
    blocks = [bf(M, H) for _ in range(nb)]
    wa, wb = bf(H, scale=0.5) + 1, bf(1, H, scale=0.005).view(H)   # product: a soft mix; wa alone: one-hot
    norm_w = bf(H, scale=0.5) + 1
    out, newp = torch.ops.k3fuse.fused_residual_norm(o, w_o, a, p, blocks, wa, norm_w, 1e-6, 1e-5, "", True,
                                                     w_mix_scale=wb)
    rn, rp = ops.fused_residual_norm._init_fn(o, w_o, a, p, blocks, wa.float() * wb.float(), norm_w, 1e-6, 1e-5, "",
                                              True)
    assert rel(out, rn) < 1e-2 and rel(newp, rp) < 1e-2
    # the pair matters: with the first factor alone the answer differs
    alone, _ = ops.fused_residual_norm._init_fn(o, w_o, a, p, blocks, wa, norm_w, 1e-6, 1e-5, "", True)
    assert rel(alone, rn) > 1e-3


@pytest.mark.parametrize("M", [1, 2, 4])
@pytest.mark.parametrize("N,K,norm,xf32,act", [(1536, 7168, True, True, "situ"), (1536, 7168, True, False, "none"),
                                               (1536, 7168, False, False, "situ"), (7168, 3584, True, True, "none"),
                                               (7168, 3584, True, False, "none")])
def test_gemv_fusions_match_reference(M, N, K, norm, xf32, act):
    from k3fuse import ops
    from k3fuse.codegen import gemv
    x = torch.randn(M, K, device="cuda") * 3
    x = x if xf32 else x.to(torch.bfloat16)
    w = bf(N, K, scale=K ** -0.5)
    nw = bf(K, scale=0.3) + 1 if norm else None
    no = N // 2 if act == "situ" else N
    y = torch.full((M, no), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemv.linear_fused(x, w, nw, 1e-5, act, out=y)
    h = ops.rms_norm._init_fn(x, nw, 1e-5, torch.bfloat16) if norm else x
    r = (h.double() @ w.double().t()).to(torch.bfloat16)
    if act == "situ":
        r = ops.situ_glu._init_fn(r, 4.0, 25.0)
    assert rel(y, r) < 1e-2


def test_registry_ops_and_graph_capture():
    from k3fuse.codegen import registry
    from k3fuse.codegen.prefetch import join_pending
    registry.register()
    w = bf(3584, 7168, scale=7168 ** -0.5)
    x = bf(4, 7168)
    tok = torch.zeros(1, device="cuda")
    y = torch.ops.k3fuse.linear(x, w)
    assert rel(y, x.double() @ w.double().t()) < 1e-2
    torch.ops.k3fuse.prefetch_l2(tok, [w], 1 << 24)   # warm-up (compile, chunk table) before capture
    join_pending()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    yg = torch.empty_like(y)
    with torch.cuda.graph(g):
        torch.ops.k3fuse.prefetch_l2(tok, [w], 1 << 24)
        yg.copy_(torch.ops.k3fuse.linear(x, w))
        join_pending()
    x.copy_(bf(4, 7168))
    yg.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert rel(yg, x.double() @ w.double().t()) < 1e-2


PDL_UP = {"variant": "mma", "W": 8, "U": 2, "WN": 1, "RT": 1, "KB": 1, "pdl": 1}          # 7168x768
PDL_DOWN = {1: {"variant": "simt", "R": 1, "W": 8, "pdl": 1},                            # 768x7168
            8: {"variant": "mma", "W": 16, "U": 8, "WN": 1, "RT": 1, "KB": 0, "pdl": 1}}


@pytest.mark.parametrize("M", [1, 8])
def test_gemv_pdl_matches_reference_and_waits_in_graph(M):
    """pdl=1 kernels: values with poisoned outputs, then a CUDA graph where a torch kernel writes x and PDL GEMVs
    each read what the kernel before them just wrote (the previous GEMV lets them launch at its start), all
    buffers NaN-poisoned before every replay: a read ahead of griddepcontrol.wait would show up."""
    from k3fuse.codegen import gemv
    from k3fuse.codegen.buckets import bucket_for
    b = bucket_for(M)
    cfgs = {(7168, 768): PDL_UP, (768, 7168): PDL_DOWN[M]}
    for (N, K), cfg in cfgs.items():
        x, w = bf(M, K), bf(N, K, scale=K ** -0.5)
        y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        gemv.linear(x, w, cfg, out=y)
        assert rel(y, x.double() @ w.double().t()) < 1e-2
    wu, wd = bf(7168, 768, scale=768 ** -0.5), bf(768, 7168, scale=7168 ** -0.5)
    ku, kd = gemv.build(7168, 768, b, PDL_UP), gemv.build(768, 7168, b, PDL_DOWN[M])
    src = bf(M, 768)
    xs = [torch.empty(M, 768, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    hs = [torch.empty(M, 7168, device="cuda", dtype=torch.bfloat16) for _ in range(2)]

    def body():
        torch.mul(src, 2.0, out=xs[0])
        for r in range(2):
            ku(xs[r], wu, hs[r])
            kd(hs[r], wd, xs[r + 1])

    def check():
        assert rel(xs[0], src.double() * 2) < 1e-2
        for r in range(2):
            assert rel(hs[r], xs[r].double() @ wu.double().t()) < 1e-2
            assert rel(xs[r + 1], hs[r].double() @ wd.double().t()) < 1e-2
    graph_replays_poisoned(body, lambda: src.copy_(bf(M, 768)), xs + hs, check)


# grouped GEMV (k3fuse::linear_group): the K3 TP16 groups of fuse_shared_input_linears (KDA q, k, v, g, f_a, b;
# MLA q_a, kv_a, g) and a small group with partial CTAs
GROUPS = [[768, 768, 768, 768, 128, 6], [1536, 576, 768], [40, 8, 24]]


@pytest.mark.parametrize("M", [1, 2, 3, 8, 13, 64])
@pytest.mark.parametrize("Ns", GROUPS)
def test_gemv_group_matches_reference(Ns, M):
    from k3fuse.codegen import gemv
    from k3fuse.codegen.buckets import bucket_for
    K = 7168
    b = bucket_for(M)
    cfgs = [gemv.group_config_for(Ns, K, b), {"variant": "mma", "W": 8, "U": 2, "WN": 1, "RT": 1, "KB": 1},
            {"variant": "mma", "W": 4, "U": 2, "WN": 2, "RT": 2, "KB": 1}]   # 64-row CTAs: whole tiles past N_i
    if b <= 8:
        cfgs.append({"variant": "simt", "R": 4, "W": 8})                # R = 4: partial CTAs (GPRED)
    per_member = gemv.group_supports(Ns, K, b, cfgs[0]) is not None
    if per_member:
        # the GPU's table names a variant with no grouped form for the concatenation (wgmma: 3216 x 7168 at buckets
        # 32, 64 on the H200 table): then the group must route per member, never to that config
        assert cfgs[0]["variant"] == "wgmma" and b >= 16, cfgs[0]
        cfg, why = gemv.group_route(Ns, K, M)
        assert cfg is None and "wgmma" in why, (cfg, why)
        cfgs = cfgs[1:]
    # the 64-row-CTA config's reduction buffer exceeds shared memory at bucket 64: only configs the kernels take
    cfgs = [c for c in cfgs if gemv.group_supports(Ns, K, b, c) is None]
    assert len(cfgs) >= (1 if per_member else 2)     # the table's config and at least one other, unless it was dropped
    for cfg in {str(c): c for c in cfgs}.values():
        x = bf(M, K)
        ws = [bf(n, K, scale=K ** -0.5) for n in Ns]
        ys = [torch.full((M, n), float("nan"), device="cuda", dtype=torch.bfloat16) for n in Ns]
        gemv.linear_group(x, ws, cfg, outs=ys)
        for y, w in zip(ys, ws):
            assert rel(y, x.double() @ w.double().t()) < 1e-2, (cfg, w.shape)


@pytest.mark.parametrize("M", [1, 8])
def test_linear_group_op_and_graph_capture(M, monkeypatch):
    """The registered op: with K3FUSE_GROUPED_GEMV=0 it is exactly the per-weight linear path; by default, one
    grouped launch, also inside a CUDA graph (outputs NaN-poisoned before the replay)."""
    from k3fuse.codegen import registry
    registry.register()
    Ns, K = GROUPS[0], 7168
    x = bf(M, K)
    ws = [bf(n, K, scale=K ** -0.5) for n in Ns]
    monkeypatch.setenv("K3FUSE_GROUPED_GEMV", "0")
    sep = torch.ops.k3fuse.linear_group(x, ws)
    assert all(torch.equal(a, torch.ops.k3fuse.linear(x, w)) for a, w in zip(sep, ws))
    monkeypatch.delenv("K3FUSE_GROUPED_GEMV", raising=False)
    ys = torch.ops.k3fuse.linear_group(x, ws)            # warm-up: compile before the capture
    for y, w in zip(ys, ws):
        assert rel(y, x.double() @ w.double().t()) < 1e-2
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    outs = [torch.empty_like(y) for y in ys]
    with torch.cuda.graph(g):
        for o, y in zip(outs, torch.ops.k3fuse.linear_group(x, ws)):
            o.copy_(y)
    for _ in range(2):
        x.copy_(bf(M, K))
        for o in outs:
            o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for o, w in zip(outs, ws):
            assert rel(o, x.double() @ w.double().t()) < 1e-2


@pytest.mark.parametrize("M", [1, 2, 3])
@pytest.mark.parametrize("Ns,member,cfg", [([3584, 768], 1, None),
                                           ([768, 1001, 384], 0, {"variant": "simt", "R": 4, "W": 8}),
                                           ([130, 768], 1, {"variant": "simt", "R": 2, "W": 4})])
def test_gemv_group_situ_matches_reference(Ns, member, cfg, M):
    """The grouped GEMV with the SiTU-GLU epilogue on one member (pass fuse_situ_glu_into_linear_group), poisoned
    outputs: the SiTU member against situ_glu of the fp64 product, the others against the product."""
    from k3fuse import ops
    from k3fuse.codegen import gemv
    from k3fuse.codegen.buckets import bucket_for
    K = 7168
    cfg = cfg or gemv.group_config_for(Ns, K, bucket_for(M))
    if cfg["variant"] != "simt":            # bucket 4 (M = 3) routes to mma, which has no SiTU epilogue
        cfg = {"variant": "simt", "R": 2, "W": 8}
    x = bf(M, K)
    ws = [bf(n, K, scale=(3 if j == member else 1) * K ** -0.5) for j, n in enumerate(Ns)]
    ys = [torch.full((M, n // 2 if j == member else n), float("nan"), device="cuda", dtype=torch.bfloat16)
          for j, n in enumerate(Ns)]
    gemv.linear_group(x, ws, cfg, outs=ys, situ=((member,), 4.0, 25.0))
    for j, (y, w) in enumerate(zip(ys, ws)):
        r = (x.double() @ w.double().t()).to(torch.bfloat16)
        if j == member:
            r = ops.situ_glu._init_fn(r, 4.0, 25.0)
        assert rel(y, r) < 1e-2, (j, w.shape)


@pytest.mark.parametrize("M", [1, 2, 8])
def test_linear_group_situ_op_and_graph_capture(M):
    """k3fuse::linear_group_situ through its registered CUDA impl on the K3 TP16-width MoE group: the fused kernel at
    the simt buckets, the split fallback (grouped GEMV + SiTU reference) at M = 8; replayed in a CUDA graph with
    poisoned outputs."""
    from k3fuse import ops
    from k3fuse.codegen import registry
    registry.register()
    K = 7168
    x = bf(M, K)
    ws = [bf(3584, K, scale=K ** -0.5), bf(768, K, scale=3 * K ** -0.5)]
    outs = []

    def body():
        outs[:] = torch.ops.k3fuse.linear_group_situ(x, ws, 1, 4.0, 25.0)

    def check():
        assert outs[0].shape == (M, 3584) and outs[1].shape == (M, 384)
        assert rel(outs[0], x.double() @ ws[0].double().t()) < 1e-2
        gu = (x.double() @ ws[1].double().t()).to(torch.bfloat16)
        assert rel(outs[1], ops.situ_glu._init_fn(gu, 4.0, 25.0)) < 1e-2

    body()
    check()
    graph_replays_poisoned(body, lambda: x.copy_(bf(M, K)), outs, check)


def moe_group_router_inputs(M, K):
    """x, the TP16-width MoE group's weights (routed down 3584, shared gate_up 768), the router's 896 rows, its bias."""
    return (bf(M, K), [bf(3584, K, scale=K ** -0.5), bf(768, K, scale=3 * K ** -0.5)], bf(896, K, scale=K ** -0.5),
            torch.randn(896, device="cuda") * 0.05)


@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("Ns,member,cfg", [([3584, 768, 896], 1, None), ([3584, 768, 896], 1, {"variant": "simt", "R": 4, "W": 4}),
                                           ([224, 56], -1, {"variant": "simt", "R": 4, "W": 2}),
                                           ([130, 768, 100], 1, {"variant": "simt", "R": 2, "W": 8})])
def test_gemv_group_router_matches_reference(Ns, member, cfg, M):
    """The grouped GEMV with the router's rows as the last, fp32-output member (pass fuse_router_into_linear_group),
    poisoned outputs: the logits fp32 against the fp64 product (rel < 1e-5: not rounded to bf16), the SiTU member
    against situ_glu, the rest against the product."""
    from k3fuse import ops
    from k3fuse.codegen import gemv
    K = 7168
    situ = ((member,), 4.0, 25.0) if member >= 0 else None
    j = len(Ns) - 1
    cfg = cfg or gemv.group_router_route(Ns, K, M, (member,) if member >= 0 else ())[0]
    x = bf(M, K)
    ws = [bf(n, K, scale=(3 if i == member else 1) * K ** -0.5) for i, n in enumerate(Ns)]
    ys = [torch.full((M, n // 2 if i == member else n), float("nan"), device="cuda",
                     dtype=torch.float32 if i == j else torch.bfloat16) for i, n in enumerate(Ns)]
    gemv.linear_group(x, ws, cfg, outs=ys, situ=situ, f32=(j,))
    for i, (y, w) in enumerate(zip(ys, ws)):
        r = x.double() @ w.double().t()
        if i == j:
            assert rel(y, r) < 1e-5, (i, w.shape)
            continue
        r = r.to(torch.bfloat16)
        if i == member:
            r = ops.situ_glu._init_fn(r, 4.0, 25.0)
        assert rel(y, r) < 1e-2, (i, w.shape)


@pytest.mark.parametrize("M", [1, 2, 8])
def test_linear_group_router_op_and_graph_capture(M):
    """k3fuse::linear_group_router through its registered CUDA impl on the K3 TP16-width MoE group + router: one
    kernel at the simt buckets, the split fallback (SiTU group + router_logits) at M = 8; then the router top-k on
    its logits; replayed in a CUDA graph with poisoned outputs, the expert ids equal to the fp64 reference's."""
    from k3fuse import ops
    from k3fuse.codegen import registry
    registry.register()
    K = 7168
    x, ws, wr, bias = moe_group_router_inputs(M, K)
    outs = []

    def body():
        outs[:] = list(torch.ops.k3fuse.linear_group_router(x, ws, wr, 1, 4.0, 25.0))
        outs[3:] = list(torch.ops.k3fuse.topk_from_logits(outs[2], bias, 16, True, 2.5))

    def check():
        assert outs[0].shape == (M, 3584) and outs[1].shape == (M, 384) and outs[2].dtype == torch.float32
        assert rel(outs[0], x.double() @ ws[0].double().t()) < 1e-2
        gu = (x.double() @ ws[1].double().t()).to(torch.bfloat16)
        assert rel(outs[1], ops.situ_glu._init_fn(gu, 4.0, 25.0)) < 1e-2
        lg = x.double() @ wr.double().t()
        assert rel(outs[2], lg) < 1e-5
        rids, rw = ops.topk_from_logits._init_fn(lg.float(), bias, 16, True, 2.5)
        assert torch.equal(outs[3], rids) and rel(outs[4], rw.double()) < 1e-4

    body()
    check()
    graph_replays_poisoned(body, lambda: x.copy_(bf(M, K)), outs, check)


@pytest.mark.parametrize("M,cfg", [(1, {"variant": "simt", "R": 4, "W": 8}), (2, {"variant": "simt", "R": 4, "W": 2}),
                                   (1, {"variant": "simt", "R": 2, "W": 4}), (2, {"variant": "simt", "R": 2, "W": 8})])
@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("gu", [768, 1536])         # the shared gate_up's rows at TP16, TP8
def test_gemv_group_router_topk_matches_reference(M, cfg, first, gu):
    """The selection in the router member's last CTA (linear_group_router_topk's kernel) on the TP16 and TP8 MoE groups +
    router, the router last or first (the launcher's order): poisoned outputs, replayed in a CUDA graph with fresh
    inputs (the arrival counter re-arms itself: 0 after every launch); the expert ids equal to the reference's on
    the kernel's own logits, the logits against fp64."""
    from k3fuse import ops
    from k3fuse.codegen import gemv
    K = 7168
    x = bf(M, K)
    ws = [bf(3584, K, scale=K ** -0.5), bf(gu, K, scale=3 * K ** -0.5), bf(896, K, scale=K ** -0.5)]
    bias = torch.randn(896, device="cuda") * 0.05
    ys = [torch.empty(M, 3584, device="cuda", dtype=torch.bfloat16),
          torch.empty(M, gu // 2, device="cuda", dtype=torch.bfloat16), torch.empty(M, 896, device="cuda")]
    sel = (torch.empty(M, 16, device="cuda", dtype=torch.int64), torch.empty(M, 16, device="cuda"))
    order = [2, 0, 1] if first else [0, 1, 2]           # ws / ys as launched; the checks index the original order
    run = lambda: gemv.linear_group(x, [ws[i] for i in order], cfg, outs=[ys[i] for i in order],
                                    situ=((order.index(1),), 4.0, 25.0), f32=(order.index(2),),
                                    topk=(order.index(2), 16, True, 2.5), bias=bias, sel=sel)

    def check():
        assert gemv.arrival_counter(x.device).item() == 0
        assert rel(ys[0], x.double() @ ws[0].double().t()) < 1e-2
        g_u = (x.double() @ ws[1].double().t()).to(torch.bfloat16)
        assert rel(ys[1], ops.situ_glu._init_fn(g_u, 4.0, 25.0)) < 1e-2
        assert rel(ys[2], x.double() @ ws[2].double().t()) < 1e-5
        rids, rw = ops.topk_from_logits._init_fn(ys[2], bias, 16, True, 2.5)
        assert torch.equal(sel[0], rids) and rel(sel[1], rw.double()) < 1e-5

    sel[0].fill_(-1)
    run()
    torch.cuda.synchronize()
    check()
    graph_replays_poisoned(run, lambda: x.copy_(bf(M, K)), [ys[0], ys[1], ys[2], sel[1]], check, replays=4)


@pytest.mark.parametrize("knob,first", [("0", "1"), ("1", "1"), ("1", "0")])
@pytest.mark.parametrize("M", [1, 2, 8])
def test_linear_group_router_topk_op_in_graph(M, knob, first, monkeypatch):
    """k3fuse::linear_group_router_topk through its registered CUDA impl: one launch where the group's config has
    256 threads (M = 1 on the H200), the router member first (K3FUSE_ROUTER_FIRST, default) or last; with
    K3FUSE_TOPK_IN_GROUP=0 (and at M = 2, 8) the group, then the top-k kernel; in a CUDA graph with poisoned
    outputs."""
    from k3fuse import ops
    from k3fuse.codegen import registry
    registry.register()
    monkeypatch.setenv("K3FUSE_TOPK_IN_GROUP", knob)
    monkeypatch.setenv("K3FUSE_ROUTER_FIRST", first)
    K = 7168
    x, ws, wr, bias = moe_group_router_inputs(M, K)
    outs = []

    def body():
        outs[:] = list(torch.ops.k3fuse.linear_group_router_topk(x, ws, wr, bias, 16, True, 2.5, 1, 4.0, 25.0))

    def check():
        assert [o.shape for o in outs] == [(M, 3584), (M, 384), (M, 16), (M, 16)]
        assert rel(outs[0], x.double() @ ws[0].double().t()) < 1e-2
        lg = (x.double() @ wr.double().t()).float()
        rids, rw = ops.topk_from_logits._init_fn(lg, bias, 16, True, 2.5)
        assert torch.equal(outs[2], rids) and rel(outs[3], rw.double()) < 1e-4

    body()
    check()
    graph_replays_poisoned(body, lambda: x.copy_(bf(M, K)), outs, check)


@pytest.mark.parametrize("M", [1, 4, 8])
@pytest.mark.parametrize("N,K", [(7168, 3584), (1152, 1536)])
def test_rms_norm_linear_op(M, N, K):
    """k3fuse::rms_norm_linear through its registered CUDA impl (pass fuse_rms_norm_into_linear; K3's routed up and
    MLA q_b shapes at TP16): the fused kernel at M <= 4, the split fallback above, both against the fp64 math."""
    from k3fuse.codegen import registry
    registry.register()
    x, nw, w = bf(M, K, scale=3.0), bf(K, scale=0.5) + 1, bf(N, K, scale=K ** -0.5)
    y = torch.ops.k3fuse.rms_norm_linear(x, nw, 1e-5, w)
    xd = x.double()
    h = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)) * nw.double()
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    assert rel(y, h @ w.double().t()) < 1e-2


@pytest.mark.parametrize("M", [1, 2])
def test_gemv_chain_in_graph(M, monkeypatch):
    """Under the PDL chain: grouped simt GEMV (partial member tiles) -> mma GEMV -> fused SiTU GEMV, each reading what
    the kernel before it just wrote (so each is resident and waiting while its predecessor runs), in a CUDA graph,
    every buffer NaN-poisoned before each replay."""
    from k3fuse.codegen import compile as kcompile
    monkeypatch.setenv("K3FUSE_PDL_CHAIN", "1")
    kcompile.clear_memo()           # the knob is read at render time: no earlier kernel, and none left for later tests
    try:
        _gemv_chain(M)
    finally:
        kcompile.clear_memo()


def _gemv_chain(M):
    from k3fuse import ops
    from k3fuse.codegen import gemv
    K, Ns = 7168, [768, 40, 1536]
    simt = {"variant": "simt", "R": 1, "W": 8}
    ws = [bf(n, K, scale=K ** -0.5) for n in Ns]
    wd = bf(K, Ns[0], scale=Ns[0] ** -0.5)
    wgu = bf(2 * 768, K, scale=K ** -0.5)
    src = bf(M, K)
    x = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
    ys = [torch.empty(M, n, device="cuda", dtype=torch.bfloat16) for n in Ns]
    h = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
    a = torch.empty(M, 768, device="cuda", dtype=torch.bfloat16)
    kg = gemv.build_group(Ns, K, M, {"variant": "simt", "R": 2, "W": 8})
    kd = gemv.build(K, Ns[0], M, {"variant": "mma", "W": 8, "U": 2, "WN": 1, "RT": 1, "KB": 1})  # the o_proj shape
    ks = gemv.build(2 * 768, K, M, simt, fusion=dict(act="situ"))
    for k in (kg, kd, ks):
        assert "PDL_CHAIN=True" in k.source.split("\n")[1]

    def body():
        torch.mul(src, 2.0, out=x)
        kg(x, *ws, *ys)
        kd(ys[0], wd, h)
        ks(h, wgu, a)

    def check():
        for y, w in zip(ys, ws):
            assert rel(y, (src.double() * 2) @ w.double().t()) < 1e-2
        assert rel(h, ys[0].double() @ wd.double().t()) < 1e-2
        ref = ops.situ_glu._init_fn((h.double() @ wgu.double().t()).to(torch.bfloat16), 4.0, 25.0)
        assert rel(a, ref) < 1e-2
    graph_replays_poisoned(body, lambda: src.copy_(bf(M, K)), [x, h, a] + ys, check)
