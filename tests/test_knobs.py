"""codegen/knobs.py: every K3FUSE_* variable in one table, and every kernel memo keyed on the ones its render reads.

The memo test is the one that matters: kda_recurrent's memo once missed a variable read at render, and toggling it in
one process returned the stale kernel (session 38). Here every kernel of the K3 configs is built with its reads
recorded (compilation stubbed: the render and the build's choices are what read the environment), and a read that
the family's key() does not cover fails.
"""
import hashlib
import logging
import pathlib
import re
import types

import pytest

from k3fuse.codegen import knobs

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAME = re.compile(r"K3FUSE_[A-Z0-9_]*[A-Z0-9]")


def test_table_is_well_formed():
    assert len(knobs.KNOBS) == len(knobs.TABLE)                  # no name twice
    assert not set(knobs.KNOBS) & set(knobs.REMOVED)
    for k in knobs.TABLE:
        assert k.kind in knobs.KINDS, k
        assert set(k.families) <= set(knobs.FAMILIES), k
        assert k.doc, k
        if k.kind in ("unmeasured", "diagnostic"):               # opt-in: off unless set
            assert k.unset in ("0", ""), k


def test_families_are_the_modules_families():
    import importlib
    for f in ROOT.joinpath("codegen").glob("*.py"):
        text = f.read_text()
        m = re.search(r'^FAMILY = "(\w+)"', text, re.M)
        if m:
            assert m.group(1) in knobs.FAMILIES, f
            mod = importlib.import_module(f"k3fuse.codegen.{f.stem}")
            if hasattr(mod, "_built"):          # a build memo: it must key on its family's variables
                assert "knobs.key(FAMILY)" in text, f


def test_every_name_in_the_repository_is_in_the_table_or_removed():
    """Code, benchmarks and docs: a variable named there that k3fuse does not read is a silent no-op (an A/B of it
    measures nothing) unless REMOVED says so. tests/ is left out: it uses made-up names for layer_ab's parser."""
    paths = [ROOT / "README.md", *ROOT.joinpath("docs").glob("*.md")]
    for d in ("codegen", "compiler", "passes", "templates", "models", "benchmarks"):
        paths += [p for p in ROOT.joinpath(d).rglob("*") if p.suffix in (".py", ".jinja", ".md", ".sh", ".json")]
    unknown = {}
    for p in paths:
        for n in set(NAME.findall(p.read_text())) - set(knobs.KNOBS) - set(knobs.REMOVED):
            unknown.setdefault(n, []).append(str(p.relative_to(ROOT)))
    assert not unknown, unknown


def test_no_module_reads_a_variable_around_the_table():
    pat = re.compile(r"os\.environ|getenv")
    allowed = {"codegen/knobs.py", "codegen/compile.py", "compiler/peer_buffers.py"}   # CC; NCCL / torch defaults
    for d in ("codegen", "compiler", "passes", "models"):
        for p in ROOT.joinpath(d).glob("*.py"):
            rel = str(p.relative_to(ROOT))
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if pat.search(line) and rel not in allowed:
                    pytest.fail(f"{rel}:{i} reads the environment directly: {line.strip()}")
            if rel in allowed and rel != "codegen/knobs.py":
                assert not re.search(r"environ[^\n]*K3FUSE_|environ\.get\((ENV_FLAG|OVERLAY_VAR)", p.read_text())


def test_env_returns_unset_value_and_rejects_unregistered(monkeypatch):
    monkeypatch.delenv("K3FUSE_MLA_PUSH", raising=False)
    assert knobs.env("K3FUSE_MLA_PUSH") == "1"
    monkeypatch.setenv("K3FUSE_MLA_PUSH", "0")
    assert knobs.env("K3FUSE_MLA_PUSH") == "0"
    with pytest.raises(KeyError, match="K3FUSE_NOT_A_KNOB"):
        knobs.env("K3FUSE_NOT_A_KNOB")
    with knobs.recording() as reads:
        knobs.env("K3FUSE_MLA_PUSH")
    assert reads == ["K3FUSE_MLA_PUSH"]


def test_key_follows_the_family_variables(monkeypatch):
    for n in ("K3FUSE_MLA_CMMA_PRE", "K3FUSE_MOE_DOWN_AXB"):
        monkeypatch.delenv(n, raising=False)
    mla, moe = knobs.key("mla_attention"), knobs.key("moe_experts")
    monkeypatch.setenv("K3FUSE_MLA_CMMA_PRE", "0")
    assert knobs.key("mla_attention") != mla and knobs.key("moe_experts") == moe


