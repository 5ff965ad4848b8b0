"""k3fuse::topk_from_logits kernel (codegen/router_topk.py) on a GPU against the ops.py reference: ids equal,
weights fp32 rel err < 1e-5, outputs poisoned; inside a CUDA graph. Skipped without CUDA."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")


def ref(logits, bias, k, renorm, scale):
    from k3fuse import ops
    return ops.topk_from_logits._init_fn(logits, bias, k, renorm, scale)


@pytest.mark.parametrize("M", [1, 3, 8, 64])
@pytest.mark.parametrize("E,k,renorm", [(896, 16, True), (896, 16, False), (100, 7, True), (1000, 32, True)])
def test_router_topk_matches_reference(M, E, k, renorm, seed):
    from k3fuse.codegen import router_topk as rt
    logits = torch.randn(M, E, device="cuda") * 2
    bias = torch.randn(E, device="cuda") * 0.05
    kern = rt.build(E, k, renorm, 2.5)
    ids = torch.full((M, k), -1, dtype=torch.int64, device="cuda")
    w = torch.full((M, k), float("nan"), device="cuda")
    kern(logits, bias, ids, w)
    rids, rw = ref(logits, bias, k, renorm, 2.5)
    assert torch.equal(ids, rids)
    assert ((w.double() - rw.double()).norm() / rw.double().norm()).item() < 1e-5


def test_router_topk_ties_and_graph(seed):
    """Tied keys: the lower expert id first (what the (key, E - 1 - id) order promises); replay in a CUDA graph."""
    from k3fuse.codegen import router_topk as rt
    logits = torch.zeros(2, 896, device="cuda")           # every key equal: ids 0..15 in order
    bias = torch.zeros(896, device="cuda")
    ids, w = rt.topk_from_logits(logits, bias, 16, True, 1.0)
    assert ids.tolist() == [list(range(16))] * 2 and torch.allclose(w, torch.full_like(w, 1 / 16))
    tied = torch.randn(3, 896, device="cuda").round()     # keys in a few values: many ties across warps
    ids, _ = rt.topk_from_logits(tied, bias, 16, True, 1.0)
    # torch.topk does not order ties; a stable descending sort does (lower id first among equal keys)
    assert torch.equal(ids, torch.sort(torch.sigmoid(tied), dim=-1, descending=True, stable=True).indices[:, :16])
    x = torch.randn(4, 896, device="cuda")
    rt.topk_from_logits(x, bias, 16, True, 2.5)            # compile before the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = rt.topk_from_logits(x, bias, 16, True, 2.5)
    x.copy_(torch.randn(4, 896, device="cuda"))
    g.replay()
    rids, rw = ref(x, bias, 16, True, 2.5)
    assert torch.equal(out[0], rids) and torch.allclose(out[1], rw, rtol=1e-5)


@pytest.mark.parametrize("M", [1, 8])
def test_router_logits_and_topk_cuda(M, seed):
    """router_logits_cuda (bf16 x bf16 -> fp32 cuBLAS) and router_topk_cuda against the ops.py references."""
    from k3fuse import ops
    from k3fuse.codegen import router_topk as rt
    x = torch.randn(M, 7168, device="cuda").to(torch.bfloat16)
    w = (torch.randn(896, 7168, device="cuda") * 7168 ** -0.5).to(torch.bfloat16)
    bias = torch.randn(896, device="cuda") * 0.05
    lg = rt.router_logits_cuda(x, w)
    ref = ops.router_logits._init_fn(x, w)
    assert lg.dtype == torch.float32 and ((lg - ref).norm() / ref.norm()).item() < 1e-5
    ids, wt = rt.router_topk_cuda(x, w, bias, 16, True, 2.5)
    rids, rwt = ops.router_topk._init_fn(x, w, bias, 16, True, 2.5)
    same = ids == rids
    assert same.float().mean().item() > 0.99              # summation order may swap a near-tie
    assert torch.allclose(wt[same], rwt[same], rtol=1e-5)   # the weights of the experts both chose


@pytest.mark.parametrize("M", [1, 2, 3, 4])
def test_router_logits_gemv_fp32_out(M, seed, monkeypatch):
    """M <= GEMV_MAX_M: the logits come from the simt GEMV with an fp32 output (gemv.linear_fp32_out), not cuBLAS:
    fp32 rel err < 1e-5 against the fp32 reference, output NaN-poisoned; K3FUSE_ROUTER_GEMV=0 gives cuBLAS's."""
    from k3fuse import ops
    from k3fuse.codegen import gemv
    from k3fuse.codegen import router_topk as rt
    x = torch.randn(M, 7168, device="cuda").to(torch.bfloat16)
    w = (torch.randn(896, 7168, device="cuda") * 7168 ** -0.5).to(torch.bfloat16)
    ref = ops.router_logits._init_fn(x, w).double()
    out = torch.full((M, 896), float("nan"), device="cuda")
    gemv.linear_fp32_out(x, w, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    assert rt._gemv_ok(x, w) is None
    calls = []
    real = gemv.linear_fp32_out
    monkeypatch.setattr(gemv, "linear_fp32_out", lambda *a, **k: calls.append(1) or real(*a, **k))
    lg = rt.router_logits_cuda(x, w)
    assert calls == [1] and torch.equal(lg, out)
    monkeypatch.setenv("K3FUSE_ROUTER_GEMV", "0")
    assert rt._gemv_ok(x, w) == "K3FUSE_ROUTER_GEMV=0"
    lg2 = rt.router_logits_cuda(x, w)
    assert calls == [1] and ((lg2.double() - ref).norm() / ref.norm()).item() < 1e-5
