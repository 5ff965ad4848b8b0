"""k3fuse.codegen pipeline on the CPU: buckets, rendering, the disk cache, fallback logging, the kernels CLI."""
import json
import logging
import subprocess
import sys

import pytest
import torch

from k3fuse.codegen import buckets, cache, render


def test_import_does_not_load_cutlass():
    code = ("import sys, k3fuse.codegen, k3fuse.codegen.registry, k3fuse.codegen.gemv, "
            "k3fuse.codegen.fused_residual_norm, k3fuse.codegen.prefetch, k3fuse.codegen.kernels_cli; "
            "print(any(m == 'cutlass' or m.startswith('cutlass.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("m,b", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (17, 32), (33, 64),
                                 (64, 64), (65, None), (1000, None), (0, None)])
def test_bucket_for(m, b):
    assert buckets.bucket_for(m) == b


def test_every_template_renders():
    from k3fuse.codegen import fused_residual_norm as frn
    from k3fuse.codegen import gemv, prefetch
    names = render.template_names()
    assert {"gemv_simt.py.jinja", "gemv_mma.py.jinja", "fused_residual_norm_mixnorm.py.jinja",
            "prefetch_l2_bulk.py.jinja"} <= set(names)
    srcs = []
    for N, K in [(6288, 7168), (7168, 384), (1536, 128), (2304, 1536)]:
        for b in buckets.BUCKETS:
            for cfg in gemv.candidates(N, K, b):
                srcs.append(gemv.render_source(N, K, b, cfg)[1])
    for f in (dict(norm=True), dict(norm=True, x_fp32=True, act="situ"), dict(act="situ")):
        for b in (1, 2, 4, 8):
            srcs.append(gemv.render_source(1536, 7168, b, fusion=f)[1])
    for nb in range(9):
        srcs.append(frn.render_mixnorm(7168, nb, nb % 2 == 0, nb % 3 != 0, True, nb % 2 == 1, 1e-5, 1e-5))
    srcs.append(frn.render_mixnorm(64, 1, False, True, False, True, 1e-5, 1e-6))
    srcs.append(prefetch.render_source())
    for s in srcs:
        compile(s, "<rendered>", "exec")  # valid Python
        assert "def ENTRY" in s and "def fake_args" in s


def test_cache_key_covers_source_arch_version():
    k = cache.cache_key("src", "sm_90a", "4.8.1")
    assert k != cache.cache_key("src2", "sm_90a", "4.8.1")
    assert k != cache.cache_key("src", "sm_100a", "4.8.1")
    assert k != cache.cache_key("src", "sm_90a", "4.9.0")
    assert k == cache.cache_key("src", "sm_90a", "4.8.1")


def test_cache_store_load_corrupt(tmp_path, caplog):
    c = cache.KernelCache(tmp_path)
    key = cache.cache_key("x", "sm_90a")
    assert c.load(key) is None
    e = c.store(key, {"kernel.py": b"x", "kernel.ptx": b"ptx"}, {"arch": "sm_90a"})
    assert open(e["files"]["kernel.ptx"], "rb").read() == b"ptx"
    assert c.load(key)["arch"] == "sm_90a"
    # corrupt a file: the entry is reported corrupt, deleted, and is a miss
    with open(e["files"]["kernel.ptx"], "wb") as f:
        f.write(b"garbage")
    with caplog.at_level(logging.WARNING, logger="k3fuse.codegen"):
        assert c.load(key) is None
    assert "corrupt" in caplog.text
    assert not c.entry_dir(key).exists()
    # a truncated meta.json too
    e = c.store(key, {"kernel.py": b"x"}, {})
    (c.entry_dir(key) / "meta.json").write_text("{")
    assert c.load(key) is None
    # store over an existing entry replaces it; no temporary directories are left behind
    c.store(key, {"kernel.py": b"y"}, {})
    c.store(key, {"kernel.py": b"z"}, {})
    assert open(c.load(key)["files"]["kernel.py"], "rb").read() == b"z"
    assert [p.name for p in c.entry_dir(key).parent.iterdir()] == [key]


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("K3FUSE_CACHE_DIR", str(tmp_path / "kc"))
    assert cache.cache_dir() == tmp_path / "kc"
    monkeypatch.delenv("K3FUSE_CACHE_DIR")
    assert str(cache.cache_dir()).endswith(".cache/k3fuse/kernels")


