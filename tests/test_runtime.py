"""compiler/runtime.py: BucketedDecoder pads to batch buckets over cache row views (CPU: no CUDA graphs)."""
import pytest
import torch

from k3fuse.models import KimiK3Config, KimiK3ForCausalLM
from k3fuse.models.config import PRESETS
from k3fuse.runtime import BucketedDecoder


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return KimiK3ForCausalLM(KimiK3Config.from_dict(PRESETS["tiny"])).requires_grad_(False)


class Spy:
    """The eager model, recording the batch sizes it was called with."""
    def __init__(self, m):
        self.m, self.sizes = m, []

    def __call__(self, ids, cache):
        self.sizes.append(ids.shape[0])
        return self.m(ids, cache)


# (live rows, rows that start a new sequence at this step)
SCHEDULE = [(3, [0, 1, 2]), (3, []), (5, [3, 4]), (1, []), (8, [5, 6, 7]), (6, []), (6, [])]


def test_buckets_match_independent_sequences(model, seed):
    """Each row decoded through the buckets == that sequence decoded alone at batch 1 (rows are independent)."""
    V = model.config.vocab_size
    spy = Spy(model)
    dec = BucketedDecoder(spy, model.new_cache(8, 32))
    alone = {}
    g = torch.Generator().manual_seed(seed)
    for m, new in SCHEDULE:
        dec.reset(new)
        for r in new:
            alone[r] = model.new_cache(1, 32)
        ids = torch.randint(0, V, (m,), generator=g)
        got = dec(ids)
        assert got.shape == (m, V)
        for r in range(m):
            ref = model(ids[r:r + 1], alone[r]).double()
            # batch-1 vs batched fp32 matmuls round differently: a norm-relative bound, far below any row mix-up
            assert ((got[r:r + 1].double() - ref).norm() / ref.norm()).item() < 1e-5
    assert set(spy.sizes) <= {1, 2, 4, 8} and spy.sizes == [4, 4, 8, 1, 8, 8, 8]


def test_scratch_rows_never_run_past_the_cache(model):
    """A bucket's padding rows are reset before every step: 3 live rows for more steps than the cache holds."""
    dec = BucketedDecoder(model, model.new_cache(4, 6))
    for _ in range(5):
        dec(torch.tensor([1, 2, 3]))
    assert dec.cache.seq_lens.tolist() == [5, 5, 5, 1]
    with pytest.raises(Exception):       # the live rows themselves do hit the end (no silent wrap-around)
        for _ in range(5):
            dec(torch.tensor([1, 2, 3]))


def test_compiled_step_specializes_per_bucket(model, seed):
    """torch.compile(backend="k3fuse") behind the decoder: one graph per bucket used, same values as eager."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()                     # the graph count is process-wide
    V = model.config.vocab_size
    compiled = torch.compile(model, backend="k3fuse", fullgraph=True, dynamic=False,
                             options={"inner_compiler": "eager"})
    spy = Spy(compiled)
    dc, de = BucketedDecoder(spy, model.new_cache(8, 16)), BucketedDecoder(model, model.new_cache(8, 16))
    g = torch.Generator().manual_seed(seed)
    for m in (3, 4, 1, 7, 2, 3):
        ids = torch.randint(0, V, (m,), generator=g)
        torch.testing.assert_close(dc(ids), de(ids), rtol=1e-4, atol=1e-4)
    assert sorted(set(spy.sizes)) == [1, 2, 4, 8]
    assert counters["stats"]["unique_graphs"] <= 4


def test_errors(model):
    dec = BucketedDecoder(model, model.new_cache(4, 8))
    with pytest.raises(ValueError, match="holds 1..4"):
        dec(torch.tensor([1, 2, 3, 4, 5]))
    with pytest.raises(ValueError, match=r"\[M\]"):
        dec(torch.tensor([[1]]))
    with pytest.raises(ValueError, match="CUDA"):
        BucketedDecoder(model, model.new_cache(4, 8), cuda_graphs=True)
    with pytest.raises(ValueError, match="no bucket"):
        BucketedDecoder(model, model.new_cache(4, 8), buckets=(8, 16))
    # above every bucket: runs at its exact size, un-graphed
    dec = BucketedDecoder(model, model.new_cache(6, 8), buckets=(1, 2, 4))
    assert dec(torch.tensor([1, 2, 3, 4, 5])).shape == (5, model.config.vocab_size)
