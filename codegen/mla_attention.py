"""Kernel family: k3fuse::mla_attention (absorbed MLA decode attention over the latent cache, K3_MODEL.md section 5).

One ENTRY, three launches on the current stream (templates/mla_attention.py.jinja):
  1. qabsorb  q_lat = scale * W_UK[h]^T q_nope[h] (+ scale * q_pe) per (token, head, column split) -> [M, HP, C + r]
  2. split    one CTA per (token, split of T): each cache row [C + r] is read ONCE for ALL heads (the latent cache is
              shared by the heads, MQA-like), scores, fp32 online softmax, partial o_lat     -> scratch [M, NS, HP, C]
  3. combine  one CTA per (token, head, row split): log-sum-exp merge of the NS partials, o = W_UV[h] o_lat -> [M, h, v]
So the cache is read once per decode step (M * min(seq_len+1, T) * (C + r) * 2 bytes); kv_b is read twice (W_UK half
by kernel 1, W_UV half by kernel 3, once per token row, L2-resident at 1.5 MB per rank at TP16).
All dot products run on CUDA cores in fp32 (no tensor cores). Estimated (not measured) on H200 at h = 12, TT = 32:
per 32-token tile the score step takes ~4 K shared-memory wavefronts (each lane reads its own row; query chunks are
broadcasts) against ~1.7 K cycles of FMAs, the PV step ~1.5 K cycles: ~3 us per tile per SM, so M = 8, T = 4096
(1024 tiles) is ~20-25 us against an HBM floor of ~8 us (37.7 MB). The score step is the limit; an MMA version
(mma.sync / wgmma with the heads as M and the cache tile as N) is the next step.
Registers (ptxas, K3 h = 12, 8x8): qabsorb 32 (sm_90a / sm_100a), split 116 / 118, combine 64 / 68; no spills.
TT = 64 compiles too but takes ~200 registers in the split kernel (one CTA per SM).
Variants (session 15; the kernels are @cute.jit phase functions that each kernel calls):
- PIPE (pipe_for): the split kernel's tile pipeline; 148 registers at h = 12 (182-186 with the MMA score step), so only
  where the split grid fits the SMs. Without it the MMA split kernel launches with min_blocks_per_mp = 2 (<= 128).
- MMA (mma_scores; default since session 16, K3FUSE_MLA_MMA=0 turns it off): the score step on tensor cores.
  Measured 2026-12-02 (H200, layer_ab MLA + MoE): -1.1 / -2.9 us at TP16 M = 1 / 8, -3.4 / -10.3 at TP8.
- PVMMA (pv_mma; default since session 34, K3FUSE_MLA_PVMMA=0 turns it off): the PV step on tensor cores too.
- CMMA (combine_mma_choice; the default where CMMA_BY_HEADS lists the bucket, session 34): the combine as one CTA per
  (head, 8 tokens) with W_UV on tensor cores (three launches only).
(The "all dot products on CUDA cores" estimate above is the first version's.)

Compile-time: h (and its padding HP), n, v, r, C, the q dtype, the scale, the tile TT (tokens per shared-memory tile),
threads, and the arch. Runtime: M, T and NS (splits per row, chosen by n_splits() from M, T and the SM count; the
scratch tensors carry it), so the kernel does not recompile per batch, cache length or split count.

The per-head variant (HEADS_TEMPLATE, session 24; below): one launch, a cluster of splits per (head, row) sharing the
head's W_UK / W_UV rows and merging in distributed shared memory; the default where HEADS_BY_HEADS lists it.
Validated on the H200 (2026-11-29; session 12 column-split qabsorb and combine 2026-12-01, tests/test_mla_kernel_gpu.py);
registered by registry.register() (IMPLS).
"""
from __future__ import annotations

import collections
import functools
from typing import Optional

from .buckets import bucket_for
from .render import render
from . import knobs

FAMILY = "mla_attention"
TEMPLATE = "mla_attention.py.jinja"
OP = "k3fuse::mla_attention"
OP_APPEND = "k3fuse::mla_append_attention_"   # + the cache append (qabsorb) and the output gate (combine)
OP_QB = "k3fuse::mla_qb_append_attention_"     # + the query's projection (the per-head kernel with clusters only)
THREADS = 256
HG = 2                  # head groups of the PV step (THREADS / HG column groups)
DEFAULT_TT = 32         # tokens per shared-memory tile
TILE_SIZES = (32, 64)
MAX_HEADS = 16          # HP / HG * C / (THREADS / HG) fp32 accumulators per thread: 32 at h = 16, C = 512
MIN_TILES_PER_SPLIT = 2
# (QS, VS): qabsorb splits of W_UK's C columns (until session 12: of its N rows, with QS partials summed by the
# split kernel), combine splits of W_UV's V rows (templates/mla_attention.py.jinja).
# (1, 1) runs h CTAs per kernel: 21 + 19 us of the MLA layer's ~55 us of attention kernels at M = 1 (session 3).
DEFAULT_SPLITS = (1, 1)
# Per batch bucket, measured 2026-11-29 on the H200 (benchmarks/mla_splits.py --heads 6,12 --ms 1,8,64, context
# 1024; RESULTS.md "Session 4"), all three kernels together, h = 6 / 12 heads:
#   M = 1:  16x32 22.7 / 28.2 us (1x1: 49.1 / 53.8)     M = 8: 8x8 25.4 / 31.7 (1x1: 48.2 / 53.2)
#   M = 64: 4x4 130.3 / 177.7 (1x1: 148.6 / 183.1)
# Buckets 2-4 and 16-32 were not measured: they take the neighbouring choice (8x8 is within 8% of the best at M = 1).
# Session 12 (2026-12-01, qabsorb over W_UK's columns, the combine's merge weights once; RESULTS.md "Session 12"),
# context 1024, h = 6 / 12: M = 1 8x8 13.8 / 15.8 us (16x32 18.1 / 22.8, every other of 9 candidates >= 16.0 at
# h = 6), so bucket 1 is 8x8 too. M = 2 / 8 / 16 (8x8, 32x8, 16x8): h = 6 8x8 22.9 / 27.7 / 29.9, 32x8 20.5 / 23.1 /
# 36.1; h = 12 8x8 33.2 / 38.6 / 44.6 is the best of the three. Hence SPLITS_BY_HEADS below.
# Session 32 (H200, layer_ab.py --var K3FUSE_MLA_VS=4,1, MLA + MoE M = 64, 16 splits, 8 pairs, RESULTS.md "Session
# 32"): VS 4 -> 1 TP16 -3.22 us [-6.07, -0.92], TP8 -3.75 [-11.89, -2.08], 7 / 8 each (each row split re-read the
# partials), so bucket 64 is 4x1.
SPLITS_BY_BUCKET = {1: (8, 8), 2: (8, 8), 4: (8, 8), 8: (8, 8), 16: (8, 8), 32: (4, 4), 64: (4, 1)}
# Per heads per rank where a bucket's best differs (h = 6 is K3 at TP16); bucket 4 was not timed (both neighbours
# take 32x8).
# Session 15 (2026-12-02, with the split kernel's tile pipeline, pipe_for()): the three kernels alone, h = 6 M = 8,
# took 8x8 18.3 us against 32x8 20.9 (mla_splits.py --pipe 0,1, context 1001). But the MLA TP16 M = 8 layer with
# 8x8 was 266.1 us, against 253.6 with 32x8 in the call before. That is one run each; KDA, the control, moved
# 229.0 -> 230.7. So bucket 8 stays 32x8, the choice the pipeline's layer A/B was measured with.
SPLITS_BY_HEADS = {6: {2: (32, 8), 4: (32, 8), 8: (32, 8)}}


def splits_for(M: int, h: Optional[int] = None) -> tuple:
    """The (QS, VS) of batch M with h heads per rank: SPLITS_BY_HEADS[h]'s entry for M's bucket, else
    SPLITS_BY_BUCKET's, DEFAULT_SPLITS past the last bucket."""
    b = bucket_for(M)
    if b is None:
        return DEFAULT_SPLITS
    qs, vs = SPLITS_BY_HEADS.get(h, {}).get(b) or SPLITS_BY_BUCKET.get(b, DEFAULT_SPLITS)
    # K3FUSE_MLA_VS=N (a measurement knob): the combine's row splits; each re-reads the (m, head)'s NS partials
    return qs, knobs.integer("K3FUSE_MLA_VS", 0) or vs


LOADS_IN_FLIGHT = 9     # 16-byte cache loads per thread per round (9 = a 32-token tile of 576-wide rows in one)


def _dtname(dtype) -> str:
    s = str(dtype).replace("torch.", "")
    return {"bfloat16": "BFloat16", "float32": "Float32", "BFloat16": "BFloat16", "Float32": "Float32"}[s]


