"""Shared checks for the GPU tests (outputs are poisoned with NaN before a kernel runs)."""
import torch


def rel(out, ref):
    """Relative error in fp64; fails first if any output is non-finite (unwritten NaN poison included)."""
    out = out.double()
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    return ((out - ref.double()).norm() / ref.double().norm()).item()
