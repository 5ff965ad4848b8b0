"""Are a PDL kernel's CTAs resident before its predecessor ends? (session 7 diagnostic)

    python3 benchmarks/pdl_probe.py [--spin-us 5] [--ctas 132,1056]

A one-CTA "spin" kernel (triggers its dependents at its start, then busy-waits SPIN_US on %globaltimer, like the
latency-bound top-k / mix-norm kernels) is followed by a "probe" grid of CTAS x 256 threads launched with use_pdl,
which records %globaltimer at entry (before griddepcontrol.wait) and after the wait. Run on a stream and inside a
CUDA graph (torch capture). Prints, per case: the share of probe CTAs that entered before the spin ended, and the
delay from the spin's end to the probe's wake-up (median over CTAs). If no CTA enters early, nothing a kernel does
before its wait (weight prefetch) can overlap its predecessor.
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
    args = ap.parse_args()
    from k3fuse.codegen.compile import compile_source, current_arch
    arch = current_arch()
    spin = compile_source(SPIN.format(ns=int(args.spin_us * 1000)), arch)
    print(f"{'mode':<6} {'ctas':>5} {'rep':>3} {'early %':>8} {'entry-spin_start us':>20} {'wake-spin_end us':>17} "
          f"{'spin us':>8}")
    for ctas in map(int, args.ctas.split(",")):
        probe = compile_source(PROBE.format(ctas=ctas), arch)
        pairs = 3
        ts = [torch.zeros(2, dtype=torch.int64, device="cuda") for _ in range(pairs)]
        ps = [torch.zeros(ctas, 2, dtype=torch.int64, device="cuda") for _ in range(pairs)]

        def body():
            for t, p in zip(ts, ps):
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
            for i, (t, p) in enumerate(zip(ts, ps)):
                t0, t1 = t.tolist()
                ent = p[:, 0].tolist()
                wake = p[:, 1].tolist()
                early = sum(e < t1 for e in ent) / ctas
                print(f"{mode:<6} {ctas:>5} {i:>3} {100 * early:>8.1f} {(statistics.median(ent) - t0) / 1000:>20.2f}"
                      f" {(statistics.median(wake) - t1) / 1000:>17.2f} {(t1 - t0) / 1000:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
