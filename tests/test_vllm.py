"""k3fuse inside the real vLLM (0.32, CPU build): the K3FuseVllmPass under vLLM's own compile path, on pieces in the
style of a vLLM K3 graph, with exact match counts and numerics against plain math and against the unfused vLLM
compile. Skipped without vLLM; run it in the vLLM venv (docs/VLLM.md):

    /tmp/vllmenv/bin/python -m pytest -q tests/test_vllm.py

The piece is what lies between two attention ops of a vLLM K3 graph (vLLM splits there): o_proj -> all-reduce ->
AttnRes prefix update -> mix -> post_attention_layernorm (vLLM RMSNorm), dense SiTU-GLU MLP -> down_proj ->
all-reduce -> prefix update -> mix -> the next layer's input_layernorm -> its first projection and a norm on that
(an MLA LoRA norm: no fusion site). Two fusion sites.
At TP = 2 the all-reduces are torch.ops.vllm.all_reduce, as GroupCoordinator.all_reduce emits them on CUDA/ROCm/XPU
(use_custom_op_collectives; vLLM's CPU platform calls the communicator directly instead), run in a 2-process gloo
world with vLLM's own distributed init.

This file is also the TP worker: python tests/test_vllm.py tp-worker RANK WORLD INIT_FILE OUT_DIR
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")     # every compile runs the passes (no artifact reuse)
if __name__ != "__main__":
    pytest.importorskip("vllm")

H, I, Q, A, M = 64, 32, 48, 64, 5          # hidden, MLP intermediate, next projection, attention output, tokens
EPS, MIX_EPS, BETA, LBETA = 1e-6, 1e-5, 4.0, 25.0


# ------------------------------------------------------------------------------------------------ reference math
def mix(sources, w, eps=MIX_EPS):
    """AttnRes depth mix, literally as k3fuse.models.modeling_kimi_k3.AttnRes (w folded: res_norm * res_proj)."""
    v = torch.stack(sources, dim=1).float()
    logits = (v * w).sum(-1) * torch.rsqrt(v.pow(2).mean(-1) + eps)
    return (torch.softmax(logits, dim=1).unsqueeze(-1) * v).sum(1)


def situ_glu(gate_up):
    g, u = gate_up.float().chunk(2, dim=-1)
    return (BETA * torch.tanh(g / BETA) * torch.sigmoid(g) * (LBETA * torch.tanh(u / LBETA))).to(gate_up.dtype)


def rms(x, w, eps=EPS):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(w.dtype) * w


def weights(seed: int, dtype):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dtype)
    return {"w_o": r(H, A, scale=A ** -0.5), "w_gu": r(2 * I, H, scale=H ** -0.5), "w_d": r(H, I, scale=I ** -0.5),
            "w_q": r(Q, H, scale=H ** -0.5),
            "mlp_res_w": r(H, scale=0.3).float(), "attn_res_w": r(H, scale=0.3).float(),
            "post_norm": 1 + r(H, scale=0.1), "in_norm": 1 + r(H, scale=0.1), "q_norm": 1 + r(Q, scale=0.1),
            "o": r(M, A), "prefix": r(M, H), "block0": r(M, H)}


def reference(wt, restart: bool):
    """The piece at TP = 1, eager, in plain torch (the K3 model's math; the mix rounded before the norm)."""
    dt = wt["o"].dtype
    a = torch.nn.functional.linear(wt["o"], wt["w_o"])
    prefix = a if restart else wt["prefix"] + a
    x = rms(mix([wt["block0"], prefix], wt["mlp_res_w"]).to(dt), wt["post_norm"])
    m = torch.nn.functional.linear(situ_glu(torch.nn.functional.linear(x, wt["w_gu"])), wt["w_d"])
    prefix = prefix + m
    x = rms(mix([wt["block0"], prefix], wt["attn_res_w"]).to(dt), wt["in_norm"])
    return rms(torch.nn.functional.linear(x, wt["w_q"]), wt["q_norm"]), prefix


# ------------------------------------------------------------------------------------------------ the vLLM piece
def make_piece_class():
    from vllm.compilation.decorators import support_torch_compile
    from vllm.model_executor.layers.layernorm import RMSNorm

    @support_torch_compile(dynamic_arg_dims={"o": 0, "prefix": 0, "block0": 0})
    class K3Piece(nn.Module):
        def __init__(self, *, vllm_config, prefix="", wt=None, restart=False, tp_rank=0, tp_size=1, group=""):
            super().__init__()
            self.restart, self.tp_rank, self.tp_size, self.group = restart, tp_rank, tp_size, group

            def p(t):
                return nn.Parameter(t.clone(), requires_grad=False)
            sh = lambda t, dim: t.chunk(tp_size, dim)[tp_rank]                       # noqa: E731
            gate, up = wt["w_gu"].chunk(2, 0)
            self.w_o = p(sh(wt["w_o"], 1))                                       # row parallel
            self.w_gu = p(torch.cat([sh(gate, 0), sh(up, 0)]))                   # merged column parallel
            self.w_d = p(sh(wt["w_d"], 1))                                       # row parallel
            self.w_q = p(sh(wt["w_q"], 1))                                       # row parallel (an unfused all-reduce)
            self.mlp_res_w, self.attn_res_w = p(wt["mlp_res_w"]), p(wt["attn_res_w"])
            self.post_attention_layernorm = RMSNorm(H, eps=EPS, dtype=wt["o"].dtype)
            self.input_layernorm = RMSNorm(H, eps=EPS, dtype=wt["o"].dtype)
            self.post_attention_layernorm.weight.data.copy_(wt["post_norm"])
            self.input_layernorm.weight.data.copy_(wt["in_norm"])
            self.q_norm = RMSNorm(Q, eps=EPS, dtype=wt["o"].dtype)            # a norm that is no fusion site
            self.q_norm.weight.data.copy_(wt["q_norm"])

        def all_reduce(self, x):
            if self.tp_size == 1:             # vLLM bypasses the all-reduce at TP = 1
                return x
            return torch.ops.vllm.all_reduce(x, group_name=self.group)

        def forward(self, o: torch.Tensor, prefix: torch.Tensor, block0: torch.Tensor):
            dt = o.dtype
            a = self.all_reduce(torch.nn.functional.linear(o, self.w_o))
            prefix = a if self.restart else prefix + a
            x = self.post_attention_layernorm(mix([block0, prefix], self.mlp_res_w).to(dt))
            h = situ_glu(torch.nn.functional.linear(x, self.w_gu))
            prefix = prefix + self.all_reduce(torch.nn.functional.linear(h, self.w_d))
            x = self.input_layernorm(mix([block0, prefix], self.attn_res_w).to(dt))
            xs = x.chunk(self.tp_size, dim=1)[self.tp_rank]
            return self.q_norm(self.all_reduce(torch.nn.functional.linear(xs, self.w_q))), prefix
    return K3Piece


def vllm_config(custom_pass=None, vllm_compile=True, ranges=None):
    """A VllmConfig without a model. vllm_compile: vLLM's own compile path (VllmBackend: Dynamo capture, split at
    attention ops, PiecewiseBackend, Inductor with PostGradPassManager), which vLLM's CPU platform otherwise replaces
    by DYNAMO_TRACE_ONCE + plain Inductor. False: the configuration exactly as the CPU platform leaves it."""
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig
    icc = {} if custom_pass is None else {"post_grad_custom_post_pass": custom_pass}
    cfg = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend="inductor",
                                                          inductor_compile_config=icc,
                                                          compile_ranges_endpoints=ranges))
    if vllm_compile:
        cc = cfg.compilation_config
        cc.mode = CompilationMode.VLLM_COMPILE
        cc.ir_enable_torch_wrap = True      # RMSNorm as the vllm_ir.rms_norm op, as on CUDA
        cc.post_init_cudagraph_sizes()      # compile_sizes = [] (no model config to derive them)
    return cfg


