"""Where a linear group's GEMMs run concurrently on side streams (K3FUSE_GROUP_STREAMS=1, codegen/registry.py
_concurrent_fns): only where every member goes to the library at that M, and the lowering keeps the group ops whole
there. CPU only, on fake CUDA tensors (no tuning table for an unknown GPU: the library from bucket 16 on)."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from k3fuse.codegen import registry


def _fake(M, Ns, K=7168, router=None):
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(M, K, dtype=torch.bfloat16, device="cuda")
        ws = [torch.empty(n, K, dtype=torch.bfloat16, device="cuda") for n in Ns]
        rw = torch.empty(router, K, dtype=torch.bfloat16, device="cuda") if router else None
    return x, ws, rw


@pytest.mark.parametrize("M,on,expect", [(64, "1", 5), (32, "1", 5), (64, "0", None), (1, "1", None),
                                         (65, "1", None)])
def test_concurrent_only_on_library_buckets(monkeypatch, M, on, expect):
    monkeypatch.setenv("K3FUSE_GROUP_STREAMS", on)
    x, ws, _ = _fake(M, (768, 768, 768, 96, 32))
    fns = registry._concurrent_fns(x, ws)
    assert (None if fns is None else len(fns)) == expect


def test_router_and_situ_members_kept_whole(monkeypatch):
    """At M = 64 the MoE group (latent down, shared gate_up with SiTU, router): 3 callables, and the lowering keeps
    linear_group_router / linear_group_situ whole with the switch on, splits them with it off."""
    x, ws, rw = _fake(64, (3584, 768), router=896)
    monkeypatch.setenv("K3FUSE_GROUP_STREAMS", "1")
    assert len(registry._concurrent_fns(x, ws, 1, 4.0, 25.0, rw)) == 3
    assert registry._linear_group_router_applies(x, ws, rw, 1, 4.0, 25.0)
    assert registry._linear_group_situ_applies(x, ws, 1, 4.0, 25.0)
    monkeypatch.setenv("K3FUSE_GROUP_STREAMS", "0")
    assert not registry._linear_group_router_applies(x, ws, rw, 1, 4.0, 25.0)
    assert not registry._linear_group_situ_applies(x, ws, 1, 4.0, 25.0)


def test_single_member_or_cpu_never_forks(monkeypatch):
    monkeypatch.setenv("K3FUSE_GROUP_STREAMS", "1")
    x, ws, _ = _fake(64, (768,))
    assert registry._concurrent_fns(x, ws) is None
    xc = torch.randn(64, 64, dtype=torch.bfloat16)
    assert registry._concurrent_fns(xc, [torch.randn(8, 64, dtype=torch.bfloat16)] * 2) is None


def test_group_size_threshold(monkeypatch):
    """K3FUSE_GROUP_STREAMS=N takes groups of N or more GEMMs only (1 reads as 2)."""
    x, ws, rw = _fake(64, (3584, 768), router=896)
    monkeypatch.setenv("K3FUSE_GROUP_STREAMS", "4")
    assert registry._concurrent_fns(x, ws, 1, 4.0, 25.0, rw) is None
    assert len(registry._concurrent_fns(*_fake(64, (768,) * 4)[:2])) == 4
    monkeypatch.setenv("K3FUSE_GROUP_STREAMS", "3")
    assert len(registry._concurrent_fns(x, ws, 1, 4.0, 25.0, rw)) == 3
    assert registry._concurrent_fns(x, ws) is None
    monkeypatch.setenv("K3FUSE_GROUP_STREAMS", "1")
    assert len(registry._concurrent_fns(x, ws)) == 2
