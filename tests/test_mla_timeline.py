"""The per-head MLA kernel's phase stamps (K3FUSE_MLA_STAMPS=1, diagnostic): the rendered kernels with and without
them, and benchmarks/mla_timeline.py's reader on a hand-made buffer (CPU)."""
import pathlib
import re
import sys

import pytest
import torch

from k3fuse.codegen import mla_attention as ma
from k3fuse.codegen.render import render

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import mla_timeline  # noqa: E402

K3 = dict(n=128, v=128, r=64, C=512)
SCALE = 192 ** -0.5


def _src(monkeypatch, stamps, cl, qb=None):
    monkeypatch.setenv("K3FUSE_MLA_STAMPS", "1" if stamps else "0")
    return render(ma.HEADS_TEMPLATE, **ma.heads_params(6, K3["n"], K3["v"], K3["r"], K3["C"], SCALE, append_eps=1e-6,
                                                       gate=True, out_dtype="bfloat16", cl=cl, qb=qb))


@pytest.mark.parametrize("qb", [None, (1536, 1e-6)])
def test_stamps_only_where_asked(monkeypatch, qb):
    """Off (the default) the source is the kernel of before, not a line more; on, thread 0 writes the 13 phases'
    timer and clock into slots k and 32 + k of its (m, split, hd) partials row; never without a cluster (the counter
    path uses that buffer)."""
    off = _src(monkeypatch, False, 8, qb)
    assert "sreg_bits_f32" not in off and "STAMPS" not in off
    on = _src(monkeypatch, True, 8, qb)
    slots = sorted(int(k) for k in re.findall(r'mOp\[m, split, hd, (\d+)\] = sreg_bits_f32\("%globaltimer_lo"\)', on))
    # the 13 phases and, with the MMA tiles (the default), 4 inside the first tile; with q in the kernel 2 in its phase
    assert slots == sorted(list(range(len(mla_timeline.PHASES))) + [t[0] for t in mla_timeline.TILE_PHASES]
                           + ([t[0] for t in mla_timeline.Q_PHASES] if qb else []))
    clocks = sorted(int(k) for k in re.findall(r'mOp\[m, split, hd, (\d+)\] = sreg_bits_f32\("%clock"\)', on))
    assert clocks == [mla_timeline.CLK0 + k for k in slots]
    # without the stamp lines the two sources are the same kernel
    strip = lambda s: [ln for ln in s.splitlines() if "sreg_bits_f32" not in ln and "if tidx == 0:" not in ln
                       and "== t_begin:" not in ln and not ln.startswith("# params")]
    a = on.index("@dsl_user_op\ndef sreg_bits_f32")
    body_on = on[:a] + on[on.index("\n\n\n", a) + 3:]             # without the stamp helper
    assert strip(body_on) == strip(off)
    assert "sreg_bits_f32" not in _src(monkeypatch, True, 1)


def test_stamped_kernel_compiles(monkeypatch, isolated_kernel_cache):
    pytest.importorskip("cutlass")
    monkeypatch.setenv("K3FUSE_MLA_STAMPS", "1")
    k = ma.build_heads(6, **K3, scale=SCALE, arch="sm_90a", load=False, cl=8, append_eps=1e-6, gate=True,
                       out_dtype="bfloat16", qb=(1536, 1e-6))
    ptx = open(k.files["kernel.ptx"]).read()
    # 13 + 4 in the first (MMA) tile + 2 in the q phase
    n = len(mla_timeline.PHASES) + len(mla_timeline.TILE_PHASES) + len(mla_timeline.Q_PHASES)
    assert ptx.count("%globaltimer_lo") == n and ptx.count("%clock;") == n


def test_summarize_reads_a_launch():
    """Two CTAs; CTA 1 starts 1 us later; the timer wraps past 2^32 between phases 0 and 1 of CTA 0."""
    n = len(mla_timeline.PHASES)
    buf = torch.zeros(1, 2, 1, 128, dtype=torch.int32)
    base = (1 << 32) - 500                       # 0.5 us before the wrap
    # the phases in time order: 0..12, then the first tile's (slots 16, 13, 14, 15) at positions 13..16
    order = list(range(n)) + [t[0] for t in mla_timeline.TILE_PHASES]
    for cta, start in ((0, base), (1, base + 1000)):
        for pos, k in enumerate(order):
            buf[0, cta, 0, k] = torch.tensor((start + 1000 * pos) % (1 << 32), dtype=torch.int64).to(torch.int32)
            buf[0, cta, 0, mla_timeline.CLK0 + k] = torch.tensor((7 + 2000 * pos * (cta + 1)) % (1 << 32)).to(torch.int32)
    r = mla_timeline.summarize(buf.view(torch.float32))
    assert r["ctas"] == 2
    p = r["phases"]
    assert [x["name"] for x in p] == list(mla_timeline.PHASES) + [t[1] for t in mla_timeline.TILE_PHASES]
    assert p[0]["first_us"] == 0.0 and p[0]["last_us"] == 1.0
    assert p[3]["first_us"] == 3.0 and p[3]["last_us"] == 4.0          # across the wrap
    assert p[0]["clocks"] == 0 and p[5]["clocks"] == 2000               # torch's median of two: the lower
    # the first tile's phases count from their own reference phase (16 from 5, 13 from 16, 14 from 13, 15 from 14)
    assert [x["clocks"] for x in p[n:]] == [2000 * 8, 2000, 2000, 2000]
    assert p[n]["first_us"] == 13.0 and p[n + 1]["first_us"] == 14.0


def test_summarize_skips_unstamped_slots():
    """A variant that stamps the q phase (slots 17, 18) gets those rows, counted from their reference phases; slots
    left at zero (the buffer is zeroed when stamps are on) give no row."""
    n = len(mla_timeline.PHASES)
    buf = torch.zeros(1, 1, 1, 128, dtype=torch.int32)
    order = list(range(n)) + [t[0] for t in mla_timeline.Q_PHASES]
    for pos, k in enumerate(order):
        buf[0, 0, 0, k] = 1000 + 1000 * pos
        buf[0, 0, 0, mla_timeline.CLK0 + k] = 5 + 100 * pos * pos
    p = mla_timeline.summarize(buf.view(torch.float32))["phases"]
    assert [x["name"] for x in p] == list(mla_timeline.PHASES) + [t[1] for t in mla_timeline.Q_PHASES]
    c = lambda k: 5 + 100 * order.index(k) ** 2
    assert [x["clocks"] for x in p[n:]] == [c(17) - c(1), c(18) - c(17)]
