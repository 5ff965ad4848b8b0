"""Shared test fixtures (kept minimal)."""
import zlib

import pytest
import torch


@pytest.fixture
def seed(request) -> int:
    """A per-test seed (reproducible, different for every test): seeds torch's global RNG and is returned."""
    s = zlib.crc32(request.node.nodeid.encode()) & 0x7FFFFFFF
    torch.manual_seed(s)
    return s


@pytest.fixture(scope="module")
def isolated_kernel_cache(tmp_path_factory):
    """A fresh on-disk kernel cache and empty in-process memos for one test module (kernel compile tests)."""
    from k3fuse.codegen import compile as kcompile
    mp = pytest.MonkeyPatch()
    mp.setenv("K3FUSE_CACHE_DIR", str(tmp_path_factory.mktemp("kcache")))
    kcompile.clear_memo()
    yield
    kcompile.clear_memo()
    mp.undo()
