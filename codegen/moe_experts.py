"""Kernel family: routed latent MoE experts for decode, M <= 64 (k3fuse::moe_experts).

    out[m] = bf16(sum_j fp32(weights[m, j]) * fp32(bf16(W2_e bf16(SiTU-GLU(bf16(W13_e z_m)))))),  e = ids[m, j]

One template, templates/moe_experts_simt.py.jinja, compiled as ONE function that issues two launches on the
current stream (scratch a [M, k, I] bf16 between them; three with the tensor-core down, below):
  up    W13 GEMV + SiTU-GLU in registers (gate row i and up row I + i in the same CTA). GROUPED for buckets > 1:
        an expert chosen by several tokens is read once (its first pair computes every member token); bucket 1
        is the plain per-(token, slot) kernel.
  down  W2 GEMV per (token, D-chunk) over the k slots, y rounded to bf16 per slot, fp32 combine, bf16 out.
        Not grouped: W2 is read once per (token, slot), but the grid runs the M tokens of one D-chunk side by
        side, so a W2 slice shared by several tokens should come from L2 after the first (unmeasured).
Both are CUDA-core kernels with 16-byte weight loads and compile-time register indices, except where up_mma()
takes the grouped up on tensor cores (the H200 table's UPMMA, measured in session 17) and where down_mma() takes the
grouped down on tensor cores + a combine kernel (the table's DOWNMMA, measured in session 18; scratch y [M, k, D]
bf16 between them).

Status (2026-11-29): renders and compiles for sm_90a and sm_100a (tests/test_moe_kernel_compile.py); matches the
reference on the H200 (tests/test_moe_kernel_gpu.py); registered by registry.register() (IMPLS below).

Compile key: the rendered source (E, I, D, k, batch bucket, beta, linear_beta and the config are baked in) plus
the arch (codegen/cache.py), memoised in-process by the same values.
"""
from __future__ import annotations

import logging
from typing import Optional

from . import tuning
from .buckets import MAX_M, bucket_for
from .render import pdl_chain, render
from . import knobs

log = logging.getLogger("k3fuse.codegen")

FAMILY = "moe_experts"
OP = "k3fuse::moe_experts"
TEMPLATE = "moe_experts_simt.py.jinja"


def default_config(E: int, I: int, D: int, KT: int, bucket: int) -> dict:
    """Heuristic (untimed): up = gemv-simt-like with W warps covering D in as few unrolled steps as divide evenly;
    down = LPR lanes per W2 row so each lane reads a few 16-byte vectors of a row."""
    nv = D // 8
    W = next((w for w in (7, 4, 8, 2, 1) if nv % (32 * w) == 0), 4)
    R = next(r for r in (2, 1) if I % r == 0)
    G = min(bucket, 4)    # members per pass: RR * G fp32 accumulators (G = 8 took 174 registers on sm_100a)
    nvi = I // 8
    LPR = next((l for l in (8, 16, 4, 2, 1) if nvi % l == 0))
    # 8 warps x 4 rows, one pass: 112 CTAs of 256 threads per token at D = 3584 (M = 1 has only M * D / DR CTAs,
    # so they are made wide rather than many); RT = 2 at I = 384 used stack on sm_90a
    WD = 8
    rpw = 32 // LPR
    RT = 1
    while D % (WD * rpw) and WD > 1:
        WD //= 2
    return {"R": R, "W": W, "G": G, "GROUP": int(bucket > 1), "WD": WD, "LPR": LPR, "RT": RT,
            "CPC": cpc_for(I, R, KT, bucket), "SB": default_sb(KT, I, LPR, RT), "KS": default_ks(KT, bucket)}


def default_ks(KT: int, bucket: int) -> int:
    """Slot groups of the down kernel (KS): 4 at bucket 1, where the grid is only D / DR CTAs for one token (ncu on
    the H200, TP16 M = 1, KS = 1: 112 CTAs, 12% achieved occupancy, 1.13 TB/s; the kernel waits on its loads);
    1 from bucket 2, where the M tokens already multiply the grid. Tables written before the knob get this."""
    return next(k for k in ((4, 2, 1) if bucket == 1 else (1,)) if KT % k == 0)


MAX_BATCH_VECTORS = 24   # 16-byte vectors a down-kernel lane holds per slot batch (96 registers)


