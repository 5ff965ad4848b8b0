"""Time the mix-norm kernel (second half of k3fuse::fused_residual_norm) alone with K3FUSE_MIXNORM_CLUSTER = each of
--clusters, the arms interleaved in one process (the knob is read at render time: memos cleared per arm); inputs
rotated through sets beyond L2, CUDA-graph replays; each cluster arm's outputs compared with the one-CTA kernel's
(err_vs_1cta; list 1 first; tests/test_kernels_gpu.py checks both against the reference). Bytes = the row's
sources + outputs; floor = bytes / copy bandwidth of the same run.
    python3 benchmarks/mixnorm_bench.py --out DIR --clusters 1,4,8"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch

from gpu_kernels import L2_BYTES, copy_bandwidth, graph_time, rel_err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--clusters", default="1,4,8")
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    from k3fuse.codegen import compile as kcompile
    from k3fuse.codegen import fused_residual_norm as frn
    H = 7168
    bw = copy_bandwidth()
    rows = []

    def bf(*s, scale=1.0):
        return (torch.randn(*s, device="cuda") * scale).to(torch.bfloat16)
    for M in [int(m) for m in a.ms.split(",")]:
        for nb, addend, prefix in ((3, False, True), (8, True, True)):
            nbytes = M * H * 2 * (1 + nb + addend + prefix + 2) + H * 2 * 3
            nrot = max(2, math.ceil(3 * L2_BYTES / nbytes))
            sets = [dict(y=bf(M, H), a=bf(M, H) if addend else None, p=bf(M, H) if prefix else None,
                         b=[bf(M, H) for _ in range(nb)]) for _ in range(nrot)]
            wa, wb, nw = bf(H, scale=0.3), bf(H, scale=0.3), bf(H, scale=0.5) + 1
            for rnd in range(a.rounds):
                for cl in [int(c) for c in a.clusters.split(",")]:
                    os.environ["K3FUSE_MIXNORM_CLUSTER"] = str(cl)
                    kcompile.clear_memo()
                    frn._built.clear()
                    row = dict(M=M, nb=nb, addend=addend, prefix=prefix, cluster=cl, round=rnd,
                               floor_us=nbytes / bw * 1e6)
                    try:
                        s0 = sets[0]
                        out, newp = frn.mix_norm(s0["y"], s0["a"], s0["p"], s0["b"], wa, nw, 1e-6, 1e-5, True,
                                                 w_mix_scale=wb)
                        torch.cuda.synchronize()
                        row["ok"] = bool(torch.isfinite(out.float()).all())
                        row["us"] = graph_time(lambda i: frn.mix_norm(
                            sets[i % nrot]["y"], sets[i % nrot]["a"], sets[i % nrot]["p"], sets[i % nrot]["b"], wa, nw,
                            1e-6, 1e-5, True, w_mix_scale=wb))[0]
                        if cl == 1:
                            ref_out, ref_p = out.clone(), newp.clone()
                            row["err_vs_1cta"] = 0.0
                        else:
                            row["err_vs_1cta"] = max(rel_err(out, ref_out.double()), rel_err(newp, ref_p.double()))
                    except Exception as e:
                        row.update(ok=False, error=repr(e)[:300])
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    os.environ.pop("K3FUSE_MIXNORM_CLUSTER", None)
    for M in sorted({r["M"] for r in rows}):
        for nb in (3, 8):
            arms = {}
            for r in rows:
                if r["M"] == M and r["nb"] == nb and "us" in r:
                    arms.setdefault(r["cluster"], []).append(r["us"])
            fl = next(r["floor_us"] for r in rows if r["M"] == M and r["nb"] == nb)
            print(f"M {M} nb {nb} floor {fl:.2f} us: " + ", ".join(
                f"cluster {c}: {min(v):.2f} us (runs {', '.join(f'{x:.2f}' for x in v)})" for c, v in sorted(arms.items())))
    with open(os.path.join(a.out, "mixnorm_bench.json"), "w") as f:
        json.dump(dict(copy_TBps=bw / 1e12, gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
