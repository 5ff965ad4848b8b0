"""K3FUSE_TUNING_OVERLAY: a user's tuning table laid over the packaged one (codegen/tuning.py), the memos keyed by it,
and the recording of which table entries a compile consults. CPU only (the table decides configs, not kernels)."""
import json

import pytest

from k3fuse.codegen import gemv, moe_experts as me, tuning

E, I, D, KT = 896, 384, 3584, 16
N, K = 3216, 7168


def write(tmp_path, name, entries):
    p = tmp_path / name
    p.write_text(json.dumps({"gpu": "x", "entries": entries}))
    return str(p)


def test_overlay_lays_configs_over_the_table(monkeypatch, tmp_path):
    tabled = gemv.config_for(N, K, 1, gpu="nvidia_h200")
    other_bucket = gemv.config_for(N, K, 2, gpu="nvidia_h200")
    want = {"variant": "simt", "R": 4, "W": 4} if tabled != {"variant": "simt", "R": 4, "W": 4} else \
        {"variant": "simt", "R": 2, "W": 8}
    path = write(tmp_path, "o.json", {f"gemv:{N}x{K}": {"1": want}})
    monkeypatch.setenv(tuning.OVERLAY_VAR, path)
    assert gemv.config_for(N, K, 1, gpu="nvidia_h200") == want
    assert gemv.route(N, K, 1, gpu="nvidia_h200") == (want, "")
    assert gemv.config_for(N, K, 2, gpu="nvidia_h200") == other_bucket            # a bucket the overlay does not name
    # a partial entry merges key by key over the table's: the MoE's KS alone, its other knobs stay the table's
    path2 = write(tmp_path, "o2.json", {f"moe_experts:{E}x{I}x{D}x{KT}": {"2": {"KS": 1}}})
    monkeypatch.setenv(tuning.OVERLAY_VAR, "none")
    base = me.config_for(E, I, D, KT, 2, gpu="nvidia_h200")
    assert base["KS"] == 2 and base["LPR"] == 16                      # the shipped table's layer knobs
    monkeypatch.setenv(tuning.OVERLAY_VAR, path2)
    # the overlay's KS = 1 replaces the sweep-level value, and the entry's `layer` KS = 2 still applies over it
    assert me.config_for(E, I, D, KT, 2, gpu="nvidia_h200") == base
    path3 = write(tmp_path, "o3.json", {f"moe_experts:{E}x{I}x{D}x{KT}": {"2": {"layer": {"KS": 1, "LPR": 8}}}})
    monkeypatch.setenv(tuning.OVERLAY_VAR, path3)
    assert me.config_for(E, I, D, KT, 2, gpu="nvidia_h200") == dict(base, KS=1, LPR=8)


def test_overlay_without_a_packaged_table(monkeypatch, tmp_path):
    """A GPU with no table of its own (or none detected): the overlay alone decides where it has entries."""
    cfg = {"variant": "mma", "W": 4, "U": 2, "WN": 1, "RT": 1, "KB": 1}
    monkeypatch.setenv(tuning.OVERLAY_VAR, write(tmp_path, "o.json", {f"gemv:{N}x{K}": {"8": cfg}}))
    assert gemv.config_for(N, K, 8, gpu="some_new_gpu") == cfg
    assert gemv.config_for(N, K, 4, gpu="some_new_gpu") == gemv.default_config(N, K, 4)


def test_memos_follow_the_overlay(monkeypatch, tmp_path):
    """Table-derived memos (moe_experts._config_for, gemv's fp32-output config) are keyed by the overlay, so a
    process that switches it between compiles (layer_ab's arms) gets each arm's config."""
    monkeypatch.delenv(tuning.OVERLAY_VAR, raising=False)
    a = me.config_for(E, I, D, KT, 4, gpu="nvidia_h200")
    f32 = gemv.fp32_out_config(896, 7168, 1)
    monkeypatch.setenv(tuning.OVERLAY_VAR, write(tmp_path, "o.json", {
        f"moe_experts:{E}x{I}x{D}x{KT}": {"4": {"layer": {"WD": 2 if a["WD"] != 2 else 4}}},
        "gemv:896x7168": {"1": {"variant": "simt", "R": 4, "W": 2}}}))
    b = me.config_for(E, I, D, KT, 4, gpu="nvidia_h200")
    assert b["WD"] != a["WD"] and {k: v for k, v in b.items() if k != "WD"} == {k: v for k, v in a.items() if k != "WD"}
    if tuning.current_gpu() is None:                 # the fp32 config asks the current GPU's table: none here
        assert gemv.fp32_out_config(896, 7168, 1) == {"variant": "simt", "R": 4, "W": 2} != f32
    monkeypatch.delenv(tuning.OVERLAY_VAR)
    assert me.config_for(E, I, D, KT, 4, gpu="nvidia_h200") == a and gemv.fp32_out_config(896, 7168, 1) == f32


