"""The one-launch fused_residual_norm's phase stamps (K3FUSE_FRN_STAMPS=1, diagnostic): the rendered kernels with and
without them, the stamped kernel compiled, and benchmarks/frn_timeline.py's reader on a hand-made buffer (CPU)."""
import pathlib
import re
import sys

import pytest
import torch

from k3fuse.codegen import fused_residual_norm as frn
from k3fuse.codegen.render import render

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import frn_timeline  # noqa: E402

# K3 TP16's o_proj one-launch kernel: H = 7168, K = 768, 4 blocks, a prefix, no addend, w_mix as a pair
ARGS = (7168, 768, 4, False, True, False, 1e-5, 1e-5, True)


def _src(monkeypatch, stamps, bm=1):
    monkeypatch.setenv("K3FUSE_FRN_STAMPS", "1" if stamps else "0")
    return render(frn.ONE_TEMPLATE, **frn.one_params(*ARGS, bm=bm))


@pytest.mark.parametrize("bm", [1, 4])
def test_stamps_only_where_asked(monkeypatch, bm):
    """Off (the default) the source is the kernel of before, not a line more; on, thread 0 writes the 7 phases' timer
    and clock into slots k and 16 + k of its row of the extra [G, 32] argument, which the entry point passes on."""
    off = _src(monkeypatch, False, bm)
    assert "sreg_u32" not in off and "STAMPS" not in off and "mSt" not in off
    on = _src(monkeypatch, True, bm)
    slots = sorted(int(k) for k in re.findall(r'mSt\[bidx, (\d+)\] = sreg_u32\("%globaltimer_lo"\)', on))
    assert slots == list(range(len(frn_timeline.PHASES)))
    clocks = sorted(int(k) for k in re.findall(r'mSt\[bidx, (\d+)\] = sreg_u32\("%clock"\)', on))
    assert clocks == [frn_timeline.CLK0 + k for k in slots]
    assert "mCtr, mSt).launch(" in on and "make(Int32, (G, 32)" in on
    # without the stamp lines, the helper and the extra argument, the two sources are the same kernel
    a = on.index("from cutlass._mlir.dialects import llvm")
    body_on = on[:a] + on[on.index("\n\n\nH = ", a) + 2:]
    strip = lambda s: [ln.replace(", mSt: cute.Tensor", "").replace(" mSt: cute.Tensor,", "").replace(", mSt)", ")")
                       for ln in s.splitlines() if "sreg_u32" not in ln and ln.strip() != "if tidx == 0:"
                       and not ln.startswith("# params") and "(G, 32)" not in ln]
    assert strip(body_on) == strip(off)
    # the barrier's own thread-0 block is still there, after the statistics' stamp and before the barrier's
    i3, i4 = on.index("mSt[bidx, 3]"), on.index("mSt[bidx, 4]")
    assert i3 < on.index('cute.arch.red(mCtr.iterator, Int32(1), op="add", dtype="s32", sem="release"') < i4


def test_stamped_kernel_compiles(monkeypatch, isolated_kernel_cache):
    pytest.importorskip("cutlass")
    monkeypatch.setenv("K3FUSE_FRN_STAMPS", "1")
    k = frn.build_one(*ARGS, arch="sm_90a", load=False)
    ptx = open(k.files["kernel.ptx"]).read()
    n = len(frn_timeline.PHASES)
    assert ptx.count("%globaltimer_lo") == n and ptx.count("%clock;") == n
    assert "ld.local" not in ptx and "st.local" not in ptx
    monkeypatch.setenv("K3FUSE_FRN_STAMPS", "0")
    assert frn.build_one(*ARGS, arch="sm_90a", load=False) is not k      # the memo tells the two apart


def test_summarize_reads_a_launch():
    """Two CTAs; CTA 1 starts 1 us later; the timer wraps past 2^32 between phases 0 and 1 of CTA 0."""
    n = len(frn_timeline.PHASES)
    buf = torch.zeros(2, 32, dtype=torch.int32)
    base = (1 << 32) - 500                       # 0.5 us before the wrap
    for cta, start in ((0, base), (1, base + 1000)):
        for k in range(n):
            buf[cta, k] = torch.tensor((start + 1000 * k) % (1 << 32), dtype=torch.int64).to(torch.int32)
            buf[cta, frn_timeline.CLK0 + k] = torch.tensor((7 + 2000 * k * (cta + 1)) % (1 << 32)).to(torch.int32)
    r = frn_timeline.summarize(buf)
    assert r["ctas"] == 2
    p = r["phases"]
    assert [x["name"] for x in p] == list(frn_timeline.PHASES)
    assert p[0]["first_us"] == 0.0 and p[0]["last_us"] == 1.0
    assert p[3]["first_us"] == 3.0 and p[3]["last_us"] == 4.0          # across the wrap
    assert p[0]["clocks"] == 0 and p[5]["clocks"] == 2000               # torch's median of two: the lower


def test_kda_stamps_only_where_asked(monkeypatch):
    """K3FUSE_KDA_STAMPS=1: the fused kda_decode kernel stamps its 5 phases (start before the chain's trigger and
    wait, wait done after it) into the extra [R, 32] argument; off, or the unfused kernel, renders as before."""
    from k3fuse.codegen import kda_recurrent as kr
    fused = dict(kc=4, fk=128, newest_last=True, x="bfloat16", f="bfloat16", g="bfloat16", o="bfloat16", eps=1e-5)
    monkeypatch.setenv("K3FUSE_KDA_STAMPS", "0")
    off = kr.render_source(128, fused=fused)
    monkeypatch.setenv("K3FUSE_KDA_STAMPS", "1")
    on = kr.render_source(128, fused=fused)
    assert "sreg_u32" not in off and "mSt" not in off and "sreg_u32" not in kr.render_source(128)
    slots = [int(k) for k in re.findall(r'mSt\[r, (\d+)\] = sreg_u32\("%globaltimer_lo"\)', on)]
    assert slots == list(range(len(frn_timeline.KDA_PHASES)))
    assert on.index("mSt[r, 0]") < on.index("griddepcontrol_wait()") < on.index("mSt[r, 1]")
    assert "mOn, mSt).launch(" in on


def test_summarize_on_a_shared_axis():
    """kda_decode's buffer gives the axis (its earliest start); a later launch's phases are read on it."""
    kda = torch.zeros(2, 32, dtype=torch.int32)
    for cta, start in ((0, 5000), (1, 4000)):                  # CTA 1 starts first
        for k in range(len(frn_timeline.KDA_PHASES)):
            kda[cta, k] = start + 1000 * k
    ref = frn_timeline.first_start(kda)
    assert ref == 4000
    r = frn_timeline.summarize(kda, frn_timeline.KDA_PHASES)
    assert [p["name"] for p in r["phases"]] == list(frn_timeline.KDA_PHASES)
    assert r["phases"][0]["first_us"] == 0.0 and r["phases"][4]["last_us"] == 5.0
    later = torch.zeros(1, 32, dtype=torch.int32)
    for k in range(len(frn_timeline.PHASES)):
        later[0, k] = 10000 + 500 * k
    p = frn_timeline.summarize(later, t_ref=ref)["phases"]
    assert p[0]["first_us"] == 6.0 and p[6]["median_us"] == 9.0