def run_piece(wt, restart, custom_pass, vllm_compile=True, tp_rank=0, tp_size=1, group="", calls=(M,), ranges=None):
    import vllm.ir
    from vllm.config import set_current_vllm_config
    torch._dynamo.reset()
    cfg = vllm_config(custom_pass, vllm_compile, ranges)
    outs = []
    # what a vLLM worker sets for its lifetime (WorkerBase: vllm.ir.set_default_torch_wrap)
    wrap = vllm.ir.enable_torch_wrap(cfg.compilation_config.ir_enable_torch_wrap is not False)
    # Inductor's own FX graph cache would replay an earlier compile of the same piece without running the passes
    with set_current_vllm_config(cfg), torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True), wrap:
        piece = make_piece_class()(vllm_config=cfg, wt=wt, restart=restart, tp_rank=tp_rank, tp_size=tp_size,
                                   group=group)
        for n in calls:                   # several batch sizes: one compile (dynamic batch), reused
            outs.append(piece(wt["o"][:n].chunk(tp_size, 1)[tp_rank].contiguous(), wt["prefix"][:n],
                              wt["block0"][:n]))
    return outs


def new_pass():
    from k3fuse.vllm_plugin import K3FuseVllmPass
    return K3FuseVllmPass()


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("restart", [False, True], ids=["prefix", "restart"])
def test_vllm_compile_tp1_fp32(restart):
    """vLLM's VllmBackend + PostGradPassManager with the k3fuse pass in post_grad_custom_post_pass: both sites fuse;
    outputs equal the unfused vLLM compile and the plain math."""
    wt = weights(1, torch.float32)
    p = new_pass()
    fused = run_piece(wt, restart, p, calls=(M, 3))
    assert len(p.history) == 1, p.history          # one piece, one compile range
    rec = p.history[0]
    # the prefix update is folded into the o_proj GEMM by Inductor (addmm) unless it is a restart
    assert rec["vllm_ops"] == {"rms_norm": 3, "all_reduce": 0, "addmm": 1 if restart else 2, "reshape": 2}
    assert rec["canonicalize"] == 2 + 1 + 4        # 2 mixes, SiTU-GLU, 4 linears
    assert rec["fuse_attn_out_allreduce_attnres_norm"] == 2
    assert rec["restored"] == {"all_reduce": 0, "rms_norm": 1, "reshape": 0}   # q_norm goes back to vLLM
    unfused = run_piece(wt, restart, None, calls=(M, 3))
    for n, f, u in zip((M, 3), fused, unfused):
        ref = reference({k: (v[:n] if k in ("o", "prefix", "block0") else v) for k, v in wt.items()}, restart)
        for a, b, r in zip(f, u, ref):
            assert rel(a, b) < 1e-5 and rel(a, r) < 1e-5