def test_recording_lists_the_entries_consulted():
    with tuning.recording() as seen:
        gemv.config_for(N, K, 1, gpu="nvidia_h200")
        me.config_for(E, I, D, KT, 8, gpu="nvidia_h200")
        me.config_for(E, I, D, KT, 8, gpu="nvidia_h200")       # memoised: recorded once, asked once
    assert seen == {(f"gemv:{N}x{K}", 1): "table", (f"moe_experts:{E}x{I}x{D}x{KT}", 8): "table"}
    gemv.config_for(N, K, 2, gpu="nvidia_h200")
    assert (f"gemv:{N}x{K}", 2) not in seen                      # only inside the block
    with tuning.recording() as seen:
        gemv.config_for(N, K, 1, gpu="no_table_gpu")
    assert seen == {(f"gemv:{N}x{K}", 1): "none"}               # the heuristic default ran


def test_bad_overlays_say_what_is_wrong(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.OVERLAY_VAR, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="no such file"):
        gemv.config_for(N, K, 1, gpu="nvidia_h200")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    monkeypatch.setenv(tuning.OVERLAY_VAR, str(bad))
    with pytest.raises(ValueError, match="not a readable JSON"):
        gemv.config_for(N, K, 1, gpu="nvidia_h200")
    monkeypatch.setenv(tuning.OVERLAY_VAR, write(tmp_path, "shape.json", {f"gemv:{N}x{K}": {"R": 4}}))
    with pytest.raises(ValueError, match="wants"):
        gemv.config_for(N, K, 1, gpu="nvidia_h200")


def test_overlay_reaches_the_moe_config_without_a_gpu(monkeypatch, tmp_path):
    """`k3fuse kernels --arch sm_100a` (no table for it) and CPU-only runs ask with gpu None: the overlay still
    decides the MoE config there, a complete entry taken alone."""
    cfg = dict(me.default_config(E, I, D, KT, 8), KS=2, WD=4)
    monkeypatch.setenv(tuning.OVERLAY_VAR, write(tmp_path, "o.json", {f"moe_experts:{E}x{I}x{D}x{KT}": {"8": cfg}}))
    monkeypatch.setattr(tuning, "current_gpu", lambda: None)
    assert me.config_for(E, I, D, KT, 8, gpu=None) == cfg
    monkeypatch.delenv(tuning.OVERLAY_VAR)
    assert me.config_for(E, I, D, KT, 8, gpu=None) == me.default_config(E, I, D, KT, 8)


def test_kernels_cli_plans_the_overlay_configs(monkeypatch, tmp_path):
    """`k3fuse kernels` (what a user inspects) plans the configs the overlay names: the TP16 in_proj group's
    3216-row shape at bucket 1, and a bucket the overlay does not name keeps the table's."""
    from k3fuse.codegen.kernels_cli import plan
    name = "gemv_group_simt_768-768-768-768-128-6x7168_b1"

    def cfg_of(jobs, n):
        return next(j["config"] for j in jobs if j.get("name") == n)

    monkeypatch.delenv(tuning.OVERLAY_VAR, raising=False)
    jobs, _ = plan("k3", 16, [1, 8], "sm_90a")
    before = cfg_of(jobs, name)
    want = {"variant": "simt", "R": 2, "W": 8} if before != {"variant": "simt", "R": 2, "W": 8} else \
        {"variant": "simt", "R": 4, "W": 4}
    monkeypatch.setenv(tuning.OVERLAY_VAR, write(tmp_path, "o.json", {"gemv:3216x7168": {"1": want}}))
    jobs2, _ = plan("k3", 16, [1, 8], "sm_90a")
    assert cfg_of(jobs2, name) == want
    others = lambda js: sorted((j["name"], json.dumps(j["config"], sort_keys=True)) for j in js if j["name"] != name
                               and "3216x7168_b1" not in j["name"])
    assert others(jobs2) == others(jobs)


def test_kernels_manifest_says_where_configs_came_from(monkeypatch, tmp_path):
    """`k3fuse kernels` records the table lookups of its plan in manifest.json ('tuning'): table, overlay or none
    (the heuristic default), so a user on another GPU sees which kernels ran untuned. Only the tiny config's
    prefetch family is compiled (fast); the plan, and so the lookups, cover every family."""
    from k3fuse.codegen import kernels_cli
    cfg = {"variant": "simt", "R": 2, "W": 4}
    ov = write(tmp_path, "o.json", {f"gemv:{N}x{K}": {"1": cfg}})
    monkeypatch.setenv(tuning.OVERLAY_VAR, ov)
    out = tmp_path / "k"
    assert kernels_cli.main(["--config", "k3", "--tp", "16", "--batch", "1", "--arch", "sm_100a", "--out", str(out),
                             "--only", "prefetch_l2"]) == 0
    t = json.loads((out / "manifest.json").read_text())["tuning"]
    assert t["gpu_table"] is None and t["overlay"] == ov
    src = {(e["key"], e["bucket"]): e["source"] for e in t["entries"]}
    assert src[(f"gemv:{N}x{K}", 1)] == "overlay"
    assert src[("gemv:7168x768", 1)] == "none"                # no table for sm_100a: the heuristic default
    assert all(v in ("overlay", "none") for v in src.values())
