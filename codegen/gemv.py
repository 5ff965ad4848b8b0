"""Kernel family: skinny GEMM / GEMV for M <= 64 (k3fuse::linear), y = x @ w^T, bf16 in, fp32 accumulate.

Variants (templates/gemv_<variant>.py.jinja):
  simt  CUDA cores, 16-byte loads, R rows per CTA, W warps splitting K (see the template's docstring).
  mma   tensor cores (mma.sync m16n8k16), weight as the A operand, K permuted so that every operand is read
        with 16-byte loads; 16 rows per CTA, W warps splitting K, U k-steps of loads in flight per warp.
Configs are dicts {"variant": ..., plus the variant's parameters}; `default_config` is the heuristic used for
GPUs and shapes without a tuning table entry; `candidates` lists what the GPU tuner times.
Both variants take an optional "pdl": 1 (Programmatic Dependent Launch with an L2 bulk prefetch of the CTA's
weight rows before griddepcontrol.wait, so that a launch's weight traffic overlaps the previous kernel's tail;
meant for small weights, where a ~1.7 us fixed cost per launch dominates). "pdl" is absent when 0, so configs,
rendered sources and cache keys of kernels without it are the same as before it existed.
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

from . import tuning
from .buckets import bucket_for
from .render import render
from . import knobs

log = logging.getLogger("k3fuse.codegen")

FAMILY = "gemv"
VARIANTS = ("simt", "mma", "wgmma")


def _divisors(n: int, options) -> list[int]:
    return [r for r in options if n % r == 0]


def supports(N: int, K: int, bucket: Optional[int], cfg: Optional[dict] = None) -> Optional[str]:
    """None if a kernel exists for this problem, else the reason why not (for the fallback log line)."""
    if bucket is None:
        return "M outside the batch buckets (1..64)"
    if K % 8:
        return f"K={K} is not a multiple of 8 (16-byte loads)"
    if cfg is not None:
        if cfg["variant"] not in VARIANTS:
            return f"unknown variant {cfg['variant']}"
        if cfg.get("pdl", 0) not in (0, 1, False, True):
            return f"pdl must be 0 or 1, not {cfg['pdl']!r}"
        if cfg["variant"] == "simt" and N % cfg["R"]:
            return f"N={N} not a multiple of R={cfg['R']}"
        if cfg["variant"] == "mma":
            bn = 16 * cfg.get("RT", 1) * cfg.get("WN", 1)
            if N % 16 or K % 32 or bn > 4 * N:
                return f"N={N} not a multiple of 16 or K={K} not a multiple of 32 (or CTA rows {bn} >> N)"
            if cfg.get("KB", 0) and (K // 32) % cfg["U"]:
                return f"KB=1 needs U={cfg['U']} to divide the {K // 32} k-steps"
            if cfg["W"] * cfg.get("WN", 1) > 32:
                return "more than 1024 threads per CTA"
            if cfg["W"] * bn * max(1, bucket // 8) * 8 * 4 > 48 * 1024:
                return "reduction buffer over 48 KiB of shared memory"
        if cfg["variant"] == "wgmma":
            return wg_supports(N, K, bucket, cfg)
    return None


# ------------------------------------------------------------------------------------------ TMA + wgmma (wgmma)
WG_BUCKETS = (16, 32, 64)   # the MMA's N is the bucket; below 16 the GEMVs run near the copy bandwidth (table)
WG_ARCHES = ("sm_90a",)     # warpgroup MMA is Hopper's (sm_100a has tcgen05 instead)
WG_KS_MAX = 8               # splits of K = CTAs per cluster (8: the portable cluster size) for the default
WG_KS_WIDE = 16             # the tuner's ceiling where 8 splits leave the grid under WG_GRID (768 x 7168: 96 CTAs):
                            # Hopper's non-portable cluster size (CuTe DSL allows it on every kernel it loads)
WG_ST = (4, 8)              # pipeline stages the tuner tries; (BN + BM) x 64 x 2 bytes each (16 KB at BN = BM = 64)
WG_BN = (64, 128)           # weight rows per CTA: 128 reads x from L2 half as often, with half the CTAs
WG_GRID = 112               # the default aims at >= this many CTAs (132 SMs on an H200, clusters of KS)


def wg_supports(N: int, K: int, bucket: int, cfg: dict) -> Optional[str]:
    """None if the TMA + wgmma variant (templates/gemv_wgmma.py.jinja) takes this config, else why not. The arch is
    checked where it is known (wg_arch_supports): the template compiles for sm_90a only."""
    KS, ST, BN = cfg["KS"], cfg["ST"], cfg.get("BN", 64)
    if BN not in WG_BN:
        return f"BN={BN} not one of {WG_BN}"
    if bucket not in WG_BUCKETS:
        return f"wgmma needs a bucket in {WG_BUCKETS} (not {bucket})"
    if cfg.get("pdl"):
        return "wgmma has no L2-prefetch (pdl=1) prologue"
    if N % 8:
        return f"N={N} not a multiple of 8"
    if not 1 <= KS <= WG_KS_WIDE or K % (64 * KS):
        return f"K={K} not a multiple of 64 * KS (KS={KS}, 1..{WG_KS_WIDE})"
    if not 2 <= ST <= 12:
        return f"ST={ST} outside 2..12 stages"
    if ST * (BN + bucket) * 64 * 2 + (BN * bucket * 4 if KS > 1 else 0) > 200 * 1024:
        return f"ST={ST} stages at bucket {bucket} exceed 200 KiB of shared memory"
    return None


def wg_arch_supports(arch: str) -> Optional[str]:
    return None if arch in WG_ARCHES else f"wgmma is sm_90a only (warpgroup MMA), not {arch}"


def wg_config(N: int, K: int, bucket: int, KS: int, ST: int = 8, BN: int = 64) -> Optional[dict]:
    """The wgmma config with BN rows per CTA, KS splits and ST stages (capped at the CTA's k-tiles), or None where it
    does not apply."""
    cfg = {"variant": "wgmma", "KS": KS, "ST": max(2, min(ST, K // (64 * KS))), "BN": BN}
    return cfg if wg_supports(N, K, bucket, cfg) is None else None


def wg_default(N: int, K: int, bucket: int) -> Optional[dict]:
    """The wgmma config used where nothing is tabled (K3FUSE_GEMV_WGMMA=1): the fewest splits that give WG_GRID
    CTAs (each CTA streams K / KS of its 64 rows; fewer splits mean fewer partial sums), 8 stages (a first guess,
    not measured: 8 x 16 KB in flight per CTA at bucket 64)."""
    tiles = -(-N // 64)
    ks = [d for d in range(1, WG_KS_MAX + 1) if K % (64 * d) == 0]
    if not ks:
        return None
    KS = next((d for d in ks if tiles * d >= WG_GRID), ks[-1])
    return wg_config(N, K, bucket, KS)


def wg_candidates(N: int, K: int, bucket: int) -> list[dict]:
    """The wgmma configs the GPU tuner times on an sm_90 device (benchmarks/gpu_kernels.py): for 64 and 128 rows per
    CTA, every split count up to WG_KS_MAX whose grid is 0.5-4 waves, with 4 and 8 stages; up to WG_KS_WIDE (clusters
    of 9-16) where WG_KS_MAX splits leave fewer than WG_GRID CTAs (session 36: 768 x 7168 at 40-44% of copy with 96)."""
    out = []
    for BN in WG_BN:
        tiles = -(-N // BN)
        top = WG_KS_WIDE if tiles * WG_KS_MAX < WG_GRID else WG_KS_MAX
        for KS in range(1, top + 1):
            if K % (64 * KS) == 0 and WG_GRID // 2 <= tiles * KS <= 4 * 132:
                for ST in WG_ST:
                    c = wg_config(N, K, bucket, KS, ST, BN)
                    if c is not None and c not in out:
                        out.append(c)
    d = wg_default(N, K, bucket)
    if d is not None and d not in out:
        out.append(d)
    return out


@functools.lru_cache(maxsize=None)
def _device_arch() -> str:
    """The current device's target, asked once per process: route() runs on every k3fuse::linear call."""
    from .compile import current_arch
    try:
        return current_arch()
    except Exception:                     # no CUDA device: nothing to launch on
        return "no CUDA device"


def wg_forced(N: int, K: int, bucket: int, arch: Optional[str] = None) -> Optional[dict]:
    """K3FUSE_GEMV_WGMMA=1: the wgmma variant at buckets 16-64 where it applies, for sm_90a (`arch`, else the current
    device's; an A/B knob: forced on every shape it was slower in the layer, session 36, so the H200 table names it
    only where it won); otherwise None."""
    if knobs.env("K3FUSE_GEMV_WGMMA") != "1" or bucket not in WG_BUCKETS:
        return None
    return None if wg_arch_supports(arch or _device_arch()) else wg_default(N, K, bucket)


def default_config(N: int, K: int, bucket: int) -> dict:
    """Heuristic for GPUs and shapes without a table entry, from what won most often on the H200 (2026-11-29,
    benchmarks/RESULTS.md): CUDA cores (simt) at M <= 2; from M = 4 tensor cores (mma) with contiguous k-groups
    (KB=1), which measured within a few % of the copy bandwidth at M = 4..8 on the large K3 shapes."""
    S = K // 32
    if bucket >= 4 and N % 16 == 0 and K % 32 == 0 and S % 2 == 0:
        W = 16 if (S >= 128 and 8 <= bucket <= 16) else 8 if S >= 32 else 4 if S >= 8 else 1
        if bucket > 16:
            W = min(W, 4)
        return {"variant": "mma", "W": W, "U": 2, "WN": 1, "RT": 1, "KB": 1}
    R = next(r for r in ((1, 2, 4) if N >= 2048 else (2, 4, 1)) if N % r == 0)
    nv = K // 8
    W = next((w for w in (4, 8, 2) if nv % (32 * w) == 0), max(1, min(8, nv // 64)))
    return {"variant": "simt", "R": R, "W": W}


def candidates(N: int, K: int, bucket: int) -> list[dict]:
    """Configs the GPU tuner times for one (shape, bucket)."""
    out = []
    nv = K // 8
    if bucket <= 8:
        for R in _divisors(N, (1, 2, 4) if bucket <= 4 else (1, 2)):
            for W in ((2, 4, 8) if bucket <= 4 else (4, 8)):
                if nv >= 32 * W:
                    out.append({"variant": "simt", "R": R, "W": W})
    if bucket <= 4 and nv < 64:
        # short rows (K < 512: the TP16 shared down projection, 7168 x 384): one warp per CTA, more rows each, so
        # that a CTA keeps more loads in flight (the table's R = 4, W = 1 ran 0.91-0.95x cuBLAS at M = 1, session 8)
        out += [{"variant": "simt", "R": R, "W": 1} for R in _divisors(N, (1, 2, 4, 8, 16))]
    if N % 16 == 0 and K % 32 == 0:
        S = K // 32
        if bucket <= 4:
            grid = [(W, U, 1, 1, KB) for W in (2, 4, 8) for U in (2, 4) for KB in (0, 1)]
        elif bucket <= 16:
            grid = [(W, U, 1, 1, KB) for W in (4, 8, 16) for U in (2, 4, 8) for KB in (0, 1)]
            grid += [(W, U, WN, RT, 1) for W in (4, 8) for U in (2, 4) for WN, RT in ((2, 1), (1, 2))]
        else:
            grid = [(W, 2, WN, RT, 1) for W in (1, 2, 4) for WN in (1, 2, 4) for RT in (1, 2) if W * WN <= 8]
        for W, U, WN, RT, KB in grid:
            c = {"variant": "mma", "W": W, "U": U, "WN": WN, "RT": RT, "KB": KB}
            if W * U <= max(S, 2) and supports(N, K, bucket, c) is None:
                out.append(c)
    d = default_config(N, K, bucket)
    if d not in out:
        out.append(d)
    if N * K * 2 < PDL_MAX_BYTES:
        out += [dict(c, pdl=1) for c in _pdl_bases(N, K, bucket, out)]
    return out


# PDL copies are timed for weights below this size: there the fixed launch cost is a large share of the time
# (54-55% of copy bandwidth at 11 MB, M = 1, on the H200); at >= 40 MB the kernels are within a few % of it.
PDL_MAX_BYTES = 40 * 10**6
# configs that won on the H200 for small K3 shapes (2026-11-29 table), tried with pdl=1 when they are candidates
_PDL_USUAL = ({"variant": "simt", "R": 1, "W": 8}, {"variant": "simt", "R": 2, "W": 8},
              {"variant": "mma", "W": 8, "U": 2, "WN": 1, "RT": 1, "KB": 1},
              {"variant": "mma", "W": 4, "U": 2, "WN": 1, "RT": 1, "KB": 1})


def _pdl_bases(N: int, K: int, bucket: int, cands: list[dict], most: int = 4) -> list[dict]:
    """Up to `most` candidates to copy with pdl=1: the tabled and default configs, then the usual winners."""
    tabled = config_for(N, K, bucket)
    first = [_clean(tabled)] if tabled.get("variant") in VARIANTS else []
    out = []
    for c in first + [default_config(N, K, bucket)] + [c for c in _PDL_USUAL if c in cands]:
        c = {k: v for k, v in c.items() if k != "pdl"}
        if c not in out and supports(N, K, bucket, c) is None:
            out.append(c)
    return out[:most]


_CFG_KEYS = {"simt": ("variant", "R", "W"), "mma": ("variant", "W", "U", "WN", "RT", "KB"),
             "wgmma": ("variant", "KS", "ST", "BN")}
_CFG_DEFAULTS = {"WN": 1, "RT": 1, "KB": 0, "PF": 0, "BN": 64}


def _clean(cfg: dict) -> dict:
    out = {k: cfg.get(k, _CFG_DEFAULTS.get(k)) for k in _CFG_KEYS[cfg["variant"]]}
    if cfg.get("pdl"):  # only when set: a pdl=0 config is the same dict (and kernel) as one without the key
        out["pdl"] = 1
    if cfg["variant"] == "wgmma" and cfg.get("GL"):      # likewise (wg_gather)
        out["GL"] = 1
    return out


def wg_gather() -> bool:
    """K3FUSE_WG_GATHER (default 1 since session 43): the wgmma kernels with split-K clusters (KS > 1) load every
    peer value of their cluster sum before the first sum and output store (config key GL, added by route). With 0,
    each accumulator entry's KS loads (inline asm with a memory clobber) issue after the previous entry's store, so a
    thread's NACC / KS entries are as many serial distributed-shared-memory round trips (codegen/sass.py on the sm_90a
    SASS: 32 -> 2). The same sums in the same order: bitwise. Measured -1.1..-3.1 us per KDA layer at M = 16, 64
    (s155 / s161). Read at each route; only "0" turns it off (set empty: the default, as K3FUSE_MLA_CMMA_PRE)."""
    return knobs.env("K3FUSE_WG_GATHER") != "0"


def _with_gather(cfg: Optional[dict]) -> Optional[dict]:
    return dict(cfg, GL=1) if cfg is not None and cfg.get("variant") == "wgmma" and cfg["KS"] > 1 and wg_gather() \
        else cfg


def config_for(N: int, K: int, bucket: int, gpu: Optional[str] = None) -> dict:
    """The kernel config to compile: the tuning table's (if it names a kernel), else the heuristic default."""
    cfg = tuning.lookup(FAMILY, (N, K), bucket, gpu)
    if cfg is None or cfg.get("variant") not in VARIANTS:
        return default_config(N, K, bucket)
    cfg = _clean(cfg)
    return cfg if supports(N, K, bucket, cfg) is None else default_config(N, K, bucket)


def route(N: int, K: int, M: int, gpu: Optional[str] = None,
          arch: Optional[str] = None) -> tuple[Optional[dict], str]:
    """(config, "") to run a generated kernel for this problem, or (None, reason) for the unfused path.

    The tuning table decides where it has an entry ({"variant": "torch"} where cuBLAS measured faster); without
    one, buckets up to 8 use the heuristic kernel and larger buckets the unfused path (on the H200, 2026-11-29,
    the mma kernel measured 2-3x slower than cuBLAS at M = 64: benchmarks/RESULTS.md)."""
    bucket = bucket_for(M)
    why = supports(N, K, bucket)
    if why:
        return None, why
    forced = wg_forced(N, K, bucket, arch)
    if forced is not None:
        return _with_gather(forced), ""
    cfg = tuning.lookup(FAMILY, (N, K), bucket, gpu)
    if cfg is not None:
        if cfg.get("variant") == "torch":
            return None, f"tuning table: cuBLAS faster for {N}x{K} at bucket {bucket}"
        cfg = _clean(cfg)
        if cfg["variant"] == "wgmma":             # a table / overlay entry measured on an sm_90 GPU
            why = wg_arch_supports(arch or _device_arch())
            if why:
                return None, f"tuning table names the wgmma variant for {N}x{K} at bucket {bucket}, but {why}"
        if supports(N, K, bucket, cfg) is None:
            return _with_gather(cfg), ""
    if bucket > 8:
        return None, f"no tuned kernel for {N}x{K} at bucket {bucket} (cuBLAS is faster above M = 8 by default)"
    return default_config(N, K, bucket), ""


# bytes per L2 bulk-prefetch instruction in the PDL prologue (one instruction per thread; a multiple of 16)
PF_CHUNK = 8192


def template_params(N: int, K: int, bucket: int, cfg: dict) -> dict:
    # PDL / PF_CHUNK are passed only with pdl=1 (the templates default PDL to off): see the module docstring
    pdl = dict(PDL=True, PF_CHUNK=PF_CHUNK) if cfg.get("pdl") else {}
    if cfg["variant"] == "wgmma":
        return dict(N=N, K=K, BM=bucket, KS=cfg["KS"], ST=cfg["ST"], BN=cfg.get("BN", 64),
                    **({"GL": True} if cfg.get("GL") else {}))      # absent when off: the same source
    if cfg["variant"] == "mma":
        S, W, U, KB = K // 32, cfg["W"], cfg["U"], int(cfg.get("KB", 0))
        return dict(N=N, K=K, BM=bucket, W=W, U=U, WN=cfg.get("WN", 1), RT=cfg.get("RT", 1), NT=max(1, bucket // 8),
                    KB=KB, OUTER=-(-S // (W * U)), PRED_S=(S // U) % W != 0 if KB else S % (W * U) != 0, PRED_M=True,
                    PRED_N=N % (16 * cfg.get("RT", 1) * cfg.get("WN", 1)) != 0, **pdl)
    nv = K // 8
    p = dict(N=N, K=K, BM=bucket, R=cfg["R"], W=cfg["W"], NORM=False, XF32=False, ACT="none", **pdl)
    p["ITERS"] = -(-nv // (32 * cfg["W"]))
    return p


# ------------------------------------------------------------------------------------------ fusions
# fusion = {"norm": bool, "eps": float, "x_fp32": bool, "act": "none" | "situ", "beta": float, "lbeta": float}
#   norm: fused RMSNorm (k3fuse::rms_norm(x, norm_w, eps) feeding the GEMV; x bf16 or fp32), its per-row scale applied
#         in the epilogue (the template's docstring)
#   act = "situ": SiTU-GLU epilogue over [gate; up] weight rows (k3fuse::situ_glu of the GEMV output)
# Only the simt variant has them so far (the buckets where it is the fastest kernel: M <= 4 on the H200).
NO_FUSION = {"norm": False, "eps": 1e-5, "x_fp32": False, "act": "none", "beta": 4.0, "lbeta": 25.0,
             "y_fp32": False}


def fusion_supports(N: int, K: int, bucket: int, cfg: dict, fusion: dict) -> Optional[str]:
    if not (fusion.get("norm") or fusion.get("act", "none") != "none" or fusion.get("y_fp32")):
        return None
    if cfg["variant"] != "simt":
        return f"fusions are generated for the simt variant only (not {cfg['variant']})"
    if fusion.get("act", "none") == "situ" and (N % 2 or (N // 2) % cfg["R"]):
        return f"SiTU-GLU epilogue needs N/2 a multiple of R={cfg['R']}"
    if fusion.get("act", "none") not in ("none", "situ"):
        return f"unknown epilogue {fusion['act']}"
    return None


# tuning-table family of the fused RMSNorm GEMV (benchmarks/fused_norm_tune.py): a simt config, or {"variant":
# "torch"} where the norm kernel + plain GEMV measured faster (codegen/registry.py rms_norm_linear_split_reason)
NORM_FAMILY = "gemv_norm"


def default_fused_config(N: int, K: int, bucket: int, fusion: dict, gpu: Optional[str] = None) -> dict:
    """The config of a fused simt GEMV. Norm only: the GPU table's NORM_FAMILY entry, else the plain GEMV's tuned
    simt config (the same main loop). With the SiTU-GLU epilogue a CTA reads 2R weight rows, so it mirrors the plain
    simt config with twice the rows, chosen from the plain simt timings of 2026-11-29 (RESULTS.md: R = 2-4 rows,
    W = 8 warps won at K = 7168 for M <= 4); those fused kernels were timed with an older default (R = 4, W = 4)."""
    situ = fusion.get("act", "none") == "situ"
    if not situ:
        # the RMSNorm scale sits in the epilogue, so a norm-only kernel has the plain simt main loop plus the norm
        # weight and x^2: its own table entry (NORM_FAMILY) first, else the plain kernel's tuned simt config
        for fam in (NORM_FAMILY, FAMILY):
            tuned = tuning.lookup(fam, (N, K), bucket, gpu)
            if tuned is not None and tuned.get("variant") == "simt":
                cfg = _clean(tuned)
                if supports(N, K, bucket, cfg) is None:
                    return cfg
    no = N // 2 if situ else N
    r_plain = 2 if bucket == 1 else 4
    r_pref = max(1, r_plain // 2) if situ else r_plain
    R = next(r for r in (r_pref, 2, 1) if no % r == 0)
    nv = K // 8
    W = 8 if nv >= 512 else next((w for w in (4, 2) if nv >= 32 * w), 1)
    return {"variant": "simt", "R": R, "W": W}


def render_source(N: int, K: int, bucket: int, cfg: Optional[dict] = None,
                  fusion: Optional[dict] = None) -> tuple[str, str, dict]:
    fusion = dict(NO_FUSION, **(fusion or {}))
    fused = fusion["norm"] or fusion["act"] != "none"
    cfg = _clean(cfg or (default_fused_config(N, K, bucket, fusion) if fused else default_config(N, K, bucket)))
    why = supports(N, K, bucket, cfg) or fusion_supports(N, K, bucket, cfg, fusion)
    if why:
        raise ValueError(why)
    template = f"gemv_{cfg['variant']}.py.jinja"
    params = template_params(N, K, bucket, cfg)
    if fused:
        params.update(NORM=bool(fusion["norm"]), XF32=bool(fusion["x_fp32"]), EPS=repr(float(fusion["eps"])),
                      ACT=fusion["act"], BETA=repr(float(fusion["beta"])), LBETA=repr(float(fusion["lbeta"])))
    if fusion["y_fp32"]:
        params["YF32"] = True
    return template, render(template, **params), cfg


_built: dict = {}


def build(N: int, K: int, bucket: int, cfg: Optional[dict] = None, arch: Optional[str] = None, load: bool = True,
          fusion: Optional[dict] = None):
    """Compiled kernel for (shape, bucket, config, fusion, arch); memoised so repeated calls skip rendering and
    hashing (the compile/disk-cache layer below is keyed by the rendered source)."""
    from .compile import compile_source, current_arch
    arch = arch or current_arch()
    memo = (N, K, bucket, repr(sorted((cfg or {}).items())), repr(sorted((fusion or {}).items())), arch, load,
            knobs.key(FAMILY))
    k = _built.get(memo)
    if k is not None:
        return k
    k = _build(N, K, bucket, cfg, arch, load, fusion, compile_source)
    _built[memo] = k
    return k


def _build(N, K, bucket, cfg, arch, load, fusion, compile_source):
    template, src, cfg = render_source(N, K, bucket, cfg, fusion)
    why = wg_arch_supports(arch) if cfg["variant"] == "wgmma" else None
    if why:
        raise ValueError(why)
    meta = dict(family=FAMILY, op="k3fuse::linear", shape=dict(N=N, K=K), bucket=bucket, config=cfg,
                template=template, fusion=fusion or {})
    return compile_source(src, arch, load=load, meta=meta)


def linear_fused(x, w, norm_w=None, eps: float = 1e-5, act: str = "none", beta: float = 4.0, lbeta: float = 25.0,
                 cfg: Optional[dict] = None, out=None):
    """situ_glu?(rms_norm?(x) @ w^T) in one launch. x [M, K] bf16 or fp32 (with norm_w), w [N, K] bf16.
    With act="situ" the output is [M, N / 2] (w = [gate; up])."""
    import torch
    M, K = x.shape
    N = w.shape[0]
    fusion = dict(norm=norm_w is not None, eps=eps, x_fp32=x.dtype == torch.float32, act=act, beta=beta,
                  lbeta=lbeta)
    k = build(N, K, bucket_for(M), cfg, fusion=fusion)
    no = N // 2 if act == "situ" else N
    y = out if out is not None else torch.empty(M, no, dtype=torch.bfloat16, device=x.device)
    if norm_w is not None:
        k(x, w, norm_w, y)
    else:
        k(x, w, y)
    return y


def linear_fp32_out(x, w, cfg: Optional[dict] = None, out=None):
    """y = x @ w^T with an fp32 output (fp32 accumulate, no bf16 rounding): the router logits. simt variant only.
    x [M, K] bf16 contiguous, w [N, K] bf16 contiguous, M <= 64."""
    import torch
    M, K = x.shape
    N = w.shape[0]
    k = build(N, K, bucket_for(M), cfg or fp32_out_config(N, K, bucket_for(M)), fusion=dict(y_fp32=True))
    y = out if out is not None else torch.empty(M, N, dtype=torch.float32, device=x.device)
    k(x, w, y)
    return y


def fp32_out_config(N: int, K: int, bucket: int) -> dict:
    """The fp32-output kernel's config: the tuned / heuristic simt config of the shape (the store is the only
    difference), else the simt default. Memoised (the router asks on every call)."""
    return dict(_fp32_out_config(N, K, bucket))


@tuning.memo
def _fp32_out_config(N: int, K: int, bucket: int) -> dict:
    cfg = config_for(N, K, bucket)
    return cfg if cfg["variant"] == "simt" else default_fused_config(N, K, bucket, {})


@tuning.memo
def fp32_out_supports(N: int, K: int, bucket: int) -> Optional[str]:
    """None if the fp32-output kernel exists for (N, K, bucket), else why not. Memoised (per-call check)."""
    return supports(N, K, bucket, _fp32_out_config(N, K, bucket))


def linear(x, w, cfg: Optional[dict] = None, out=None):
    """Launch the GEMV on the current stream. x [M, K] bf16 contiguous, w [N, K] bf16 contiguous, M <= 64."""
    import torch
    M, K = x.shape
    N = w.shape[0]
    bucket = bucket_for(M)
    cfg = cfg or config_for(N, K, bucket)
    k = build(N, K, bucket, cfg)
    y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    k(x, w, y)
    return y


# ------------------------------------------------------------------------------------------ grouped GEMV
# k3fuse::linear_group: G weights [N_i, K] that read the same x, in ONE launch (pass fuse_shared_input_linears).
# The same templates with a GROUP list (absent for single GEMVs, whose sources and cache keys do not change).
# Config: the single-GEMV config (tuning table / heuristic, route) of the concatenated shape, with every member
# padded to 16 rows (what the kernel's CTAs cover: 3206 -> 3216 rows for the KDA group at TP16); pdl is dropped
# (the prefetch prologue covers one weight tensor). Each member gets ceil(N_i / rows per CTA) CTAs.
GROUP_MAX = 8      # member pointers are selected by a chain of G - 1 compares


def _group_rows(Ns) -> int:
    return sum(-(-n // 16) * 16 for n in Ns)


def _group_cfg(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "pdl"}


def group_supports(Ns, K: int, bucket: Optional[int], cfg: Optional[dict] = None) -> Optional[str]:
    """None if a grouped kernel exists for these members, else why not."""
    if not 2 <= len(Ns) <= GROUP_MAX:
        return f"{len(Ns)} members (grouped kernels take 2..{GROUP_MAX})"
    if min(Ns) < 1:
        return "an empty member"
    if cfg is not None and cfg.get("variant") == "wgmma":
        return "the wgmma variant has no grouped form (one launch per member)"
    # rows past a member's end (a partial last CTA, even a whole 16-row tile of it) re-read the member's last row
    # and are not stored, so any member size works with any config the concatenated shape supports
    return supports(_group_rows(Ns), K, bucket, cfg)


def group_route(Ns, K: int, M: int, gpu: Optional[str] = None,
                arch: Optional[str] = None) -> tuple[Optional[dict], str]:
    """(config, "") for one grouped launch, or (None, reason): where the concatenated shape routes to cuBLAS,
    the group falls back too."""
    bucket = bucket_for(M)
    why = group_supports(Ns, K, bucket)
    if why:
        return None, why
    cfg, why = route(_group_rows(Ns), K, M, gpu, arch)
    if cfg is None:
        return None, why
    cfg = _group_cfg(cfg)
    why = group_supports(Ns, K, bucket, cfg)
    return (None, why) if why else (cfg, "")


def group_config_for(Ns, K: int, bucket: int, gpu: Optional[str] = None) -> dict:
    return _group_cfg(config_for(_group_rows(Ns), K, bucket, gpu))


def group_situ_config(cfg: dict) -> dict:
    """A group with a SiTU-GLU member gives that member's CTAs R / 2 gate + R / 2 up rows: R must be even, so an odd
    R (the R = 1 the tables pick at M = 1) is doubled; the other members then take 2 rows per CTA."""
    cfg = dict(cfg)
    if cfg.get("variant") == "simt" and cfg["R"] % 2:
        cfg["R"] *= 2
    return cfg


# tuning-table family of the grouped GEMV with a SiTU-GLU member (benchmarks/group_situ_tune.py), keyed like the
# plain group by its 16-row-padded concatenated shape
GROUP_SITU_FAMILY = "gemv_group_situ"


def group_situ_route(Ns, K: int, M: int, situ_members, gpu: Optional[str] = None) -> tuple[Optional[dict], str]:
    """(config, "") for the grouped GEMV with the SiTU-GLU epilogue on situ_members, or (None, why): the table's own
    entry where it has one, else the plain group's route with R made even (group_situ_config); None where the
    kernel does not take it (the mma buckets, a member that is not [gate; up] in R / 2-row tiles)."""
    cfg, why = group_route(Ns, K, M, gpu)
    if cfg is None:
        return None, why
    t = tuning.lookup(GROUP_SITU_FAMILY, (_group_rows(Ns), K), bucket_for(M), gpu)
    if t is not None and t.get("variant") == "simt" and cfg["variant"] == "simt":
        cfg = _clean(t)
    cfg = group_situ_config(cfg)
    why = group_supports(Ns, K, bucket_for(M), cfg) or group_situ_supports(Ns, K, bucket_for(M), cfg, situ_members)
    return (None, why) if why else (cfg, "")


def group_router_route(Ns, K: int, M: int, situ_members, gpu: Optional[str] = None) -> tuple[Optional[dict], str]:
    """(config, "") for the grouped GEMV whose last member (the MoE router's rows) has an fp32 output, or (None, why):
    the route of the same group without the fp32 distinction (group_situ_route with a SiTU member, else
    group_route), kept only where it is a simt config (the fp32 member is generated for the simt variant)."""
    situ_members = tuple(situ_members)
    cfg, why = group_situ_route(Ns, K, M, situ_members, gpu) if situ_members else group_route(Ns, K, M, gpu)
    if cfg is None:
        return None, why
    if cfg["variant"] != "simt":
        return None, f"the grouped fp32 (router) member is generated for the simt variant only (not {cfg['variant']})"
    return cfg, ""


def group_situ_supports(Ns, K: int, bucket: int, cfg: dict, situ_members) -> Optional[str]:
    """None if the grouped kernel can give the members in situ_members the SiTU-GLU epilogue with this config."""
    if not situ_members:
        return None
    if cfg["variant"] != "simt":
        return f"the grouped SiTU-GLU epilogue is generated for the simt variant only (not {cfg['variant']})"
    if cfg["R"] % 2:
        return f"R = {cfg['R']} is odd (a SiTU member's CTA takes R / 2 gate and R / 2 up rows)"
    for j in situ_members:
        if not 0 <= j < len(Ns) or Ns[j] % 2 or (Ns[j] // 2) % (cfg["R"] // 2):
            return f"member {j} ({Ns[j] if 0 <= j < len(Ns) else '?'} rows) is not [gate; up] in R / 2-row tiles"
    return None


def render_group_source(Ns, K: int, bucket: int, cfg: Optional[dict] = None, situ: Optional[tuple] = None,
                        f32: tuple = (), topk: Optional[tuple] = None) -> tuple[str, str, dict]:
    """situ = (member indices, beta, linear_beta): those members' outputs are situ_glu(x @ w^T) [M, N_i / 2];
    f32 = member indices whose outputs are fp32 (the router logits; simt only); topk = (the fp32 member j, k,
    renormalize, scale): the grid's last CTA also takes the router's top-k of member j's logits (group_topk_supports)."""
    Ns = [int(n) for n in Ns]
    members = tuple(situ[0]) if situ else ()
    f32 = tuple(f32)
    cfg = _clean(_group_cfg(cfg or group_config_for(Ns, K, bucket)))
    if members:
        cfg = group_situ_config(cfg)
    why = group_supports(Ns, K, bucket, cfg) or group_situ_supports(Ns, K, bucket, cfg, members)
    if not why and f32 and (cfg["variant"] != "simt" or set(f32) & set(members)
                            or not all(0 <= j < len(Ns) for j in f32)):
        why = f"fp32 members {list(f32)}: simt only, not a SiTU member (config {cfg})"
    if not why and topk:
        why = group_topk_supports(Ns, cfg, f32, topk)
    if why:
        raise ValueError(why)
    template = f"gemv_{cfg['variant']}.py.jinja"
    params = template_params(sum(Ns), K, bucket, cfg)
    tile = cfg["R"] if cfg["variant"] == "simt" else 16 * cfg.get("RT", 1) * cfg.get("WN", 1)
    group, t0 = [], 0
    for j, n in enumerate(Ns):
        t = (n // 2) // (tile // 2) if j in members else -(-n // tile)
        group.append(dict(N=n, T0=t0, T=t, SITU=j in members, **({"F32": j in f32} if f32 else {})))
        t0 += t
    params.update(GROUP=group, GPRED=any(n % tile for j, n in enumerate(Ns) if j not in members))
    if members:
        params.update(GSITU=True, BETA=repr(float(situ[1])), LBETA=repr(float(situ[2])))
    if f32:         # only when set, so that the other groups' sources and cache keys stay as they were
        params["GF32"] = True
    if topk:        # likewise
        j, k, renorm, scale = topk
        from .router_topk import rank_select
        params["TOPK"] = dict(J=j, E=Ns[j], K=k, RENORM=bool(renorm), SCALE=repr(float(scale)),
                              VPT=-(-Ns[j] // (32 * cfg["W"])), RANK=rank_select())
    if cfg["variant"] == "mma":
        params["PRED_N"] = False     # per-member row predication (GPRED) instead
    return template, render(template, **params), cfg


def build_group(Ns, K: int, bucket: int, cfg: Optional[dict] = None, arch: Optional[str] = None,
                load: bool = True, situ: Optional[tuple] = None, f32: tuple = (), topk: Optional[tuple] = None):
    from .compile import compile_source, current_arch
    arch = arch or current_arch()
    situ = (tuple(situ[0]), float(situ[1]), float(situ[2])) if situ else None
    f32 = tuple(f32)
    topk = (int(topk[0]), int(topk[1]), bool(topk[2]), float(topk[3])) if topk else None
    memo = ("group", tuple(Ns), K, bucket, repr(sorted((cfg or {}).items())), arch, load, situ, f32, topk,
            knobs.key(FAMILY))
    k = _built.get(memo)
    if k is not None:
        return k
    template, src, cfg = render_group_source(Ns, K, bucket, cfg, situ, f32, topk)
    op = ("k3fuse::linear_group_router_topk" if topk else "k3fuse::linear_group_router" if f32
          else "k3fuse::linear_group_situ" if situ else "k3fuse::linear_group")
    meta = dict(family=FAMILY, op=op, shape=dict(N=list(Ns), K=K), bucket=bucket, config=cfg, template=template)
    if situ or f32:
        meta["fusion"] = dict(situ_members=list(situ[0]) if situ else [], beta=situ[1] if situ else None,
                              lbeta=situ[2] if situ else None, **({"f32_members": list(f32)} if f32 else {}),
                              **({"topk": list(topk)} if topk else {}))
    k = compile_source(src, arch, load=load, meta=meta)
    _built[memo] = k
    return k


def linear_group(x, ws, cfg: Optional[dict] = None, outs=None, situ: Optional[tuple] = None, f32: tuple = (),
                 topk: Optional[tuple] = None, bias=None, sel=None):
    """[x @ w^T for w in ws] in one launch on the current stream. x [M, K] bf16 contiguous, each w [N_i, K] bf16
    contiguous and 16-byte aligned, M <= 64. situ = (member indices, beta, linear_beta): those outputs are
    situ_glu(x @ w^T, beta, linear_beta), [M, N_i / 2] (simt configs only: group_situ_supports). f32 = member
    indices with fp32 outputs (the router logits; simt configs only). topk = (j, k, renormalize, scale) with bias
    (fp32 [N_j]): the router's selection of member j's logits in the same launch; returns ys + [ids, weights]
    (into sel = (ids [M, k] int64, weights [M, k] fp32) if given)."""
    import torch
    M, K = x.shape
    Ns = [w.shape[0] for w in ws]
    bucket = bucket_for(M)
    k = build_group(Ns, K, bucket, cfg or group_config_for(Ns, K, bucket), situ=situ, f32=f32, topk=topk)
    members = tuple(situ[0]) if situ else ()
    ys = outs if outs is not None else [torch.empty(M, n // 2 if j in members else n,
                                                    dtype=torch.float32 if j in f32 else x.dtype,
                                                    device=x.device) for j, n in enumerate(Ns)]
    if not topk:
        k(x, *ws, *ys)
        return ys
    ids, wts = sel if sel is not None else (torch.empty(M, topk[1], dtype=torch.int64, device=x.device),
                                            torch.empty(M, topk[1], dtype=torch.float32, device=x.device))
    k(x, *ws, *ys, bias, ids, wts, arrival_counter(x.device))
    return list(ys) + [ids, wts]


# The last-CTA selection's arrival counter: one int32 per device, zero between launches (the grid's last CTA re-arms
# it). Shared by every such launch on the device: under the PDL chain a kernel touches it only after its wait for
# the previous grid, so two launches never count at once; kernels on concurrent streams must not share it.
_counters: dict = {}


def arrival_counter(device):
    import torch
    c = _counters.get(device)
    if c is None:
        c = _counters[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return c


def group_topk_supports(Ns, cfg: dict, f32, topk) -> Optional[str]:
    """None if the grouped simt kernel can take the router's selection of member topk[0] in its last CTA."""
    j, k = topk[0], topk[1]
    if cfg.get("variant") != "simt":
        return f"the last-CTA selection is generated for the simt variant only (not {cfg.get('variant')})"
    if j not in tuple(f32):
        return f"member {j} is not an fp32 (logits) member"
    if not 1 <= k <= 32 or k > Ns[j]:
        return f"top_k = {k} of {Ns[j]} experts (1..32: one warp reduces the scores)"
    if -(-Ns[j] // (32 * cfg["W"])) > 32:
        return f"{Ns[j]} experts over {32 * cfg['W']} threads: more than 32 per thread"
    return None