def test_unknown_set_names_removed_and_misspelt(monkeypatch):
    for n in [v for v in list(__import__("os").environ) if v.startswith("K3FUSE_")]:
        monkeypatch.delenv(n)
    monkeypatch.setenv("K3FUSE_MLA_QTB", "8")          # removed in session 35
    monkeypatch.setenv("K3FUSE_MLA_ERLY", "1")         # misspelt
    monkeypatch.setenv("K3FUSE_MLA_CMMA_PRE", "0")      # fine
    monkeypatch.setenv("K3FUSE_MLA_LOADS_FIRST", "1")   # removed in session 43
    got = knobs.unknown_set()
    assert len(got) == 3
    assert got[0].startswith("K3FUSE_MLA_ERLY (not a k3fuse variable")
    assert got[1].startswith("K3FUSE_MLA_LOADS_FIRST (session 43")
    assert got[2].startswith("K3FUSE_MLA_QTB (session 35")


def test_backend_warns_once_per_ignored_variable(monkeypatch, caplog):
    from k3fuse import backend
    monkeypatch.setattr(backend, "_warned_unknown", set())
    monkeypatch.setenv("K3FUSE_FRN_SPREAD", "8")
    with caplog.at_level(logging.WARNING, logger="k3fuse"):
        backend._warn_unknown_variables()
        backend._warn_unknown_variables()
    hits = [r for r in caplog.records if "K3FUSE_FRN_SPREAD" in r.getMessage()]
    assert len(hits) == 1 and "since removed" in hits[0].getMessage()


