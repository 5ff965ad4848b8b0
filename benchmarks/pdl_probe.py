"""Are a PDL kernel's CTAs resident before its predecessor ends? (session 7 diagnostic)

    python3 benchmarks/pdl_probe.py [--spin-us 5] [--ctas 132,1056] [--head-us 0,3]

A one-CTA "spin" kernel (triggers its dependents at its start, then busy-waits SPIN_US on %globaltimer, like the
latency-bound top-k / mix-norm kernels) is followed by a "probe" grid of CTAS x 256 threads launched with use_pdl,
which records %globaltimer at entry (before griddepcontrol.wait) and after the wait. Run on a stream and inside a
CUDA graph (torch capture). Prints, per case: the share of probe CTAs that entered before the spin ended, and the
delay from the spin's end to the probe's wake-up (median over CTAs). If no CTA enters early, nothing a kernel does
before its wait (weight prefetch) can overlap its predecessor.

--head-us H (session 31): before each spin a "head" grid of 132 CTAs busy-waits H us and only then triggers (the
GEMVs' late trigger: the layer's in_proj before kda_decode, whose dependent is the fused_residual_norm). H = 0: no
head (session 7's chain). Asks whether the probe still enters during the spin when the spin is itself the dependent
of a late-triggering grid (in the layer, session 31's stamps had the fused_residual_norm's CTAs enter only ~0.3 us
before their wait returned).
"""
from __future__ import annotations

import argparse
import statistics

import torch

SPIN = '''
import cutlass
import cutlass.cute as cute
from cutlass import Int64

SPIN_NS = {ns}


@cute.kernel
def spin_kernel(mT: cute.Tensor):
    cute.arch.griddepcontrol_launch_dependents()
    cute.arch.griddepcontrol_wait()
    tidx, _, _ = cute.arch.thread_idx()
    t0 = cute.arch.globaltimer()
    t = t0
    while t - t0 < Int64(SPIN_NS):
        t = cute.arch.globaltimer()
    if tidx == 0:
        mT[0] = Int64(t0)
        mT[1] = Int64(t)


@cute.jit
def ENTRY(mT: cute.Tensor, stream):
    spin_kernel(mT).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream, use_pdl=True)


def fake_args():
    return (cute.runtime.make_fake_compact_tensor(Int64, (2,), assumed_align=16),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
'''

HEAD = '''
import cutlass
import cutlass.cute as cute
from cutlass import Int64

SPIN_NS = {ns}


@cute.kernel
def head_kernel(mH: cute.Tensor):
    cute.arch.griddepcontrol_wait()
    tidx, _, _ = cute.arch.thread_idx()
    b, _, _ = cute.arch.block_idx()
    t0 = cute.arch.globaltimer()
    t = t0
    while t - t0 < Int64(SPIN_NS):
        t = cute.arch.globaltimer()
    cute.arch.griddepcontrol_launch_dependents()     # late, as the GEMVs
    if tidx == 0:
        mH[b, 0] = Int64(t0)
        mH[b, 1] = Int64(t)


@cute.jit
def ENTRY(mH: cute.Tensor, stream):
    head_kernel(mH).launch(grid=[132, 1, 1], block=[256, 1, 1], stream=stream, use_pdl=True)


def fake_args():
    return (cute.runtime.make_fake_compact_tensor(Int64, (132, 2), stride_order=(1, 0), assumed_align=16),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
'''

PROBE = '''
import cutlass
import cutlass.cute as cute
from cutlass import Int64

CTAS = {ctas}


@cute.kernel
def probe_kernel(mP: cute.Tensor):
    t_in = cute.arch.globaltimer()
    cute.arch.griddepcontrol_launch_dependents()
    cute.arch.griddepcontrol_wait()
    t_out = cute.arch.globaltimer()
    tidx, _, _ = cute.arch.thread_idx()
    b, _, _ = cute.arch.block_idx()
    if tidx == 0:
        mP[b, 0] = Int64(t_in)
        mP[b, 1] = Int64(t_out)


@cute.jit
def ENTRY(mP: cute.Tensor, stream):
    probe_kernel(mP).launch(grid=[CTAS, 1, 1], block=[256, 1, 1], stream=stream, use_pdl=True)


def fake_args():
    return (cute.runtime.make_fake_compact_tensor(Int64, (CTAS, 2), stride_order=(1, 0), assumed_align=16),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
'''


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spin-us", type=float, default=5.0)
    ap.add_argument("--ctas", default="132,1056")
    ap.add_argument("--head-us", default="0", help="a late-triggering head grid before each spin (0: none)")
    args = ap.parse_args()
    from k3fuse.codegen.compile import compile_source, current_arch
    arch = current_arch()
    spin = compile_source(SPIN.format(ns=int(args.spin_us * 1000)), arch)
    print(f"{'mode':<6} {'head':>5} {'ctas':>5} {'rep':>3} {'early %':>8} {'entry-spin_start us':>20} "
          f"{'wake-spin_end us':>17} {'spin us':>8} {'spin_start-head_end us':>23}")
    for head_us in map(float, args.head_us.split(",")):
        head = compile_source(HEAD.format(ns=int(head_us * 1000)), arch) if head_us > 0 else None
        for ctas in map(int, args.ctas.split(",")):
            probe = compile_source(PROBE.format(ctas=ctas), arch)
            pairs = 3
            ts = [torch.zeros(2, dtype=torch.int64, device="cuda") for _ in range(pairs)]
            ps = [torch.zeros(ctas, 2, dtype=torch.int64, device="cuda") for _ in range(pairs)]
            hs = [torch.zeros(132, 2, dtype=torch.int64, device="cuda") for _ in range(pairs)]

            def body():
                for t, p, h in zip(ts, ps, hs):
                    if head is not None:
                        head(h)
                    spin(t)
                    probe(p)
            for mode in ("stream", "graph"):
                if mode == "stream":
                    body()
                else:
                    g = torch.cuda.CUDAGraph()
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        body()
                    torch.cuda.current_stream().wait_stream(s)
                    torch.cuda.synchronize()
                    with torch.cuda.graph(g):
                        body()
                    g.replay()
                torch.cuda.synchronize()
                for i, (t, p, h) in enumerate(zip(ts, ps, hs)):
                    t0, t1 = t.tolist()
                    ent = p[:, 0].tolist()
                    wake = p[:, 1].tolist()
                    early = sum(e < t1 for e in ent) / ctas
                    gap = f"{(t0 - max(h[:, 1].tolist())) / 1000:>23.2f}" if head is not None else f"{'-':>23}"
                    print(f"{mode:<6} {head_us:>5.1f} {ctas:>5} {i:>3} {100 * early:>8.1f} "
                          f"{(statistics.median(ent) - t0) / 1000:>20.2f} {(statistics.median(wake) - t1) / 1000:>17.2f}"
                          f" {(t1 - t0) / 1000:>8.2f} {gap}", flush=True)

if __name__ == "__main__":
    main()
