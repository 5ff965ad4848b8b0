"""compiler/runtime.py on a GPU: the CUDA-graph path (one graph per bucket) == the un-graphed path, with generated
kernels on, the static output poisoned before each replay. Skipped without CUDA."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")


def test_graph_per_bucket_matches_ungraphed(seed):
    from k3fuse.models import KimiK3Config, KimiK3ForCausalLM
    from k3fuse.models.config import PRESETS
    from k3fuse.runtime import BucketedDecoder
    torch._dynamo.reset()
    cfg = KimiK3Config.from_dict(PRESETS["tiny"])
    model = KimiK3ForCausalLM(cfg, dtype=torch.bfloat16).cuda().requires_grad_(False)
    compiled = torch.compile(model, backend="k3fuse", fullgraph=True, dynamic=False)
    dg = BucketedDecoder(compiled, model.new_cache(8, 32))                   # graphs
    dp = BucketedDecoder(compiled, model.new_cache(8, 32), cuda_graphs=False)
    g = torch.Generator().manual_seed(seed)
    for m in (3, 3, 8, 1, 5, 3, 8):
        ids = torch.randint(0, cfg.vocab_size, (m,), generator=g).cuda()
        for _, out in dg._graphs.values():
            out.fill_(float("nan"))                                          # a replay must rewrite it
        a, b = dg(ids), dp(ids)
        assert torch.isfinite(a).all()
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() < 1e-3   # same kernels, same state
    assert dg.captured == (1, 4, 8)
    for t, u in zip(dg.cache.recurrent_state, dp.cache.recurrent_state):
        if t is not None:
            assert ((t - u).norm() / u.norm()).item() < 1e-2
