"""benchmarks/op_ledger.py: bytes per k3fuse op call of a compiled graph (the tiny model on CPU), the expert and
in-place accounting, and the matching of profiler op events to the graph's op calls."""
import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import op_ledger  # noqa: E402

from k3fuse import backend  # noqa: E402
from k3fuse.models import KimiK3Config, KimiK3ForCausalLM  # noqa: E402

M = 2


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    cfg = KimiK3Config.preset("tiny")
    model = KimiK3ForCausalLM(cfg, dtype=torch.bfloat16).requires_grad_(False)
    torch._dynamo.reset()      # a fresh static compile: not a recompile of another test's graph (dynamic shapes)
    c = torch.compile(model, backend="k3fuse", fullgraph=True, dynamic=False, options={"inner_compiler": "eager"})
    cache = model.new_cache(M, 4)
    g0 = max((p.graph_id for p in backend.LAST_PIPELINES), default=-1)   # it keeps the last 16: by id, not index
    with torch.no_grad():
        c(torch.randint(0, cfg.vocab_size, (M,)), cache)
    (pipe,) = [p for p in backend.LAST_PIPELINES if p.graph_id > g0]
    return cfg, model, cache, pipe.graph_module


def test_expert_and_in_place_bytes(compiled):
    cfg, model, cache, gm = compiled
    k = cfg.num_experts_per_token
    rows = op_ledger.op_bytes(gm, cfg.num_experts, k)
    by = lambda op: [r for r in rows if r["op"] == op]
    moe = [l.mlp for l in model.model.layers if hasattr(l.mlp, "experts")]
    assert len(by("moe_experts")) == len(moe) > 0
    ex = moe[0].experts
    per_expert = (ex.w13_weight[0].numel() + ex.w2_weight[0].numel()) * 2
    D = cfg.routed_expert_hidden_size
    # z [M, D] bf16, ids [M, k] int64, routing weights [M, k] fp32; the k chosen experts of the E; out [M, D] bf16
    for r in by("moe_experts"):
        assert r["read_bytes"] == k * per_expert + M * D * 2 + M * k * 8 + M * k * 4
        assert r["written_bytes"] == M * D * 2
    # kda_decode_ writes its output, then S (fp32) and the conv state in place
    la = cfg.linear_attn_config
    H, d = la["num_heads"], la["head_dim"]
    kda = by("kda_decode_")
    assert len(kda) == len(la["kda_layers"])
    l0 = la["kda_layers"][0] - 1
    S, conv = cache.recurrent_state[l0], cache.conv_state[l0]
    assert S.shape == (M, H, d, d) and S.dtype == torch.float32
    for r in kda:
        assert r["written_bytes"] == M * H * d * 2 + S.numel() * 4 + conv.numel() * 2
        assert r["read_bytes"] > S.numel() * 4 + conv.numel() * 2
    # without the experts' scaling every stacked expert counts
    full = [r for r in op_ledger.op_bytes(gm) if r["op"] == "moe_experts"]
    assert full[0]["read_bytes"] - by("moe_experts")[0]["read_bytes"] == (cfg.num_experts - k) * per_expert


def test_every_k3fuse_op_call_has_a_row(compiled):
    cfg, _, _, gm = compiled
    rows = op_ledger.op_bytes(gm, cfg.num_experts, cfg.num_experts_per_token)
    ops = [n.target._schema.name.split("::")[-1] for n in gm.graph.nodes
           if n.op == "call_function" and getattr(n.target, "namespace", None) == "k3fuse"]
    assert [r["op"] for r in rows] == ops and len(ops) > 10
    assert all(r["read_bytes"] > 0 for r in rows)


def _ev(name, start, us, parent=None):
    return SimpleNamespace(name=name, cpu_parent=parent, time_range=SimpleNamespace(start=start),
                           device_time_total=us)


def test_add_times_matches_calls_by_name_and_order():
    rows = [dict(op="linear_group", read_bytes=4e6, written_bytes=0), dict(op="kda_decode_", read_bytes=1e6,
                                                                         written_bytes=1e6),
            dict(op="linear_group", read_bytes=2e6, written_bytes=0), dict(op="moe_experts", read_bytes=8e6,
                                                                         written_bytes=0)]
    outer = _ev("k3fuse::linear_group", 30, 5.0)
    evs = [_ev("k3fuse::linear_group", 10, 3.0), _ev("k3fuse::kda_decode_", 20, 2.5), outer,
           _ev("k3fuse::linear", 31, 9.0, parent=outer),           # nested in a reference implementation: skipped
           _ev("aten::mm", 40, 1.0)]
    assert op_ledger.add_times(rows, evs) == 3
    assert [r.get("us") for r in rows] == [3.0, 2.5, 5.0, None]
    led = op_ledger.ledger_rows(rows, 1e12)               # 1 TB/s: 1 MB = 1 us
    assert led[1] == dict(op="kda_decode_", MB=2.0, floor_us=2.0, us=2.5) and "us" not in led[3]
    last = op_ledger.format_ledger(led).splitlines()[-1].split()
    assert last[0] == "sum" and float(last[1]) == pytest.approx(16.0) and float(last[2]) == pytest.approx(16.0)
    assert float(last[3]) == pytest.approx(10.5)
    # a profile without device times (CPU only, or kernels not attributed to their ops) sets no times
    bare = [dict(op="linear_group", read_bytes=1, written_bytes=0)]
    assert op_ledger.add_times(bare, [_ev("k3fuse::linear_group", 1, 0.0)]) == 0 and "us" not in bare[0]
    assert op_ledger.format_ledger(op_ledger.ledger_rows(bare, 1e12)).splitlines()[-1].split()[-2:] == ["-", "-"]