def score_hpt(hp: int, tt: int = DEFAULT_TT) -> int:
    """Heads per thread in the split kernel's score step: K3FUSE_MLA_SCORE_HPT if set (a measurement knob), else
    the fewest that cover HP heads with THREADS / TT token groups; never fewer than that. Read when a kernel is
    rendered (the memo keys on it)."""
    least = -(-hp // (THREADS // tt))
    return max(least, knobs.integer("K3FUSE_MLA_SCORE_HPT", 0) or least)


def pipe_for(M: int, h: int, mma: bool = True) -> bool:
    """The split kernel's tile pipeline at batch M with h heads per rank (the loads of tile i + 1 in registers while
    tile i is worked on, the first tile's before the queries'): K3FUSE_MLA_PIPE=1 / 0 forces it on / off; unset, on,
    except at M = 1 with more than 8 heads when the score step runs on CUDA cores (mma False). Measured on the H200
    (2026-12-02, RESULTS.md "Session 15"; the three kernels alone, context 1001, mla_splits.py --pipe 0,1, CUDA-core
    scores): h = 6 M = 1 8x8 13.4 -> 12.4 us, M = 8 32x8 22.7 -> 20.9 and 8x8 26.5 -> 18.3; h = 12 M = 1 8x8
    15.8 -> 17.6 (slower), M = 8 8x8 36.5 -> 30.2. MLA layers (layer_ab.py): TP16 M = 1 -0.2 us (within the spread),
    M = 8 -2.0; TP8 M = 1 +2.5 (hence the exception), M = 8 -5.9. With the MMA score step (session 16, layer_ab
    PIPE 0 -> 1 at M = 1): TP8 -0.50 us [-0.90, -0.30], 17 / 20 pairs faster; TP16 -0.50 [-0.81, 0.17], 12 / 20. Read
    at each launch (the memo keys on the choice)."""
    v = knobs.env("K3FUSE_MLA_PIPE")
    if v:
        return v != "0"
    return mma or not (M == 1 and h > 8)


# heads per rank -> batch buckets where the split kernel's cp.async tile ring is the default (K3FUSE_MLA_ASYNC unset).
# Measured on the H200 (2026-12-04, RESULTS.md "Session 37", layer_ab.py --var K3FUSE_MLA_ASYNC=0,1 --kinds mla, 8
# ABBA pairs): TP16 (h = 6) M = 64 -7.8 us (8 / 8), 32 -4.9 (8 / 8), 16 -3.2 (8 / 8); TP8 (h = 12) M = 64 +14.1
# (1 / 8; one CTA per SM) and with mode 2 (two, ~8 spilled words) +9.3 (1 / 8): not listed.
ASYNC_BY_HEADS: dict = {6: (16, 32, 64)}


def async_for(M: int, h: int, r: int, C: int, pipe: bool, tt: int = DEFAULT_TT) -> int:
    """The split kernel's cp.async tile ring at batch M with h heads per rank: 0 off, else its mode (async_mode). The
    cache tiles go by cp.async into a ring of two shared-memory tiles, tile i + 1's copies issued before tile i is
    worked on and the first tile's before the queries', so that no tile's DRAM round trip is exposed and no registers
    hold it (PIPE holds the next tile in registers: 182-186 of them, so it runs only where the grid fits the SMs;
    s128's ncu at M = 64: 2 CTAs per SM, DRAM at 28% of peak). Only the HP real query rows are in shared memory (the
    MMA's rows HP .. 15 are zeros in registers), so with the second tile two CTAs still fit per SM up to HP = 12
    (async_two_ctas). Off where PIPE runs, or the score / PV steps are not on tensor cores.
    Read at each launch; the mode is passed to build (the memo keys on it)."""
    hp = padded_heads(h)
    return async_mode(M, h) if not pipe and pv_mma(hp, r, C, tt) else 0


def async_mode(M: int, h: int) -> int:
    """K3FUSE_MLA_ASYNC: 0 off; 1 the cp.async ring, two CTAs per SM (<= 128 registers) where HP <= 8 and one
    elsewhere; 2 also two at HP = 9-12, where the shared memory fits them but ptxas spills a few words at the
    register cap (h = 12: 8 on sm_90a; session 36, CPU); unset: 1 where ASYNC_BY_HEADS lists (h, M's bucket), else 0."""
    v = knobs.env("K3FUSE_MLA_ASYNC").strip()
    if not v:
        return int(bucket_for(M) in ASYNC_BY_HEADS.get(h, ()))
    if v not in ("0", "1", "2"):
        raise ValueError(f"K3FUSE_MLA_ASYNC={v!r}: 0, 1 or 2")
    return int(v)


def async_two_ctas(h: int, r: int, C: int, tt: int = DEFAULT_TT) -> bool:
    """Whether two CTAs of the split kernel with the cp.async ring fit an SM's 228 KB (1 KB reserved per CTA): up to
    HP = 12 at K3's widths (h = 12: 111.8 KB). Where they fit and the ring's mode allows, its launch asks for two
    (<= 128 registers)."""
    return 2 * (smem_bytes(h, r, C, tt, True) + 1024) <= 228 * 1024


def mma_scores(hp: int, r: int, C: int, tt: int = DEFAULT_TT) -> bool:
    """The split kernel's score step on tensor cores (m16n8k16 bf16 MMAs, the query as bf16 hi + lo halves), where
    HP <= 16 heads fill one MMA tile, C + r is a multiple of 32 and the tile a whole number of 8-token n-tiles over
    the 8 warps; elsewhere the CUDA-core score step. On by default (session 16: faster at every TP16 / TP8, M = 1 / 8
    cell measured); K3FUSE_MLA_MMA=0 turns it off. Read when a kernel is rendered (the memo keys on it)."""
    nwarps = THREADS // 32
    return (knobs.env("K3FUSE_MLA_MMA") != "0" and hp <= 16 and (C + r) % 32 == 0 and tt % 8 == 0
            and nwarps % (tt // 8) == 0)


def padded_heads(h: int) -> int:
    return -(-h // HG) * HG


def smem_bytes(h: int, r: int, C: int, tt: int = DEFAULT_TT, asy: bool = False) -> int:
    """Shared memory of the split kernel: scaled queries, the padded cache tile, probabilities, max / sum / alpha
    (with the MMA score step: the queries as 16 bf16 hi + lo rows, rows padded by 64 bytes, the k-shares' partial
    scores)."""
    hp = padded_heads(h)
    if mma_scores(hp, r, C, tt):
        kh = THREADS // 32 // (tt // 8)
        qrows, tiles = (hp, 2) if asy else (16, 1)     # the cp.async ring: two tiles, only the HP real query rows
        return 2 * qrows * (C + r + 32) * 2 + tiles * tt * (C + r + 32) * 2 + (1 + kh) * tt * hp * 4 + 3 * hp * 4
    return hp * (C + r) * 4 + tt * (C + r + 8) * 2 + tt * hp * 4 + 3 * hp * 4


QABSORB_THREADS = 256
MAX_SPLITS = 1024       # NS (KV splits per row) the combine's shared memory holds; n_splits() stays far below


def splits_ok(n: int, v: int, splits, C: int) -> Optional[str]:
    """None if (QS, VS) is valid for q_nope width n, v_head_dim v and latent width C: QS column splits of W_UK
    (each CTA C / QS columns = CH 16-byte chunks over 256 threads in 256 / CH n-groups, each a whole number of the n
    rows), VS row splits of W_UV (a multiple of 4 warps)."""
    qs, vs = splits
    if qs < 1 or C % (8 * qs):
        return f"qabsorb splits {qs} do not divide C / 8 = {C // 8} chunks"
    ch = C // 8 // qs
    cw = 8 * ch
    if QABSORB_THREADS % ch or n % (QABSORB_THREADS // ch):
        return f"qabsorb splits {qs}: {ch} chunks per CTA do not tile 256 threads over n={n} rows"
    if not ((QABSORB_THREADS % cw == 0 and (QABSORB_THREADS // cw) & (QABSORB_THREADS // cw - 1) == 0)
            or cw % QABSORB_THREADS == 0):
        return f"qabsorb splits {qs}: {cw} columns per CTA (not a power-of-two share of 256 threads)"
    if vs < 1 or v % (4 * vs):
        return f"combine splits {vs}: v={v} is not a multiple of 4 (warps) x {vs}"
    return None


def fit_splits(n: int, v: int, C: int, splits) -> tuple:
    """splits, or (for a latent width the bucket's QS does not tile) the largest valid QS below it, then VS likewise."""
    qs, vs = (int(x) for x in splits)
    while qs > 1 and splits_ok(n, v, (qs, 1), C):
        qs -= 1
    while vs > 1 and splits_ok(n, v, (qs, vs), C):
        vs -= 1
    return qs, vs


def supports(h: int, n: int, v: int, r: int, C: int, tt: int = DEFAULT_TT) -> Optional[str]:
    if not 1 <= h <= MAX_HEADS:
        return f"h={h} heads per rank (kernels for 1..{MAX_HEADS})"
    if C % 256 or not 256 <= C <= 1024:
        return f"kv_lora C={C} (kernels for multiples of 256 up to 1024)"
    if r % 8 or r <= 0:
        return f"rope width r={r} (a positive multiple of 8)"
    if n <= 0 or n > 512:
        return f"q_nope width n={n} (1..512)"
    if v % 4 or v <= 0:
        return f"v_head_dim v={v} (a positive multiple of 4)"
    if tt not in TILE_SIZES:
        return f"tile {tt} not in {TILE_SIZES}"
    if smem_bytes(h, r, C, tt) > 200 * 1024:
        return f"{smem_bytes(h, r, C, tt)} bytes of shared memory"
    return None


# 32 since session 22 (H200, layer_ab K3FUSE_MLA_CPRE=0,32, MLA + MoE, 10 pairs, RESULTS.md): TP16 M = 1 -1.79 us
# (10 / 10), M = 2 -0.96 (9 / 10); TP8 M = 1 -1.32 (10 / 10), M = 2 -1.32 (9 / 10)
CPRE_DEFAULT = "32"
COMBINE_THREADS = 128      # the CUDA-core combine kernel's (NT3 in the template)
MAX_CPRE_REGS = 128       # fp32 registers of preloaded partials per combine thread


def combine_preload(C: int) -> int:
    """K3FUSE_MLA_CPRE=N (default CPRE_DEFAULT): the combine loads its first N splits' partials of o_lat (each
    thread's C / NT3 columns) at its start, before the log-sum-exp pass, whose result they do not depend on; the
    rest as before. At M = 1 (NS = 32 splits of a 1024-token context) the merge otherwise pays the max / sum round
    trip and then one L2 round trip per 8 splits (the dynamic loop's unroll). Capped at MAX_CPRE_REGS registers."""
    n = knobs.integer("K3FUSE_MLA_CPRE", int(CPRE_DEFAULT))
    cpt = C // COMBINE_THREADS
    return max(0, min(n, MAX_CPRE_REGS // cpt))


CBATCH_DEFAULT = "8"       # session 33 paired A/B at M = 64: RB 8 -4.4 us TP16 (6/8), -10.1 TP8 (8/8); RB 4 -1.5 / -7.0


def combine_batch(v: int, splits) -> int:
    """K3FUSE_MLA_CBATCH=RB (default CBATCH_DEFAULT, 0 = off): where the combine does not
    hoist its W_UV rows (v / VS > 32 rows per CTA: bucket 64's 4x1), it loads them RB rows per warp at a time, the
    first batch before the merge and batch b + 1 before batch b's dot products, instead of one row per L2 round
    trip (the SASS of 4x1: 32 dependent LDG -> SHFL x5 -> STG steps per warp). 0 where it does not apply (HOIST3
    configs, or RB not dividing the warp's rows). Read when a kernel is rendered."""
    rb = knobs.integer("K3FUSE_MLA_CBATCH", int(CBATCH_DEFAULT))
    vs = int(splits[1])
    rpw = v // vs // (COMBINE_THREADS // 32)
    if rb <= 0 or v // vs <= 32 or rpw % rb or rb >= rpw:
        return 0
    return rb


CMMA_MIN_BUCKET = 16      # K3FUSE_MLA_CMMA=1 takes the tensor-core combine from this batch bucket
# heads per rank -> batch buckets where the tensor-core combine is the default (K3FUSE_MLA_CMMA unset). Measured on the
# H200 (2026-12-04, RESULTS.md "Session 34", layer_ab.py --var K3FUSE_MLA_CMMA=0,1 --kinds mla, 8 ABBA pairs): TP8
# (h = 12) M = 64 -15.6 us (8 / 8), 32 -10.3 (7 / 8), 16 -1.5 (6 / 8); TP16 (h = 6) M = 64 -3.6 (8 / 8), 32 +0.6
# (2 / 8), 16 +5.8 (0 / 8): about even at a grid of h x M / 8 = 24 CTAs (TP8 M = 16, TP16 M = 32), a win above.
# Session 37 (RESULTS.md "Session 37", K3FUSE_MLA_CMMA=0,1 with 4 tokens per CTA and the ring on): TP16 M = 32 -2.3
# (8 / 8), M = 16 -0.2 (4 / 8: not listed).
CMMA_BY_HEADS: dict = {6: (32, 64), 12: (16, 32, 64)}
CMMA_MAX_SPLITS = 64      # its per-warp merge weights in shared memory: NS <= this (n_splits() gives 16 at M = 64)
CMMA_UD = 4               # its k-steps of 32 per W_UV load group (C = 512: 4 groups, double-buffered)


def pv_mma(hp: int, r: int, C: int, tt: int = DEFAULT_TT) -> bool:
    """K3FUSE_MLA_PVMMA (default 1 since session 34; 0 = the CUDA-core PV step): the split kernel's PV step on tensor
    cores where its score step is (mma_scores) and the widths fit (C a multiple of 16 per warp, 16-token k-blocks).
    o_lat^T += C_tile^T p as m16n8k16 MMAs: each warp's C / 8 columns as 16-row m-tiles, the heads as 8-wide n-tiles,
    the tile's tokens as K; the cache tile's 8 x 8 blocks are read from shared memory as packed column pairs and
    transposed by movmatrix (the per-head kernel's way), p enters as bf16 hi + lo halves (two MMAs, ~16 bits of p).
    Why: the CUDA-core PV step issued per thread and tile TT x HH x CPT FMAs plus TT x HH shared-memory reads of p.
    Measured (H200, 2026-12-04, RESULTS.md "Session 34", layer_ab MLA + MoE, 8 pairs): TP8 M = 64 -13.2 us (8 / 8;
    -15.0 on top of CMMA), 32 -6.3, 16 -3.9, 1 -0.8 (7 / 8); TP16 M = 64 -0.5 (5 / 8), 32 -0.9, 16 -0.6: neutral at
    TP16, so one default. The partial's sums change order (MMA accumulation): not bitwise, within 1e-4 of the CUDA-core
    step (tests/test_mla_kernel_gpu.py). Read when a kernel is rendered."""
    nwarps = THREADS // 32
    return (knobs.env("K3FUSE_MLA_PVMMA") != "0" and mma_scores(hp, r, C, tt) and C % (16 * nwarps) == 0
            and tt % 16 == 0)


# Targets whose ptxas fits the PV step's two 16-token k-blocks unrolled in the split kernel's 128 registers (two CTAs
# per SM) at h = 12: sm_90a (no spills). For sm_100a the unrolled loop spilled 8 bytes (CPU compile, session 34), so
# other targets get a rolled loop. On the H200 the rolled loop measured TP8 M = 64 -9.3 us / M = 32 -3.6 against the
# CUDA-core step (8 / 8 each), the unrolled -13.2 / -6.3.
PV_UNROLL_ARCHES = ("sm_90a",)


def pv_unroll(arch: Optional[str]) -> bool:
    """Whether the PV step's k-blocks are unrolled for arch (None: the H200's sm_90a, where it was measured)."""
    return arch is None or arch in PV_UNROLL_ARCHES


def combine_mma_reason(v: int, C: int, tok: int = 8) -> Optional[str]:
    """None if the tensor-core combine (template CMMA) takes these widths, else why not: 8 warps merge the 8 tokens
    of a CTA and each owns a 16-row tile of W_UV, a lane C / 32 columns (16-byte vectors of bf16). With 4 tokens per
    CTA (combine_mma_tokens) the v / 16 warps share each token's columns: v / 64 warps a token, C / 256 a multiple
    of that."""
    if v % 16 or not 8 <= v // 16 <= 32:
        return f"v = {v}: the tensor-core combine takes 8-32 tiles of 16 rows"
    if C % 256 or C % (32 * CMMA_UD):
        return f"C = {C}: the tensor-core combine takes multiples of 256"
    if tok != 8 and ((v // 16) % tok or C % (256 * (v // 16 // tok))):
        return f"v = {v}, C = {C}: {tok} tokens per CTA need v / 16 warps a multiple of {tok} sharing C in 8-column lanes"
    return None


CMMA_TOKENS = (8, 4)      # tokens per tensor-core-combine CTA K3FUSE_MLA_CMMA_TOK takes (8: the MMA's n-tile)
# heads per rank -> batch buckets where the tensor-core combine takes 4 tokens per CTA (K3FUSE_MLA_CMMA_TOK unset).
# Measured on the H200 (2026-12-04, RESULTS.md "Session 37", layer_ab.py --var K3FUSE_MLA_CMMA_TOK=8,4 --kinds mla,
# 8 ABBA pairs): TP16 (h = 6) M = 64 -3.0 us (8 / 8); TP8 (h = 12) M = 64 -2.5 (6 / 8), 32 -3.1 (7 / 8), 16 -6.5
# (7 / 8). h = 6 bucket 32: measured only with 4 tokens (CMMA_BY_HEADS).
CMMA_TOK_BY_HEADS: dict = {6: (32, 64), 12: (16, 32, 64)}


def combine_mma_tokens(M: int, h: int) -> int:
    """Tokens per CTA of the tensor-core combine at batch M with h heads per rank: 4 (twice the CTAs: 48 -> 96 at
    TP16 M = 64, where ncu showed the 8-token combine long-scoreboard bound at 12% warps active; two warps merge each
    token's halves of the columns, W_UV crosses L2 twice as often) or 8 (the MMA's n-tile). K3FUSE_MLA_CMMA_TOK=8 / 4
    forces it; unset: 4 where CMMA_TOK_BY_HEADS lists (h, M's bucket). Read at each launch; passed to build (the memo
    and the source's MT3 follow it, and the launcher's grid follows MT3). Both render one merge (template CTOK,
    session 39): with 8, WPT3 = 1 and warps past the 8th (v > 128) repeat a token's merge, storing the same values;
    at v = 128 its PTX is the former 8-token branch's, byte for byte (sm_90a)."""
    v = knobs.env("K3FUSE_MLA_CMMA_TOK").strip()
    if not v:
        return 4 if bucket_for(M) in CMMA_TOK_BY_HEADS.get(h, ()) else 8
    tok = int(v) if v.isdigit() else 0
    if tok not in CMMA_TOKENS:
        raise ValueError(f"K3FUSE_MLA_CMMA_TOK={v!r}: one of {CMMA_TOKENS}")
    return tok


def combine_mma_choice(M: int, h: int) -> bool:
    """The three launches' combine on tensor cores (template CMMA, session 33): one CTA per (head, 8 tokens), 8 warps:
    warp w merges token w's NS partials (log-sum-exp by warp shuffles, no CTA barrier) and rounds o_lat to bf16 into
    shared memory, then owns a 16-row tile of W_UV[hd] as the A operand of m16n8k16 MMAs over the 8 tokens, its load
    groups double-buffered, the first issued before the merge. W_UV[hd] leaves L2 once per 8 tokens instead of once
    per token, and the CUDA-core GEMV's serial row steps per warp are gone. o_lat is rounded to bf16 before W_UV (the
    fp32 combine does not round it): not bitwise the CUDA-core combine, within the tests' 1e-2.
    K3FUSE_MLA_CMMA=1: from bucket CMMA_MIN_BUCKET; 0: nowhere; unset: where CMMA_BY_HEADS lists (h, M's bucket)."""
    b = bucket_for(M)
    v = knobs.env("K3FUSE_MLA_CMMA")
    if v:
        return v != "0" and b is not None and b >= CMMA_MIN_BUCKET
    return b in CMMA_BY_HEADS.get(h, ())


def combine_mma_on(M: int, h: int, v: int, C: int, ns: int) -> bool:
    """The launcher's rule for the tensor-core combine (also what `k3fuse kernels` plans): NS within CMMA_MAX_SPLITS,
    combine_mma_choice and widths it takes."""
    return ns <= CMMA_MAX_SPLITS and combine_mma_choice(M, h) and combine_mma_reason(v, C) is None


CMMA_PRE_MAX_REGS = 40    # K3FUSE_MLA_CMMA_PRE's preloaded partials per lane (fp32 registers): 5 splits at CPW3 = 8


def combine_mma_pre(v: int, C: int, ctok: int) -> int:
    """K3FUSE_MLA_CMMA_PRE=N (default 5 since session 43; 0: off): the tensor-core combine with CTOK (4 tokens per
    CTA) issues at its start the loads that do not depend on its merge: the gate values of its C fragment (in the
    epilogue 4 serial L2 round trips, one per output store: codegen/sass.py on the sm_90a SASS) and the first N
    splits' partials (capped at CMMA_PRE_MAX_REGS registers); each split's (max, sum) pair in one pass instead of two;
    the other partials in chunks of 4 splits without a remainder loop. The same sums in the same order: bitwise
    (tests/test_mla_kernel_gpu.py). Serial global round trips (codegen/sass.py, sm_90a, TP16 bucket 64): the most on
    a control-flow path 15 -> 6 with N = 5. Measured with WG_GATHER: -1.2..-4.7 us per MLA layer at M = 16, 64
    (s155). Read when a kernel is rendered."""
    n = knobs.integer("K3FUSE_MLA_CMMA_PRE", int(knobs.KNOBS["K3FUSE_MLA_CMMA_PRE"].unset))   # set empty: the default
    if n <= 0 or ctok == 8 or combine_mma_reason(v, C, ctok) is not None:
        return 0
    cpw = C // (32 * ((v // 16) // ctok))
    return max(1, min(n, CMMA_PRE_MAX_REGS // cpw))


def combine_tokens_for(M: int, h: int, v: int, C: int) -> int:
    """The tensor-core combine's tokens per CTA the launcher takes: combine_mma_tokens, or 8 where the widths do not
    share columns among 4 tokens (combine_mma_reason)."""
    tok = combine_mma_tokens(M, h)
    return tok if combine_mma_reason(v, C, tok) is None else 8


def template_params(h: int, n: int, v: int, r: int, C: int, scale: float, q_dtype="bfloat16",
                    tt: int = DEFAULT_TT, splits=DEFAULT_SPLITS, append_eps: Optional[float] = None,
                    gate: bool = False, out_dtype="float32", pipe: bool = False,
                    cmma: bool = False, arch: Optional[str] = None, asy: int = 0, ctok: int = 8) -> dict:
    hp = padded_heads(h)
    rb3 = combine_batch(v, splits)
    nch = (C + r) // 8
    unroll = next(u for u in (8, 4, 2, 1) if nch % u == 0)   # score loop over the row's 16-byte chunks
    nld = -(-tt * nch // THREADS)
    pre3 = combine_mma_pre(v, C, ctok) if cmma else 0
    return dict(H=h, HP=hp, N=n, V=v, R=r, C=C, TT=tt, THREADS=THREADS, HPT=score_hpt(hp, tt),
                PIPE=bool(pipe) and nld <= LOADS_IN_FLIGHT, MMA=mma_scores(hp, r, C, tt), HG=HG, HH=hp // HG,
                CPT=C // (THREADS // HG), UNROLL_S=unroll, LDG=LOADS_IN_FLIGHT, SCALE=repr(float(scale)), QDT=_dtname(q_dtype),
                QS=int(splits[0]), VS=int(splits[1]), NT1=QABSORB_THREADS, HOIST3=v // int(splits[1]) <= 32,
                MAX_SPLITS=MAX_SPLITS,
                APPEND=append_eps is not None,
                EPS=repr(float(append_eps)) if append_eps is not None else None, GATE=bool(gate), ODT=_dtname(out_dtype),
                CPRE=combine_preload(C),
                **({"RB3": rb3} if rb3 else {}),      # absent when off: the same source
                **(dict(CMMA=True, UD3=CMMA_UD, MAX_SPLITS3=CMMA_MAX_SPLITS) if cmma else {}),
                **({"CTOK": int(ctok)} if cmma else {}),
                **({"PRE3": pre3} if pre3 else {}),
                **({"PVMMA": True} if pv_mma(hp, r, C, tt) else {}),
                **({"ASYNC": True, "ASYNC_2CTA": async_two_ctas(h, r, C, tt) and (hp <= 8 or asy == 2)}
                   if asy else {}),                                                # absent when off: the same source
                **({"PV_UNROLL": False} if pv_mma(hp, r, C, tt) and not pv_unroll(arch) else {}))


def render_source(h: int, n: int, v: int, r: int, C: int, scale: float, q_dtype="bfloat16",
                  tt: int = DEFAULT_TT, splits=DEFAULT_SPLITS, append_eps: Optional[float] = None,
                  gate: bool = False, out_dtype="float32", pipe: bool = False,
                  cmma: bool = False, arch: Optional[str] = None, asy: int = 0, ctok: int = 8) -> str:
    """append_eps: the mla_append_attention_ variant (the cache append in qabsorb, with kv_a_layernorm's eps);
    gate: the output gate in combine; out_dtype: o's dtype (float32, or bfloat16 with the fused cast); pipe: the
    split kernel's tile pipeline; cmma: the tensor-core combine (combine_mma_choice); arch: the target (pv_unroll); asy:
    the split kernel's cp.async tile ring, 0 off or its mode 1 / 2 (async_for: no PIPE, the score and PV steps on
    tensor cores); ctok: the tensor-core combine's tokens per CTA (combine_tokens_for)."""
    why = supports(h, n, v, r, C, tt) or splits_ok(n, v, splits, C)
    if ctok not in CMMA_TOKENS:
        why = why or f"{ctok} tokens per tensor-core-combine CTA: one of {CMMA_TOKENS}"
    if cmma:
        why = why or combine_mma_reason(v, C, ctok)
    if asy not in (0, 1, 2):
        why = why or f"cp.async tile ring mode {asy!r}: 0, 1 or 2"
    if asy:
        why = why or ((pipe or not pv_mma(padded_heads(h), r, C, tt))
                      and "the cp.async tile ring takes no PIPE, the score and PV steps on tensor cores")
        why = why or (smem_bytes(h, r, C, tt, True) > 200 * 1024 and
                      f"{smem_bytes(h, r, C, tt, True)} bytes of shared memory with the cp.async tile ring")
    if why:
        raise ValueError(why)
    return render(TEMPLATE, **template_params(h, n, v, r, C, scale, q_dtype, tt, splits, append_eps, gate,
                                              out_dtype, pipe, cmma, arch, int(asy), int(ctok)))


_built: dict = {}


def build(h: int = 12, n: int = 128, v: int = 128, r: int = 64, C: int = 512, scale: float = 192 ** -0.5,
          q_dtype="bfloat16", tt: int = DEFAULT_TT, arch: Optional[str] = None, load: bool = True,
          splits=DEFAULT_SPLITS, append_eps: Optional[float] = None, gate: bool = False, out_dtype="float32",
          pipe: bool = False, cmma: bool = False, asy: int = 0, ctok: int = 8):
    """Compile (through the disk cache) the kernel for (h, n, v, r, C, scale, q dtype, tile, the append / gate
    variant, the combine on tensor cores or not and its tokens per CTA (ctok), the
    split kernel's cp.async ring mode (asy: 0 off)) and arch. The rendered source
    bakes every one of these, so the cache key (sha256 of source + arch) covers them."""
    from .compile import compile_source, current_arch
    arch = arch or current_arch()
    splits = tuple(int(x) for x in splits)
    eps = float(append_eps) if append_eps is not None else None
    # the arguments and the family's variables determine the source (every choice read at render is a function of
    # them: tests/test_knobs.py), so nothing derived from them belongs in the key
    memo = (h, n, v, r, C, float(scale), _dtname(q_dtype), tt, arch, load, splits, eps, bool(gate),
            _dtname(out_dtype), bool(pipe), bool(cmma), int(ctok) if cmma else 8, int(asy), knobs.key(FAMILY))
    if memo in _built:
        return _built[memo]
    pre3 = combine_mma_pre(v, C, ctok) if cmma else 0
    src = render_source(h, n, v, r, C, scale, q_dtype, tt, splits, eps, gate, out_dtype, pipe, cmma, arch, asy, ctok)
    op = OP_APPEND if eps is not None else OP
    meta = dict(family=FAMILY, op=op, shape=dict(h=h, n=n, v=v, r=r, C=C), template=TEMPLATE,
                config=dict(tt=tt, threads=THREADS, q=_dtname(q_dtype), scale=float(scale), splits=list(splits),
                            append_eps=eps, gate=bool(gate), out=_dtname(out_dtype),
                            pipe=bool(pipe), **({"combine_mma": True} if cmma else {}),
                            **({"cp_async_tiles": True} if asy else {}),
                            **({"combine_mma_tokens": int(ctok)} if cmma and ctok != 8 else {}),
                            **({"combine_mma_pre": pre3} if pre3 else {})))
    _built[memo] = k = compile_source(src, arch, load=load, meta=meta)
    return k


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    import torch
    return torch.cuda.get_device_properties(index).multi_processor_count


# The split kernel's CTAs per SM that n_splits aims at, per batch bucket (default 2). Session 32 (H200, layer_ab.py
# --var K3FUSE_MLA_CTAS_PER_SM=2,8, MLA + MoE, 8 pairs, RESULTS.md "Session 32"): at M = 64 (5 -> 16 splits of a
# 1024-token context) TP16 -13.8 us (8 / 8), TP8 -8.7 (8 / 8); at M = 32 (9 -> 16) +2.8 / +4.1, so not there.
CTAS_PER_SM_BY_BUCKET = {64: 8}
# heads per rank -> {bucket: CTAs per SM} over CTAS_PER_SM_BY_BUCKET. Session 37 (layer_ab.py --var
# K3FUSE_MLA_CTAS_PER_SM=8,4, 8 pairs): TP16 (h = 6, with the cp.async ring of ASYNC_BY_HEADS: longer splits keep
# the next tile in flight) M = 64 -4.3 us (8 / 8), NS 16 -> 9.
CTAS_PER_SM_BY_HEADS: dict = {6: {64: 4}}


def ctas_per_sm(M: int = 1, h: Optional[int] = None) -> int:
    """K3FUSE_MLA_CTAS_PER_SM=N (a measurement knob; default CTAS_PER_SM_BY_HEADS for h and M's bucket, else
    CTAS_PER_SM_BY_BUCKET for the bucket, else 2): the split kernel's CTAs per SM that n_splits aims at. Read at every
    launch (NS is a runtime value: no recompile). K3FUSE_MLA_MIN_TILES (default MIN_TILES_PER_SPLIT) likewise sets
    the fewest tiles per split at M > 1."""
    if knobs.env("K3FUSE_MLA_CTAS_PER_SM"):
        return max(1, knobs.integer("K3FUSE_MLA_CTAS_PER_SM", 0))
    b = bucket_for(M)
    return CTAS_PER_SM_BY_HEADS.get(h, {}).get(b) or CTAS_PER_SM_BY_BUCKET.get(b, 2)


def n_splits(M: int, T: int, sms: int = 132, tt: int = DEFAULT_TT, h: Optional[int] = None) -> int:
    """Splits of T per token row: about ctas_per_sm(M) CTAs per SM in all (2; 8 at bucket 64), at least
    MIN_TILES_PER_SPLIT tiles per split (one at M = 1: 16 -> 32 splits of a 1024-token context took the three kernels 22.8 -> 19.4 us at h = 6 and 28.0 ->
    22.7 us at h = 12 on the H200; at M = 8, 32 instead of 16 splits was 2-6% slower: benchmarks/mla_splits.py
    --kv-splits, RESULTS.md session 4)."""
    ntiles = -(-T // tt)
    want = -(-ctas_per_sm(M, h) * sms // max(M, 1))
    min_tiles = 1 if M == 1 else knobs.integer("K3FUSE_MLA_MIN_TILES", MIN_TILES_PER_SPLIT)
    return max(1, min(want, -(-ntiles // min_tiles)))


def head_groups(h: int) -> int:
    """Launches for h heads per rank: 1 up to MAX_HEADS; above (TP < 8: 24 or 48 heads), the fewest equal groups of
    <= MAX_HEADS heads, one launch each (each re-reads the latent cache, which all heads share: a fallback for small
    TP, not the fast path); 0 when h does not split evenly."""
    if h <= MAX_HEADS:
        return 1
    g = -(-h // MAX_HEADS)
    return g if h % g == 0 else 0


def launch_ok(q_nope, q_pe, cache, kv_b, seq_lens) -> Optional[str]:
    """None if the kernel takes these inputs (after the cheap fixes mla_attention() makes), else the reason."""
    import torch
    if q_nope.dim() != 3 or q_pe.dim() != 3 or cache.dim() != 3 or kv_b.dim() != 2:
        return "q_nope / q_pe / cache must be 3-D, kv_b 2-D"
    M, h, n = q_nope.shape
    r = q_pe.shape[2]
    C = kv_b.shape[1]
    if M == 0 or h == 0 or cache.shape[1] == 0:
        return "empty input"
    if tuple(q_pe.shape[:2]) != (M, h) or cache.shape[0] != M or cache.shape[2] != C + r:
        return f"shapes q_pe {tuple(q_pe.shape)} / cache {tuple(cache.shape)} do not match q_nope / kv_b"
    if kv_b.shape[0] % h or kv_b.shape[0] // h <= n:
        return f"kv_b rows {kv_b.shape[0]} are not h * (n + v)"
    v = kv_b.shape[0] // h - n
    why = supports(h, n, v, r, C)
    if why:
        return why
    if seq_lens.dim() != 1 or seq_lens.numel() != M:
        return "seq_lens must be [M]"
    if cache.dtype != torch.bfloat16 or kv_b.dtype != torch.bfloat16:
        return f"cache / kv_b dtypes {cache.dtype} / {kv_b.dtype} (kernels take bf16)"
    if q_nope.dtype not in (torch.bfloat16, torch.float32) or q_pe.dtype != q_nope.dtype:
        return f"q dtypes {q_nope.dtype} / {q_pe.dtype} (kernels take bf16 or fp32, the same for both)"
    if seq_lens.dtype not in (torch.int64, torch.int32):
        return f"seq_lens dtype {seq_lens.dtype}"
    if not (cache.is_contiguous() and cache.data_ptr() % 16 == 0):
        return "cache must be contiguous and 16-byte aligned"
    if any(t.device != cache.device for t in (q_nope, q_pe, kv_b, seq_lens)):
        return "inputs on different devices"
    if cache.numel() >= 2 ** 31:
        return "cache too large for 32-bit indexing"
    return None


def _prep(t, dtype=None):
    """t as a contiguous, 16-byte aligned tensor (a copy only when it is not already one)."""
    import torch
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if not t.is_contiguous() or t.data_ptr() % 16:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _prep_q(t):
    """q_nope / q_pe as they come (strided slices of q are fine: the kernel reads them by element) unless the inner
    stride is not 1."""
    import torch
    if t.stride(-1) != 1:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def mla_attention(q_nope, q_pe, cache, kv_b, seq_lens, scale, out=None, n_split: Optional[int] = None,
                  splits=None, append=None, gate=None, out_dtype=None, heads: Optional[bool] = None):
    """Launch the kernels (caller checked launch_ok(), and append_ok() for append / gate). Returns o [M, h, v] fp32
    (out_dtype if given). splits: (QS, VS), default splits_for(M, h). append: (ckv [M, C + r], kv_norm_w [C], eps): the
    new token's row is written into the cache first (mla_append_attention_); gate [M, h * v]: o * sigmoid(gate).
    heads: the per-head variant (default heads_choice(); taken where heads_reason() allows it; n_split is then its
    splits per (row, head))."""
    import torch
    M, h, n = q_nope.shape
    r = q_pe.shape[2]
    C = kv_b.shape[1]
    v = kv_b.shape[0] // h - n
    T = cache.shape[1]
    hp = padded_heads(h)
    dev = cache.device
    chosen = bool(splits)     # the caller picked the three launches' splits
    splits = tuple(splits) if splits else fit_splits(n, v, C, splits_for(M, h))
    odt = out_dtype or torch.float32
    sms = _sm_count(dev.index if dev.index is not None else torch.cuda.current_device())
    if heads is None:
        heads = not chosen and heads_choice(M, h)
    if heads and heads_reason(M, h, n, v, r, C, sms) is None:
        return _launch_heads(q_nope, q_pe, cache, kv_b, seq_lens, scale, out, n_split or heads_splits(M, h, T, sms),
                             append, gate, odt)
    ns = n_split or n_splits(M, T, sms, h=h)
    if not 1 <= ns <= MAX_SPLITS:
        raise ValueError(f"{ns} KV splits (the combine kernel takes 1..{MAX_SPLITS})")
    # the pipeline's registers (148 at h = 12, 182-186 with MMA scores, against <= 128 without) leave one CTA per
    # SM: where the grid fits
    pipe = pipe_for(M, h, mma_scores(padded_heads(h), r, C)) and M * ns <= sms
    cmma = combine_mma_on(M, h, v, C, ns)
    asy = async_for(M, h, r, C, pipe)
    kern = build(h, n, v, r, C, float(scale), q_nope.dtype, splits=splits,
                 append_eps=append[2] if append is not None else None, gate=gate is not None, out_dtype=odt, pipe=pipe,
                 cmma=cmma, asy=asy, ctok=combine_tokens_for(M, h, v, C) if cmma else 8)
    f32 = torch.float32
    qn, qp = _prep_q(q_nope), _prep_q(q_pe)
    w = _prep(kv_b).view(h, n + v, C)
    sl = _prep(seq_lens, torch.int64)
    qs = torch.empty(M, hp, C + r, dtype=f32, device=dev)                 # the scaled queries
    opart = torch.empty(M, ns, hp, C, dtype=f32, device=dev)
    ml = torch.empty(M, ns, hp, 2, dtype=f32, device=dev)
    if out is None:
        out = torch.empty(M, h, v, dtype=odt, device=dev)
    extra = _append_gate_args(M, h, v, append, gate)
    kern(qn, qp, cache, w, sl, qs, opart, ml, out, *extra)
    return out


# The per-head variant (templates/mla_attention_heads.py.jinja): one launch, a CTA per (split, head, token row) that
# absorbs its own head's query (W_UK[hd] brought into shared memory by the copy engine before the chain's wait),
# attends to its split of the tokens, applies W_UV[hd] to its partial and arrives on a per-(row, head) counter; the
# last split merges. No grid barrier, no qabsorb / combine launches: 3 -> 1 kernel per MLA layer. Costs: every
# split re-reads W_UK[hd] and W_UV[hd] (256 KB, from L2 after the first), ~150 KB of shared memory (one CTA per SM).
# K3FUSE_MLA_HEADS=1 everywhere it applies, 0 nowhere; unset: where HEADS_BY_HEADS lists the heads per rank ->
# batch buckets in which a measurement made it the default.
HEADS_TEMPLATE = "mla_attention_heads.py.jinja"
HEADS_MAX_NS = 64       # splits per (row, head): the merge's 8 warps x 8 partials
HEADS_TT = 32
# heads per rank -> batch buckets where the per-head kernel is the default (K3FUSE_MLA_HEADS unset). Measured on the
# H200 (2026-12-03, RESULTS.md "Session 24", layer_ab.py --var K3FUSE_MLA_HEADS=0,1 --kinds mla, 16 ABBA pairs, with
# the weight rows split over a cluster): TP16 (h = 6) M = 2 -2.09 us [-2.38, -1.67], 16 / 16 faster (alone: 11.06
# against 12.96 us); M = 1 +1.05 (2 / 16); TP8 (h = 12) M = 1 -0.80 (13 / 16) in one process, +0.43 (5 / 16) in the
# next, M = 2 +1.03 (4 / 16). Buckets 4 and up were not measured.
# Session 26 (2026-12-03, RESULTS.md "Session 26", 16 pairs, with each rank merging C / CL columns): TP16 M = 1 with
# clusters of 16 (HEADS_CL_BY_HEADS) and q inside, against the three launches + the q_b GEMV: -0.28 us [-0.68, +0.13]
# (11 / 16), and +0.01 [-0.85, +0.56] (12 / 24) from the table: time-neutral and three launches fewer (11 -> 8 per MLA
# layer), so on; TP8 M = 1 (clusters of 8) +0.94 (3 / 16), off; TP16 M = 2 -3.06 (16 / 16).
HEADS_BY_HEADS: dict = {6: (1, 2)}
HEADS_CTR_SLOTS = 64 * MAX_HEADS      # the arrival counters per device: M * h <= this
HEADS_CL = 8            # the largest cluster: the splits of one (head, row), each CTA with its 1 / CL of W_UK and
                        # W_UV, merged in distributed shared memory; 8 is the portable cluster size.
                        # K3FUSE_MLA_HEADS_CL overrides it (1: no clusters; splits merged by the counters).
HEADS_CL_BY_HEADS: dict = {6: {1: 16}}   # heads per rank -> bucket -> the largest cluster there, where not
                        # HEADS_CL (K3FUSE_MLA_HEADS_CL overrides): measured above (TP16 M = 1)
HEADS_CL_MAX = 16       # the knob's ceiling: 16 is Hopper's non-portable cluster size (CuTe DSL sets
                        # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED on every kernel it loads); a cluster
                        # of 16 runs only where a GPC has 16 free SMs.


def heads_supports(h: int, n: int, v: int, r: int, C: int) -> Optional[str]:
    """None if the per-head kernel's thread mappings cover these sizes, else why not."""
    cch = C // 8
    if C % 256 or THREADS % cch:
        return f"C = {C}: the per-head kernel needs C / 8 to divide {THREADS} and C % 256 == 0"
    if (C + r) % (8 * (THREADS // HEADS_TT)):
        return f"C + r = {C + r} is not a multiple of {8 * (THREADS // HEADS_TT)}"
    if n % (THREADS // cch) or n % 32 or v != 128:
        return f"n = {n} / v = {v} (the per-head kernel: n a multiple of 32, v = 128)"
    if max(n, v) * C * 2 + 4 * (8 * C + 2 * C + 2 * (C + r)) > 200 * 1024:
        return f"W_UK / W_UV rows of {C} bf16 do not fit one CTA's shared memory"
    return None


def heads_cl(M: Optional[int] = None, h: Optional[int] = None) -> int:
    """The largest cluster of the per-head kernel: K3FUSE_MLA_HEADS_CL, else HEADS_CL_BY_HEADS at (h, M's bucket),
    else HEADS_CL."""
    v = knobs.env("K3FUSE_MLA_HEADS_CL")
    if not v and M is not None and h is not None:
        v = HEADS_CL_BY_HEADS.get(h, {}).get(bucket_for(M), "")
    return max(1, min(HEADS_CL_MAX, int(v or HEADS_CL)))


def heads_cluster(ns: int, M: Optional[int] = None, h: Optional[int] = None) -> int:
    """CTAs per cluster for ns splits of M rows x h heads: ns itself where it is a power of two in 2 .. heads_cl(M, h)
    (the cluster is all the splits of a (head, row)), else 1."""
    return ns if 2 <= ns <= heads_cl(M, h) and ns & (ns - 1) == 0 else 1


def heads_splits(M: int, h: int, T: int, sms: int = 132) -> int:
    """Splits of T per (row, head). With clusters (heads_cl(M, h) > 1): the largest power of two <= it that
    keeps one wave (M * h * NS <= sms) and a tile per split, if that is >= 2. Otherwise one wave of one CTA per SM,
    at least one 32-token tile each, at most HEADS_MAX_NS (merged by the counters)."""
    ntiles = -(-T // HEADS_TT)
    cl = heads_cl(M, h)
    while cl >= 2 and (M * h * cl > sms or cl > ntiles):
        cl //= 2
    if cl >= 2:
        return cl
    return max(1, min(HEADS_MAX_NS, sms // max(1, M * h), ntiles))


def heads_choice(M: int, h: int) -> bool:
    """K3FUSE_MLA_HEADS=1 / 0: the per-head kernel wherever it applies / nowhere; unset: where HEADS_BY_HEADS lists
    (h, M's bucket)."""
    v = knobs.env("K3FUSE_MLA_HEADS")
    if v:
        return v != "0"
    return bucket_for(M) in HEADS_BY_HEADS.get(h, ())


def heads_reason(M: int, h: int, n: int, v: int, r: int, C: int, sms: int) -> Optional[str]:
    """None if the per-head kernel takes this launch, else why not (it would run more than one wave)."""
    why = heads_supports(h, n, v, r, C)
    if why:
        return why
    if M * h > sms or M * h > HEADS_CTR_SLOTS:
        return f"M * h = {M * h} (row, head) pairs: more than one CTA per SM before any split"
    return None


def qb_supports(n: int, v: int, r: int, C: int, ql: int, cl: int) -> Optional[str]:
    """None if the per-head kernel with a cluster of cl can compute q itself (mla_qb_append_attention_), else why
    not: each rank takes n / cl + r / cl rows of W_qb ([h * (n + r), ql]) into shared memory, one row per thread."""
    if cl < 2:
        return "the query's projection runs in the kernel only with clusters (the rows split over the ranks)"
    if n % cl or r % cl:
        return f"a cluster of {cl} does not split n = {n} / r = {r} rows of W_qb"
    if ql % 256 or ql // 8 > THREADS:
        return f"q_lora = {ql}: the kernel needs a multiple of 256, at most {8 * THREADS}"
    rows = n // cl + r // cl
    if n // cl + v // cl + rows > THREADS or rows * ql * 2 + (n // cl + v // cl) * C * 2 + 4 * (12 * C + ql) > \
            200 * 1024:
        return f"{rows} rows of W_qb ({ql} wide) per CTA do not fit its shared memory at a cluster of {cl}"
    return None


def heads_params(h, n, v, r, C, scale, q_dtype="bfloat16", append_eps=None, gate=False, out_dtype="float32",
                 cl: int = 1, qb: Optional[tuple] = None) -> dict:
    """qb: (q_lora, q_eps) for the variant that computes q itself (mla_qb_append_attention_)."""
    if n % cl or v % cl or (n // cl) % (THREADS // (C // 8)) or n // cl + v // cl > THREADS:
        raise ValueError(f"a cluster of {cl} does not split n = {n} / v = {v} rows")
    if qb is not None:
        why = qb_supports(n, v, r, C, int(qb[0]), cl)
        if why:
            raise ValueError(why)
    return dict(H=h, N=n, V=v, R=r, C=C, TT=HEADS_TT, THREADS=THREADS, MAX_NS=HEADS_MAX_NS, SCALE=repr(float(scale)),
                CL=int(cl), QB=qb is not None, QL=int(qb[0]) if qb else 0, QEPS=repr(float(qb[1])) if qb else None,
                **({"STAMPS": True} if stamps_on() and cl > 1 else {}),     # absent when off: the same source
                **({"PUSH": True} if push_on() and cl > 1 else {}),
                **({"MMA": True} if heads_mma(r, C) else {}),
                **({"QFIRST": True} if qfirst_on() and qb is not None else {}),
                QDT=_dtname(q_dtype), ODT=_dtname(out_dtype), APPEND=append_eps is not None,
                EPS=repr(float(append_eps)) if append_eps is not None else None, GATE=bool(gate))


def stamps_on() -> bool:
    """K3FUSE_MLA_STAMPS=1 (diagnostic): the per-head kernel with clusters writes each CTA's phase timestamps into its
    partials buffer (unused with clusters), and the launcher keeps every such buffer in STAMP_BUFS for
    benchmarks/mla_timeline.py. Read when a kernel is rendered and launched."""
    return knobs.env("K3FUSE_MLA_STAMPS") == "1"


def push_on() -> bool:
    """K3FUSE_MLA_PUSH (default 1): the per-head kernel with clusters gathers the partial queries and the splits'
    partials by st.async pushes into each owner's shared memory, completing on its mbarriers; 0: distributed shared
    memory loads between four cluster barriers (each a MEMBAR.ALL.GPU in the SASS; H200, TP16 M = 1: -2.3 us per MLA
    layer, 16 / 16 pairs, PERF_NOTES "Session 27"). Read when a kernel is rendered."""
    return knobs.env("K3FUSE_MLA_PUSH") != "0"


def heads_mma_on() -> bool:
    """K3FUSE_MLA_HEADS_MMA (default 1): the per-head kernel's tiles on tensor cores (score and PV as m16n8k16 MMAs
    with the query's and p's bf16 high / low halves as two B columns, the rows' registers transposed by movmatrix for
    PV), where heads_mma_supports allows; 0: on CUDA cores in fp32. H200, 2026-12-03 (RESULTS.md "Session 28", 16
    ABBA pairs): TP16 M = 1 -1.64 us [-2.36, -0.91] per MLA layer, 16 / 16 faster; TP16 M = 2 -1.64 [-3.48, -0.66],
    13 / 16. Read when a kernel is rendered."""
    return knobs.env("K3FUSE_MLA_HEADS_MMA") != "0"


def qfirst_on() -> bool:
    """K3FUSE_MLA_QFIRST (default 1): the per-head kernel that computes q itself loads cq[m] and the q_a norm weight
    before the first tile's cache rows (40 KB per CTA, issued right after the chain's wait; their issue takes ~1600 SM
    clocks) instead of after them: cq lands ~950 clocks sooner (H200 stamps, TP16 M = 1), the layer -1.06 us [-2.21,
    -0.47], 13 / 16 pairs at TP16 M = 1, -0.30 [-0.98, +0.36] at M = 2 (RESULTS.md "Session 29"). 0: after them.
    Read when a kernel is rendered."""
    return knobs.env("K3FUSE_MLA_QFIRST") != "0"


def heads_mma_supports(r: int, C: int) -> Optional[str]:
    """None if the tensor-core tiles cover these widths: 8 warps as 2 token blocks of 16 x 4 groups of latent
    32-column steps, rope in 32-column steps; else why not."""
    ndg = THREADS // 32 // 2
    if HEADS_TT != 32 or C % (32 * ndg) or r % 32:
        return f"C = {C} / r = {r}: the MMA tiles need C a multiple of {32 * ndg}, r of 32 (tiles of 32 tokens)"
    return None


def heads_mma(r: int, C: int) -> bool:
    """Whether a per-head kernel of these widths gets the tensor-core tiles (the knob on and the widths covered)."""
    return heads_mma_on() and heads_mma_supports(r, C) is None


STAMP_BUFS = collections.deque(maxlen=64)   # the partials buffers of the last launches with stamps, oldest first


def build_heads(h: int = 12, n: int = 128, v: int = 128, r: int = 64, C: int = 512, scale: float = 192 ** -0.5,
                q_dtype="bfloat16", arch: Optional[str] = None, load: bool = True, append_eps: Optional[float] = None,
                gate: bool = False, out_dtype="float32", cl: int = 1, qb: Optional[tuple] = None):
    """Compile (through the disk cache) the per-head kernel (cl: CTAs per cluster; qb: (q_lora, q_eps) where it
    computes q itself); the rendered source bakes every argument."""
    from .compile import compile_source, current_arch
    arch = arch or current_arch()
    eps = float(append_eps) if append_eps is not None else None
    qb = (int(qb[0]), float(qb[1])) if qb is not None else None
    memo = ("heads", h, n, v, r, C, float(scale), _dtname(q_dtype), arch, load, eps, bool(gate), _dtname(out_dtype),
            int(cl), qb, knobs.key(FAMILY))
    if memo in _built:
        return _built[memo]
    why = heads_supports(h, n, v, r, C)
    if why:
        raise ValueError(why)
    src = render(HEADS_TEMPLATE, **heads_params(h, n, v, r, C, scale, q_dtype, eps, gate, out_dtype, cl, qb))
    op = OP_QB if qb is not None else OP_APPEND if eps is not None else OP
    meta = dict(family=FAMILY, op=op, shape=dict(h=h, n=n, v=v, r=r, C=C, **(dict(q_lora=qb[0]) if qb else {})),
                template=HEADS_TEMPLATE, config=dict(variant="heads", tt=HEADS_TT, threads=THREADS,
                                                     q=_dtname(q_dtype), scale=float(scale), append_eps=eps,
                                                     gate=bool(gate), out=_dtname(out_dtype), cluster=int(cl),
                                                     mma=heads_mma(r, C),
                                                     **(dict(q_eps=qb[1], qfirst=qfirst_on()) if qb else {})))
    _built[memo] = k = compile_source(src, arch, load=load, meta=meta)
    return k


_heads_ctr: dict = {}


def heads_counters(device):
    """The per-device arrival counters (int32 zeros; each launch's last CTAs re-arm theirs). Launches sharing them
    run one after another on one stream, as the layer's kernels do."""
    import torch
    key = str(device)
    if key not in _heads_ctr:
        _heads_ctr[key] = torch.zeros(HEADS_CTR_SLOTS, dtype=torch.int32, device=device)
    return _heads_ctr[key]


def _append_gate_args(M, h, v, append, gate) -> list:
    """The kernels' trailing arguments of the append (ckv, kv_norm_w) and gate ([M, h, v]) variants, in that order."""
    extra = []
    if append is not None:
        extra += [_prep(append[0]), _prep(append[1])]
    if gate is not None:
        extra.append(_prep(gate).view(M, h, v))
    return extra


def _launch_heads(q_nope, q_pe, cache, kv_b, seq_lens, scale, out, ns, append, gate, odt, qb=None):
    """qb: (cq, q_norm_w, q_eps, w_qb) for the variant that computes q itself; q_nope / q_pe are then only read for
    their shapes (any tensors of those shapes and dtype)."""
    import torch
    M, h, n = q_nope.shape
    r = q_pe.shape[2]
    C = kv_b.shape[1]
    v = kv_b.shape[0] // h - n
    dev = cache.device
    if not 1 <= ns <= HEADS_MAX_NS:
        raise ValueError(f"{ns} splits per (row, head) (the per-head kernel takes 1..{HEADS_MAX_NS})")
    kern = build_heads(h, n, v, r, C, float(scale), q_nope.dtype,
                       append_eps=append[2] if append is not None else None, gate=gate is not None, out_dtype=odt,
                       cl=heads_cluster(ns, M, h), qb=(qb[0].shape[1], qb[2]) if qb is not None else None)
    f32 = torch.float32
    if stamps_on() and heads_cluster(ns, M, h) > 1:     # zeros: the reader skips the slots a variant leaves unstamped
        opart = torch.zeros(M, ns, h, v, dtype=f32, device=dev)
        STAMP_BUFS.append(opart)
    else:
        opart = torch.empty(M, ns, h, v, dtype=f32, device=dev)
    ml = torch.empty(M, ns, h, 2, dtype=f32, device=dev)
    if out is None:
        out = torch.empty(M, h, v, dtype=odt, device=dev)
    extra = _append_gate_args(M, h, v, append, gate)
    if qb is not None:
        cq, qw, _, w_qb = qb
        q_args = (_prep(cq), _prep(qw), _prep(w_qb).view(h, n + r, cq.shape[1]))
    else:
        q_args = (_prep_q(q_nope), _prep_q(q_pe))
    kern(*q_args, cache, _prep(kv_b).view(h, n + v, C), _prep(seq_lens, torch.int64), opart, ml, out,
         heads_counters(dev), *extra)
    return out


def _reference(q_nope, q_pe, cache, kv_b, seq_lens, scale):
    from k3fuse import ops
    return ops.mla_attention._init_fn(q_nope, q_pe, cache, kv_b, seq_lens, scale)


def mla_attention_cuda(q_nope, q_pe, cache, kv_b, seq_lens, scale):
    """CUDA implementation of k3fuse::mla_attention (same signature); the reference where the kernel does not apply."""
    import torch
    from .prefetch import join_pending
    from .registry import _env_ok, log_fallback
    h = q_nope.shape[1] if q_nope.dim() == 3 else 0
    g = head_groups(h)
    if g > 1 and kv_b.dim() == 2 and kv_b.shape[0] % h == 0:
        hg, rows = h // g, kv_b.shape[0] // h
        parts = [(q_nope[:, i * hg:(i + 1) * hg], q_pe[:, i * hg:(i + 1) * hg],
                  kv_b[i * hg * rows:(i + 1) * hg * rows]) for i in range(g)]
        if all(launch_ok(qn, qp, cache, kb, seq_lens) is None for qn, qp, kb in parts) \
                and _env_ok(OP, cache.device):
            join_pending()
            return torch.cat([mla_attention(qn, qp, cache, kb, seq_lens, scale) for qn, qp, kb in parts], 1)
    reason = launch_ok(q_nope, q_pe, cache, kv_b, seq_lens)
    if reason is not None:
        log_fallback(OP, reason)
        return _reference(q_nope, q_pe, cache, kv_b, seq_lens, scale)
    if not _env_ok(OP, cache.device):          # logs its own reason once
        return _reference(q_nope, q_pe, cache, kv_b, seq_lens, scale)
    join_pending()
    return mla_attention(q_nope, q_pe, cache, kv_b, seq_lens, scale)


def append_ok(q_nope, ckv, kv_norm_w, norm_dtype, cache, kv_b, gate, out_dtype) -> Optional[str]:
    """None if the append / gate variant takes these (on top of launch_ok()), else the reason."""
    import torch
    bf = torch.bfloat16
    M, h = q_nope.shape[:2]
    C = kv_b.shape[1]
    if ckv.dim() != 2 or tuple(ckv.shape) != (M, cache.shape[2]):
        return f"ckv {tuple(ckv.shape)} is not [M, C + r] = [{M}, {cache.shape[2]}]"
    if ckv.dtype != bf or kv_norm_w.dtype != bf or norm_dtype != bf or tuple(kv_norm_w.shape) != (C,):
        return f"ckv / kv_norm_w / norm dtypes {ckv.dtype} / {kv_norm_w.dtype} / {norm_dtype} (the kernel: bf16, [C])"
    if gate is not None and (gate.dtype != bf or gate.numel() != M * h * (kv_b.shape[0] // h - q_nope.shape[2])):
        return f"gate {gate.dtype} {tuple(gate.shape)} (the kernel: bf16 [M, h * v])"
    if out_dtype not in (None, torch.float32, bf):
        return f"out dtype {out_dtype}"
    if head_groups(h) != 1:
        return f"{h} heads per rank take {head_groups(h)} launches (the append runs in one)"
    if any(t.device != cache.device for t in (ckv, kv_norm_w) + ((gate,) if gate is not None else ())):
        return "inputs on different devices"
    return None


def mla_append_attention_cuda(q_nope, q_pe, ckv, kv_norm_w, kv_eps, norm_dtype, cache, kv_b, seq_lens, scale,
                              gate, out_dtype):
    """CUDA implementation of k3fuse::mla_append_attention_: the append in qabsorb and the gate in combine (one
    three-launch entry); where that variant does not apply, the op's reference (which calls rms_norm and
    mla_attention through the dispatcher, so the attention still runs its kernel where it applies)."""
    from .prefetch import join_pending
    from .registry import _env_ok, log_fallback
    from k3fuse import ops
    reason = launch_ok(q_nope, q_pe, cache, kv_b, seq_lens) or append_ok(q_nope, ckv, kv_norm_w, norm_dtype, cache,
                                                                          kv_b, gate, out_dtype)
    if reason is not None:
        log_fallback(OP_APPEND, reason)
    if reason is not None or not _env_ok(OP_APPEND, cache.device):      # _env_ok logs its own reason
        return ops.mla_append_attention_._init_fn(q_nope, q_pe, ckv, kv_norm_w, kv_eps, norm_dtype, cache, kv_b,
                                                  seq_lens, scale, gate, out_dtype)
    join_pending()
    return mla_attention(q_nope, q_pe, cache, kv_b, seq_lens, scale, append=(ckv, kv_norm_w, float(kv_eps)),
                         gate=gate, out_dtype=out_dtype)


# Where the per-head kernel is not chosen (TP8 M = 1), q_b stays its own GEMV launch ahead of the three. Session 48
# put it into the first of them (qb_absorb: clusters of QS = 8 CTAs per (head, row), each computing 16 + 8 rows of q
# from W_qb rows bulk-copied into shared memory before the chain's wait, q shared in distributed shared memory, then
# qabsorb's work; 88348df): MLA TP8 M = 1 11 -> 10 kernels but +1.94 us [+1.55, +2.54] per layer (0 / 12 pairs),
# +13.63 with clusters of 16; the op alone +0.32 us, behind a 52 MB GEMV +0.77 (an H100, RESULTS.md "Session 48").
# Removed: 96 CTAs pulling 7 MB and then a cluster barrier are no shorter than the GEMV's full grid + a boundary.
def qb_plan_reason(M: int, h: int, n: int, v: int, r: int, C: int, ql: int, T: int, sms: int) -> Optional[str]:
    """None if the per-head kernel computes q itself at these shapes (the one rule for the launcher, the lowering's
    predicate and `k3fuse kernels`): that kernel is chosen (heads_choice()) and applies, with a cluster that splits
    W_qb's rows (qb_supports()), and K3FUSE_MLA_QB is not 0 (the A/B knob: 0 launches the q_b GEMV apart)."""
    if knobs.env("K3FUSE_MLA_QB") == "0":
        return "K3FUSE_MLA_QB=0"
    if not heads_choice(M, h):
        return f"the per-head kernel is not chosen at M = {M}, {h} heads (K3FUSE_MLA_HEADS / HEADS_BY_HEADS)"
    return heads_reason(M, h, n, v, r, C, sms) or qb_supports(n, v, r, C, ql,
                                                             heads_cluster(heads_splits(M, h, T, sms), M, h))


def qb_reason(cq, q_norm_w, w_qb, q_nope, q_pe, cache, kv_b) -> Optional[str]:
    """qb_plan_reason() for these tensors, after their shape / dtype / device checks; q_nope / q_pe: tensors of q's
    slices' shapes."""
    import torch
    M, h, n = q_nope.shape
    r, C = q_pe.shape[2], kv_b.shape[1]
    if cq.dim() != 2 or cq.shape[0] != M or tuple(w_qb.shape) != (h * (n + r), cq.shape[1]) \
            or tuple(q_norm_w.shape) != (cq.shape[1],):
        return f"cq {tuple(cq.shape)} / w_qb {tuple(w_qb.shape)} / q_norm_w {tuple(q_norm_w.shape)} shapes"
    if any(t.dtype != torch.bfloat16 for t in (cq, q_norm_w, w_qb)):
        return "cq / q_norm_w / w_qb are not bf16"
    if any(t.device != cache.device for t in (cq, q_norm_w, w_qb)):
        return "inputs on different devices"
    sms = _sm_count(cache.device.index if cache.device.index is not None else torch.cuda.current_device())
    return qb_plan_reason(M, h, n, kv_b.shape[0] // h - n, r, C, cq.shape[1], cache.shape[1], sms)


def qb_applies(cq, q_norm_w, q_eps, w_qb, heads, ckv, kv_norm_w, kv_eps, norm_dtype, cache, kv_b, seq_lens, scale,
               gate, out_dtype) -> bool:
    """The lowering's predicate (registry.KERNEL_APPLIES, on the graph's fake values): does the per-head kernel compute
    q at this graph's shapes? Where not, the lowering inlines the op's reference (compiler/lowering.py
    INLINE_MUTABLE): the q_b rms_norm_linear then lowers like any other (its GEMV at M <= 4, else norm + GEMV) and
    mla_append_attention_ keeps its kernels, instead of the fallback in mla_qb_append_attention_cuda running the
    norm's ATen reference eagerly (6 extra kernels, +30 us at TP16 M = 8, session 25). Off CUDA: kept (its reference
    is that math)."""
    import torch
    if getattr(cache.device, "type", "cpu") != "cuda":
        return True
    M, h = cq.shape[0], int(heads)
    r = cache.shape[-1] - kv_b.shape[1]
    if not isinstance(M, int) or w_qb.shape[0] % h or kv_b.shape[0] % h:
        return False
    n = w_qb.shape[0] // h - r
    q = torch.empty(M, h, n + r, dtype=w_qb.dtype, device="meta")
    return n > 0 and qb_reason(cq, q_norm_w, w_qb, q[..., :n], q[..., n:], cache, kv_b) is None


APPLIES = {"mla_qb_append_attention_": qb_applies}


def mla_qb_append_attention_cuda(cq, q_norm_w, q_eps, w_qb, heads, ckv, kv_norm_w, kv_eps, norm_dtype, cache, kv_b,
                                 seq_lens, scale, gate, out_dtype):
    """CUDA implementation of k3fuse::mla_qb_append_attention_: the per-head kernel computing q itself where
    qb_reason() allows it (one launch for q_b + the attention); elsewhere the two ops it fuses through the
    dispatcher (the q_b GEMV's kernel, then mla_append_attention_'s), logging why once."""
    import torch
    from .prefetch import join_pending
    from .registry import _env_ok, log_fallback
    M, h = cq.shape[0], int(heads)
    r = cache.shape[-1] - kv_b.shape[1]
    n = w_qb.shape[0] // h - r
    q = torch.empty(M, h, n + r, dtype=w_qb.dtype, device=cache.device)     # its shapes, for the checks
    qn, qp = q[..., :n], q[..., n:]
    reason = launch_ok(qn, qp, cache, kv_b, seq_lens) or append_ok(qn, ckv, kv_norm_w, norm_dtype, cache, kv_b, gate,
                                                                    out_dtype)
    ok = reason is None and _env_ok(OP_QB, cache.device)          # _env_ok logs its own reason (CPU, no DSL, arch)
    if ok:
        reason = qb_reason(cq, q_norm_w, w_qb, qn, qp, cache, kv_b)
    if ok and reason is None:
        join_pending()
        sms = _sm_count(cache.device.index if cache.device.index is not None else torch.cuda.current_device())
        return _launch_heads(qn, qp, cache, kv_b, seq_lens, scale, None, heads_splits(M, h, cache.shape[1], sms),
                             (ckv, kv_norm_w, float(kv_eps)), gate, out_dtype or torch.float32,
                             qb=(cq, q_norm_w, float(q_eps), w_qb))
    if reason is not None:
        log_fallback(OP_QB, reason + ": the q_b GEMV and the attention launch apart")
    q = torch.ops.k3fuse.rms_norm_linear(cq, q_norm_w, q_eps, w_qb).view(M, h, n + r)
    return torch.ops.k3fuse.mla_append_attention_(q[..., :n], q[..., n:], ckv, kv_norm_w, kv_eps, norm_dtype, cache,
                                                  kv_b, seq_lens, scale, gate, out_dtype)


IMPLS = {OP: mla_attention_cuda, OP_APPEND: mla_append_attention_cuda, OP_QB: mla_qb_append_attention_cuda}
