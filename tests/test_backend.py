"""The k3fuse backend end to end on CPU: compiled == eager over several decode steps, options, errors, inspection."""
import json
import subprocess
import sys

import pytest
import torch

from k3fuse.models import KimiK3Config, KimiK3ForCausalLM


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return KimiK3ForCausalLM(KimiK3Config.preset("tiny"), dtype=dtype).requires_grad_(False)


def _steps(model, compiled, M, steps, seed=0):
    ce, cc = model.new_cache(M, steps + 1), model.new_cache(M, steps + 1)
    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.randint(0, model.config.vocab_size, (M,), generator=g)
            out.append((model(ids, ce), compiled(ids, cc)))
    assert torch.equal(ce.seq_lens, cc.seq_lens)
    # fp32 states (the KDA recurrence) of a bf16 model sum bf16-rounded inputs: one rounding flip of an input moves
    # them by ~1e-4 relative (seen: 1.5e-4 at M = 3 on a 2-core CPU), so they get a bf16-model tolerance
    bf16_model = next(model.parameters()).dtype == torch.bfloat16
    for x, y in zip(ce.conv_state + ce.recurrent_state + ce.latent_cache,
                    cc.conv_state + cc.recurrent_state + cc.latent_cache):
        if x is not None:
            tol = 2e-2 if x.dtype == torch.bfloat16 else (1e-3 if bf16_model else 1e-4)
            assert rel(y, x) < tol
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_compiled_equals_eager_eager_inner(dtype, tol):
    torch._dynamo.reset()
    model = _model(dtype)
    compiled = torch.compile(model, backend="k3fuse", fullgraph=True, options={"inner_compiler": "eager"})
    for M in (1, 3, 8):
        for a, b in _steps(model, compiled, M, 3, seed=M):
            assert b.shape == (M, 512) and b.dtype == dtype
            assert rel(b, a) < tol
            assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_compiled_equals_eager_inductor():
    """The default inner compiler (Inductor) runs the graph the passes left, k3fuse custom ops included."""
    torch._dynamo.reset()
    model = _model()
    compiled = torch.compile(model, backend="k3fuse", fullgraph=True, dynamic=False)
    for a, b in _steps(model, compiled, 3, 3):
        assert rel(b, a) < 1e-4 and torch.equal(a.argmax(-1), b.argmax(-1))


def test_entry_point_fresh_process():
    """After pip install, backend="k3fuse" works in a process that never imports k3fuse itself."""
    code = (
        "import sys, torch\n"
        "import importlib.metadata as md\n"
        "assert any(e.name == 'k3fuse' for e in md.entry_points(group='torch_dynamo_backends'))\n"
        "f = torch.compile(lambda x: torch.nn.functional.linear(x, x), backend='k3fuse',\n"
        "                  options={'inner_compiler': 'eager'})\n"
        "x = torch.randn(4, 4)\n"
        "assert torch.allclose(f(x), x @ x.t(), rtol=1e-5, atol=1e-5)\n"
        "print('ok', 'k3fuse.backend' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "ok True"


def test_unknown_option_names_valid_ones():
    torch._dynamo.reset()
    f = torch.compile(lambda x: x + 1, backend="k3fuse", options={"debugdir": "/tmp/x"})
    with pytest.raises(Exception) as e:
        f(torch.randn(2))
    assert "debugdir" in str(e.value) and "debug_dir" in str(e.value) and "inner_compiler" in str(e.value)
    torch._dynamo.reset()
    f = torch.compile(lambda x: x + 1, backend="k3fuse", options={"inner_compiler": "tvm"})
    with pytest.raises(Exception, match="inner_compiler must be one of"):
        f(torch.randn(2))


def test_debug_dir_env(tmp_path, monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setenv("K3FUSE_DEBUG_DIR", str(tmp_path))
    model = _model()
    compiled = torch.compile(model, backend="k3fuse", fullgraph=True, options={"inner_compiler": "eager"})
    _steps(model, compiled, 2, 1)
    d = sorted(tmp_path.glob("graph_*"))[-1]
    s = json.loads((d / "summary.json").read_text())
    assert [p["name"] for p in s["passes"]] == ["canonicalize", "fuse_kda_conv_gated_norm",
                                                "fuse_attn_out_allreduce_attnres_norm",
                                                "split_moe_across_ranks", "fuse_shared_input_linears",
                                                "fuse_situ_glu_into_linear_group",
                                                "fuse_router_into_linear_group",
                                                "fuse_topk_into_linear_group_router",
                                                "fuse_rms_norm_into_linear", "insert_prefetch",
                                                "fuse_mla_append_and_gate", "fuse_q_b_into_mla_attention",
                                                "write_kda_state_in_place"]
    assert s["ops"]["k3fuse.fused_residual_norm"] == 12
    assert (d / "02.fuse_attn_out_allreduce_attnres_norm.after.py").read_text().count(
        "torch.ops.k3fuse.fused_residual_norm.default(") == 12


def test_grad_mode_error():
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    f = torch.compile(lin, backend="k3fuse")
    with pytest.raises(Exception, match="inference graphs"):
        f(torch.randn(2, 4))


def test_bad_inputs_are_clear_errors():
    torch._dynamo.reset()
    model = _model()
    compiled = torch.compile(model, backend="k3fuse", fullgraph=True, options={"inner_compiler": "eager"})
    cache = model.new_cache(3, 4)
    with torch.no_grad():
        with pytest.raises(Exception, match="one new token per sequence"):
            compiled(torch.zeros(3, 1, dtype=torch.long), cache)
        with pytest.raises(Exception, match="batch"):
            compiled(torch.zeros(2, dtype=torch.long), cache)
        with pytest.raises(Exception, match="dtype"):
            compiled(torch.zeros(3, dtype=torch.long), model.new_cache(3, 4, dtype=torch.bfloat16))
        with pytest.raises(Exception, match="integer"):
            compiled(torch.zeros(3), cache)


def test_cli_inspect(tmp_path):
    r = subprocess.run([sys.executable, "-m", "k3fuse.cli", "inspect", "--config", "tiny", "--batch", "3",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fuse_attn_out_allreduce_attnres_norm     matches=12" in r.stdout
    assert "k3fuse.fused_residual_norm" in r.stdout
    s = json.loads(next(tmp_path.glob("graph_*/summary.json")).read_text())
    assert {p["name"]: p["matches"] for p in s["passes"]}["fuse_attn_out_allreduce_attnres_norm"] == 12
