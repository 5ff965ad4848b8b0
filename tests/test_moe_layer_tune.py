"""benchmarks/moe_layer_tune.py's pure parts on the CPU: the override strings, the descent, the table's layer keys."""
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import moe_layer_tune as mlt  # noqa: E402
from k3fuse.codegen import moe_experts as me  # noqa: E402

E, I, D, KT = 896, 384, 3584, 16


def test_override_strings_are_what_the_knob_reads(monkeypatch):
    assert mlt.override_str({}) == "table"
    s = mlt.override_str({"LPR": 8, "KS": 4})
    assert s == "KS=4:LPR=8"
    monkeypatch.setenv(mlt.VAR, s)
    assert me.config_override() == {"KS": 4, "LPR": 8}
    monkeypatch.setenv(mlt.VAR, mlt.override_str({}))
    assert me.config_override() == {}


def test_accept_needs_the_gain_and_most_pairs():
    r = dict(diff_us=-2.0, b_faster=7, pairs=8, a_us=120.0)
    assert mlt.accepted(r)
    assert not mlt.accepted(dict(r, diff_us=-0.5))            # below MIN_GAIN_US
    assert not mlt.accepted(dict(r, b_faster=5))              # 5 / 8 < 0.75
    assert not mlt.accepted(dict(r, diff_us=+3.0, b_faster=0))


def test_descent_on_a_model_layer():
    """A layer whose time is a known function of (KS, LPR): the descent finds KS = 4 then LPR = 8 (one knob at a time,
    each against the best so far), skips unsupported and kernel-identical candidates, and keeps the table's values
    where nothing beats them by MIN_GAIN_US."""
    base = me.config_for(E, I, D, KT, 1, gpu="nvidia_h200")
    base = dict(base, KS=1, LPR=4)

    def layer_us(over):
        c = dict(base, **over)
        return 140.0 - {1: 0, 2: -5, 4: 10}[c["KS"]] - {4: 0, 8: 8, 16: 3}[c["LPR"]] + (0.3 if c["WD"] == 2 else 0)

    calls = []

    def measure(a, b):
        calls.append((dict(a), dict(b)))
        if dict(base, **b)["RT"] == 2:
            return None                                     # the knob does not reach a kernel here
        da, db = layer_us(a), layer_us(b)
        return dict(a_us=da, b_us=db, diff_us=round(db - da, 2), b_faster=8 if db < da else 0, pairs=8)

    supported = lambda c: c["WD"] != 16
    best, trials = mlt.descend(base, [("KS", (1, 2, 4)), ("LPR", (4, 8, 16)), ("WD", (2, 4, 16)),
                                      ("RT", (1, 2))], measure, supported)
    assert best == {"KS": 4, "LPR": 8}
    assert [t["B"] for t in trials if t.get("accepted")] == ["KS=4", "KS=4:LPR=8"]
    assert any(t.get("skip") == "unsupported" and t["B"] == "KS=4:LPR=8:WD=16" for t in trials)
    assert any(t.get("skip") == "same kernels as A" for t in trials)
    assert ({"KS": 4, "LPR": 8}, {"KS": 4, "LPR": 16}) in calls      # each candidate against the best so far
    assert all(a != b for a, b in calls)
    # out of time before the first step: nothing measured, the table's config stays
    assert mlt.descend(base, [("KS", (2,))], measure, supported, out_of_time=lambda: True) == ({}, [])


def test_write_layer_keys_merges_into_the_entry(tmp_path):
    key = f"moe_experts:{E}x{I}x{D}x{KT}"
    (tmp_path / "gpu_x.json").write_text(json.dumps({"gpu": "GPU X", "entries": {key: {
        "1": {"KS": 1, "LPR": 4, "kernel_us": 81.9, "layer": {"KS": 4, "why": "session 19"}},
        "8": {"KS": 1, "UPMMA": 1}}}}))
    from k3fuse.codegen import tuning
    slug = tuning.gpu_slug
    try:
        tuning.gpu_slug = lambda name: "gpu_x"
        mlt.write_layer_keys([dict(key=key, M=1, best={"LPR": 8}, why="tuned"),
                              dict(key=key, M=5, best={}, why="")], "GPU X", table_dir=tmp_path)
    finally:
        tuning.gpu_slug = slug
    e = json.loads((tmp_path / "gpu_x.json").read_text())["entries"][key]
    assert e["1"]["layer"] == {"KS": 4, "LPR": 8, "why": "session 19; then tuned"}
    assert e["1"]["KS"] == 1 and e["1"]["kernel_us"] == 81.9          # the sweep's knobs untouched
    assert e["8"] == {"KS": 1, "UPMMA": 1}                              # no win at bucket 8: unchanged