def default_sb(KT: int, I: int, LPR: int, RT: int) -> int:
    """Slots per load batch of the down kernel: the most (4, 2, 1) dividing KT whose a + W2 vectors fit
    MAX_BATCH_VECTORS per lane (more would spill: SB = 4 at 24 vectors per slot took 175 vs 43 us). Batching was
    meant to put more bytes in flight; measured on the H200 (RESULTS.md session 4) it changes nothing beyond +-2%
    (TP16 M = 1 down + up: 30.1 us at SB = 1, 30.5 at SB = 4). This default is what the session-4 tables ran."""
    per_slot = (I // 8 // LPR) * (RT + 1)
    return next(s for s in (4, 2, 1) if KT % s == 0 and (s * per_slot <= MAX_BATCH_VECTORS or s == 1))


KNOBS = ("R", "W", "G", "GROUP", "WD", "LPR", "RT", "CPC", "SB", "KS")


def config_for(E: int, I: int, D: int, KT: int, bucket: int, gpu: Optional[str] = None) -> dict:
    """The tuned config of this GPU's table (codegen/tuning/<gpu>.json, "moe_experts:ExIxDxk", measured by
    benchmarks/moe_sweep.py) where there is one the kernels take, else the heuristic default. An entry's LAYER_KEY
    knobs (A/B'd in the layer) override the sweep's or the default; K3FUSE_MOE_CONFIG (config_override) overrides
    both. Memoised: the launch path asks on every call (through supports())."""
    cfg = dict(_config_for(E, I, D, KT, bucket, gpu if gpu is not None else tuning.current_gpu()))
    over = config_override()
    if over:
        cfg.update(over)
        why = supports(E, I, D, KT, bucket, cfg)
        if why is not None:
            raise ValueError(f"K3FUSE_MOE_CONFIG={knobs.env('K3FUSE_MOE_CONFIG')!r} at {E}x{I}x{D}x{KT} bucket "
                             f"{bucket}: {why}")
    return cfg


def config_override() -> dict:
    """Knob values from K3FUSE_MOE_CONFIG ("KS=2:SB=2"; "" or "table": none) laid over the table's config at every
    shape and bucket: how benchmarks/layer_ab.py and benchmarks/moe_layer_tune.py A/B a config in the layer."""
    v = knobs.env("K3FUSE_MOE_CONFIG")
    if v in ("", "table"):
        return {}
    out = {}
    for item in v.split(":"):
        k, eq, val = item.partition("=")
        if not eq or k not in KNOBS or not val.lstrip("-").isdigit():
            raise ValueError(f"K3FUSE_MOE_CONFIG={v!r}: wants KNOB=INT items joined by ':', knobs {KNOBS}")
        out[k] = int(val)
    return out


@tuning.memo
def _config_for(E: int, I: int, D: int, KT: int, bucket: int, gpu: Optional[str]) -> dict:
    t = tuning.lookup(FAMILY, (E, I, D, KT), bucket, gpu) if gpu is not None or tuning.overlay() else None
    if t:
        cfg = {k: int(v) for k, v in t.items() if k in KNOBS}
        if "LPR" in cfg and "RT" in cfg:             # entries written before the knobs existed
            cfg.setdefault("SB", default_sb(KT, I, cfg["LPR"], cfg["RT"]))
        cfg.setdefault("KS", default_ks(KT, bucket))
        if set(cfg) != set(KNOBS) or supports(E, I, D, KT, bucket, cfg) is not None:
            cfg = default_config(E, I, D, KT, bucket)    # an entry with the up variant alone, or an unusable one
        # the layer-measured knobs go on top of whichever base that is (session 20: on entries holding only a
        # variant key they were dropped with the incomplete sweep config, so the TP16 M = 2 / 16 and TP8 M = 2
        # results did not reach the kernels)
        layer = {k: int(v) for k, v in (t.get(LAYER_KEY) or {}).items() if k in KNOBS}
        if layer and supports(E, I, D, KT, bucket, dict(cfg, **layer)) is None:
            cfg.update(layer)
        cfg.update({v: int(t[v]) for v in VARIANT_KEYS if v in t})
        return cfg
    return default_config(E, I, D, KT, bucket)


UP_CTAS = 3072   # target grid size of the grouped up kernel (every CTA pays the ids scan before it exits)

# table keys beside the knobs: the up / down kernels' variants where measured in the layer (up_mma, down_mma), not
# knobs of moe_sweep (which keeps them when it rewrites an entry)
VARIANT_KEYS = ("UPMMA", "DOWNMMA", "DCTAS", "UCTAS")
# table key holding knob values A/B'd in the layer (layer_ab with K3FUSE_MOE_CONFIG) that override the sweep's:
# moe_sweep times the two kernels alone and can rank configs differently from the layer (session 19, TP8 M = 1:
# KS = 4 +2.3 us there, -10 us per layer; then LPR = 8 -8.5 more); moe_sweep keeps this key when it rewrites an entry
LAYER_KEY = "layer"


def _variant_on(var: str, tabled: Optional[int], bucket: int, min_bucket: int) -> bool:
    """A kernel variant's switch: the variable var = 0 / 1 if set, else the GPU table's entry, else from min_bucket."""
    env = knobs.env(var)
    if env in ("0", "1"):
        return env == "1"
    return bool(tabled) if tabled is not None else bucket >= min_bucket


UP_MMA_MIN_BUCKET = 16   # heuristic where the GPU's table says nothing: the tensor-core up kernel from this bucket
# the tensor-core up's grid cap where the table has no UCTAS, with its ballot scan (up_ballot): session 33, layer_ab,
# 8 pairs, 3072 -> 8192: TP16 M = 64 -22.5 us, TP8 -31.0, M = 32 -2.3 / -14.7; 8192 -> 16384 TP16 M = 64 +7.2, TP8
# -19.4 (the table's UCTAS there). Without the ballot scan, UP_CTAS.
UP_MMA_CTAS = 8192


def up_mma(I: int, D: int, KT: int, bucket: int, group: bool, tabled: Optional[int] = None,
           ctas: Optional[int] = None) -> Optional[dict]:
    """The grouped up kernel on tensor cores (template UPMMA), or None for the CUDA-core one. K3FUSE_MOE_UP_MMA=1 takes
    it at every grouped bucket, 0 never; otherwise the GPU table's "UPMMA" for the shape and bucket (`tabled`, read by
    config_for), else from bucket UP_MMA_MIN_BUCKET. Why: the CUDA-core owner re-reads W13_e from L2 once per pass
    of G members (G = 2 at bucket 64), the MMA kernel once per 16 (NTG = 2 n-tiles of 8).
    Measured on the H200 (2026-12-02, session 17, KDA + MoE layer, layer_ab, CUDA-core -> MMA, us per layer):
    TP16 (I = 192) M = 64 747.1 -> 561.1, M = 16 332.7 -> 269.0, M = 8 216.5 -> 200.0 (10 / 10 pairs each);
    M = 4 165.8 -> 150.6, M = 2 119.8 -> 115.4 (8 / 8 each; table entries holding UPMMA alone: the knobs there are
    the heuristic's, as before); TP8 (I = 384) M = 64 1344.1 -> 971.7 (6 / 6), M = 8 325.9 -> 330.5 (+3.8, 0 / 6:
    the table keeps it off there). Session 34 (2026-12-04, 8 pairs each): TP8 M = 4 KDA -24.3 / -25.6, MLA -30.9;
    M = 2 -1.3 / -1.6 (the table's UPMMA there since); M = 8 +4.4 again (1 / 8).
    The up kernel alone (profile without the PDL chain, TP16): M = 64 396.9 -> 219.5 us, M = 8 90.8 -> 73.0.
    Read at render time (build's memo keys on the variable). Returns the template's UPMMA, UW (warps along K), UU
    (k-steps per load group), NTG (n-tiles of 8 members per pass) and the kernel's own CPC (column blocks of 16 per
    CTA: the fewest that keep the grid <= `ctas`, the table's "UCTAS" where measured, else UP_MMA_CTAS, UP_CTAS with
    K3FUSE_MOE_UP_BALLOT=0; K3FUSE_MOE_UP_CTAS overrides))."""
    # group: a grouped bucket (> 1)
    if not _variant_on("K3FUSE_MOE_UP_MMA", tabled, bucket, UP_MMA_MIN_BUCKET) or not group or I % 16:
        return None
    nv = D // 8
    UU = 2
    UW = next((w for w in (8, 4, 2, 1) if nv % (4 * UU * w) == 0), None)
    if UW is None:
        return None
    ballot = up_ballot() and 32 * UW >= bucket
    p = dict(UPMMA=True, UW=UW, UU=UU, NTG=2 if bucket >= 16 else 1,
             CPC=cpc_for(I, 16, KT, bucket, ctas or (UP_MMA_CTAS if ballot else UP_CTAS)))
    if ballot:
        p["UBAL"] = True         # passed only when on: the other sources stay as they were
    return p


def up_ballot() -> bool:
    """K3FUSE_MOE_UP_BALLOT=1 (the default; 0 = the serial scan): the tensor-core up kernel's member scan compacts
    the tokens by warp ballots, as the down's (down_we), instead of thread 0's serial loop over M that every CTA of
    its grid pays (ncu, TP16 M = 64 in the layer, s112: barrier stalls 8.0 per issued instruction beside
    long-scoreboard 14.5). Only where the CTA's threads cover the bucket. Measured on the H200 (2026-12-04, session 33,
    KDA + MoE layer, layer_ab, 8 pairs, us per layer): TP16 M = 64 -8.3 (8 / 8), TP8 -4.6 (7 / 8); M = 32 -6.3 (8 / 8),
    -7.6 (7 / 8). Read at render time."""
    return knobs.env("K3FUSE_MOE_UP_BALLOT") == "1"


DOWN_MMA_MIN_BUCKET = 32   # heuristic where the GPU's table says nothing: the tensor-core down kernel from this bucket
# the tensor-core down's grid cap where the table has no DCTAS, with its ballot scan (down_we): session 33, layer_ab,
# 8 pairs: TP16 M = 64 3072 -> 4096 -> 8192 -21.4, -7.9 us (16384: +13.0), M = 32 3072 -> 8192 TP16 -11.7, TP8 -13.1
# (the table: 16384 at TP8 M = 64, 8192 at TP8 M = 8); TP8 M = 16 3072 -> 8192 -10.5. Without the ballot scan, UP_CTAS.
DOWN_CTAS = 8192


def down_mma(I: int, D: int, KT: int, bucket: int, group: bool, tabled: Optional[int] = None,
             ctas: Optional[int] = None) -> Optional[dict]:
    """The grouped down projection on tensor cores + a combine kernel (template DOWNMMA; three launches in all), or
    None for the per-(token, slot) down kernel. K3FUSE_MOE_DOWN_MMA=1 takes it at every grouped bucket, 0 never;
    otherwise the GPU table's "DOWNMMA" for the shape and bucket (`tabled`, read by config_for), else from bucket
    DOWN_MMA_MIN_BUCKET. Why: the per-(token, slot) down kernel reads W2 once per (token, slot) through L2 (without
    the PDL chain the TP16 M = 64 layer's down kernel took 178 us for ~0.41 GB of distinct W2, ~99 us). Here an owner
    CTA per (chosen expert, RPC row blocks of 128) runs W2_e's 16-row tiles as MMA A operands over 16 member tokens
    at a time, so W2_e crosses L2 once per 16 members; y [M, k, D] bf16 goes to a scratch and the combine sums it in
    slot order. RPC is the fewest row blocks per CTA that keep the grid <= `ctas` (the table's "DCTAS" where
    measured, else DOWN_CTAS, UP_CTAS with K3FUSE_MOE_DOWN_WE=0; K3FUSE_MOE_DOWN_CTAS overrides).
    Measured on the H200 (2026-12-02, session 18, KDA + MoE layer, layer_ab, per-slot -> MMA down, us per layer):
    TP16 (I = 192) M = 64 559.6 -> 541.2 (8 / 8 pairs), M = 16 268.8 -> 271.1 (0 / 8), M = 8 199.5 -> 200.8
    (2 / 8): the table keeps it off at 8 and 16; TP8 (I = 384) M = 64 971.5 -> 890.2, M = 8 322.0 -> 309.3 (6 / 6
    each); TP16 M = 32 416.5 -> 408.5 (5 / 6), TP8 M = 32 712.4 -> 639.6, M = 16 481.5 -> 453.1 (6 / 6 each).
    The down kernel alone (profile without the PDL chain, TP16 M = 64): 178 -> 141.9 us.
    Grid cap (layer_ab, 3072 -> 8192, i.e. RPC 14 -> 4 at bucket 64, 2 -> 1 at 8): TP8 M = 64 910.2 -> 893.6, M = 8
    318.3 -> 316.1 (6 / 6 each), so the table's DCTAS = 8192 there; TP16 M = 64 548.9 -> 567.2 (16384: 684.3): kept.
    UD = 6 or 12 (fewer, larger load groups) was slower everywhere (TP16 M = 64 +8.7, TP8 M = 64 +41.5 / +215.7).
    Read at render time (build's memo keys on the variable). Returns the template's DOWNMMA, RPC, UD (k-steps per
    load group), DNTG."""
    if not _variant_on("K3FUSE_MOE_DOWN_MMA", tabled, bucket, DOWN_MMA_MIN_BUCKET) or not group:
        return None
    nvi, nd = I // 8, D // 128
    ud = knobs.integer("K3FUSE_MOE_DOWN_UD", 3)           # k-steps per load group (an A/B knob, session 18)
    if D % 512 or nvi % (4 * ud):                    # 128-row blocks, the combine's 64 x 16-byte CTAs, UD k-step groups
        if ud != 3:
            raise ValueError(f"K3FUSE_MOE_DOWN_UD={ud}: I / 8 = {nvi} is not a multiple of 4 * UD")
        return None
    cap = knobs.integer("K3FUSE_MOE_DOWN_CTAS", ctas or (DOWN_CTAS if down_we() else UP_CTAS))   # grid cap
    rpc = next(d for d in range(1, nd + 1) if nd % d == 0 and (bucket * KT * (nd // d) <= cap or d == nd))
    p = dict(DOWNMMA=True, RPC=rpc, UD=ud, DNTG=2 if bucket >= 16 else 1)
    if down_we():
        p["DWE"] = True          # passed only when on: the other sources stay as they were
    return p


def member_lists() -> bool:
    """K3FUSE_MOE_MEMBER_LISTS=1 (the default since session 35; 0 = the down kernel's own ids scan): where both
    tensor-core kernels run with their ballot scans, the up kernel's CTAs of column block 0 (one per (token, slot)
    pair, every step) write the pair's member list for the down: a count (0 where the pair owns no down pass) and the
    members as token | slot mask << 8 (scratch [M, k] + [M, k, bucket] int32). The down kernel reads its pair's count
    (one load: non-owners exit there) and list instead of scanning the M x k ids with its 256 threads, a ballot and
    two barriers. Bitwise the scan (the same members in the same order). Why: at M = 64 about 7 of 8 of the down's
    8192 CTAs own nothing (~134-145 distinct experts for 1024 pairs) and each paid the 8 KB ids read, the vote and
    two barriers before exiting.
    Measured on the H200 (2026-12-04, session 35, KDA + MoE layer, layer_ab, 8 pairs, us per layer, 0 -> 1):
    TP16 M = 64 -3.9 (8 / 8), M = 32 -4.5 (8 / 8); TP8 M = 64 -3.8 (7 / 8), M = 32 -0.7 (8 / 8), M = 16 -4.8 (8 / 8);
    TP8 M = 8 does not take it (its up runs on CUDA cores). With it, the down's grid cap 8192 -> 16384 at TP16:
    M = 64 -1.2 (7 / 8), M = 32 +4.3 (0 / 8): DOWN_CTAS kept. Tried and removed (session 35): a CTA per pass of 16
    members instead of one owner per chosen expert looping over its passes (K3FUSE_MOE_PASS_OWNERS, session 34):
    TP16 / TP8 M = 64 +13.6 / +23.6 us. Read at render time."""
    return knobs.env("K3FUSE_MOE_MEMBER_LISTS") == "1"


def down_we() -> bool:
    """K3FUSE_MOE_DOWN_WE=1 (the default; 0 = session 18's barrier epilogue and serial scan): the tensor-core down
    kernel's member scan compacts the tokens by warp ballots (not thread 0's serial loop over M, which every one of the grid's CTAs
    pays, owners or not, the other 255 threads waiting at a barrier), and each warp writes its own 16-row y tile
    through its own shared-memory slice with warp syncs only: no CTA barrier between row blocks, so a warp's next
    tile loads are not held behind the slowest warp's epilogue. Why: ncu of the TP16 M = 64 layer (s112): barrier
    stalls 11.3 per issued instruction beside 14.2 long-scoreboard, DRAM at 46% of peak.
    Measured on the H200 (2026-12-04, session 33, KDA + MoE layer, layer_ab, 8 pairs, us per layer): TP8 M = 64
    -34.5 (8 / 8; its grid of 7168 CTAs, DCTAS 8192, paid the serial scan most), TP16 M = 64 -1.6 (6 / 8), M = 32
    -0.1 / -0.9; with it on, TP16 M = 64's grid cap 3072 -> 4096 -21.4 (8 / 8). Read at render time."""
    return knobs.env("K3FUSE_MOE_DOWN_WE") == "1"


def cpc_for(I: int, R: int, KT: int, bucket: int, cap: int = UP_CTAS) -> int:
    """Column groups per up CTA: the smallest power of two dividing I / R that keeps bucket * k * I / (R * CPC)
    CTAs <= cap (K3FUSE_MOE_UP_CTAS overrides, for A/Bs; 1 for the ungrouped bucket 1)."""
    cap = knobs.integer("K3FUSE_MOE_UP_CTAS", cap)
    cpc = 1
    while bucket > 1 and bucket * KT * (I // R) // cpc > cap and (I // R) % (2 * cpc) == 0:
        cpc *= 2
    return cpc


def supports(E: int, I: int, D: int, KT: int, bucket: Optional[int], cfg: Optional[dict] = None) -> Optional[str]:
    """None if a kernel exists for this problem, else the reason why not (for the fallback log line)."""
    if bucket is None:
        return f"M outside the batch buckets (1..{MAX_M})"
    if D % 8 or I % 8:
        return f"D={D} or I={I} not a multiple of 8 (16-byte loads)"
    if not 1 <= KT <= 30:
        return f"k={KT} outside 1..30 (slot bitmask)"
    cfg = cfg or config_for(E, I, D, KT, bucket)
    if I % (cfg["R"] * cfg.get("CPC", 1)):
        return f"I={I} not a multiple of R * CPC = {cfg['R']} * {cfg.get('CPC', 1)}"
    if KT % (cfg.get("SB", 1) * cfg.get("KS", 1)):
        return f"k={KT} not a multiple of the down kernel's slot batch SB * slot groups KS"
    if (I // 8) % cfg["LPR"] or 32 % cfg["LPR"]:
        return f"I/8={I // 8} not a multiple of LPR={cfg['LPR']}"
    if D % (cfg["WD"] * (32 // cfg["LPR"]) * cfg["RT"]):
        return f"D={D} not a multiple of the down kernel's rows per CTA"
    if cfg["R"] * min(cfg["G"], bucket) > 32 * cfg["W"]:
        return "R * G entries > threads of the up kernel"
    if cfg["W"] * 32 > 1024 or cfg["WD"] * cfg.get("KS", 1) * 32 > 1024:
        return "more than 1024 threads per CTA"
    return None


# (I, bucket) -> slots per W2 load batch (0: all of a lane's slots at once), where the layer measured the down with AX
# faster. All at once (session 22, H200, layer_ab K3FUSE_MOE_DOWN_AX=0,1, RESULTS.md): TP8 (I = 384) M = 2 -3.90 us
# per KDA layer (8 / 8 pairs), M = 4 -5.30 (8 / 8); at M = 1 -0.54 .. -0.98, within the spread. One slot per batch
# (session 41, an H100 with the H200 table, layer_ab): TP8 M = 1 against the SB kernel -1.50 (KDA, 14 / 16 pairs) /
# -1.90 (MLA, 16 / 16); 0 -> 1 with AX -1.50 (12 / 12) at M = 1, -0.96 (9 / 12) at M = 2; M = 4 not measured. Not
# listed: TP16 M = 1 (AX +0.10; with one slot per batch -0.28 / -0.31) and TP16 M = 2 (+1.70, 0 / 8)
AX_MEASURED = {(384, 1): 1, (384, 2): 1, (384, 4): 0}
MAX_AX_VECTORS = 32       # 16-byte W2 vectors a down lane holds with AX (128 registers)


def down_ax(I: int, KT: int, cfg: dict, bucket: int) -> bool:
    """Whether the per-slot down kernel loads every W2 vector of a lane's KT / KS slots ahead of its FMAs, the
    token's activations staged in shared memory behind a CTA barrier (ptxas otherwise interleaves FMAs with the
    loads: 3 of 24 loads ahead of the first FMA at TP16 M = 1). K3FUSE_MOE_DOWN_AX=1 / 0 forces it on / off; unset,
    where AX_MEASURED lists (I, bucket). Only where those vectors fit MAX_AX_VECTORS per lane and the CTA's register
    share (bucket 1's KS = 4 configs: 12 at TP16, 24 at TP8); elsewhere the SB batches."""
    v = knobs.env("K3FUSE_MOE_DOWN_AX")
    if v == "0" or (v != "1" and (I, bucket) not in AX_MEASURED):
        return False
    nvec = (KT // cfg.get("KS", 1)) * cfg["RT"] * ((I // 8) // cfg["LPR"])
    # 4 registers a vector + ~24 others within the per-thread share of the register file at this CTA size
    # (1024 threads: 64 each, where 24 vectors spilled on sm_90a)
    return nvec <= MAX_AX_VECTORS and 4 * nvec + 24 <= min(255, 65536 // (32 * cfg["WD"] * cfg.get("KS", 1)))


def down_axb(I: int, bucket: int, ksl: int) -> int:
    """With AX: the per-slot down's W2 vectors N slots at a time instead of all ksl = KT / KS of a lane's slots at
    once, a CTA barrier between each batch's loads and its FMAs. Why: at TP8 M = 1 (KS = 4, LPR = 8) the SB kernel
    uses 48 registers and its longest round-trip chain is 23 (ptxas interleaves its loads with the FMAs;
    codegen/sass.py); AX cuts the chain to 2 but needs 122 registers (one 512-thread CTA per SM instead of two), and
    the layer measured the two alike (session 22); with N = 1 the chain is ksl + 1 = 5 at 64 registers (two CTAs).
    The same sums in the same order as AX (bitwise). K3FUSE_MOE_DOWN_AXB=N forces N (0: all at once); unset,
    AX_MEASURED's entry for (I, bucket). N >= ksl or N not dividing ksl: all at once. Read when a kernel is rendered."""
    n = knobs.integer("K3FUSE_MOE_DOWN_AXB", AX_MEASURED.get((I, bucket), 0))
    return n if 0 < n < ksl and ksl % n == 0 else 0


# (I, bucket) where the layer measured the EARLY down faster (session 46, an H100 with the H200 table, layer_ab
# K3FUSE_MOE_DOWN_EARLY=0,1, 12 pairs, RESULTS.md): TP8 (I = 384) M = 1 -0.72 us per KDA layer [-1.26, -0.10] (9 / 12),
# -0.90 per MLA layer [-1.89, -0.19] (9 / 12). Not listed: TP16 M = 1, where AX + EARLY against the defaults measured
# -0.05 (KDA, 6 / 10) and +0.74 (MLA, 3 / 10); TP8 buckets 2 and 4 (the tensor-core up: session 47 gave it the
# trigger after its wait and measured, H100, 10 pairs: KDA +0.38 / +8.17 us at M = 2 / 4, MLA -0.34 / +8.88; removed,
# commit 8fc9152 has it)
EARLY_MEASURED = {(384, 1)}


def down_early(params: dict) -> bool:
    """The EARLY down: the per-slot down with AX issues the ids, the routing weights and its first batch of W2 vectors
    (AXB slots, or all with plain AX) before its PDL chain wait, and the simt up triggers it only after its own wait.
    Why: the down (TP8 M = 1: 224 CTAs of 512 threads, one wave) could not load a byte before the whole up grid had
    drained, although its W2 rows (a third of the experts' bytes) depend on nothing the up writes; its CTAs placed in
    the up's tail now stream them meanwhile, and the ids -> W2 round trips leave the path after the wait (session 44's
    lead in PERF_NOTES, in its cheap form). Safe because the ids come from the top-k up the chain: with the up's
    trigger after its wait, the down launches only once every up CTA has passed that wait, i.e. every earlier grid
    has completed; for the up's grid of several waves that trigger is no later than the one at its start. Only where
    the down is the simt AX kernel and the up the simt one (the tensor-core up keeps its trigger at the start), under
    the chain. The sums and their order are AX's: bitwise the same. K3FUSE_MOE_DOWN_EARLY=1 / 0 forces it on / off;
    unset, where EARLY_MEASURED lists (I, bucket). Read when a kernel is rendered."""
    v = knobs.env("K3FUSE_MOE_DOWN_EARLY")
    if v == "0" or (v != "1" and (params["I"], params["BM"]) not in EARLY_MEASURED):
        return False
    return bool(params.get("AX")) and not params.get("UPMMA") and not params.get("DOWNMMA") and pdl_chain()


def template_params(E, I, D, KT, bucket, cfg, beta, lbeta) -> dict:
    nv = D // 8
    group = bool(cfg["GROUP"]) and bucket > 1
    params = dict(E=E, I=I, D=D, KT=KT, BM=bucket, BETA=repr(float(beta)), LBETA=repr(float(lbeta)),
                  R=cfg["R"], W=cfg["W"], ITERS=-(-nv // (32 * cfg["W"])), G=min(cfg["G"], bucket) if group else 1,
                  GROUP=group, CPC=cfg.get("CPC", 1) if group else 1, WD=cfg["WD"], LPR=cfg["LPR"], RT=cfg["RT"], VPL=(I // 8) // cfg["LPR"],
                  SB=cfg.get("SB", default_sb(KT, I, cfg["LPR"], cfg["RT"])), KS=cfg.get("KS", 1),
                  DR=cfg["WD"] * (32 // cfg["LPR"]) * cfg["RT"])
    if down_ax(I, KT, cfg, bucket):
        params["AX"] = True      # passed only when on: the other sources stay as they were
        axb = down_axb(I, bucket, KT // cfg.get("KS", 1))
        if axb:
            params["AXB"] = axb  # likewise
    # UPMMA (and its own CPC) only when on: the other sources (and so their compile keys) stay as they were
    params.update(up_mma(I, D, KT, bucket, group, cfg.get("UPMMA"), cfg.get("UCTAS")) or {})
    params.update(down_mma(I, D, KT, bucket, group, cfg.get("DOWNMMA"), cfg.get("DCTAS")) or {})
    if down_early(params):
        params["EARLY"] = True   # passed only when on: the other sources stay as they were
    # the lists pack token | slot mask << 8 in an int32: k <= 23 slots
    if params.get("UBAL") and params.get("DWE") and member_lists() and KT <= 23:
        params["MLIST"] = True   # passed only when on: the other sources stay as they were
    return params


def render_source(E, I, D, KT, bucket, beta=4.0, lbeta=25.0, cfg: Optional[dict] = None) -> tuple[str, dict]:
    cfg = dict(cfg or config_for(E, I, D, KT, bucket))
    why = supports(E, I, D, KT, bucket, cfg)
    if why:
        raise ValueError(why)
    return render(TEMPLATE, **template_params(E, I, D, KT, bucket, cfg, beta, lbeta)), cfg


_built: dict = {}
_scratch_y: dict = {}    # compile key -> the kernel takes the tensor-core down's y [M, k, D] scratch (decided at build)
_scratch_lists: dict = {}    # compile key -> it takes the member lists' scratch (MLIST: counts [M, k], lists [M, k, BM])


def build(E: int, I: int, D: int, KT: int, bucket: int, beta: float = 4.0, lbeta: float = 25.0,
          cfg: Optional[dict] = None, arch: Optional[str] = None, load: bool = True):
    """Compiled kernel pair for (E, I, D, k, bucket, beta, lbeta, config, arch); memoised."""
    from .compile import compile_source, current_arch
    arch = arch or current_arch()
    memo = (E, I, D, KT, bucket, float(beta), float(lbeta), repr(sorted((cfg or {}).items())), arch, load,
            knobs.key(FAMILY))
    k = _built.get(memo)
    if k is not None:
        return k
    src, cfg = render_source(E, I, D, KT, bucket, beta, lbeta, cfg)
    meta = dict(family=FAMILY, op=OP, shape=dict(E=E, I=I, D=D, k=KT), bucket=bucket, config=cfg,
                template=TEMPLATE, beta=float(beta), lbeta=float(lbeta))
    k = compile_source(src, arch, load=load, meta=meta)
    params = template_params(E, I, D, KT, bucket, cfg, beta, lbeta)
    _scratch_y[k.key] = "DOWNMMA" in params
    _scratch_lists[k.key] = "MLIST" in params
    _built[memo] = k
    return k


def moe_experts(z, ids, weights, w13, w2, beta: float, linear_beta: float, cfg: Optional[dict] = None,
                out=None, scratch=None):
    """Launch both kernels on the current stream (no checks: see moe_experts_cuda). Returns out [M, D] bf16."""
    import torch
    M, D = z.shape
    KT = ids.shape[1]
    E, I2, _ = w13.shape
    I = I2 // 2
    k = build(E, I, D, KT, bucket_for(M), beta, linear_beta, cfg)
    a = scratch if scratch is not None else torch.empty(M, KT, I, dtype=torch.bfloat16, device=z.device)
    y = out if out is not None else torch.empty(M, D, dtype=torch.bfloat16, device=z.device)
    extra = []
    if _scratch_y[k.key]:        # the per-slot y of the tensor-core down, for its combine
        extra.append(torch.empty(M, KT, D, dtype=torch.bfloat16, device=z.device))
    if _scratch_lists[k.key]:    # the down's member lists, written by the up kernel every step
        extra += [torch.empty(M, KT, dtype=torch.int32, device=z.device),
                  torch.empty(M, KT, bucket_for(M), dtype=torch.int32, device=z.device)]
    k(z, ids, weights, w13, w2, a, y, *extra)
    return y


def _unsupported(z, ids, weights, w13, w2) -> Optional[str]:
    import torch
    if z.dim() != 2 or ids.dim() != 2 or weights.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        return "ranks (z 2-D, ids 2-D, weights 2-D, w13 3-D, w2 3-D)"
    if (z.dtype, ids.dtype, weights.dtype, w13.dtype, w2.dtype) != \
            (torch.bfloat16, torch.int64, torch.float32, torch.bfloat16, torch.bfloat16):
        return f"dtypes z {z.dtype}, ids {ids.dtype}, weights {weights.dtype}, w13 {w13.dtype}, w2 {w2.dtype}"
    M, D = z.shape
    E, I2, D1 = w13.shape
    if D1 != D or I2 % 2 or tuple(w2.shape) != (E, D, I2 // 2) or tuple(ids.shape) != tuple(weights.shape) \
            or ids.shape[0] != M:
        return "inconsistent shapes"
    if M < 1 or M > MAX_M:
        return f"M={M} outside 1..{MAX_M}"
    why = supports(E, I2 // 2, D, ids.shape[1], bucket_for(M))
    if why:
        return why
    for name, t in (("w13", w13), ("w2", w2)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            return f"{name} not contiguous / 16-byte aligned"
    return None


def moe_experts_cuda(z, ids, weights, w13, w2, beta, linear_beta):
    """CUDA implementation of k3fuse::moe_experts (same signature); the reference where unsupported."""
    from k3fuse import ops
    from . import registry
    op = OP
    reason = _unsupported(z, ids, weights, w13, w2)
    if reason is not None:
        registry.log_fallback(op, reason)
        return ops.moe_experts._init_fn(z, ids, weights, w13, w2, beta, linear_beta)
    if not registry._env_ok(op, z.device):    # logs its own reason (device, DSL, compute capability)
        return ops.moe_experts._init_fn(z, ids, weights, w13, w2, beta, linear_beta)
    from .prefetch import join_pending
    join_pending()
    # small inputs: a fresh contiguous copy is 16-byte aligned (no-ops when already so)
    z, ids, weights = (t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.contiguous().clone()
                       for t in (z, ids, weights))
    return moe_experts(z, ids, weights, w13, w2, beta, linear_beta)


IMPLS = {OP: moe_experts_cuda}
