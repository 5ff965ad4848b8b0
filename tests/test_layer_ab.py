"""benchmarks/layer_ab.py's pure parts on the CPU: the ABBA replay order and the paired summary."""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import layer_ab  # noqa: E402


def test_abba_order_cancels_a_linear_drift():
    order = layer_ab.abba(4)
    assert order == [(0, 0), (0, 1), (1, 1), (1, 0), (2, 0), (2, 1), (3, 1), (3, 0)]
    # a clock that slows linearly (replay k takes 100 + k us) adds the same total to both arms over ABBA blocks
    tot = [0.0, 0.0]
    for k, (_, arm) in enumerate(order):
        tot[arm] += 100 + k
    assert tot[0] == tot[1]


def test_paired_summary_reads_the_pairs():
    a = [90.0, 91.0, 95.0, 89.0, 92.0]
    b = [88.5, 90.0, 94.0, 90.0, 90.5]          # diffs -1.5, -1.0, -1.0, +1.0, -1.5
    r = layer_ab.paired_summary(a, b)
    assert r["a_us"] == 91.0 and r["b_us"] == 90.0
    assert r["diff_us"] == -1.0 and r["diff_q1_us"] == -1.5 and r["diff_q3_us"] == -1.0
    assert r["b_faster"] == 4 and r["pairs"] == 5
    with pytest.raises(ValueError, match="equal, nonzero"):
        layer_ab.paired_summary(a, b[:-1])


def test_arms_from_var_or_settings():
    assert layer_ab.parse_arms(var="K3FUSE_X=0,1") == [{"K3FUSE_X": "0"}, {"K3FUSE_X": "1"}]
    # a variable only one arm names is unset (None) in the other: building an arm undoes the other's settings
    a, b = layer_ab.parse_arms(arms="K3FUSE_A=0 K3FUSE_B=8; -")
    assert a == {"K3FUSE_A": "0", "K3FUSE_B": "8"} and b == {"K3FUSE_A": None, "K3FUSE_B": None}
    a, b = layer_ab.parse_arms(arms="K3FUSE_A=0 ;K3FUSE_C=2")
    assert a == {"K3FUSE_A": "0", "K3FUSE_C": None} and b == {"K3FUSE_A": None, "K3FUSE_C": "2"}
    assert layer_ab.arm_label(a) == "K3FUSE_A=0" and layer_ab.arm_label(b) == "K3FUSE_C=2"
    assert layer_ab.arm_label({"K3FUSE_A": None}) == "-"
    for bad in (dict(var="K3FUSE_X=0"), dict(var="=0,1"), dict(arms="K3FUSE_A=0"), dict(arms="K3FUSE_A; -"),
                dict(arms="-; -"), dict(var="K3FUSE_X=0,1", arms="K3FUSE_A=0; -"), {}):
        with pytest.raises(ValueError):
            layer_ab.parse_arms(**bad)


def test_build_arm_sets_and_unsets(monkeypatch):
    """build_arm applies the arm's settings to the environment (None: unset) before the compile."""
    monkeypatch.setattr(layer_ab.kcompile, "clear_memo", lambda keep=None: None)
    monkeypatch.setenv("K3FUSE_B", "stale")
    # set, then unset, through monkeypatch: it restores both to the state before the test (a delenv after build_arm
    # recorded "0" as K3FUSE_A's original and left it set for every later test: `k3fuse knobs` then listed it)
    monkeypatch.setenv("K3FUSE_A", "stale")
    monkeypatch.delenv("K3FUSE_A")
    layer_ab.build_arm({"K3FUSE_A": "0", "K3FUSE_B": None})
    import os
    assert os.environ["K3FUSE_A"] == "0" and "K3FUSE_B" not in os.environ