def test_vllm_compile_tp1_bf16():
    """bf16 activations: the norms take the mix rounded to bf16 (vLLM RMSNorm on x.to(bf16))."""
    wt = weights(2, torch.bfloat16)
    p = new_pass()
    (fused,) = run_piece(wt, False, p)
    assert p.history[0]["fuse_attn_out_allreduce_attnres_norm"] == 2
    assert p.history[0]["vllm_ops"]["rms_norm"] == 3 and p.history[0]["restored"]["rms_norm"] == 1
    (unfused,) = run_piece(wt, False, None)
    ref = reference(wt, False)
    for a, b, r in zip(fused, unfused, ref):
        assert a.dtype == r.dtype == torch.bfloat16
        assert rel(a, r) < 1e-2 and rel(b, r) < 1e-2


def test_decode_range_only():
    """compile_ranges_endpoints=[4] and K3FuseVllmPass(max_tokens=4): vLLM compiles the piece per range; k3fuse
    rewrites only the decode range [1, 4]; both ranges give the plain math."""
    from k3fuse.vllm_plugin import K3FuseVllmPass
    wt = weights(5, torch.float32)
    p = K3FuseVllmPass(max_tokens=4)
    outs = run_piece(wt, False, p, calls=(3, M), ranges=[4])
    assert len(p.history) == 1 and p.history[0]["fuse_attn_out_allreduce_attnres_norm"] == 2, p.history
    for n, out in zip((3, M), outs):
        ref = reference({k: (v[:n] if k in ("o", "prefix", "block0") else v) for k, v in wt.items()}, False)
        for a, r in zip(out, ref):
            assert rel(a, r) < 1e-5


