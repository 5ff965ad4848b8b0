"""Every K3FUSE_* environment variable, in one table.

Why one table: a variable read while a kernel is rendered changes its source, so every build memo must key on it. A
memo that missed one handed back a stale kernel in one process (kda_recurrent, session 38). Here each variable names
the kernel families whose source it can change (`families`), and `key(family)` is what a family's build memo keys on.
tests/test_knobs.py renders every kernel of the K3 configs with reads recorded, and fails if a family reads a variable
not listed for it, or if a module reads one that is not in this table.

Reading: `env(name)` returns the variable's value, or the table's `unset` value when it is not set. The caller parses
it as before; an empty `unset` means the caller's table or heuristic decides. `k3fuse knobs` prints the table.

Kinds:
- path: which implementation runs (kernels on / off, one launch or two, streams); a user's switch.
- setting: a location or a table (cache and debug folders, tuning overlays, config overrides).
- measured: a variant A/B'd on the H200; the default is the one that measured faster (the doc says where).
- unmeasured: an opt-in variant not yet run on a GPU; it stays off until an A/B says otherwise, and goes if it loses.
- diagnostic: timestamps for the benchmarks' timelines; off in production.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Optional

KINDS = ("path", "setting", "measured", "unmeasured", "diagnostic")

# the families of codegen/*.py (their FAMILY); a kernel's build memo keys on key(family)
GEMV, FRN, KDA, MLA, MOE = "gemv", "fused_residual_norm", "kda_recurrent", "mla_attention", "moe_experts"
TOPK, PREFETCH, MIXNORM_AR, ALLGATHER = "router_topk", "prefetch_l2", "mixnorm_allreduce", "allgather_oneshot"
FAMILIES = (GEMV, FRN, KDA, MLA, MOE, TOPK, PREFETCH, MIXNORM_AR, ALLGATHER)


@dataclass(frozen=True)
class Knob:
    name: str
    unset: str                 # what env() returns when the variable is not set ("": the caller's table decides)
    kind: str
    families: tuple = ()       # kernel families whose kernels it can change: read at render or by build, or it
                               # picks the variant the launcher builds (their build memos key on it)
    doc: str = ""


_K = Knob
TABLE: tuple[Knob, ...] = (
    # --- paths --------------------------------------------------------------------------------------------------
    _K("K3FUSE_KERNELS", "1", "path", (), "0: register no CUDA kernels; every k3fuse op takes its unfused path"),
    _K("K3FUSE_DISABLE_KERNELS", "", "path", (),
       "comma-separated op names (kda_recurrent,moe_experts, ...) kept on the unfused path, to bisect a layer"),
    _K("K3FUSE_GROUPED_GEMV", "1", "path", (),
       "0: one k3fuse::linear per weight instead of one launch per group of linears sharing an input (session 3: the "
       "KDA TP16 group 28.7 -> 13.5 us)"),
    _K("K3FUSE_ROUTER_TOPK", "1", "path", (), "0: the router's top-k on the ATen path instead of its kernel"),
    _K("K3FUSE_ROUTER_GEMV", "1", "path", (),
       "0: the router logits by cuBLAS (two launches at M <= 8) instead of the fp32-output GEMV (one)"),
    _K("K3FUSE_TOPK_IN_GROUP", "1", "path", (),
       "0: the MoE group, then the top-k kernel; 1 (session 10): the selection in the group's last CTA, one launch"),
    _K("K3FUSE_FRN_ONE_KERNEL", "1", "path", (),
       "0: the o_proj GEMV + mix-norm kernel pair at M = 1 too, instead of one launch with a grid barrier"),
    _K("K3FUSE_FRN_ONE_MAX_M", "", "path", (),
       "1, 2 or 4: the largest batch on the one-launch fused_residual_norm (unset: ONE_MAX_M_DEFAULT = 1; M = 2..4 "
       "measured slower in sessions 21 and 23)"),
    _K("K3FUSE_NORM_LINEAR_MAX_MB", "64", "path", (),
       "the largest weight (MB) that takes the fused RMSNorm + linear kernel; 16 restores the old limit"),
    _K("K3FUSE_GROUP_STREAMS", "", "path", (),
       "N: linear groups of N or more library GEMMs (M = 17..64) run them on side streams inside the graph; 0 "
       "never (unset: GROUP_STREAMS_DEFAULT = 4; session 32: -18..-26 us per layer at M = 32, 64)"),
    _K("K3FUSE_MLA_HEADS", "", "path", (MLA,),
       "1 / 0: the per-head MLA kernel (q_b, qabsorb, split and combine in one launch) wherever it applies / "
       "nowhere; unset: HEADS_BY_HEADS (TP16 M = 1, 2)"),
    _K("K3FUSE_MLA_QB", "1", "path", (MLA,),
       "0: the per-head MLA kernel does not compute q itself (q_b launched apart)"),
    _K("K3FUSE_INKERNEL_COLLECTIVES", "", "path", (),
       "1: the registry may route all-reduce / all-gather to the in-kernel one-shot kernels over peer buffers "
       "(multi-GPU; opt-in: only TP = 2 has run across GPUs)"),
    _K("K3FUSE_VLLM_MAX_TOKENS", "", "path", (),
       "the vLLM pass applies only to compile ranges up to this many tokens (unset: every range)"),
    # --- settings -----------------------------------------------------------------------------------------------
    _K("K3FUSE_CACHE_DIR", "", "setting", (), "the compiled kernels' disk cache (unset: ~/.cache/k3fuse/kernels)"),
    _K("K3FUSE_DEBUG_DIR", "", "setting", (),
       "where the backend writes each graph before and after the passes (the debug_dir option's default)"),
    _K("K3FUSE_TUNING_OVERLAY", "", "setting", (),
       "a JSON tuning table laid over the GPU's packaged table ('' or 'none': no overlay; benchmarks' A/Bs)"),
    _K("K3FUSE_MOE_CONFIG", "", "setting", (MOE,),
       "knob values laid over the MoE table's config at every shape and bucket, e.g. KS=2:SB=2 (layer A/Bs)"),
    # --- measured variants (the default is the faster) -------------------------------------------------------------
    _K("K3FUSE_PDL_CHAIN", "1", "measured", (GEMV, FRN, KDA, MLA, MOE, TOPK),
       "the layer's kernels as a programmatic-dependent-launch chain (session 6: -10 us per layer at TP16 M = 1)"),
    _K("K3FUSE_GEMV_WGMMA", "0", "measured", (GEMV,),
       "1: the TMA + wgmma GEMM at buckets 16-64 everywhere it applies (session 36: the H200 table names it only at "
       "the 23 entries where it won)"),
    _K("K3FUSE_MIXNORM_CLUSTER", "8", "measured", (FRN,),
       "CTAs per row of the mix-norm kernel, 1..8 (session 9: 8.76 -> 3.74 us at 8 blocks, C = 1 -> 8)"),
    _K("K3FUSE_MIXNORM_PUSH", "1", "measured", (FRN,),
       "the cluster mix-norm gathers its totals by st.async pushes; 0: DSMEM loads between cluster barriers "
       "(session 27)"),
    _K("K3FUSE_FRN_LEAN_TAIL", "1", "measured", (FRN,),
       "the one-launch kernel's barrier tail without the per-thread fence (session 12: -0.3..-0.4 us per kernel)"),
    _K("K3FUSE_FRN_SPIN_NS", "64", "measured", (FRN,),
       "the one-launch barrier's sleep between polls (0 / 64 / 256: alike)"),
    _K("K3FUSE_FRN_PRELOAD", "", "measured", (FRN,),
       "0 / 1 / 2: how the one-launch projection orders its loads (unset: PRELOAD_DEFAULT = 1, every weight load "
       "first)"),
    _K("K3FUSE_ROUTER_FIRST", "1", "measured", (),
       "the router as the MoE group's first member, so the selection overlaps the other members' streams "
       "(session 13: the group 23.2 -> 20.9 us)"),
    _K("K3FUSE_TOPK_RANK", "1", "measured", (TOPK, GEMV),
       "the top-k selection by a threshold and ranks; 0: k rounds of a block max (session 12: the group -2.4 us)"),
    _K("K3FUSE_KDA_LPR", "", "measured", (KDA,),
       "lanes per S row of kda_decode, 1, 2 or 4 (unset: DEFAULT_LPR = 2; session 12: 4 alike, 1 slower)"),
    _K("K3FUSE_MLA_MMA", "1", "measured", (MLA,), "the split kernel's score step on tensor cores (session 16)"),
    _K("K3FUSE_MLA_PVMMA", "1", "measured", (MLA,), "the split kernel's PV step on tensor cores (session 34)"),
    _K("K3FUSE_MLA_PIPE", "", "measured", (MLA,),
       "1 / 0: the split kernel's register tile pipeline on / off (unset: on, except M = 1 with > 8 heads on CUDA "
       "cores; session 15, 16)"),
    _K("K3FUSE_MLA_ASYNC", "", "measured", (MLA,),
       "0 / 1 / 2: the split kernel's cp.async tile ring (unset: ASYNC_BY_HEADS, h = 6 buckets 16-64; session 37: "
       "-3..-8 us there, +9..+14 at h = 12)"),
    _K("K3FUSE_MLA_CMMA", "", "measured", (MLA,),
       "1 / 0: the combine on tensor cores from CMMA_MIN_BUCKET / nowhere (unset: CMMA_BY_HEADS; sessions 33, "
       "34, 37)"),
    _K("K3FUSE_MLA_CMMA_TOK", "", "measured", (MLA,),
       "8 / 4: tokens per CTA of the tensor-core combine (unset: CMMA_TOK_BY_HEADS; session 37)"),
    _K("K3FUSE_MLA_CPRE", "", "measured", (MLA,),
       "N: the CUDA-core combine's first N splits' partials loaded at its start (unset: CPRE_DEFAULT = 32)"),
    _K("K3FUSE_MLA_CBATCH", "", "measured", (MLA,),
       "RB: the combine's W_UV rows RB per warp at a time where not hoisted (unset: CBATCH_DEFAULT = 8; session 33: "
       "-4.4 / -10.1 us at M = 64)"),
    _K("K3FUSE_MLA_CTAS_PER_SM", "", "measured", (),
       "the split kernel's CTAs per SM that its split count aims at (unset: CTAS_PER_SM_BY_HEADS / _BY_BUCKET, "
       "else 2; a launch-time value)"),
    _K("K3FUSE_MLA_MIN_TILES", "", "measured", (),
       "the fewest 32-token tiles per split at M > 1 (unset: MIN_TILES_PER_SPLIT = 2; a launch-time value)"),
    _K("K3FUSE_MLA_VS", "0", "measured", (MLA,),
       "the combine's row splits (0: the splits table's; a measurement knob)"),
    _K("K3FUSE_MLA_SCORE_HPT", "0", "measured", (MLA,),
       "heads per thread in the CUDA-core score step (0: the fewest that cover the heads; a measurement knob)"),
    _K("K3FUSE_MLA_HEADS_CL", "", "measured", (MLA,),
       "the per-head kernel's largest cluster (unset: HEADS_CL_BY_HEADS, else HEADS_CL)"),
    _K("K3FUSE_MLA_HEADS_MMA", "1", "measured", (MLA,),
       "the per-head kernel's tiles on tensor cores (session 28: -1.64 us per MLA layer at TP16 M = 1)"),
    _K("K3FUSE_MLA_PUSH", "1", "measured", (MLA,),
       "the per-head kernel's cluster gathers by st.async pushes (session 27: -2.3 us per MLA layer at TP16 M = 1)"),
    _K("K3FUSE_MLA_QFIRST", "1", "measured", (MLA,),
       "the per-head kernel loads cq before the first tile's cache rows (session 29: -1.06 us at TP16 M = 1)"),
    _K("K3FUSE_MOE_UP_MMA", "", "measured", (MOE,),
       "1 / 0: the routed up on tensor cores at every grouped bucket / never (unset: the GPU table, else from "
       "bucket 16)"),
    _K("K3FUSE_MOE_DOWN_MMA", "", "measured", (MOE,),
       "1 / 0: the routed down on tensor cores + a combine kernel (unset: the GPU table, else from "
       "DOWN_MMA_MIN_BUCKET)"),
    _K("K3FUSE_MOE_DOWN_UD", "", "measured", (MOE,),
       "k-steps per load group of the tensor-core down (unset: 3; session 18)"),
    _K("K3FUSE_MOE_DOWN_CTAS", "", "measured", (MOE,),
       "the tensor-core down's grid cap (unset: the table's, else DOWN_CTAS; session 33)"),
    _K("K3FUSE_MOE_UP_CTAS", "", "measured", (MOE,),
       "the tensor-core up's grid cap (unset: the table's, else UP_MMA_CTAS; session 33)"),
    _K("K3FUSE_MOE_DOWN_AX", "", "measured", (MOE,),
       "1 / 0: the per-slot down loads all its W2 vectors ahead of its FMAs (unset: where AX_MEASURED lists)"),
    _K("K3FUSE_MOE_DOWN_AXB", "", "measured", (MOE,),
       "N: with AX, the per-slot down's W2 loads N slots per batch (unset: AX_MEASURED's entry; 0: all at once; "
       "session 41)"),
    _K("K3FUSE_MOE_DOWN_EARLY", "", "measured", (MOE,),
       "1 / 0: the per-slot AX down loads its ids and first W2 batch before its PDL wait, the simt up triggers after "
       "its wait (unset: where EARLY_MEASURED lists; session 46: -0.7 / -0.9 us at TP8 M = 1)"),
    _K("K3FUSE_MOE_DOWN_WE", "1", "measured", (MOE,),
       "the tensor-core down's ballot member scan and per-warp epilogue (session 33: -34.5 us at TP8 M = 64)"),
    _K("K3FUSE_MOE_UP_BALLOT", "1", "measured", (MOE,),
       "the tensor-core up's member scan by warp ballots (session 33)"),
    _K("K3FUSE_MOE_MEMBER_LISTS", "1", "measured", (MOE,),
       "the up writes member lists that the down reads instead of scanning the ids (session 35: -0.7..-4.8 us)"),
    _K("K3FUSE_WG_GATHER", "1", "measured", (GEMV,),
       "0: the wgmma split-K cluster sum loads each peer value after the previous store (1, session 43's default: "
       "every peer value first; s155 / s161: -1.1..-3.1 us per KDA layer at M = 16, 64; bitwise)"),
    _K("K3FUSE_MLA_CMMA_PRE", "5", "measured", (MLA,),
       "N: the 4-token tensor-core combine's gate values and first N partials loaded at its start; 0 off (session "
       "43's default 5; s155: with WG_GATHER -1.2..-4.7 us per MLA layer at M = 16, 64; bitwise)"),
    # --- diagnostics ------------------------------------------------------------------------------------------------
    _K("K3FUSE_FRN_STAMPS", "0", "diagnostic", (FRN,),
       "1: the one-launch kernel writes phase timestamps (frn_timeline.py)"),
    _K("K3FUSE_KDA_STAMPS", "0", "diagnostic", (KDA,), "1: kda_decode writes phase timestamps (frn_timeline.py)"),
    _K("K3FUSE_MLA_STAMPS", "0", "diagnostic", (MLA,),
       "1: the per-head kernel writes phase timestamps (mla_timeline.py)"),
)
KNOBS: dict[str, Knob] = {k.name: k for k in TABLE}

# Variables that existed once: variants measured no faster and removed (RESULTS.md, the session named, has the numbers).
# Setting one does nothing; unknown_set() names them so that a stale A/B setting is not mistaken for a measurement.
REMOVED: dict[str, str] = {
    "K3FUSE_TOPK_VARIANT": "session 5: the router top-k's block variant",
    "K3FUSE_TOPK_ROUNDS": "session 6: the top-k rounds' key width",
    "K3FUSE_GEMV_LATE_TRIGGER": "session 7: the GEMV's PDL trigger after its loads (kept as the only form)",
    "K3FUSE_WEIGHT_PREFETCH": "session 7: L2 prefetch of the weights by the GEMVs' CTAs",
    "K3FUSE_GEMV_WSMEM": "session 8: GEMV weights into shared memory before the chain's wait",
    "K3FUSE_EXPERIMENTAL_KERNELS": "session 8: the opt-in kernel families' switch (each has its own now)",
    "K3FUSE_TOPK_TWO_STAGE": "session 9: per-warp top-k lists merged by one warp",
    "K3FUSE_FRN_PARTIALS": "session 13: the one-launch kernel's statistics as per-CTA partials",
    "K3FUSE_MOE_UP_LATE_TRIGGER": "session 13: the routed up's late PDL trigger",
    "K3FUSE_EARLY_WEIGHTS": "session 14: the simt GEMVs' weights loaded before the chain's wait",
    "K3FUSE_MOE_UP_CHUNK": "session 17: the routed up's column chunks",
    "K3FUSE_MOE_DOWN_GROUP": "session 17: the grouped per-slot down",
    "K3FUSE_FRN_STAT_ALL_WARPS": "session 21: the statistics reduced by every warp",
    "K3FUSE_GEMV_XS": "session 22: the simt GEMVs' x staged in shared memory",
    "K3FUSE_KDA_CLUSTER": "session 23: kda_decode on a cluster of CTAs per (token, head)",
    "K3FUSE_MLA_PF2": "session 27: the per-head kernel's second tile loaded with the first",
    "K3FUSE_MLA_WMAX": "session 27: the tile max from warp maxima",
    "K3FUSE_MLA_HEADS_PF": "session 28: the per-head kernel's tiles two ahead",
    "K3FUSE_MLA_TILE2": "session 28: the per-head softmax in every warp",
    "K3FUSE_MLA_HEADS_TMA": "session 30: the per-head kernel's tiles by bulk copies",
    "K3FUSE_FRN_SPREAD": "session 31: the statistics atomics spread over accumulator copies",
    "K3FUSE_KDA_EARLY": "session 31: kda_decode's own-state loads before the chain's wait",
    "K3FUSE_MLA_EARLY": "session 31: the per-head kernel's first cache tile before the chain's wait (session 38's "
                        "qabsorb / combine variant, K3FUSE_MLA_LOADS_FIRST, went in session 43)",
    "K3FUSE_FRN_EARLY_W": "session 32: the one-launch kernel's weights before the chain's wait",
    "K3FUSE_MOE_PASS_OWNERS": "session 35: the routed down's pass owners",
    "K3FUSE_MLA_QTB": "session 35: qabsorb over several tokens per CTA",
    "K3FUSE_MLA_ONE_KERNEL": "session 39: the MLA attention's three kernels as one launch with two grid barriers "
                             "(sessions 15-23: slower at TP16 and TP8)",
    "K3FUSE_MLA_ONE_PREFETCH": "session 39: that one launch's L2 prefetch",
    "K3FUSE_MOE_DOWN_RING": "session 41: the tensor-core down's W2 tiles through a cp.async ring (TP16 M = 32 "
                            "+7.4 / +8.7 us, M = 64 +2.3 / +0.6 on an H100)",
    "K3FUSE_KDA_FB_FIRST": "session 41: kda_decode's f_b loads before the conv warps' (SASS 18 -> 5 waits; -0.1 / "
                           "-0.2 us per layer at TP16 / TP8 M = 1, within noise)",
    "K3FUSE_GEMV_SPLITK": "session 39: the split-K mma GEMV (gemv_mma_sk; session 19: slower than cuBLAS on 13 of 14 "
                          "K3 cases at M = 16-64, where the wgmma GEMM now runs)",
    "K3FUSE_MLA_LOADS_FIRST": "session 43: qabsorb's and the CUDA-core combine's independent loads first (s161: "
                              "-0.30 / -0.25 / -0.15 us per MLA layer at M = 1, 4 on an H100, 4-5 / 8 pairs: noise)",
    "K3FUSE_KDA_FA_SMEM": "session 39: kda_decode's fa staged in shared memory (session 7: 6.0 -> 6.3 us, slower)",
    "K3FUSE_MLA_QB3": "session 48: q_b inside the three MLA launches' first kernel, clusters of 8 per (head, row) "
                      "(88348df; TP8 M = 1 +1.94 us, 0 / 12, on an H100: 11 -> 10 kernels, slower)",
    "K3FUSE_MLA_QB3_CL": "session 48: that kernel's cluster size (16: +13.63 us)",
}
_BY_FAMILY: dict[str, tuple] = {f: tuple(k.name for k in TABLE if f in k.families) for f in FAMILIES}
_reads: Optional[list] = None


def env(name: str) -> str:
    """The variable's value, else the table's `unset`. A name not in TABLE is an error: register it first."""
    k = KNOBS.get(name)
    if k is None:
        raise KeyError(f"{name} is not in codegen/knobs.py's TABLE: add it there (its kind, families and doc)")
    if _reads is not None:
        _reads.append(name)
    return os.environ.get(name, k.unset)


def integer(name: str, default: Optional[int]) -> Optional[int]:
    """env(name) as an int: `default` when it is empty (unset with an empty `unset`, or set to ""); a value that is
    not an integer raises a ValueError that names the variable and what it sets."""
    v = env(name).strip()
    if v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name}={v!r}: an integer expected ({KNOBS[name].doc})") from None


def key(family: str) -> tuple:
    """The raw values of the variables that can change `family`'s rendered source: part of its build memo's key."""
    return tuple(os.environ.get(n) for n in _BY_FAMILY[family])


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Collect the names env() reads inside the block (tests/test_knobs.py)."""
    global _reads
    prev, _reads = _reads, []
    try:
        yield _reads
    finally:
        _reads = prev


def describe(kinds: Optional[tuple] = None) -> list[dict]:
    """The table with each variable's value in this process (`k3fuse knobs`)."""
    return [dict(name=k.name, kind=k.kind, value=os.environ.get(k.name), unset=k.unset, families=list(k.families),
                 doc=k.doc) for k in TABLE if kinds is None or k.kind in kinds]


def unknown_set() -> list[str]:
    """K3FUSE_* variables set in this process that k3fuse does not read: removed ones (REMOVED says since when) or
    misspellings. Each does nothing; the backend logs them once."""
    out = []
    for n in sorted(v for v in os.environ if v.startswith("K3FUSE_") and v not in KNOBS):
        out.append(f"{n} ({REMOVED[n]}, since removed)" if n in REMOVED else f"{n} (not a k3fuse variable)")
    return out
