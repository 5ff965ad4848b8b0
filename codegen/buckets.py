"""Batch buckets: a kernel is compiled for a bucket B and handles any M <= B (rows past M are predicated off)."""
from __future__ import annotations

from typing import Optional

BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
MAX_M = BUCKETS[-1]


def bucket_for(m: int) -> Optional[int]:
    """Smallest bucket >= m, or None when m is out of range (m < 1 or m > 64: the unfused path)."""
    if m < 1:
        return None
    for b in BUCKETS:
        if m <= b:
            return b
    return None
