"""Tensor parallelism on CPU (gloo, one process per rank): TP = 2 and TP = 4 give the TP = 1 logits, and a
config that does not divide by the TP size is a clear ValueError at construction."""
import sys
from pathlib import Path

import pytest
import torch

from k3fuse.models import KimiK3Config

sys.path.insert(0, str(Path(__file__).parent))
import _tp_worker  # noqa: E402
from _launch import launch_ranks  # noqa: E402

WORLD = 4


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """Launch the 4 ranks once; every test of this module reads their outputs."""
    tmp = tmp_path_factory.mktemp("tp")
    seed = 1234
    launch_ranks("_tp_worker.py", WORLD, tmp, seed, timeout=150)
    ref = _tp_worker.decode(KimiK3Config.preset("tiny"), seed)
    return tmp, ref


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_logits_equal_tp1(tp_run, tp):
    tmp, ref = tp_run
    assert ref.shape == (_tp_worker.STEPS, _tp_worker.M, KimiK3Config.preset("tiny").vocab_size)
    outs = [torch.load(tmp / f"tp{tp}_rank{r}.pt") for r in range(WORLD)]
    for r, got in enumerate(outs):
        assert got.shape == ref.shape
        err = rel(got, ref)
        assert err < 1e-5, f"TP={tp} rank {r}: rel err {err:.2e}"
        # every rank of a group holds the same (gathered) logits
        assert torch.equal(got, outs[r - r % tp]), f"TP={tp}: rank {r} differs from its group's first rank"


def test_tp_size_that_does_not_divide_is_a_clear_error(tp_run):
    tmp, _ = tp_run
    for r in range(3):
        msg = (tmp / f"tp3_rank{r}.txt").read_text()
        assert msg.startswith("ValueError") and "does not divide by tensor-parallel size 3" in msg, msg
