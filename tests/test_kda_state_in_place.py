"""Pass write_kda_state_in_place: kda_decode -> the in-place kda_decode_ where the graph only copied its new states
back into the cache (CPU: the op's reference; the kernel's in-place run is in tests/test_kda_kernel_gpu.py)."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from _check import compiled_steps, rel
from k3fuse import ops
from k3fuse.models import KimiK3Config
from k3fuse.passes.write_kda_state_in_place import WriteKdaStateInPlace
from k3fuse.pipeline import PASS_NAMES

k3, aten = torch.ops.k3fuse, torch.ops.aten


def run(cfg, dtype, inner, passes=None):
    opts = {"inner_compiler": inner} if passes is None else {"inner_compiler": inner, "passes": passes}
    return compiled_steps(cfg, dtype, M=3, steps=3, **opts)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_in_place_equals_functional(inner):
    """Tiny K3 (4 KDA layers), 3 steps: with the pass == without it (logits, every S and conv state after the
    steps, so the in-place writes land where the copies did); one match per KDA layer; no kda_decode left."""
    cfg = KimiK3Config.preset("tiny")
    n_kda = sum(cfg.layer_kind(l) == "kda" for l in range(cfg.num_hidden_layers))
    a, ca, sa = run(cfg, torch.float32, inner)
    b, cb, sb = run(cfg, torch.float32, inner, passes=[p for p in PASS_NAMES[1:] if p != "write_kda_state_in_place"])
    m = {p["name"]: p["matches"] for p in sa["passes"]}
    assert m["write_kda_state_in_place"] == n_kda == 4
    assert sa["ops"]["k3fuse.kda_decode_"] == n_kda and "k3fuse.kda_decode" not in sa["ops"]
    assert sb["ops"]["k3fuse.kda_decode"] == n_kda
    # the two trailing copies per KDA layer are gone (S, conv state); the MLA caches' and seq_lens' stay
    assert sb["ops"]["aten.copy_"] - sa["ops"]["aten.copy_"] == 2 * n_kda
    # eager: the same reference math, bit for bit; Inductor fuses the functional op's inlined reference (fp32 order)
    same = torch.equal if inner == "eager" else (lambda x, y: rel(x, y) < 1e-5)
    assert same(a, b)
    n_states = 0
    for x, y in zip(ca.recurrent_state + ca.conv_state, cb.recurrent_state + cb.conv_state):
        if x is not None:
            assert same(x, y) and x.abs().sum() > 0
            n_states += 1
    assert n_states == 2 * n_kda


def _decode_args(M=2, h=2, d=16, K=4, fk=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = h * d
    rn = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale
    return [rn(M, P), rn(M, P), rn(M, P), rn(M, K - 1, 3 * P), rn(P, K, scale=0.5), rn(P, K, scale=0.5),
            rn(P, K, scale=0.5), rn(M, fk), rn(P, fk, scale=fk ** -0.5), rn(P, scale=0.5),
            torch.log(torch.rand(h, generator=g) * 15 + 1), rn(M, h), rn(M, P), 1 + rn(d, scale=0.1),
            rn(M, h, d, d, scale=0.1)]


def _graph(read_old_state: bool):
    """make_fx of a step that writes kda_decode's states back into its inputs (as AOTAutograd's graph does), and
    optionally also reads the old S afterwards."""
    def step(*a):
        o, S_new, conv_new = k3.kda_decode(*a, -5.0, 1e-5, True, torch.float32)
        extra = a[14] * 2 if read_old_state else o
        a[14].copy_(S_new)
        a[3].copy_(conv_new)
        return o, extra
    return make_fx(step)(*_decode_args())


def test_rewrite_and_reference_write_in_place():
    gm = _graph(read_old_state=False)
    p = WriteKdaStateInPlace()
    assert p(gm.graph) == 1
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert k3.kda_decode_.default in targets and k3.kda_decode.default not in targets
    assert aten.copy_.default not in targets
    args = _decode_args(seed=1)
    ref = ops.kda_decode._init_fn(*[t.clone() for t in args], -5.0, 1e-5, True, torch.float32)
    S0 = args[14].clone()
    o, _ = gm(*args)
    assert rel(o, ref[0]) < 1e-6
    assert rel(args[14], ref[1]) < 1e-6 and rel(args[3], ref[2]) < 1e-6      # written in place
    assert rel(args[14], S0) > 1e-3                                              # and really changed


def test_no_rewrite_when_old_state_is_read():
    gm = _graph(read_old_state=True)
    p = WriteKdaStateInPlace()
    assert p(gm.graph) == 0
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert k3.kda_decode.default in targets and k3.kda_decode_.default not in targets
