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
