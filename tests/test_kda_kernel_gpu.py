"""k3fuse::kda_recurrent kernel (codegen/kda_recurrent.py) on a GPU: o and S_new against the ops.py reference on
fresh random inputs, outputs poisoned with NaN, fp32 rel err < 1e-4; replay inside a CUDA graph.
Skipped without CUDA."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

from _check import rel  # noqa: E402

LOWER_BOUND = -5.0


def inputs(M, h, d, adt=torch.bfloat16, bdt=torch.bfloat16, gen=None):
    dev = "cuda"
    def rn(*shape, scale=1.0):
        return torch.randn(*shape, device=dev, generator=gen) * scale
    q, k, v = rn(M, h, d), rn(M, h, d), rn(M, h, d)
    a = rn(M, h * d).to(adt)
    dt_bias = rn(h * d, scale=0.5)
    A_log = torch.log(torch.rand(h, device=dev, generator=gen) * 15 + 1)
    b = rn(M, h).to(bdt)
    S = rn(M, h, d, d, scale=0.1)
    return q, k, v, a, dt_bias, A_log, b, S


def run_kernel(args):
    from k3fuse.codegen import kda_recurrent as kr
    q = args[0]
    M, h, d = q.shape
    assert kr.launch_ok(*args) is None
    o = torch.full((M, h, d), float("nan"), device="cuda")
    Sn = torch.full((M, h, d, d), float("nan"), device="cuda")
    kr.kda_recurrent(*args, LOWER_BOUND, out=o, S_new=Sn)
    return o, Sn


@pytest.mark.parametrize("M", [1, 3, 8, 64])
@pytest.mark.parametrize("h", [6, 12])
@pytest.mark.parametrize("d,adt,bdt", [(128, torch.bfloat16, torch.bfloat16), (128, torch.float32, torch.float32),
                                       (64, torch.bfloat16, torch.float32)])
def test_kda_matches_reference(M, h, d, adt, bdt, seed):
    from k3fuse import ops
    args = inputs(M, h, d, adt, bdt)
    S0 = args[-1].clone()
    o, Sn = run_kernel(args)
    torch.cuda.synchronize()
    ro, rS = ops.kda_recurrent._init_fn(*args, LOWER_BOUND)
    assert torch.equal(args[-1], S0), "the kernel wrote its input state"
    assert rel(Sn, rS) < 1e-4
    assert rel(o, ro) < 1e-4


def test_kda_cuda_impl_and_fallback(seed):
    from k3fuse import ops
    from k3fuse.codegen import kda_recurrent as kr
    args = inputs(4, 12, 128)
    o, Sn = kr.kda_recurrent_cuda(*args, LOWER_BOUND)
    ro, rS = ops.kda_recurrent._init_fn(*args, LOWER_BOUND)
    assert rel(o, ro) < 1e-4 and rel(Sn, rS) < 1e-4
    # non-contiguous q / k / v (slices of one [M, 3, h, d] buffer) go through the kernel too
    qkv = torch.randn(4, 3, 12, 128, device="cuda")
    args2 = (qkv[:, 0], qkv[:, 1], qkv[:, 2]) + args[3:]
    o2, S2 = kr.kda_recurrent_cuda(*args2, LOWER_BOUND)
    ro2, rS2 = ops.kda_recurrent._init_fn(*args2, LOWER_BOUND)
    assert rel(o2, ro2) < 1e-4 and rel(S2, rS2) < 1e-4
    # unsupported head dim: the reference
    args3 = inputs(2, 4, 32)
    o3, S3 = kr.kda_recurrent_cuda(*args3, LOWER_BOUND)
    ro3, rS3 = ops.kda_recurrent._init_fn(*args3, LOWER_BOUND)
    assert torch.equal(o3, ro3) and torch.equal(S3, rS3)


@pytest.mark.parametrize("M", [1, 8])
def test_kda_cuda_graph_replay(M, seed):
    """Capture two chained decode steps (state fed back) in a CUDA graph; replay on new inputs."""
    from k3fuse import ops
    from k3fuse.codegen import kda_recurrent as kr
    h, d = 12, 128
    args = inputs(M, h, d)
    args_b = inputs(M, h, d)
    kr.kda_recurrent(*args, LOWER_BOUND)                     # compile / load before capture
    torch.cuda.synchronize()
    q, k, v, a, dt, A_log, b, S = args
    q2, k2, v2, a2, _, _, b2, _ = args_b
    o = torch.empty(M, h, d, device="cuda")
    o2 = torch.empty(M, h, d, device="cuda")
    S_out = torch.empty(M, h, d, d, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        oa, Sa = kr.kda_recurrent(q, k, v, a, dt, A_log, b, S, LOWER_BOUND)
        ob, Sb = kr.kda_recurrent(q2, k2, v2, a2, dt, A_log, b2, Sa, LOWER_BOUND)
        o.copy_(oa)
        o2.copy_(ob)
        S_out.copy_(Sb)
    for _ in range(2):
        fresh, fresh_b = inputs(M, h, d), inputs(M, h, d)
        for dst, src in zip(args, fresh):
            if dst is not dt and dst is not A_log:
                dst.copy_(src)
        for dst, src in zip((q2, k2, v2, a2, b2), (fresh_b[0], fresh_b[1], fresh_b[2], fresh_b[3], fresh_b[6])):
            dst.copy_(src)
        for t in (o, o2, S_out):
            t.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ro, rS = ops.kda_recurrent._init_fn(q, k, v, a, dt, A_log, b, S, LOWER_BOUND)
        ro2, rS2 = ops.kda_recurrent._init_fn(q2, k2, v2, a2, dt, A_log, b2, rS, LOWER_BOUND)
        assert rel(o, ro) < 1e-4 and rel(o2, ro2) < 1e-4 and rel(S_out, rS2) < 1e-4


# ------------------------------------------------------------------------------------ kda_decode (fused variant)
def decode_inputs(M, h, d, K, xdt, fdt, gdt, fk=128, gen=None):
    dev = "cuda"
    P = h * d

    def rn(*shape, scale=1.0, dt=torch.float32):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(dt)
    return (rn(M, P, dt=xdt), rn(M, P, dt=xdt), rn(M, P, dt=xdt), rn(M, K - 1, 3 * P, dt=xdt),
            rn(P, K, scale=0.5), rn(P, K, scale=0.5), rn(P, K, scale=0.5),
            rn(M, fk, dt=fdt), rn(P, fk, scale=fk ** -0.5, dt=fdt), rn(P, scale=0.5),
            torch.log(torch.rand(h, device=dev, generator=gen) * 15 + 1), rn(M, h, dt=xdt),
            rn(M, P, dt=gdt), 1 + rn(d, scale=0.1), rn(M, h, d, d, scale=0.1))


@pytest.mark.parametrize("M", [1, 3, 8, 64])
@pytest.mark.parametrize("h", [6, 12])
@pytest.mark.parametrize("xdt,fdt,odt,newest", [(torch.bfloat16, torch.bfloat16, torch.bfloat16, True),
                                                 (torch.float32, torch.float32, torch.float32, False)])
def test_kda_decode_matches_reference(M, h, xdt, fdt, odt, newest, seed):
    """Conv + SiLU, f_b, recurrence, gated RMSNorm in one kernel against ops.kda_decode (fp32 math) on fresh
    random inputs, every output NaN-poisoned; the inputs (S, conv state) are not written."""
    from k3fuse import ops
    from k3fuse.codegen import kda_recurrent as kr
    d, K = 128, 4
    args = decode_inputs(M, h, d, K, xdt, fdt, xdt)
    S0, C0 = args[-1].clone(), args[3].clone()
    assert kr.launch_ok_decode(*args, odt) is None
    P = h * d
    o = torch.full((M, P), float("nan"), device="cuda", dtype=odt)
    Sn = torch.full((M, h, d, d), float("nan"), device="cuda")
    Cn = torch.full_like(args[3], float("nan"))
    kr.kda_decode(*args, LOWER_BOUND, 1e-5, newest, odt, out=o, S_new=Sn, conv_new=Cn)
    torch.cuda.synchronize()
    ro, rS, rC = ops.kda_decode._init_fn(*args, LOWER_BOUND, 1e-5, newest, odt)
    assert torch.equal(args[-1], S0) and torch.equal(args[3], C0), "the kernel wrote an input"
    assert torch.equal(Cn, rC)
    assert rel(Sn, rS) < 1e-4
    assert rel(o, ro) < (1e-2 if odt == torch.bfloat16 else 1e-4)


def test_kda_decode_cuda_impl_in_graph(seed):
    """The registered CUDA impl (torch.ops.k3fuse.kda_decode) replayed in a CUDA graph on new inputs each time."""
    from k3fuse import ops
    from k3fuse.codegen import registry
    registry.register()
    M, h, d, K = 2, 6, 128, 4
    bf = torch.bfloat16
    static = decode_inputs(M, h, d, K, bf, bf, bf)
    run = lambda: torch.ops.k3fuse.kda_decode(*static, LOWER_BOUND, 1e-5, True, bf)
    run()                                                    # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = run()
    for _ in range(2):
        fresh = decode_inputs(M, h, d, K, bf, bf, bf)
        for s, f in zip(static, fresh):
            s.copy_(f)
        for t in outs:
            t.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ro, rS, rC = ops.kda_decode._init_fn(*fresh, LOWER_BOUND, 1e-5, True, bf)
        assert rel(outs[0], ro) < 1e-2 and rel(outs[1], rS) < 1e-4 and torch.equal(outs[2], rC)


@pytest.mark.parametrize("M,h", [(1, 6), (3, 12), (64, 6)])
@pytest.mark.parametrize("layout", ["contiguous", "conv_strided", "S_strided"])
def test_kda_decode_in_place(M, h, layout, seed):
    """k3fuse::kda_decode_ (pass write_kda_state_in_place): the kernel writes S and the conv state into its inputs;
    equal to the functional reference on fresh inputs. A conv state the kernel cannot address directly (a view
    into a wider buffer) is computed aside and copied in; a strided S takes the reference path (also in place)."""
    from k3fuse import ops
    from k3fuse.codegen import registry
    registry.register()
    d, K = 128, 4
    bf = torch.bfloat16
    args = list(decode_inputs(M, h, d, K, bf, bf, bf))
    if layout == "S_strided":
        wide_S = torch.full((M, h, d, 2 * d), float("nan"), device="cuda")
        wide_S[..., :d] = args[-1]
        args[-1] = wide_S[..., :d]
    if layout == "conv_strided":
        wide_C = torch.zeros(M, K - 1, 3 * h * d + 8, device="cuda", dtype=bf)
        wide_C[..., :3 * h * d] = args[3]
        args[3] = wide_C[..., :3 * h * d]
    ro, rS, rC = ops.kda_decode._init_fn(*[a.clone() for a in args], LOWER_BOUND, 1e-5, True, bf)
    S0 = args[-1].clone()
    o = torch.ops.k3fuse.kda_decode_(*args, LOWER_BOUND, 1e-5, True, bf)
    torch.cuda.synchronize()
    assert rel(o, ro) < 1e-2
    assert rel(args[-1], rS) < 1e-4 and rel(args[-1], S0) > 1e-3
    assert torch.equal(args[3], rC)
    if layout == "S_strided":
        assert torch.isnan(wide_S[..., d:]).all()
    if layout == "conv_strided":
        assert (wide_C[..., 3 * h * d:] == 0).all()


def test_kda_decode_in_place_after_a_gemv_in_a_pdl_chain(seed):
    """Three decode steps in one CUDA graph, each a k3fuse GEMV (q0 = x_t W^T, PDL chain, late trigger) and then
    kda_decode_ writing S and the conv state in place, as in the layer: step t must see step t - 1's writes through
    the chain. Every step's output and the final state against the reference run step by step, over two replays on
    fresh inputs. (Session 31 also ran it with S and the conv window read before the chain's wait, K3FUSE_KDA_EARLY,
    since removed: passed, no faster.)"""
    from k3fuse import ops
    from k3fuse.codegen import compile as kcompile
    from k3fuse.codegen import registry
    kcompile.clear_memo()
    registry.register()
    try:
        M, h, d, K, steps = 1, 6, 128, 4, 3
        bf = torch.bfloat16
        P = h * d
        state = list(decode_inputs(M, h, d, K, bf, bf, bf))          # conv state [3], S [-1]: written in place
        W = (torch.randn(P, 1024, device="cuda") * 1024 ** -0.5).to(bf)
        xs = [torch.randn(M, 1024, device="cuda").to(bf) for _ in range(steps)]
        per_step = [list(decode_inputs(M, h, d, K, bf, bf, bf)) for _ in range(steps)]   # k0, v0, fa, b, go

        def step(t):
            a = per_step[t]
            q0 = torch.ops.k3fuse.linear(xs[t], W)
            return torch.ops.k3fuse.kda_decode_(q0, a[1], a[2], state[3], *state[4:7], a[7], *state[8:11], a[11],
                                                a[12], state[13], state[14], LOWER_BOUND, 1e-5, True, bf)
        for t in range(steps):                                       # compile outside the capture
            step(t)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = [step(t) for t in range(steps)]
        for _ in range(2):
            fresh = decode_inputs(M, h, d, K, bf, bf, bf)
            state[3].copy_(fresh[3])
            state[14].copy_(fresh[14])
            for t in range(steps):
                xs[t].copy_(torch.randn(M, 1024, device="cuda").to(bf))
                for i in (1, 2, 7, 11, 12):
                    per_step[t][i].copy_(decode_inputs(M, h, d, K, bf, bf, bf)[i])
            for o in outs:
                o.fill_(float("nan"))
            conv, S = state[3].clone(), state[14].clone()
            refs = []
            for t in range(steps):
                a = per_step[t]
                q0 = (xs[t].float() @ W.float().t()).to(bf)
                ro, S, conv = ops.kda_decode._init_fn(q0, a[1], a[2], conv, *state[4:7], a[7], *state[8:11], a[11],
                                                      a[12], state[13], S, LOWER_BOUND, 1e-5, True, bf)
                refs.append(ro)
            g.replay()
            torch.cuda.synchronize()
            for o, ro in zip(outs, refs):
                assert rel(o, ro) < 1e-2
            assert rel(state[14], S) < 1e-3
            assert rel(state[3], conv) < 1e-2
    finally:
        kcompile.clear_memo()