def test_tuning_table_and_routing():
    from k3fuse.codegen import gemv
    # the H200 table measured on 2026-11-29 (benchmarks/RESULTS.md)
    cfg, why = gemv.route(6288, 7168, 1, gpu="nvidia_h200")
    assert cfg is not None and why == ""
    cfg, why = gemv.route(6288, 7168, 64, gpu="nvidia_h200")
    assert cfg is None and "cuBLAS" in why
    # unknown GPU: heuristic default up to M = 8, unfused above
    assert gemv.route(6288, 7168, 3, gpu="no_such_gpu")[0] == gemv.default_config(6288, 7168, 4)
    assert gemv.route(6288, 7168, 8, gpu="no_such_gpu")[0]["variant"] == "mma"
    assert gemv.route(6288, 7168, 32, gpu="no_such_gpu")[0] is None
    assert gemv.route(6288, 7168, 65, gpu="no_such_gpu")[0] is None
    assert gemv.route(6288, 7164, 1, gpu="no_such_gpu")[0] is None   # K not a multiple of 8


def test_fallback_logs_one_line(caplog):
    from k3fuse.codegen import registry
    registry._seen.clear()
    x = torch.randn(65, 64, dtype=torch.bfloat16)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="k3fuse.codegen"):
        for _ in range(3):
            y = registry.linear_cuda(x, w)
    lines = [r.getMessage() for r in caplog.records if r.name == "k3fuse.codegen"]
    assert lines == ["k3fuse: k3fuse::linear takes the unfused path: 32x64: M=65 > 64"]
    torch.testing.assert_close(y.float(), x.float() @ w.float().t(), rtol=2e-2, atol=2e-2)


def test_register_is_idempotent():
    from k3fuse.codegen import registry
    assert registry.register() and registry.register()


def test_prefetch_chunk_table():
    from k3fuse.codegen.prefetch import chunk_table
    rows = chunk_table([(1000, 200000), (1 << 20, 1000)], 150000, chunk=65536)
    assert all(a % 16 == 0 and n % 16 == 0 and 0 < n <= 65536 for a, n in rows)
    assert sum(n for _, n in rows) <= 150000
    assert rows[0][0] == 1008
    rows = chunk_table([(0, 4096), (1 << 20, 4096)], 1 << 30, chunk=1024)
    assert sum(n for _, n in rows) == 8192 and rows[-1] == ((1 << 20) + 3072, 1024)


def test_fused_gemv_fallback_on_cpu_matches_composition(caplog):
    """The fused-GEMV implementations fall back to the op composition (one log line) when no kernel applies."""
    from k3fuse import ops
    from k3fuse.codegen import registry
    registry._seen.clear()
    x = torch.randn(9, 64)                       # M = 9 > FUSED_MAX_M
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    nw = torch.randn(64, dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="k3fuse.codegen"):
        y = registry.rms_norm_linear_situ_glu_cuda(x, nw, 1e-5, w, 4.0, 25.0)
        registry.rms_norm_linear_situ_glu_cuda(x, nw, 1e-5, w, 4.0, 25.0)
    ref = ops.situ_glu._init_fn(ops.linear._init_fn(ops.rms_norm._init_fn(x, nw, 1e-5, torch.bfloat16), w), 4.0, 25.0)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
    lines = [r.getMessage() for r in caplog.records if "rms_norm_linear_situ_glu" in r.getMessage()]
    assert len(lines) == 1 and "M=9" in lines[0]


@pytest.mark.parametrize("M", [1, 8])
def test_linear_group_situ_fallback_on_cpu_matches_composition(caplog, M):
    """Without a kernel (CPU tensors; at M = 8 also the mma bucket) the grouped SiTU op is its composition:
    linear_group, then situ_glu on the member; one log line per reason."""
    from k3fuse import ops
    from k3fuse.codegen import registry
    registry._seen.clear()
    # seeded: the bf16 CPU fallback (F.linear) and the fp32-accumulate reference differ by a bf16 ulp on ~1% of
    # draws near zero, past the default atol; unseeded, the draw depended on which tests ran before
    torch.manual_seed(M)
    x = torch.randn(M, 64, dtype=torch.bfloat16)
    ws = [torch.randn(48, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)]
    with caplog.at_level(logging.INFO, logger="k3fuse.codegen"):
        ys = registry.linear_group_situ_cuda(x, ws, 1, 4.0, 25.0)
        registry.linear_group_situ_cuda(x, ws, 1, 4.0, 25.0)
    assert [tuple(y.shape) for y in ys] == [(M, 48), (M, 16)]
    torch.testing.assert_close(ys[0].float(), ops.linear._init_fn(x, ws[0]).float())
    ref = ops.situ_glu._init_fn(ops.linear._init_fn(x, ws[1]), 4.0, 25.0)
    torch.testing.assert_close(ys[1].float(), ref.float(), rtol=2e-2, atol=2e-2)
    lines = [r.getMessage() for r in caplog.records if "k3fuse::linear_group_situ takes" in r.getMessage()]
    assert len(lines) == 1