def test_cli_lists_the_table(capsys, monkeypatch):
    import json

    from k3fuse.cli import main
    monkeypatch.setenv("K3FUSE_WG_GATHER", "0")
    monkeypatch.delenv("K3FUSE_MLA_CMMA_PRE", raising=False)
    assert main(["knobs", "--kind", "measured,diagnostic", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["knobs"]
    assert {r["name"] for r in rows} == {k.name for k in knobs.TABLE if k.kind in ("measured", "diagnostic")}
    assert next(r for r in rows if r["name"] == "K3FUSE_WG_GATHER")["value"] == "0"
    pre = next(r for r in rows if r["name"] == "K3FUSE_MLA_CMMA_PRE")
    assert pre["value"] is None and pre["unset"] == "5"
    assert main(["knobs"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == len(knobs.TABLE)
    with pytest.raises(SystemExit):
        main(["knobs", "--kind", "nonsense"])


def _stub_compile(monkeypatch):
    """compile_source without the compiler: the source's hash as the key (renders are what read the environment)."""
    from k3fuse.codegen import compile as kcompile

    def fake(source, arch, *, load=True, cache=None, meta=None):
        return types.SimpleNamespace(key=hashlib.sha256(source.encode()).hexdigest(), source=source, files={},
                                     cached=False, fn=None, arch=arch)
    monkeypatch.setattr(kcompile, "compile_source", fake)
    kcompile.clear_memo()


# Settings that send the builds down their other branches: the opt-ins, the diagnostics, the measured variants' other
# values (each setting renders every kernel of the K3 configs at TP8 and TP16, buckets 1-64, and the all-reduce ones).
SETTINGS = {
    "defaults": {},
    "opt_ins": {"K3FUSE_MLA_CMMA_PRE": "1", "K3FUSE_WG_GATHER": "0",
                "K3FUSE_MOE_DOWN_AX": "1", "K3FUSE_MOE_DOWN_AXB": "1",
                "K3FUSE_GEMV_WGMMA": "1"},
    "others": {"K3FUSE_MLA_STAMPS": "1", "K3FUSE_KDA_STAMPS": "1", "K3FUSE_FRN_STAMPS": "1", "K3FUSE_PDL_CHAIN": "0",
               "K3FUSE_MLA_ASYNC": "2", "K3FUSE_MLA_CMMA": "0", "K3FUSE_MLA_PUSH": "0", "K3FUSE_MLA_QFIRST": "0",
               "K3FUSE_FRN_LEAN_TAIL": "0", "K3FUSE_FRN_PRELOAD": "0", "K3FUSE_TOPK_RANK": "0",
               "K3FUSE_MOE_DOWN_WE": "0", "K3FUSE_MOE_MEMBER_LISTS": "0",
               "K3FUSE_MOE_DOWN_AXB": "0"},
}


def _one_launch_jobs() -> list:
    """The one-launch fused_residual_norm at the per-rank widths a single GPU runs (o_proj K = 768 / 1536, the shared
    down 384 / 768): `k3fuse kernels` plans it only at TP = 1, where K3's widths exceed it."""
    out = []
    for K, addend in ((768, False), (1536, False), (384, True), (768, True)):
        for b in (1, 2, 4):
            for prefix, nb in ((True, 0), (True, 2), (False, 1)):
                out.append(dict(family="fused_residual_norm", shape=dict(H=7168, K=K, blocks=nb), bucket=b,
                                config=dict(addend=addend, prefix=prefix, one_kernel=True, fp32_norm=True,
                                            mix_eps=1e-5, norm_eps=1e-5, wm_pair=True)))
    return out


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_every_read_while_building_is_in_the_family_key(monkeypatch, setting):
    from k3fuse.codegen import kernels_cli
    for n, v in SETTINGS[setting].items():
        monkeypatch.setenv(n, v)
    _stub_compile(monkeypatch)
    missing, built, kinds = {}, 0, set()
    try:
        for tp, arch in ((8, "sm_90a"), (16, "sm_90a"), (8, "sm_100a")):
            jobs, _ = kernels_cli.plan("k3", tp, [1, 2, 4, 8, 16, 32, 64], arch)
            for job in jobs + (_one_launch_jobs() if tp == 16 else []):
                kinds.add((job["family"], job["config"].get("variant") or bool(job["config"].get("one_kernel"))))
                with knobs.recording() as reads:
                    kernels_cli.build_job(job, arch)
                built += 1
                extra = set(reads) - set(knobs._BY_FAMILY[job["family"]])
                if extra:
                    missing.setdefault(job["family"], set()).update(extra)
    finally:
        from k3fuse.codegen import compile as kcompile
        kcompile.clear_memo()
    assert built > 100
    for k in [("fused_residual_norm", True), ("fused_residual_norm", False), ("mla_attention", "heads"),
              ("mla_attention", False), ("kda_recurrent", False), ("moe_experts", False), ("mixnorm_allreduce", False),
              ("allgather_oneshot", False), ("router_topk", False), ("prefetch_l2", False), ("gemv", "wgmma")]:
        assert k in kinds, k                                           # every family and variant was built
    assert not missing, f"read while building, not in the family's key() (codegen/knobs.py families): {missing}"


@pytest.mark.parametrize("family,var,value,tp,bucket", [
    ("mla_attention", "K3FUSE_MLA_CMMA_PRE", "0", 16, 64),
    ("kda_recurrent", "K3FUSE_KDA_STAMPS", "1", 16, 1),
    ("moe_experts", "K3FUSE_MOE_DOWN_WE", "0", 16, 64),
    ("fused_residual_norm", "K3FUSE_FRN_LEAN_TAIL", "0", 16, 1),
    ("router_topk", "K3FUSE_TOPK_RANK", "0", 16, 1),
    ("gemv", "K3FUSE_PDL_CHAIN", "0", 16, 1),
])
def test_toggling_a_variable_in_one_process_rebuilds(monkeypatch, family, var, value, tp, bucket):
    """The stale-memo bug, end to end: build, set a variable its render reads, build again: another source."""
    from k3fuse.codegen import kernels_cli
    monkeypatch.delenv(var, raising=False)
    _stub_compile(monkeypatch)
    try:
        jobs, _ = kernels_cli.plan("k3", tp, [bucket], "sm_90a")
        job = next(j for j in jobs + _one_launch_jobs() if j["family"] == family
                   and (family != "fused_residual_norm" or j["config"].get("one_kernel")))
        a = kernels_cli.build_job(job, "sm_90a")
        assert kernels_cli.build_job(job, "sm_90a") is a              # memoised
        monkeypatch.setenv(var, value)
        b = kernels_cli.build_job(job, "sm_90a")
        assert b.source != a.source
        monkeypatch.delenv(var)
        assert kernels_cli.build_job(job, "sm_90a") is a              # and back
    finally:
        from k3fuse.codegen import compile as kcompile
        kcompile.clear_memo()


def test_integer_values_and_errors(monkeypatch):
    """knobs.integer: the default when empty, the value when set, and a ValueError naming the variable and what it
    sets when the value is not an integer; the modules' readers go through it."""
    from k3fuse.codegen import fused_residual_norm as frn
    from k3fuse.codegen import kda_recurrent as kr
    monkeypatch.delenv("K3FUSE_FRN_SPIN_NS", raising=False)
    assert knobs.integer("K3FUSE_FRN_SPIN_NS", 7) == 64 == frn.one_spin_ns()      # unset: the table's value
    monkeypatch.setenv("K3FUSE_FRN_SPIN_NS", " 256 ")
    assert frn.one_spin_ns() == 256
    monkeypatch.setenv("K3FUSE_FRN_SPIN_NS", "")
    assert knobs.integer("K3FUSE_FRN_SPIN_NS", 7) == 7
    monkeypatch.setenv("K3FUSE_KDA_LPR", "four")
    with pytest.raises(ValueError, match=r"K3FUSE_KDA_LPR='four': an integer expected \(lanes per S row"):
        kr.decode_lpr()
    monkeypatch.delenv("K3FUSE_KDA_LPR")
    assert kr.decode_lpr() == kr.DEFAULT_LPR
    monkeypatch.delenv("K3FUSE_VLLM_MAX_TOKENS", raising=False)
    assert knobs.integer("K3FUSE_VLLM_MAX_TOKENS", None) is None                  # unset: no default of its own
    monkeypatch.setenv("K3FUSE_VLLM_MAX_TOKENS", "512")
    assert knobs.integer("K3FUSE_VLLM_MAX_TOKENS", None) == 512