def test_unknown_knob_is_an_error(capsys):
    sys_argv = sys.argv
    try:
        sys.argv = ["moe_layer_tune.py", "--knobs", "KS,XX"]
        with pytest.raises(SystemExit):
            mlt.main()
    finally:
        sys.argv = sys_argv
    assert "unknown knobs ['XX']" in capsys.readouterr().err


def test_accept_scales_the_gain_with_the_layer():
    """At a 450 us layer a -1.5 us step (7 / 8 pairs) is within the drift (MIN_GAIN_FRAC); at 120 us it is a gain."""
    r = dict(diff_us=-1.5, b_faster=7, pairs=8)
    assert mlt.accepted(dict(r, a_us=120.0))
    assert not mlt.accepted(dict(r, a_us=450.0))
    assert mlt.accepted(dict(r, a_us=450.0, diff_us=-2.0))


def test_confirm_keeps_only_a_best_that_beats_the_table_again():
    seen = []

    def measure(gain, b_faster):
        def m(a, b, pairs):
            seen.append((dict(a), dict(b), pairs))
            return dict(a_us=300.0, b_us=300.0 - gain, diff_us=-gain, b_faster=b_faster, pairs=pairs)
        return m

    assert mlt.confirm({}, measure(5, 16), 16) == ({}, None)       # nothing to confirm: nothing measured
    assert seen == []
    best, row = mlt.confirm({"KS": 2}, measure(5.0, 15), 16)
    assert best == {"KS": 2} and row["accepted"] and row["confirm"] and row["A"] == "table"
    assert seen[-1] == ({}, {"KS": 2}, 16)                          # against the table's config, with the pairs given
    best, row = mlt.confirm({"KS": 2}, measure(0.4, 9), 16)          # the chain's gain does not hold up
    assert best == {} and row["accepted"] is False and row["B"] == "KS=2"
    best, row = mlt.confirm({"KS": 2}, lambda a, b, pairs: None, 16)
    assert best == {} and row["skip"] == "same kernels as A"


def test_joint_step_reaches_what_single_knobs_cannot():
    """The session-19/20 shape of the TP8 M = 1 down: KS = 4 alone and LPR = 8 alone lose, together they win. The
    one-knob steps keep the table's config; the joint step finds the pair, and only moves that change both knobs
    are timed in it."""
    base = dict(me.config_for(E, I, D, KT, 1, gpu="nvidia_h200"), KS=1, LPR=4)
    us = {(1, 4): 41.0, (4, 4): 43.7, (1, 8): 60.5, (4, 8): 35.5, (2, 8): 38.5, (2, 4): 45.0,
          (1, 16): 70.0, (2, 16): 50.0, (4, 16): 37.0}
    timed = []

    def measure(a, b):
        ca, cb = dict(base, **a), dict(base, **b)
        timed.append((cb["KS"], cb["LPR"]))
        da, db = us[ca["KS"], ca["LPR"]], us[cb["KS"], cb["LPR"]]
        return dict(a_us=da, b_us=db, diff_us=round(db - da, 2), b_faster=8 if db < da else 0, pairs=8)

    single = [("KS", (1, 2, 4)), ("LPR", (4, 8, 16))]
    assert mlt.descend(base, single, measure, lambda c: True)[0] == {}
    timed.clear()
    # the steps as main() builds them (--knobs KS,LPR --joint KS+LPR)
    steps = mlt.moe_sweep.search_steps(knobs=single, joint=[("KS", "LPR")])
    best, trials = mlt.descend(base, steps, measure, lambda c: True)
    assert best == {"KS": 4, "LPR": 8}
    jt = timed[4:]                                      # after the four one-knob candidates
    assert jt[0] == (2, 8) and (4, 8) in jt and all(k != 1 and l != 4 for k, l in jt)
