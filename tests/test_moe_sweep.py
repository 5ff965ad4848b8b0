"""benchmarks/moe_sweep.py's pure parts on the CPU: the routing relabelings that keep timed launches out of L2."""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import moe_sweep  # noqa: E402


def test_relabel_keeps_the_routing_structure_and_changes_the_experts():
    torch.manual_seed(0)
    M, KT, E = 8, moe_sweep.KT, moe_sweep.E
    ids = torch.stack([torch.randperm(40)[:KT] for _ in range(M)])     # peaked: 8 tokens over 40 experts
    rots = moe_sweep.relabel(ids, 8, seed=1)
    assert len(rots) == 8 and rots[0] is ids
    base = ids.flatten().tolist()
    for r in rots[1:]:
        assert r.shape == ids.shape and r.dtype == ids.dtype and r.is_contiguous()
        assert 0 <= int(r.min()) and int(r.max()) < E
        # a bijection on expert ids: equal ids stay equal, distinct stay distinct (tokens per expert unchanged)
        flat = r.flatten().tolist()
        assert all((base[i] == base[j]) == (flat[i] == flat[j]) for i in range(len(base)) for j in range(len(base)))
    # the copies read other experts' weights: at most a small overlap with the original's 40 experts
    for r in rots[1:]:
        assert len(set(r.flatten().tolist()) & set(base)) < 10
    assert moe_sweep.relabel(ids, 1) == [ids]
    # deterministic per seed
    assert all(torch.equal(a, b) for a, b in zip(rots, moe_sweep.relabel(ids, 8, seed=1)))


def test_search_steps_try_ks_and_lpr_together():
    """Session 20: at TP8 M = 1 neither KS = 4 nor LPR = 8 beat KS = 1, LPR = 4 alone; together they did. The joint
    step offers every (KS, LPR) pair after the one-knob steps, and --knobs keeps only the steps it names in full."""
    steps = moe_sweep.search_steps()
    names = [n for n, _ in steps]
    assert names[:len(moe_sweep.KNOBS)] == [(k,) for k, _ in moe_sweep.KNOBS]
    assert names[-1] == ("KS", "LPR")
    v = dict(moe_sweep.KNOBS)
    assert (4, 8) in steps[-1][1] and len(steps[-1][1]) == len(v["KS"]) * len(v["LPR"])
    assert [n for n, _ in moe_sweep.search_steps(only={"KS", "LPR"})] == [("KS",), ("LPR",), ("KS", "LPR")]
    assert [n for n, _ in moe_sweep.search_steps(only={"SB"})] == [("SB",)]
    # a joint group over a knob not among the single steps takes its values from KNOBS (moe_layer_tune --knobs KS)
    steps = moe_sweep.search_steps(knobs=[("KS", (1, 2))], joint=[("KS", "LPR")])
    assert steps == [(("KS",), [(1,), (2,)]), (("KS", "LPR"), [(k, l) for k in (1, 2) for l in v["LPR"]])]
