"""benchmarks/merge_tuning.py on the CPU: new buckets added, existing ones kept unless --replace, and a replaced
bucket keeps what was measured in the layer."""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import merge_tuning  # noqa: E402


def test_merge_adds_keeps_and_replaces(tmp_path):
    table = {"gpu": "x", "entries": {
        "gemv:2880x7168": {"1": {"variant": "simt", "R": 1, "W": 4}},
        "moe_experts:896x384x3584x16": {"2": {"R": 2, "W": 7, "layer": {"KS": 2, "why": "layer_ab"}, "UPMMA": 1}}}}
    new = {"entries": {
        "gemv:2880x7168": {"1": {"variant": "simt", "R": 2, "W": 8}, "8": {"variant": "mma", "W": 8, "U": 2}},
        "gemv:3648x7168": {"2": {"variant": "simt", "R": 1, "W": 8}},
        "moe_experts:896x384x3584x16": {"2": {"R": 1, "W": 4}}}}
    t = json.loads(json.dumps(table))
    changed = merge_tuning.merge(t, new)
    assert changed == ["gemv:2880x7168 bucket 8: added", "gemv:3648x7168 bucket 2: added"]
    assert t["entries"]["gemv:2880x7168"]["1"] == {"variant": "simt", "R": 1, "W": 4}     # kept without --replace
    changed = merge_tuning.merge(t, new, replace=True)
    assert "gemv:2880x7168 bucket 1: replaced" in changed
    assert t["entries"]["gemv:2880x7168"]["1"] == {"variant": "simt", "R": 2, "W": 8}
    # the layer-measured keys survive a standalone re-tune of the same bucket
    assert t["entries"]["moe_experts:896x384x3584x16"]["2"] == {
        "R": 1, "W": 4, "layer": {"KS": 2, "why": "layer_ab"}, "UPMMA": 1}


def test_cli_writes_the_table(tmp_path):
    (tmp_path / "gpu_y.json").write_text(json.dumps({"gpu": "y", "entries": {}}))
    new = tmp_path / "tuning.json"
    new.write_text(json.dumps({"gpu": "y", "entries": {"gemv:56x7168": {"1": {"variant": "simt", "R": 2, "W": 4}}}}))
    merge_tuning.main([str(new), "--gpu", "gpu_y", "--table-dir", str(tmp_path)])
    got = json.loads((tmp_path / "gpu_y.json").read_text())
    assert got["entries"] == {"gemv:56x7168": {"1": {"variant": "simt", "R": 2, "W": 4}}}
