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