def test_tuning_table_entries_render():
    """Every kernel config in the shipped tuning tables still renders (catches stale entries after template edits)."""
    from k3fuse.codegen import gemv, moe_experts, tuning
    tables = sorted(tuning.TABLE_DIR.glob("*.json"))
    assert tables, "no tuning table shipped"
    n = n_moe = 0
    for p in tables:
        for key, per_bucket in json.loads(p.read_text())["entries"].items():
            family, shape = key.split(":")
            assert family in ("gemv", "gemv_norm", "gemv_group_situ", "moe_experts"), key
            if family == "moe_experts":
                E, I, D, KT = (int(v) for v in shape.split("x"))
                for b, cfg in per_bucket.items():
                    kc = {k: v for k, v in cfg.items() if k in moe_experts.KNOBS}
                    if kc:
                        kc.setdefault("SB", moe_experts.default_sb(KT, I, kc["LPR"], kc["RT"]))  # knobs added later
                        kc.setdefault("KS", moe_experts.default_ks(KT, int(b)))
                    else:                         # an entry holding the kernels' variants (and layer knobs) alone
                        assert set(cfg) <= {*moe_experts.VARIANT_KEYS, moe_experts.LAYER_KEY, "why"}, (key, b)
                        kc = moe_experts.default_config(E, I, D, KT, int(b))
                    layer = cfg.get(moe_experts.LAYER_KEY) or {}         # knobs A/B'd in the layer, and why
                    assert set(layer) <= {*moe_experts.KNOBS, "why"} and (not layer or layer.get("why")), (key, b)
                    kc.update({k: v for k, v in layer.items() if k in moe_experts.KNOBS})
                    kc.update({v: cfg[v] for v in moe_experts.VARIANT_KEYS if v in cfg})
                    assert moe_experts.config_for(E, I, D, KT, int(b), gpu=p.stem) == kc, (key, b)  # taken as is
                    compile(moe_experts.render_source(E, I, D, KT, int(b), cfg=kc)[0], key, "exec")
                    n_moe += 1
                continue
            N, K = (int(v) for v in shape.split("x"))
            for b, cfg in per_bucket.items():
                if cfg["variant"] == "torch":
                    continue
                if family == "gemv_group_situ":   # keyed by the padded rows; rendered on the members it was tuned on
                    Ns = cfg["members"]
                    assert sum(-(-n // 16) * 16 for n in Ns) == N
                    assert gemv.group_situ_route(Ns, K, int(b), (len(Ns) - 1,), gpu=p.stem)[0] == gemv._clean(cfg), (key, b)
                    compile(gemv.render_group_source(Ns, K, int(b), gemv._clean(cfg), situ=((len(Ns) - 1,), 4.0, 25.0))[1],
                            key, "exec")
                elif family == "gemv_norm":   # the fused RMSNorm GEMV takes its entry as is (default_fused_config)
                    fusion = dict(norm=True, x_fp32=True)
                    assert gemv.default_fused_config(N, K, int(b), fusion, gpu=p.stem) == gemv._clean(cfg), (key, b)
                    compile(gemv.render_source(N, K, int(b), gemv._clean(cfg), fusion)[1], key, "exec")
                else:
                    compile(gemv.render_source(N, K, int(b), gemv._clean(cfg))[1], key, "exec")
                n += 1
    assert n > 50 and n_moe >= 2


def test_moe_group_takes_the_selection_at_batch_1_on_the_h200():
    """The MoE group with the router (routed latent down + shared gate_up + router rows, K = 7168) at M = 1 has a
    table config of TOPK_IN_GROUP_MIN_THREADS threads at both TP widths, so the router's top-k runs in the group's
    launch (TP8's entry added in session 14: without it the group took R2 W4, 128 threads, and the top-k its own
    kernel); at M = 2 it does not, and the lowering splits the op."""
    from k3fuse.codegen import gemv, registry
    for gate_up in (768, 1536):          # TP16, TP8
        Ns = [3584, gate_up, 896]
        cfg, why = gemv.group_router_route(Ns, 7168, 1, (1,), gpu="nvidia_h200")
        assert cfg is not None, why
        assert 32 * cfg["W"] >= registry.TOPK_IN_GROUP_MIN_THREADS, (gate_up, cfg)
        cfg2, _ = gemv.group_router_route(Ns, 7168, 2, (1,), gpu="nvidia_h200")
        assert 32 * cfg2["W"] < registry.TOPK_IN_GROUP_MIN_THREADS, (gate_up, cfg2)