def test_cpu_platform_path():
    """The configuration vLLM's CPU platform really runs (DYNAMO_TRACE_ONCE, plain Inductor with the config's
    post_grad_custom_post_pass, RMSNorm not wrapped as an op): the pass is called by Inductor directly and the
    standard canonicalization recognises vLLM's native RMSNorm math."""
    from vllm.config import CompilationMode
    assert vllm_config(new_pass(), vllm_compile=False).compilation_config.mode == CompilationMode.DYNAMO_TRACE_ONCE
    wt = weights(3, torch.float32)
    p = new_pass()
    (fused,) = run_piece(wt, False, p, vllm_compile=False)
    rec = p.history[0]
    assert rec["vllm_ops"]["rms_norm"] == 0          # no vllm_ir op on this path
    assert rec["fuse_attn_out_allreduce_attnres_norm"] == 2, rec
    for a, r in zip(fused, reference(wt, False)):
        assert rel(a, r) < 1e-5


@pytest.mark.slow
def test_vllm_compile_tp2_gloo(tmp_path):
    """TP = 2 in a 2-process gloo world set up by vLLM's init_distributed_environment / initialize_model_parallel:
    torch.ops.vllm.all_reduce at both sites becomes the fused op's all-reduce on the TP group's device group; the
    third (not followed by a norm) goes back to vllm.all_reduce. Outputs equal TP = 1 plain math on every rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_DISABLE_COMPILE_CACHE="1", TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    world = 2
    procs = [subprocess.Popen([sys.executable, __file__, "tp-worker", str(r), str(world), str(tmp_path / "store"),
                               str(tmp_path)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env, text=True)
             for r in range(world)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-6000:]}"
    wt = weights(4, torch.float32)
    ref = reference(wt, False)
    for r in range(world):
        res = torch.load(tmp_path / f"rank{r}.pt")
        rec = res["history"][0]
        assert len(res["history"]) == 1
        assert rec["vllm_ops"] == {"rms_norm": 3, "all_reduce": 3, "addmm": 0, "reshape": 2}, rec
        assert rec["fuse_attn_out_allreduce_attnres_norm"] == 2
        assert rec["restored"] == {"all_reduce": 1, "rms_norm": 1, "reshape": 0}
        ops = res["ops_after"]
        assert ops.get("vllm.all_reduce") == 1 and "_c10d_functional.all_reduce" not in ops, ops
        assert ops.get("vllm_ir.rms_norm") == 1 and ops.get("k3fuse.fused_residual_norm") == 2, ops
        for a, u, b in zip(res["fused"], res["unfused"], ref):
            assert rel(a, b) < 1e-5 and rel(u, b) < 1e-5


def test_pass_object_and_names():
    """Exported lazily from the top-level package, a vLLM InductorPass, stable uuid, picklable by reference."""
    import pickle

    from vllm.compilation.passes.inductor_pass import InductorPass

    import k3fuse
    from k3fuse.vllm_plugin import K3FuseVllmPass
    p = k3fuse.k3fuse_vllm_pass
    assert isinstance(p, InductorPass) and isinstance(p, K3FuseVllmPass)
    assert p.uuid() == K3FuseVllmPass().uuid() and p.uuid() != K3FuseVllmPass(max_tokens=64).uuid()
    q = pickle.loads(pickle.dumps(p))
    assert type(q) is K3FuseVllmPass and q.max_tokens == p.max_tokens
    assert K3FuseVllmPass(max_tokens=64).is_applicable_for_range(type("R", (), {"end": 64})())
    assert not K3FuseVllmPass(max_tokens=64).is_applicable_for_range(type("R", (), {"end": 65})())


def _fresh(code: str, cwd) -> str:
    # cwd: not the repo root, where a stale k3fuse.egg-info (from an older `pip install -e .`) would shadow the
    # installed entry points
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd,
                       env=dict(os.environ, VLLM_PLUGINS="k3fuse"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_import_k3fuse_does_not_import_vllm(tmp_path):
    out = _fresh("import sys, k3fuse; print('vllm' in sys.modules, 'k3fuse_vllm_pass' in vars(k3fuse))", tmp_path)
    assert out.split() == ["False", "False"]


def test_config_by_name_and_general_plugin(tmp_path):
    """In a fresh process: the `vllm.general_plugins` entry point registers the k3fuse ops, and vLLM resolves the
    documented name "k3fuse.k3fuse_vllm_pass" (a dict lookup in the package, no getattr) to the pass object."""
    out = _fresh(
        "import torch\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "print(torch.ops.k3fuse.fused_residual_norm.default.name())\n"
        "from vllm.config import CompilationConfig\n"
        "cc = CompilationConfig(inductor_passes={'post_grad_custom_post_pass': 'k3fuse.k3fuse_vllm_pass'})\n"
        "import k3fuse\n"
        "print(cc.inductor_compile_config['post_grad_custom_post_pass'] is k3fuse.k3fuse_vllm_pass)\n", tmp_path)
    assert out.split()[-2:] == ["k3fuse::fused_residual_norm", "True"]
    # vLLM imported first, then the name resolved without the plugin having run (LLM(compilation_config={...}))
    out = _fresh(
        "from vllm.config import CompilationConfig\n"
        "cc = CompilationConfig(inductor_passes={'post_grad_custom_post_pass': 'k3fuse.k3fuse_vllm_pass'})\n"
        "print(type(cc.inductor_compile_config['post_grad_custom_post_pass']).__name__)\n", tmp_path)
    assert out.split()[-1] == "K3FuseVllmPass"
    # a pass object pickled here unpickles in a fresh process (vLLM sends the config to its workers)
    import pickle

    from k3fuse.vllm_plugin import K3FuseVllmPass
    blob = pickle.dumps(K3FuseVllmPass(max_tokens=64))
    out = _fresh(f"import pickle; p = pickle.loads({blob!r}); print(type(p).__name__, p.max_tokens)", tmp_path)
    assert out.split()[-2:] == ["K3FuseVllmPass", "64"]


# ------------------------------------------------------------------------------------------------ TP worker
def _tp_worker(rank: int, world: int, init_file: str, out: str):
    torch.set_num_threads(1)
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from k3fuse.pipeline import op_counts
    cfg = vllm_config(None)
    with set_current_vllm_config(cfg):
        ps.init_distributed_environment(world_size=world, rank=rank, distributed_init_method=f"file://{init_file}",
                                        local_rank=rank, backend="gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=world)
    group = ps.get_tp_group().unique_name
    wt = weights(4, torch.float32)
    p = new_pass()
    after = {}
    orig = type(p).__call__

    def spy(self, graph):
        orig(self, graph)
        after.update(op_counts(graph))
    type(p).__call__ = spy
    (fused,) = run_piece(wt, False, p, tp_rank=rank, tp_size=world, group=group)
    (unfused,) = run_piece(wt, False, None, tp_rank=rank, tp_size=world, group=group)
    torch.save({"fused": fused, "unfused": unfused, "history": p.history, "ops_after": after},
               Path(out) / f"rank{rank}.pt")
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "tp-worker":
    _tp_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
