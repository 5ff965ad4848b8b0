"""The shared expert on a side stream (k3fuse::side_linear_situ + k3fuse::stream_join) on CUDA: same values as the
reference, also when captured in a CUDA graph while other work runs on the main stream. Skipped without CUDA."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def test_side_stream_values_and_graph():
    import k3fuse.ops as ops
    from k3fuse.codegen import registry
    registry.register()
    x = torch.randn(4, 7168, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1536, 7168, device="cuda", dtype=torch.bfloat16) * 7168 ** -0.5
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ref = ops.side_linear_situ._init_fn(x, w, 4.0, 25.0)

    def step():
        y = torch.ops.k3fuse.side_linear_situ(x, w, 4.0, 25.0)
        z = big @ big                      # main-stream work that the side stream overlaps
        return torch.ops.k3fuse.stream_join(y), z

    y, _ = step()
    torch.cuda.synchronize()
    assert rel(y, ref) < 1e-2
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, _ = step()
    out.fill_(float("nan"))
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert rel(out, ops.side_linear_situ._init_fn(x, w, 4.0, 25.0)) < 1e-2


# ------------------------------------------------------------------ K3FUSE_GROUP_STREAMS: a group's GEMMs at once
def _ref_group(x, ws):
    return [(x.double() @ w.double().t()) for w in ws]


@pytest.mark.parametrize("M", [32, 64])
def test_group_streams_linear_group_bitwise_and_graph(monkeypatch, M):
    """The library buckets' linear_group on side streams: bitwise the serial calls' values (the same cuBLAS GEMMs),
    within 1e-2 of fp64, and right when replayed from a CUDA graph with poisoned outputs and fresh inputs."""
    _group_streams_check(monkeypatch, M)


@pytest.mark.parametrize("M", [17, 64])
def test_group_streams_with_wgmma_members(monkeypatch, M):
    """K3FUSE_GEMV_WGMMA=1 (sm_90): the group declines the grouped kernel and its members, each on the wgmma GEMM,
    run on side streams; the same checks (bitwise the serial launches: the split-K sums are in a fixed order)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma is sm_90a only")
    from k3fuse.codegen import gemv
    monkeypatch.setenv("K3FUSE_GEMV_WGMMA", "1")
    assert gemv.route(768, 7168, M)[0]["variant"] == "wgmma"
    _group_streams_check(monkeypatch, M)


def _group_streams_check(monkeypatch, M):
    from k3fuse.codegen import registry
    registry.register()
    x = torch.randn(M, 7168, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, 7168, device="cuda", dtype=torch.bfloat16) * 7168 ** -0.5 for n in (768, 768, 3584, 96, 32)]
    monkeypatch.setenv("K3FUSE_GROUP_STREAMS", "0")
    assert registry._concurrent_fns(x, ws) is None
    serial = torch.ops.k3fuse.linear_group(x, ws)
    monkeypatch.setenv("K3FUSE_GROUP_STREAMS", "1")
    assert registry._concurrent_fns(x, ws) is not None
    conc = torch.ops.k3fuse.linear_group(x, ws)
    torch.cuda.synchronize()
    for a, b, r in zip(conc, serial, _ref_group(x, ws)):
        assert torch.equal(a, b)
        assert rel(a, r) < 1e-2
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.k3fuse.linear_group(x, ws)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = torch.ops.k3fuse.linear_group(x, ws)
    for o in outs:
        o.fill_(float("nan"))
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    for o, r in zip(outs, _ref_group(x, ws)):
        assert rel(o, r) < 1e-2


def test_group_streams_router_group_with_situ(monkeypatch):
    """linear_group_router with a SiTU member at M = 64 (the MoE group: latent down, shared gate_up, router):
    concurrent = serial bitwise, and within 1e-2 of the math in fp32 / fp64 (plain torch, not the dispatched ops)."""
    import k3fuse.ops as ops
    from k3fuse.codegen import registry
    registry.register()
    M = 64
    x = torch.randn(M, 7168, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, 7168, device="cuda", dtype=torch.bfloat16) * 7168 ** -0.5 for n in (3584, 768)]
    rw = torch.randn(896, 7168, device="cuda", dtype=torch.bfloat16) * 7168 ** -0.5
    args = (x, ws, rw, 1, 4.0, 25.0)
    monkeypatch.setenv("K3FUSE_GROUP_STREAMS", "0")
    serial = torch.ops.k3fuse.linear_group_router(*args)
    monkeypatch.setenv("K3FUSE_GROUP_STREAMS", "1")
    assert registry._linear_group_router_applies(*args)
    conc = torch.ops.k3fuse.linear_group_router(*args)
    torch.cuda.synchronize()
    assert [tuple(t.shape) for t in conc] == [(M, 3584), (M, 384), (M, 896)] and conc[2].dtype == torch.float32
    for a, b in zip(conc, serial):
        assert torch.equal(a, b)
    ref = [x.double() @ ws[0].double().t(),
           ops.situ_glu._init_fn(x.float() @ ws[1].float().t(), 4.0, 25.0),     # pure torch, not dispatched
           x.double() @ rw.double().t()]
    for a, r in zip(conc, ref):
        assert rel(a, r) < 1e-2
