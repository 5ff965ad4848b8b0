#!/bin/bash
# GPU checks and A/Bs, one device call each on an nvidia-h200 (each part < 10 minutes):
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh tests     # GPU suite + compute-sanitizer + graphs
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh table     # fused-norm configs, layer + GEMV tables
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh fusions   # session 8's two epilogue fusions: A/B
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s8c5      # layer twice + small-GEMV tuning
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh pending        # session 8's opt-in kernels
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh pending_layer  # their layer A/B
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh router         # the router in the MoE group
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s9final        # its memcheck + the layer table
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh topk_in_group  # the top-k in the group (s10)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s10            # the MLA glue in its kernels
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s11            # fused_residual_norm in one launch
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s11t           # then the README table + model
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s12            # session 11's unrun source + lean tail
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s13            # session 12's unrun memcheck, router first A/B
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s13b           # frn partials A/B
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s13t           # the README table
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s14            # K3FUSE_EARLY_WEIGHTS (since removed): tests, memcheck, A/B
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh ab K3FUSE_X=0,1   # paired A/B in one process (layer_ab.py)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s14t           # e2e + README table + TP8, EW default
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s15            # the one-launch MLA attention
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s16            # session 15's unrun MMA score step
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s16b           # MMA default: tests, pipeline A/B, README table
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s16c           # TP8 table (s16d: MLA max-autotune row)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s17            # end to end uncut, M = 64, max-autotune
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s18m           # K3FUSE_MOE_UP_MMA: tests, memcheck, layer A/B; profiles without the PDL chain
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s18t           # UP_MMA default: tests, A/B at TP8, tables M = 8, 64
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s18u           # the table-driven UPMMA: tests, which up kernel runs, A/B M = 2, 4, e2e M = 8
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s19            # session 17's unrun K3FUSE_MOE_DOWN_MMA: tests, memcheck, layer A/Bs, profile
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s20            # the down from the table; its UD A/Bs; TP8 M = 8 up A/B
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s21            # the down's grid cap A/Bs; the M = 64 (TP16, TP8) and TP8 M = 8 rows
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s22            # e2e M = 64; TP8 rows with the table's DCTAS; moe tests
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s23            # the down's A/B at TP16 bucket 32, TP8 16 and 32
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s24            # session 18's unrun split-K GEMM: tests, memcheck, tune at M = 32 / 64
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s26            # M = 1 MoE configs re-tuned with rotated routings, layer A/B old vs new
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s27            # TP8 M = 1 down: slot parallelism A/B'd in the layer, then the rows
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s156           # (not run) K3FUSE_MOE_DOWN_AXB=1 (AX's W2 loads one slot per batch, M = 1): tests, memcheck, A/Bs
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s155           # (not run) s152-s154's three bitwise variants together: smoke, tests, memcheck, one summed A/B
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s154           # (not run) K3FUSE_MLA_EARLY=1 (qabsorb's and the combine's independent loads first): tests, memcheck, A/Bs
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s153           # (not run) K3FUSE_WG_GATHER=1 (the wgmma cluster sum's loads first): tests, memcheck, A/Bs
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s152           # (not run) K3FUSE_MLA_CMMA_PRE=N (the combine's merge-independent loads first): tests, memcheck, A/Bs
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s151           # (not run) K3FUSE_MOE_DOWN_RING=1 (the routed down's W2 tile ring, TP16): tests, memcheck, A/Bs
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s150           # (not run) ncu of the M = 64 MLA split / combine with session 37's defaults
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s149           # (not run) session 37's MLA defaults summed (layer_ab --arms); split counts
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s148           # (session 37) h = 6's last defaults: MLA GPU tests at M >= 16, TP16 M = 32, 64 rows
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s147           # (session 37) the final MLA defaults' remaining GPU tests; s146's A/Bs
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s146           # (session 37) the 4-token combine at TP16 M = 16, 32; then s139
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s145           # (session 37) the ring + 4-token combine defaults: MLA GPU tests, TP8 M = 16-32 A/B, M = 64 rows, e2e
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s144           # (session 37) the 4-token combine; the ring's mode 2 at TP8; the ring at TP16 M = 16-32
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s143           # (superseded by s144 / s145) K3FUSE_MLA_ASYNC=1 at M = 8-32; all MLA GPU tests with it
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s142           # (session 37) K3FUSE_MLA_ASYNC=1 (cp.async tile ring): tests, memcheck, A/Bs M = 8-64
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s141           # (run as part of s144) K3FUSE_MLA_CMMA_TOK=4: bitwise tests, memcheck, A/Bs M = 16-64
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s140           # (not run) why 3216x7168's wgmma entry at bucket 16 lost in the layer
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s139           # (not run) wgmma clusters of 14-16: tests, memcheck, shapes, A/B
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s138           # the wgmma table entries: tests, M = 64 rows, e2e M = 64, 16
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s137           # the refined wgmma overlay: A/Bs M = 16-64
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s136           # the wgmma GEMM in the layer: A/Bs M = 16-64
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s135           # the TMA + wgmma GEMM: tests, memcheck, shapes vs cuBLAS
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s134           # DOWNMMA at TP8 M = 2, 4; UPMMA at TP16 M = 16, 32
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s133           # MoE GPU tests with the member lists (default); TP8 M = 2, 4 rows
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s132           # (session 35) K3FUSE_MLA_QTB: tests, memcheck, A/Bs M = 64, 32, 8
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s131           # (session 35) s129's follow-ups: member lists at M = 32, TP8 16 / 8, the down's grid cap
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s130           # (session 35) every MLA GPU test with session 34's defaults: 493 passed
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s129           # (session 35; PASS_OWNERS removed since) PASS_OWNERS + MEMBER_LISTS: tests, A/Bs M = 64
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s128           # (not run) ncu of the M = 64 layer's own kernels (MLA split, CMMA combine, up / down MMA)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s127           # (not run; superseded by s133 + s134) TP8 M = 2, 4 rows; untimed variant buckets
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s126           # s119's MoE MMA A/Bs at small M (no ncu)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s125           # PVMMA with its k-blocks rolled: tests, A/B TP8; the default-path MLA tests
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s124           # CMMA (table) + PVMMA defaults: MLA GPU tests, the M = 64 rows
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s123           # CMMA and PVMMA paired A/Bs at M = 64; CMMA at M = 32, 16
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s122           # session 33's unrun GPU tests first: CMMA, PVMMA, the MoE refactor; memchecks
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s121           # (not run: s122, s123, s125 instead) K3FUSE_MLA_PVMMA: tests, memcheck, A/Bs
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s120           # (not run: s122, s123 instead) K3FUSE_MLA_CMMA: tests, memcheck, A/Bs M = 16-64
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s119           # (its A/Bs ran as s126; ncu not run) MoE MMA variants at small M again; ncu MLA M = 64
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s118           # the new scans at M = 2..8
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s117           # MoE MMA tests, TP8 M = 16 up cap, M = 64 rows, e2e M = 64
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s116           # the up kernels' grid cap with the ballot scan
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s115           # MoE GPU tests; K3FUSE_MOE_UP_BALLOT A/Bs; TP8 M = 16 cap
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s114           # the down's grid cap with WE on
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s113           # K3FUSE_MOE_DOWN_WE: tests, memcheck, A/Bs M = 64, 32
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s112           # ncu: the routed experts' MMA kernels at M = 64
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s111           # K3FUSE_MLA_CBATCH: tests, memcheck, A/Bs at M = 64 (+ streams tests)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s110           # the MLA combine's preload 32 vs 16 at M = 64
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s109           # MLA GPU tests with the 4x1 splits
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s108           # the MLA combine's row splits at M = 64 (4 vs 1)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s107           # the M = 64 per-kernel ledger without the PDL chain
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s106           # MLA splits 17 vs 32 at M = 64; group streams TP8 M = 32
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s105           # the new defaults: tests, memcheck, M = 64 rows, e2e M = 64
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s104           # which groups gain on streams; MLA splits at M = 32, 64
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s103           # K3FUSE_GROUP_STREAMS: tests, A/B M = 64; MLA splits at M = 64
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s102           # the M = 64 rows with the op ledger (k3fuse only)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s101           # (run in session 32; K3FUSE_FRN_EARLY_W since removed) tests, the layer A/B
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s100           # kda_decode + fused_residual_norm stamps on one time axis (failed once: see frn_timeline.py)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s99            # (at 8dbf233; K3FUSE_FRN_SPREAD since removed) tests, stamps, A/B; the PDL probe with a head
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s98            # the fused_residual_norm's phase stamps in the layer
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s97            # (at 623776c; K3FUSE_MLA_EARLY since removed) bitwise test, layer A/B, memcheck, stamps
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s96            # (at 623776c; K3FUSE_KDA_EARLY since removed) KDA GPU tests with it, layer A/B
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s95            # s94, then the M = 1 rows with the op ledger
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s94            # where an L2 prefetch must be issued to land
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s93            # L2-resident vs HBM weight reads (GEMV, sum)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s92            # the M = 1 per-kernel ledger without the PDL chain
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s91            # per head vs three launches at TP8 M = 1; every per-head GPU test
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s90            # TP16 M = 1 rows at 2 and 16 layers per graph (graph launch cost)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s89            # per-head tests; ncu of the per-head tiles and the experts; M = 1 rows
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s87            # K3FUSE_MLA_HEADS_TMA (since removed): tests, A/Bs TP16 M = 1 and per head TP8, stamps, memcheck
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s86            # K3FUSE_MLA_QFIRST=2: tests, stamps, A/Bs
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s85            # K3FUSE_MLA_QFIRST: tests, q-phase stamps, A/Bs TP16 M = 1, 2
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s83            # the TP16 M = 1 rows with max-autotune; TP16 M = 2, 4 ledger without PDL (s84: the TP8 M = 1 rows)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s82            # s81, then every per-head GPU test (session 29)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s81            # (not run yet) the per-head tiles alone at 1-6 heads: per-SM or aggregate limit
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s80            # the MMA tile's inner stamps; K3FUSE_MLA_TILE2 (since removed: no gain): tests, A/Bs
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s79            # K3FUSE_MLA_HEADS_PF=2 (since removed: no gain): tests, A/Bs
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s78            # the MMA tiles: stamps, per head at TP8 M = 1, MMA at TP16 M = 2, mix-norm tests
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s77            # K3FUSE_MLA_HEADS_MMA (the per-head tiles on tensor cores): tests, memcheck, A/B TP16 M = 1
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s76            # the GPU tests after the DSMEM helpers moved to _dsmem.jinja
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s75            # the rows after session 27's pushes (TP16 M = 1, 2)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s74            # K3FUSE_MIXNORM_PUSH: tests, memcheck, A/Bs; the MLA TP16 M = 1 row
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s73            # K3FUSE_MLA_PF2 (since removed: no gain): tests, A/Bs (TP16 M = 1, 2; TP8 M = 1 per head)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s72            # K3FUSE_MLA_WMAX (since removed: no gain): tests, A/Bs; the pushes at TP16 M = 2
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s71            # K3FUSE_MLA_PUSH: all per-head GPU tests, memcheck, stamps
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s70            # K3FUSE_MLA_PUSH (st.async gathers): its tests, A/Bs at M = 1
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s69            # the TP16 M = 1 per-head default's A/B again, from the table
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s68            # per head by default at TP16 M = 1: tests, memcheck, e2e, the row
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s67            # the per-head kernel's column-owned merges: tests, stamps, A/Bs
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s66            # the per-head kernel's batched DSMEM reads: tests, stamps, A/Bs
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s65            # the MLA rows after the lowering split (M = 8, TP8 M = 2)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s64            # per-head MLA phase timeline (M = 1); its GPU tests
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s63            # MLA cast in the op: tests, the MLA rows
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s62            # q_b inside the per-head kernel: tests, memcheck, A/Bs
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s61            # clusters of 16: tests (and s24's review), alone, the A/B
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s60            # its memcheck, the MLA layer A/B at TP16 / TP8, M = 1, 2
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s59            # the per-head kernel, weights split over a cluster: tests, alone, A/B
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s58            # its layer A/B after the dispatch fix
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s57            # the same, M = 1, 2, and the MLA layer A/B at M = 1
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s56            # the per-head MLA kernel with clusters: GPU tests, alone
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s55            # the per-head MLA kernel: GPU tests, alone (s55b: memcheck, layer A/B)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s54            # WD = 1 at TP8 M = 1 confirmed, 16 pairs; M = 2 / 4
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s53            # the routed down's grid at M = 1 (WD = 1; WD = 2 at TP8), layer A/B
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s52            # one-launch MLA A/B twice; KDA M = 2 profiles, frn one vs two launches
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s51            # the one-launch frn at M = 2..4, pairs over all warps: tests, alone, A/B
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s50            # the M = 1 rows with max-autotune, TP16 and TP8
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s49            # the MLA M = 2, 4, 8 rows; FRN_PRELOAD 1 vs 2, 16 pairs
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s48            # kda_decode on a cluster per head (at 54d6841; since removed)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s47            # the MLA M = 1 rows with CPRE = 32
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s46            # K3FUSE_MLA_CPRE: tests, memcheck, MLA layer A/B
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s45            # the M = 2, 4, 8 rows, every backend, TP16 + TP8
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s44            # the M = 1 rows, every backend, TP16 + TP8
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s43            # K3FUSE_GEMV_XS (since removed: no faster): tests, memcheck, layer A/Bs
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s42            # K3FUSE_MOE_DOWN_AX: tests, memcheck, A/Bs; preload 1 vs 2
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s41            # K3FUSE_FRN_PRELOAD: tests, alone, ncu, layer A/Bs
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s40            # fused_residual_norm alone + ncu; MLA M = 1 rows
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s39            # MLA q_b + norm tuned, layer A/B via the overlay; the one launch's kernels at M = 4
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s38            # the one launch's statistics on the column warps only: A/B at M = 1, 2, 4
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s37            # one-launch fused_residual_norm at M = 2..4: GPU tests, memcheck, layer A/B
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s36            # one-launch MLA at TP16 M = 1, 2, 4 (A/B); MLA M = 1 row; rows at M = 2, 4
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s35            # untabled GEMV shapes (MLA group): tune, layer A/B via the overlay
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s34            # TP16 M = 1 rows with max-autotune; the up kernel's knobs in the layer; one-launch MLA
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s33            # s32's table A/Bs after the layer-key fix
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s32            # session 20: s29's table entries by layer_ab; layer_bench with / without Inductor
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s31            # session 20: layer-tune TP16 M = 4, 32 / TP8 16, 32 confirmed; s30
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s30            # moe_sweep with 1 vs 2 weight copies (TP8 M = 1 down ranking)
#   TPS=16 MS=1,2 bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s29   # the down's knobs tuned in the layer (then MS=4,16; TPS=8 MS=2,4)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s28            # the down's knobs around KS = 4 (TP8 M = 1), KS at TP16 M = 8, in the layer
#   TPS=8 bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s26b     # then the M = 1 rows, every backend
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s25            # M = 1 per-kernel ledger, TP8 / TP16, with and without the PDL chain
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s24b           # the split-K GEMM in the layer (layer_ab, TP16 and TP8)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s18            # M = 64 rows at TP16 and TP8, every backend; profiles without the PDL chain
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s17b           # session 16's MoE variants (since removed: slower, session 17)
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s14g           # member-order GPU test, GEMV re-tune, TP8 group
#   bash benchmarks/on_device.sh bash benchmarks/validate_pending.sh s12m           # MLA attention kernels (needs .ab_old/:
#       mkdir -p .ab_old/codegen .ab_old/templates; git show 9a81604:codegen/mla_attention.py > .ab_old/codegen/...,
#       the same for templates/mla_attention.py.jinja; untracked, so the device copy carries it)
# The first four ran in session 8 (RESULTS.md "Session 8"), the pending ones in session 9. Logs go to /tmp/k3v, back as one
# tarball ($OUT takes at most 8 files); $OUT/summary.txt grows after every step, so a cut call still returns what ran.
OUT=${OUT:-/tmp/k3out}; mkdir -p "$OUT"; L=/tmp/k3v; mkdir -p "$L"
S="$OUT/summary.txt"
part=${1:-tests}
pytests() {     # pytests NAME TIMEOUT PYTEST_ARGS...: rc, last line and failures into the summary
    local name=$1 t=$2; shift 2
    timeout "$t" python3 -m pytest -q -p no:cacheprovider "$@" > "$L/log_$name.txt" 2>&1
    echo "$name rc=$? $(tail -1 "$L/log_$name.txt")" | tee -a "$S"
    grep -E "^FAILED|^ERROR" "$L/log_$name.txt" | head -8 | tee -a "$S"
}
memcheck() {    # memcheck NAME TIMEOUT PYTEST_ARGS...: the same tests under compute-sanitizer memcheck
    local name=$1 t=$2; shift 2
    timeout "$t" compute-sanitizer --tool memcheck --report-api-errors no --target-processes all \
        python3 -m pytest -q -p no:cacheprovider "$@" > "$L/log_$name.txt" 2>&1
    echo "$name rc=$? $(grep -E 'ERROR SUMMARY' "$L/log_$name.txt" | tail -1)" | tee -a "$S"
}
layer_arm() {   # layer_arm TAG MS [VAR=VALUE ...] [-- LAYER_BENCH_ARGS...]: one k3fuse-only layer run, KDA + MLA, TP16
    local tag=$1 ms=$2 envs=(); shift 2
    while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
    [ "$1" = -- ] && shift
    env "${envs[@]}" timeout 120 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16 --ms "$ms" \
        --skip inductor --top 16 --tag "_$tag" "$@" > "$L/lb_$tag.txt" 2>&1
    echo "layer $tag rc=$? $(grep -E "^(kda|mla) +16 +(${ms//,/|}) " "$L/lb_$tag.txt" | tr -s ' ' | tr '\n' '|')" \
        | tee -a "$S"
}
# ncu metrics of the layer's kernels: stall reasons, DRAM bytes and throughput, occupancy, registers, grid
NCU_BASE="regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,dram__bytes_read.sum,gpu__time_duration.sum"
NCU_BASE="$NCU_BASE,sm__warps_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_registers,launch__grid_size"
NCU_BASE="$NCU_BASE,launch__registers_per_thread,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum"
NCU_BASE="$NCU_BASE,lts__t_sectors_srcunit_tex_op_read.sum"
ncu_layer() {   # ncu_layer TAG KIND REGEX N EXTRA_METRICS: ncu of N launches of the kernels matching REGEX (after N
    # skipped: the first layer call) in layer_bench.py's KIND layer at M = 64, TP16 and TP8, no PDL chain
    local tag=$1 kind=$2 re=$3 n=$4 extra=$5 tp
    for tp in 16 8; do
        K3FUSE_PDL_CHAIN=0 timeout 200 ncu --kernel-name regex:"$re" --launch-skip "$n" --launch-count "$n" \
            --metrics "$NCU_BASE$extra" python3 benchmarks/layer_bench.py --out "$L" --kinds "$kind" --tp $tp --ms 64 \
            --skip eager,inductor --tag "_ncu$tp" > "$L/ncu_${tag}_tp$tp.txt" 2>&1
        echo "ncu $tag tp$tp rc=$?" | tee -a "$S"; grep -E "^  [a-z_]+kernel|^    [a-z]|ERR" "$L/ncu_${tag}_tp$tp.txt" | tee -a "$S"
    done
}
smoke_or_stop() {   # smoke_or_stop PART NAME TIMEOUT PYTEST_ARGS...: pytests NAME; unless it passed, the part stops
    # there (its logs into $OUT): a variant that hangs or mismatches would otherwise eat the call's other timeouts
    local part=$1 name=$2; shift 2
    pytests "$name" "$@"
    if ! grep -q "passed" "$L/log_$name.txt" || grep -qE "^FAILED|^ERROR" "$L/log_$name.txt"; then
        echo "$part: the smoke case $name failed; stopping" | tee -a "$S"; tail -30 "$L/log_$name.txt"
        tar czf "$OUT/logs_$part.tgz" -C "$L" .; exit 1
    fi
}
ab_run() {      # ab_run TAG TIMEOUT LAYER_AB_ARGS...: one layer_ab.py A/B, its table into the summary, its JSON into $OUT
    local tag=$1 t=$2; shift 2
    timeout "$t" python3 benchmarks/layer_ab.py --out "$L" --tag "_$tag" "$@" > "$L/ab_$tag.txt" 2>&1
    echo "layer_ab $tag ($*) rc=$?" | tee -a "$S"; sed -n '/: A = .*medians/,$p' "$L/ab_$tag.txt" | tee -a "$S"
    cp "$L/layer_ab_$tag.json" "$OUT/" 2>/dev/null
}
timeline() {    # timeline TAG [VAR=VALUE ...]: mla_timeline.py at TP16 M = 1 (clusters of 16, q inside) with those settings,
    # its table into the summary, its JSON into $OUT
    local tag=$1; shift
    env "$@" timeout 80 python3 benchmarks/mla_timeline.py --out "$L" --tp 16 --ms 1 --cls 16 --qb 1 \
        > "$L/timeline_$tag.txt" 2>&1
    echo "mla_timeline $tag ($*) rc=$?" | tee -a "$S"; grep -v '^{' "$L/timeline_$tag.txt" | tail -21 | tee -a "$S"
    cp "$L/mla_timeline.json" "$OUT/mla_timeline_$tag.json" 2>/dev/null
}
sweep_copies() {    # sweep_copies TIMEOUT BUDGET: moe_sweep TP8 M = 1 (KS, LPR from the table) with 1 and 2 weight copies
    for c in 1 2; do
        timeout "$1" python3 benchmarks/moe_sweep.py --out "$L" --tp 8 --ms 1 --from-table --knobs KS,LPR --copies $c \
            --budget-s "$2" > "$L/moe_tp8_m1_copies$c.txt" 2>&1
        echo "moe_sweep TP8 M=1 copies=$c rc=$?" | tee -a "$S"
        grep '^{' "$L/moe_tp8_m1_copies$c.txt" | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l); c = r['cfg']; print('  KS', c['KS'], 'LPR', c['LPR'], r.get('us'))" | tee -a "$S"
    done
}
ab_s29_entries() {  # session 20's layer-tuned entries against their old configs restated (KDA)
    ab_run tp16m2 75 --var K3FUSE_MOE_CONFIG=KS=1,table --kinds kda --tp 16 --ms 2 --pairs 8
    ab_run tp8m2 75 --var K3FUSE_MOE_CONFIG=KS=1:LPR=8:WD=8,table --kinds kda --tp 8 --ms 2 --pairs 8
    ab_run tp16m16 75 --var K3FUSE_MOE_CONFIG=KS=1:SB=4:WD=8,table --kinds kda --tp 16 --ms 16 --pairs 8
}
e2e_and_table() {   # e2e_and_table E2E_TIMEOUT TABLE_TIMEOUT: end to end (k3tp16, M = 1, 8), then the TP16 README table
    timeout "$1" python3 benchmarks/gpu_e2e_smoke.py --out "$L" --configs k3tp16 --ms 1,8 --steps 16 > "$L/e2e.txt" 2>&1
    echo "e2e rc=$?" | tee -a "$S"; tail -4 "$L/e2e.txt" | tee -a "$S"
    cp "$L"/gpu_e2e_smoke.json "$OUT/" 2>/dev/null
    timeout "$2" python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16 --ms 1,8 --top 16 > "$L/lb.txt" 2>&1
    echo "layer table rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb.txt" | tee -a "$S"
    cp "$L"/layer_bench.json "$L"/layer_bench.png "$OUT/" 2>/dev/null
}
if [ "$part" = tests ]; then
    # test_runtime_gpu.py (one model compile per bucket) last
    pytests tests 250 tests/test_kernels_gpu.py tests/test_moe_kernel_gpu.py tests/test_mla_kernel_gpu.py \
        tests/test_kda_kernel_gpu.py tests/test_streams_gpu.py tests/test_router_topk_gpu.py
    memcheck sanitizer 130 tests/test_kernels_gpu.py tests/test_kda_kernel_gpu.py tests/test_router_topk_gpu.py \
        -k "(matches_reference or weight_pair) and not graph and not 64"
    pytests runtime_graphs 180 tests/test_runtime_gpu.py
    tar czf "$OUT/logs_tests.tgz" -C "$L" .
elif [ "$part" = table ]; then
    timeout 60 python3 benchmarks/fused_norm_tune.py --out "$L" > "$L/fnt.txt" 2>&1
    echo "fused norm configs rc=$?" | tee -a "$S"; grep "^M " "$L/fnt.txt" | tee -a "$S"
    timeout 400 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16,8 --ms 1,8,64 --top 16 \
        > "$L/lb.txt" 2>&1
    echo "layer table rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb.txt" | tee -a "$S"
    cp "$L"/layer_bench.json "$L"/layer_bench.png "$OUT/" 2>/dev/null
    timeout 100 python3 benchmarks/gpu_kernels.py --out "$L/gk" --shapes tp8,tp16 --ms 1,8 > "$L/gk.txt" 2>&1
    echo "gemv table rc=$?" | tee -a "$S"; sed -n '/shape   M/,$p' "$L/gk.txt" | tee -a "$S"
    tar czf "$OUT/logs_table.tgz" -C "$L" .
# Session 8: the fused RMSNorm's scale in the GEMV epilogue (routed up 7168 x 3584 fused at M <= 4 with
# K3FUSE_NORM_LINEAR_MAX_MB=64) and the SiTU-GLU epilogue of the MoE group (linear_group_situ): GPU tests, memcheck,
# kernel timings, the layer A/B (base = session 7's graph: norm split back on 51 MB, no SiTU pass)
elif [ "$part" = fusions ]; then
    pytests fus_tests 150 tests/test_kernels_gpu.py tests/test_streams_gpu.py \
        -k "situ or fusions or rms_norm_linear or side_stream"
    memcheck fus_sanitizer 90 tests/test_kernels_gpu.py -k "group_situ_matches or (fusions_match and 7168)"
    timeout 90 python3 benchmarks/gpu_kernels.py --out "$L/gkf" --families fused --fused-only --shapes 7168x3584 \
        > "$L/gkf.txt" 2>&1
    echo "fused kernels rc=$?" | tee -a "$S"
    grep -E '"family": "(fused|group_situ)"' "$L/gkf/log.txt" | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l[l.index('{'):])
    print(r['family'], r.get('N'), r.get('K'), 'M', r['M'], 'xf32' if r.get('x_fp32') else '', 'err %.1e' % r.get('err', -1),
          ' '.join('%s %.2f' % (k, r[k]) for k in ('us', 'unfused_us', 'situ_us', 'plain_us', 'floor_us') if k in r),
          r.get('error', '')[:200])" | sort -u | tee -a "$S"
    for r in 1 2; do
        layer_arm "base_$r" 1,2 K3FUSE_NORM_LINEAR_MAX_MB=16 -- --without-passes fuse_situ_glu_into_linear_group
        layer_arm "new_$r" 1,2 K3FUSE_NORM_LINEAR_MAX_MB=64
    done
    tar czf "$OUT/logs_fusions.tgz" -C "$L" .
# Session 8 call 5: the layer with the fused-norm table entry (twice), and the small K3 GEMVs tuned at M = 1, 2
elif [ "$part" = s8c5 ]; then
    for a in r1 r2; do
        layer_arm "$a" 1,2
        grep -A4 "k3fuse kda tp16 M1:" "$L/lb_$a.txt" | tee -a "$S"
    done
    timeout 120 python3 benchmarks/gpu_kernels.py --out "$L/gkt" --shapes 7168x384,7168x768,768x7168 --ms 1,2 --tune \
        > "$L/gkt.txt" 2>&1
    echo "gemv tune rc=$?" | tee -a "$S"; sed -n '/shape   M/,$p' "$L/gkt.txt" | tee -a "$S"
    tar czf "$OUT/logs_s8c5.tgz" -C "$L" .
# Session 9 calls 1-2 (RESULTS.md "Session 9"): session 8's two opt-in kernels, written after its device time ran out:
#   K3FUSE_MIXNORM_CLUSTER=C  the mix-norm row on a cluster of C CTAs: faster alone and in the layer, now C = 8 default
#   K3FUSE_TOPK_TWO_STAGE=1   the router top-k as per-warp lists merged by one warp: no faster, removed (f9d10f4)
# `pending`: GPU tests, memcheck, each kernel alone (arms in one call); `pending_layer`: the layer A/B.
elif [ "$part" = pending ]; then
    pytests p_tests 150 tests/test_kernels_gpu.py tests/test_router_topk_gpu.py \
        -k "mix_norm_cluster or fused_residual_norm or router_topk"   # (session 9 also ran the two-stage top-k)
    memcheck p_sanitizer 100 tests/test_kernels_gpu.py -k "mix_norm_cluster and 1-"
    timeout 60 python3 benchmarks/mixnorm_bench.py --out "$L" --clusters 1,4,8 --ms 1,8 > "$L/mnb.txt" 2>&1
    echo "mix-norm alone rc=$?" | tee -a "$S"; grep "^M " "$L/mnb.txt" | tee -a "$S"
    # the short-row candidates (one warp, up to 16 rows per CTA) for 7168 x 384, 0.91-0.95x cuBLAS at M = 1 so far
    timeout 60 python3 benchmarks/gpu_kernels.py --out "$L/gk384" --shapes 7168x384 --ms 1,2 --tune > "$L/gk384.txt" 2>&1
    echo "7168x384 tune rc=$?" | tee -a "$S"; sed -n '/shape   M/,$p' "$L/gk384.txt" | tee -a "$S"
    tar czf "$OUT/logs_pending.tgz" -C "$L" .
elif [ "$part" = pending_layer ]; then
    for r in 1 2; do
        # session 9: the two-stage top-k measured no faster alone (5.02 / 4.89 vs 5.01 / 4.85 us), so its arms are
        # dropped; the mix-norm with a cluster of 4 and of 8 CTAs (3.07 / 3.02 us alone vs 3.96 at nb 3)
        layer_arm "base_$r" 1,8 K3FUSE_MIXNORM_CLUSTER=1
        layer_arm "mc4_$r" 1,8 K3FUSE_MIXNORM_CLUSTER=4
        layer_arm "mc8_$r" 1,8 K3FUSE_MIXNORM_CLUSTER=8
    done
    tar czf "$OUT/logs_pending_layer.tgz" -C "$L" .
# Session 9 call 3: the router's rows as an fp32 member of the MoE group (k3fuse::linear_group_router, pass
# fuse_router_into_linear_group): GPU tests, memcheck, configs of the 3-member group, the layer A/B
elif [ "$part" = router ]; then
    pytests r_tests 200 tests/test_kernels_gpu.py tests/test_router_topk_gpu.py \
        -k "group_router or group_situ or router_topk_matches"
    memcheck r_sanitizer 90 tests/test_kernels_gpu.py -k "gemv_group_router_matches and Ns0"   # (call 3 selected nothing)
    timeout 90 python3 benchmarks/group_situ_tune.py --router --out "$L" > "$L/grt.txt" 2>&1
    echo "router group configs rc=$?" | tee -a "$S"; grep "^M " "$L/grt.txt" | tee -a "$S"
    for r in 1 2; do
        layer_arm "base_$r" 1,2 -- --without-passes fuse_router_into_linear_group
        layer_arm "router_$r" 1,2
    done
    tar czf "$OUT/logs_router.tgz" -C "$L" .
    pytests r_runtime 150 tests/test_runtime_gpu.py       # the compiled model, one CUDA graph per bucket
    tar czf "$OUT/logs_router.tgz" -C "$L" .
# Session 9 call 4: memcheck of the router group (call 3's selected no test), the layer table (README)
elif [ "$part" = s9final ]; then
    memcheck f_sanitizer 100 tests/test_kernels_gpu.py -k "(gemv_group_router_matches and Ns0) or (linear_group_router_op and 1)"
    timeout 430 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16,8 --ms 1,8,64 --top 16 \
        > "$L/lb.txt" 2>&1
    echo "layer table rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb.txt" | tee -a "$S"
    cp "$L"/layer_bench.json "$L"/layer_bench.png "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s9final.tgz" -C "$L" .
# Session 10 call 1 (written in session 9): K3FUSE_TOPK_IN_GROUP, the router's top-k in the MoE group GEMV's last
# CTA (k3fuse::linear_group_router_topk). GPU tests, memcheck, the layer A/B (knob 0 / 1, twice; then 1 fused at
# every simt bucket, now only from 256 threads: M = 1). Kept at M = 1, RESULTS.md "Session 10".
elif [ "$part" = topk_in_group ]; then
    pytests t_tests 200 tests/test_kernels_gpu.py tests/test_router_topk_gpu.py \
        -k "group_router_topk or linear_group_router_topk_op or group_router_matches or router_topk_matches"
    memcheck t_sanitizer 100 tests/test_kernels_gpu.py -k "group_router_topk_matches"
    for r in 1 2; do
        layer_arm "tk0_$r" 1,2 K3FUSE_TOPK_IN_GROUP=0
        layer_arm "tk1_$r" 1,2 K3FUSE_TOPK_IN_GROUP=1
    done
    tar czf "$OUT/logs_topk_in_group.tgz" -C "$L" .
    K3FUSE_TOPK_IN_GROUP=1 pytests t_runtime1 150 tests/test_runtime_gpu.py   # the compiled model, a graph per bucket
    pytests t_runtime 120 tests/test_runtime_gpu.py       # (default)
    tar czf "$OUT/logs_topk_in_group.tgz" -C "$L" .
# Session 10: the MLA glue in the attention kernels (pass fuse_mla_append_and_gate, op mla_append_attention_: the
# kv_a norm + cache append in qabsorb, the output gate + cast in combine) and the top-k in the group from 256
# threads (default now): GPU tests, memcheck, the layer A/B (without / with the pass, twice), the compiled model
elif [ "$part" = s10 ]; then
    pytests a_tests 200 tests/test_mla_kernel_gpu.py tests/test_kernels_gpu.py -k "append or linear_group_router_topk_op"
    memcheck a_sanitizer 100 tests/test_mla_kernel_gpu.py -k "append_attention_matches and 12-True and (1-2000 or 3-1000)"
    for r in 1 2; do
        layer_arm "m0_$r" 1,8 -- --without-passes fuse_mla_append_and_gate
        layer_arm "m1_$r" 1,8
    done
    tar czf "$OUT/logs_s10.tgz" -C "$L" .
    pytests a_runtime 150 tests/test_runtime_gpu.py       # the compiled model, one CUDA graph per bucket
    tar czf "$OUT/logs_s10.tgz" -C "$L" .
# Session 11: fused_residual_norm in one launch at M = 1 (the projection, a grid barrier, the mix-norm): GPU tests,
# memcheck, the layer A/B (K3FUSE_FRN_ONE_KERNEL=0 / 1, twice)
elif [ "$part" = s11 ]; then
    pytests o_tests 200 tests/test_kernels_gpu.py -k "fused_residual_norm or mix_norm_cluster or registry_ops"
    memcheck o_sanitizer 120 tests/test_kernels_gpu.py -k "one_kernel and 768-2"
    for r in 1 2; do
        layer_arm "o0_$r" 1 K3FUSE_FRN_ONE_KERNEL=0
        layer_arm "o1_$r" 1
    done
    tar czf "$OUT/logs_s11.tgz" -C "$L" .
elif [ "$part" = s11t ]; then       # the README table (TP16, M = 1, 8, with Inductor), then the compiled model
    timeout 330 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16 --ms 1,8 --top 16 \
        > "$L/lb.txt" 2>&1
    echo "layer table rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb.txt" | tee -a "$S"
    cp "$L"/layer_bench.json "$L"/layer_bench.png "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s11t.tgz" -C "$L" .
    pytests o_runtime 190 tests/test_runtime_gpu.py       # the compiled model, one CUDA graph per bucket
    tar czf "$OUT/logs_s11t.tgz" -C "$L" .
# Next session: session 11's source after its device calls (wrap-safe barrier arithmetic) and the opt-in lean tail
# (K3FUSE_FRN_LEAN_TAIL=1), the barrier's poll sleep: tests with both tails, memcheck, layer A/B twice
elif [ "$part" = s12 ]; then
    pytests l_tests 200 tests/test_kernels_gpu.py -k "one_kernel or fused_residual_norm_matches"
    ( export K3FUSE_FRN_LEAN_TAIL=1
      pytests l_tests_lean 200 tests/test_kernels_gpu.py -k "one_kernel"
      memcheck l_sanitizer 120 tests/test_kernels_gpu.py -k "one_kernel and 768-2" )
    for r in 1 2; do
        layer_arm "l0_$r" 1
        layer_arm "l1_$r" 1 K3FUSE_FRN_LEAN_TAIL=1
    done
    layer_arm "spin0" 1 K3FUSE_FRN_SPIN_NS=0
    layer_arm "spin256" 1 K3FUSE_FRN_SPIN_NS=256
    tar czf "$OUT/logs_s12.tgz" -C "$L" .
elif [ "$part" = s12m ]; then
    # the MLA attention kernels: qabsorb split over W_UK's columns (no partials for the split kernel to add), the
    # combine's merge weights read once into shared memory and its W_UV loads before the merge. Tests, memcheck, the
    # (QS, VS) sweep, then the layer A/B against session 11's source (.ab_old/: the two files from git, uncommitted)
    pytests m_tests 300 tests/test_mla_kernel_gpu.py
    memcheck m_sanitizer 150 tests/test_mla_kernel_gpu.py -k "splits_match or append_attention_matches"
    timeout 200 python3 benchmarks/mla_splits.py --out "$L" --heads 6 --ms 1,8 \
        --splits 16x32,8x8,8x16,8x32,16x8,16x16,32x8,32x32,4x8 > "$L/ms6.txt" 2>&1
    echo "mla_splits h6 rc=$?" | tee -a "$S"; sed -n '/^  h /,$p' "$L/ms6.txt" | tee -a "$S"
    grep '"us"' "$L/ms6.txt" | cut -c1-90 | tee -a "$S"
    mkdir -p "$L/h12"; timeout 120 python3 benchmarks/mla_splits.py --out "$L/h12" --heads 12 --ms 1,8 --splits 16x32,8x8,8x32,16x16 \
        > "$L/ms12.txt" 2>&1
    echo "mla_splits h12 rc=$?" | tee -a "$S"; grep '"us"' "$L/ms12.txt" | cut -c1-90 | tee -a "$S"
    mkdir -p .ab_new/codegen .ab_new/templates
    cp codegen/mla_attention.py .ab_new/codegen/; cp templates/mla_attention.py.jinja .ab_new/templates/
    swap() { cp ".ab_$1/codegen/mla_attention.py" codegen/; cp ".ab_$1/templates/mla_attention.py.jinja" templates/; }
    for r in 1 2; do
        swap old; layer_arm "m0_$r" 1
        swap new; layer_arm "m1_$r" 1
    done
    swap old; layer_arm "m0_8" 8
    swap new; layer_arm "m1_8" 8
    tar czf "$OUT/logs_s12m.tgz" -C "$L" .
elif [ "$part" = s12t ]; then     # the selection's scores from shared memory, bucket 1's MLA 8x8: tests, e2e, table
    pytests t_tests 150 tests/test_router_topk_gpu.py tests/test_kernels_gpu.py tests/test_mla_kernel_gpu.py \
        -k "topk or router or splits_match or append_attention"
    memcheck t_sanitizer 100 tests/test_router_topk_gpu.py -k "matches"
    timeout 150 python3 benchmarks/gpu_e2e_smoke.py --out "$L" --configs k3tp16 --ms 1,8 --steps 16 > "$L/e2e.txt" 2>&1
    echo "e2e rc=$?" | tee -a "$S"; tail -6 "$L/e2e.txt" | tee -a "$S"
    timeout 300 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16 --ms 1,8 --top 16 \
        > "$L/lb.txt" 2>&1
    echo "layer table rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb.txt" | tee -a "$S"
    cp "$L"/layer_bench.json "$L"/layer_bench.png "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s12t.tgz" -C "$L" .
    timeout 75 python3 benchmarks/mla_splits.py --out "$L" --heads 6,12 --ms 2,8,16 --splits 8x8,32x8,16x8 \
        > "$L/ms.txt" 2>&1
    echo "mla_splits rc=$?" | tee -a "$S"; grep '"us"' "$L/ms.txt" | cut -c1-70 | tee -a "$S"
    tar czf "$OUT/logs_s12t.tgz" -C "$L" .
elif [ "$part" = s12h ]; then     # MLA splits per heads (h = 6: 32x8 at buckets 2-8): tests, the layer at M = 1, 2, 8
    pytests h_tests 150 tests/test_mla_kernel_gpu.py
    layer_arm "h_1" 1,2,8
    layer_arm "h_2" 1,2,8
    tar czf "$OUT/logs_s12h.tgz" -C "$L" .
elif [ "$part" = s12k ]; then     # kda_decode at 1 / 2 / 4 lanes per S row (K3FUSE_KDA_LPR): tests, memcheck, KDA layer A/B
    for lpr in 4 1; do
        ( export K3FUSE_KDA_LPR=$lpr
          pytests "k_tests_$lpr" 120 tests/test_kda_kernel_gpu.py -k "decode" )
    done
    ( export K3FUSE_KDA_LPR=4; memcheck k_sanitizer 90 tests/test_kda_kernel_gpu.py -k "decode_matches and not 64" )
    i=0
    for lpr in 2 4 1 2 4; do
        i=$((i + 1)); layer_arm "k${lpr}_$i" 1 K3FUSE_KDA_LPR=$lpr -- --kinds kda
    done
    tar czf "$OUT/logs_s12k.tgz" -C "$L" .
elif [ "$part" = s12r ]; then     # K3FUSE_TOPK_RANK=1 (threshold + ranks selection): tests, then the KDA layer A/B
    ( export K3FUSE_TOPK_RANK=1
      pytests r_tests 70 tests/test_router_topk_gpu.py tests/test_kernels_gpu.py -k "topk or router" )
    layer_arm r1 1 K3FUSE_TOPK_RANK=1 -- --kinds kda
    layer_arm r0 1 K3FUSE_TOPK_RANK=0 -- --kinds kda
    layer_arm r1b 1 K3FUSE_TOPK_RANK=1 -- --kinds kda
    tar czf "$OUT/logs_s12r.tgz" -C "$L" .
elif [ "$part" = s13 ]; then      # session 12's unrun memcheck of the rank selection; the router member first (A/B)
    memcheck s_sanitizer 150 tests/test_router_topk_gpu.py tests/test_kernels_gpu.py -k "topk and not graph"
    pytests s_tests 250 tests/test_router_topk_gpu.py tests/test_kernels_gpu.py tests/test_moe_kernel_gpu.py
    for r in 1 2; do
        layer_arm rf1_$r 1
        layer_arm rf0_$r 1 K3FUSE_ROUTER_FIRST=0
    done
    tar czf "$OUT/logs_s13.tgz" -C "$L" .
elif [ "$part" = s13b ]; then     # ran at 90b0be4: K3FUSE_FRN_PARTIALS (per-CTA partials, A/B; slower, removed); s13's cut tests
    pytests b_tests 200 tests/test_kernels_gpu.py -k "one_kernel or fused_residual_norm_matches"
    K3FUSE_FRN_PARTIALS=1 memcheck b_sanitizer 120 tests/test_kernels_gpu.py -k "one_kernel and 384"
    pytests b_moe 200 tests/test_moe_kernel_gpu.py
    for r in 1 2; do
        layer_arm p1_$r 1 K3FUSE_FRN_PARTIALS=1
        layer_arm p0_$r 1 K3FUSE_FRN_PARTIALS=0
    done
    tar czf "$OUT/logs_s13b.tgz" -C "$L" .
elif [ "$part" = s13g ]; then     # layers per CUDA graph (2 vs 16, every backend); the TP8 expert kernels re-swept at M = 1
    timeout 200 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16 --ms 1 --top 16 --graph-rounds 8 \
        --tag _g8 > "$L/lb_g8.txt" 2>&1
    echo "layer table, 16 layers per graph rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_g8.txt" | tee -a "$S"
    timeout 200 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16 --ms 1 --top 16 \
        --tag _g1 > "$L/lb_g1.txt" 2>&1
    echo "layer table, 2 layers per graph rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_g1.txt" | tee -a "$S"
    timeout 200 python3 benchmarks/moe_sweep.py --out "$L" --tp 8 --ms 1 --from-table --budget-s 150 > "$L/ms.txt" 2>&1
    echo "moe sweep tp8 M=1 rc=$?" | tee -a "$S"; tail -8 "$L/ms.txt" | tee -a "$S"
    cp "$L"/layer_bench_g8.json "$L"/moe_sweep.json "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s13g.tgz" -C "$L" .
elif [ "$part" = s13u ]; then     # ran at c3704ca: K3FUSE_MOE_UP_LATE_TRIGGER (the up kernel triggers after its main loop; no gain, removed)
    K3FUSE_MOE_UP_LATE_TRIGGER=1 pytests u_tests 60 tests/test_moe_kernel_gpu.py -k "matches_reference or graph_replay"
    layer_arm ul1 1 K3FUSE_MOE_UP_LATE_TRIGGER=1
    layer_arm ul0 1 K3FUSE_MOE_UP_LATE_TRIGGER=0
    tar czf "$OUT/logs_s13u.tgz" -C "$L" .
elif [ "$part" = s14 ]; then      # ran at b959fe4: K3FUSE_EARLY_WEIGHTS (no layer gain, removed): tests, memcheck, layer A/B
    K3FUSE_EARLY_WEIGHTS=1 pytests e_tests 200 tests/test_kernels_gpu.py tests/test_router_topk_gpu.py -k "gemv or one_kernel or topk or group"
    K3FUSE_EARLY_WEIGHTS=1 memcheck e_sanitizer 150 tests/test_kernels_gpu.py -k "(one_kernel or group_router_topk or matches_reference) and not graph and not 64"
    for r in 1 2; do
        layer_arm ew1_$r 1 K3FUSE_EARLY_WEIGHTS=1
        layer_arm ew0_$r 1 K3FUSE_EARLY_WEIGHTS=0
    done
    tar czf "$OUT/logs_s14.tgz" -C "$L" .
elif [ "$part" = s14g ]; then     # the launcher's rewritten member order (d5f6785) on the GPU; GEMV re-tune EW 1/0; TP8 group
    pytests g_topk 120 tests/test_kernels_gpu.py tests/test_router_topk_gpu.py -k "group_router_topk or router_first"
    for ew in 1 0; do
        K3FUSE_EARLY_WEIGHTS=$ew timeout 130 python3 benchmarks/gpu_kernels.py --out "$L/gk$ew" --shapes 7168x3584,7168x768,768x7168 \
            --ms 1 --tune > "$L/gk$ew.txt" 2>&1
        echo "gemv tune EW=$ew rc=$?" | tee -a "$S"; tail -6 "$L/gk$ew.txt" | tee -a "$S"
    done
    timeout 150 python3 benchmarks/group_situ_tune.py --out "$L/gst8" --router --tp 8 > "$L/gst8.txt" 2>&1
    echo "group tune tp8 rc=$?" | tee -a "$S"; tail -16 "$L/gst8.txt" | tee -a "$S"
    tar czf "$OUT/logs_s14g.tgz" -C "$L" .
elif [ "$part" = ab ]; then       # validate_pending.sh ab NAME=A,B [MS]: one knob, both arms in one process, ABBA replays
    timeout 300 python3 benchmarks/layer_ab.py --out "$L" --var "$2" --kinds kda,mla --tp 16 --ms "${3:-1}" --pairs 40 \
        > "$L/ab.txt" 2>&1
    echo "layer_ab $2 rc=$?" | tee -a "$S"; sed -n '/: A = .*medians/,$p' "$L/ab.txt" | tee -a "$S"
    cp "$L"/layer_ab.json "$OUT/" 2>/dev/null
elif [ "$part" = s15 ]; then      # the one-launch MLA attention: GPU tests, memcheck, paired layer A/B at M = 1 and 8
    pytests mla 240 tests/test_mla_kernel_gpu.py
    memcheck sanitizer_mla 150 tests/test_mla_kernel_gpu.py -k "one_launch and not graph and not splits and not 4096 and not 3000 and not 2048"
    timeout 300 python3 benchmarks/layer_ab.py --out "$L" --var K3FUSE_MLA_ONE_KERNEL=0,1 --kinds mla --tp 16 --ms 1,8 \
        --pairs 40 > "$L/ab.txt" 2>&1
    echo "layer_ab MLA_ONE rc=$?" | tee -a "$S"; sed -n '/: A = .*medians/,$p' "$L/ab.txt" | tee -a "$S"
    cp "$L"/layer_ab.json "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s15.tgz" -C "$L" .
elif [ "$part" = s15b ]; then     # the one-launch MLA attention alone: counters test, 3 vs 1 launch (with / without prefetch)
    pytests mla 200 tests/test_mla_kernel_gpu.py
    timeout 330 python3 benchmarks/mla_splits.py --out "$L" --heads 6 --ms 1,8 --context 1001 \
        --splits 8x8,2x2,32x8 --one 0,1,2 --hpt 0,2,3 > "$L/ms.txt" 2>&1
    echo "mla_splits rc=$?" | tee -a "$S"; grep -E '"us"' "$L/ms.txt" | sed 's/, "rel_err".*//' | tee -a "$S"
    cp "$L"/mla_splits.json "$OUT/" 2>/dev/null
elif [ "$part" = s15c ]; then     # the split kernel's tile pipeline: GPU tests, kernels alone, paired layer A/Bs, e2e + README table
    pytests mla 200 tests/test_mla_kernel_gpu.py
    timeout 120 python3 benchmarks/mla_splits.py --out "$L" --heads 6,12 --ms 1,8 --context 1001 --splits 8x8,32x8 \
        --pipe 0,1 > "$L/ms.txt" 2>&1
    echo "mla_splits rc=$?" | tee -a "$S"; grep -E '"us"' "$L/ms.txt" | sed 's/, "rel_err".*//' | tee -a "$S"
    cp "$L"/mla_splits.json "$OUT/" 2>/dev/null
    timeout 150 python3 benchmarks/layer_ab.py --out "$L" --var K3FUSE_MLA_PIPE=0,1 --kinds mla --tp 16 --ms 1,8 \
        --pairs 40 --tag _pipe > "$L/ab_pipe.txt" 2>&1
    echo "layer_ab MLA_PIPE rc=$?" | tee -a "$S"; sed -n '/: A = .*medians/,$p' "$L/ab_pipe.txt" | tee -a "$S"
    timeout 90 python3 benchmarks/layer_ab.py --out "$L" --var K3FUSE_MLA_ONE_KERNEL=0,1 --kinds mla --tp 16 --ms 1 \
        --pairs 40 --tag _one > "$L/ab_one.txt" 2>&1
    echo "layer_ab MLA_ONE rc=$?" | tee -a "$S"; sed -n '/: A = .*medians/,$p' "$L/ab_one.txt" | tee -a "$S"
    cp "$L"/layer_ab_*.json "$OUT/" 2>/dev/null
    e2e_and_table 90 170
    tar czf "$OUT/logs_s15c.tgz" -C "$L" .
elif [ "$part" = s15d ]; then     # MLA TP16 M = 8 with bucket 8 at 8x8; the tile pipeline at TP8 (12 heads) in the layer
    layer_arm s15d 8
    timeout 60 python3 benchmarks/mla_splits.py --out "$L" --heads 6,12 --ms 1 --context 1001 --splits 8x8 \
        --kv-splits 0,16 > "$L/ms.txt" 2>&1
    echo "mla_splits kv rc=$?" | tee -a "$S"; grep -E '"us"' "$L/ms.txt" | sed 's/, "rel_err".*//' | tee -a "$S"
    timeout 150 python3 benchmarks/layer_ab.py --out "$L" --var K3FUSE_MLA_PIPE=0,1 --kinds mla --tp 8 --ms 1,8 \
        --pairs 20 --tag _pipe_tp8 > "$L/ab_pipe8.txt" 2>&1
    echo "layer_ab MLA_PIPE tp8 rc=$?" | tee -a "$S"; sed -n '/: A = .*medians/,$p' "$L/ab_pipe8.txt" | tee -a "$S"
    cp "$L"/layer_ab_*.json "$L"/layer_bench_s15d.json "$OUT/" 2>/dev/null
elif [ "$part" = s16 ]; then      # session 15's unrun MMA score step: GPU tests, memcheck, kernels alone, paired layer A/B
    pytests mla_mma 200 tests/test_mla_kernel_gpu.py -k "mma or matches_reference"
    K3FUSE_MLA_MMA=1 memcheck sanitizer_mma 150 tests/test_mla_kernel_gpu.py -k "mma_scores and not 4096 and not 2048"
    for mma in 0 1; do
        K3FUSE_MLA_MMA=$mma timeout 90 python3 benchmarks/mla_splits.py --out "$L/ms$mma" --heads 6,12 --ms 1,8 \
            --context 1001 --splits 8x8,32x8 > "$L/ms$mma.txt" 2>&1
        echo "mla_splits MMA=$mma rc=$?" | tee -a "$S"; grep -E '"us"' "$L/ms$mma.txt" | sed 's/, "rel_err".*//' | tee -a "$S"
    done
    ab_run mma 200 --var K3FUSE_MLA_MMA=0,1 --kinds mla --tp 16,8 --ms 1,8 --pairs 30
    tar czf "$OUT/logs_s16.tgz" -C "$L" .
elif [ "$part" = s16b ]; then     # the MMA score step as the default (min_blocks_per_mp = 2 without the pipeline): GPU tests, the pipeline A/B at M = 1 with it, the README table
    pytests mla 250 tests/test_mla_kernel_gpu.py -k "mma or matches_reference"
    ab_run pipe_mma 130 --var K3FUSE_MLA_PIPE=0,1 --kinds mla --tp 8,16 --ms 1 --pairs 20
    timeout 180 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16 --ms 1,8 --top 16 > "$L/lb.txt" 2>&1
    echo "layer table rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb.txt" | tee -a "$S"
    cp "$L"/layer_bench.json "$L"/layer_bench.png "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s16b.tgz" -C "$L" .
elif [ "$part" = s16c ]; then     # the TP8 table with the MMA default and the pipeline rule
    timeout 230 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 8 --ms 1,8 --top 16 --tag _tp8 \
        > "$L/lb_tp8.txt" 2>&1
    echo "layer tp8 rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_tp8.txt" | tee -a "$S"
    cp "$L"/layer_bench_tp8.json "$L"/layer_bench_tp8.png "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s16c.tgz" -C "$L" .
elif [ "$part" = s16d ]; then     # MLA's max-autotune row at TP16 M = 1
    timeout 170 python3 benchmarks/layer_bench.py --out "$L" --kinds mla --tp 16 --ms 1 --top 16 --max-autotune \
        --tag _mat_mla > "$L/lb_mat.txt" 2>&1
    echo "layer max-autotune mla rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_mat.txt" | tee -a "$S"
    cp "$L"/layer_bench_mat_mla.json "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s16d.tgz" -C "$L" .
elif [ "$part" = s17b ]; then     # session 16's unrun MoE variants (K3FUSE_MOE_UP_CHUNK, K3FUSE_MOE_DOWN_GROUP): tests, memcheck, layer A/Bs at M = 64 and 8
    pytests moe_new 200 tests/test_moe_kernel_gpu.py -k "member_chunks or down_grouped or matches_reference"
    K3FUSE_MOE_UP_CHUNK=2 K3FUSE_MOE_DOWN_GROUP=1 memcheck sanitizer_moe_new 120 tests/test_moe_kernel_gpu.py \
        -k "matches_reference and tp16 and not member_chunks and not down_grouped"
    for v in K3FUSE_MOE_UP_CHUNK=0,2 K3FUSE_MOE_DOWN_GROUP=0,1; do
        timeout 120 python3 benchmarks/layer_ab.py --out "$L" --var $v --kinds kda --tp 16 --ms 64,8 --pairs 10 \
            --tag _${v%%=*} > "$L/ab_${v%%=*}.txt" 2>&1
        echo "layer_ab $v rc=$?" | tee -a "$S"; sed -n '/: A = .*medians/,$p' "$L/ab_${v%%=*}.txt" | tee -a "$S"
        cp "$L"/layer_ab_${v%%=*}.json "$OUT/" 2>/dev/null
    done
    tar czf "$OUT/logs_s17b.tgz" -C "$L" .
elif [ "$part" = s18m ]; then     # the grouped up kernel on tensor cores (K3FUSE_MOE_UP_MMA): tests, memcheck, layer A/B; no-PDL profiles
    pytests upmma 200 tests/test_moe_kernel_gpu.py -k up_mma
    memcheck sanitizer_upmma 120 tests/test_moe_kernel_gpu.py -k "up_mma and tp16 and (16 or 64)"
    ab_run upmma 200 --var K3FUSE_MOE_UP_MMA=0,1 --kinds kda --tp 16 --ms 64,16,8 --pairs 10
    for mma in 0 1; do
        K3FUSE_MOE_UP_MMA=$mma K3FUSE_PDL_CHAIN=0 timeout 100 python3 benchmarks/layer_bench.py --out "$L" --kinds kda \
            --tp 16 --ms 8,64 --skip eager,inductor --top 20 --tag _nopdl_mma$mma > "$L/lb_nopdl_mma$mma.txt" 2>&1
        echo "layer no PDL chain, UP_MMA=$mma rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_nopdl_mma$mma.txt" | tee -a "$S"
        cp "$L"/layer_bench_nopdl_mma$mma.json "$OUT/" 2>/dev/null
    done
    tar czf "$OUT/logs_s18m.tgz" -C "$L" .
elif [ "$part" = s18t ]; then     # the tensor-core up kernel as the default from bucket 8: tests, A/B at TP8, tables
    pytests moe 150 tests/test_moe_kernel_gpu.py -k "test_moe_experts_matches_reference or graph_replay"
    ab_run upmma_tp8 100 --var K3FUSE_MOE_UP_MMA=0,1 --kinds kda --tp 8 --ms 8,64 --pairs 6
    for tp in 16 8; do
        ms=$([ $tp = 16 ] && echo 8,64 || echo 64)
        timeout 200 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp $tp --ms $ms --top 16 \
            --tag _t_tp$tp > "$L/lb_t_tp$tp.txt" 2>&1
        echo "layer TP$tp M=$ms rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_t_tp$tp.txt" | tee -a "$S"
        cp "$L"/layer_bench_t_tp$tp.json "$L"/layer_bench_t_tp$tp.png "$OUT/" 2>/dev/null
    done
    tar czf "$OUT/logs_s18t.tgz" -C "$L" .
elif [ "$part" = s18u ]; then     # the up kernel's variant from the H200 table: tests, which kernel each layer runs, A/B at M = 2, 4, end to end M = 8
    pytests moe 150 tests/test_moe_kernel_gpu.py -k "test_moe_experts_matches_reference or graph_replay or up_mma"
    for tp in 16 8; do
        timeout 90 python3 benchmarks/layer_bench.py --out "$L" --kinds kda --tp $tp --ms 8 --skip eager,inductor --top 20 \
            --tag _u_tp$tp > "$L/lb_u_tp$tp.txt" 2>&1
        echo "layer TP$tp M=8 rc=$? up kernel: $(grep -o 'up_mma_kernel\|up_kernel' "$L/layer_bench_u_tp$tp.json" | sort | uniq -c | tr '\n' ' ')" | tee -a "$S"
        sed -n '/^kind/,/^$/p' "$L/lb_u_tp$tp.txt" | tee -a "$S"
    done
    ab_run upmma_small 100 --var K3FUSE_MOE_UP_MMA=0,1 --kinds kda --tp 16 --ms 2,4 --pairs 8
    timeout 150 python3 benchmarks/gpu_e2e_smoke.py --out "$L" --configs k3tp16 --ms 8 --steps 16 > "$L/e2e.txt" 2>&1
    echo "e2e M=8 rc=$?" | tee -a "$S"; tail -4 "$L/e2e.txt" | tee -a "$S"
    cp "$L"/gpu_e2e_smoke.json "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s18u.tgz" -C "$L" .
elif [ "$part" = s19 ]; then      # the grouped down on tensor cores + combine (K3FUSE_MOE_DOWN_MMA, opt-in): tests, memcheck, A/Bs, profile
    pytests downmma 200 tests/test_moe_kernel_gpu.py -k down_mma
    memcheck sanitizer_downmma 120 tests/test_moe_kernel_gpu.py -k "down_mma and tp16 and (16 or 64)"
    ab_run downmma 150 --var K3FUSE_MOE_DOWN_MMA=0,1 --kinds kda --tp 16 --ms 64,16,8 --pairs 8
    ab_run downmma_tp8 100 --var K3FUSE_MOE_DOWN_MMA=0,1 --kinds kda --tp 8 --ms 64,8 --pairs 6
    K3FUSE_MOE_DOWN_MMA=1 K3FUSE_PDL_CHAIN=0 timeout 90 python3 benchmarks/layer_bench.py --out "$L" --kinds kda --tp 16 \
        --ms 8,64 --skip eager,inductor --top 20 --tag _nopdl_down > "$L/lb_nopdl_down.txt" 2>&1
    echo "layer no PDL chain, DOWN_MMA=1 rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_nopdl_down.txt" | tee -a "$S"
    cp "$L"/layer_bench_nopdl_down.json "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s19.tgz" -C "$L" .
elif [ "$part" = s20 ]; then      # the tensor-core down from the table: tests; its load group UD (A/B); TP8 M = 8 up A/B with the down on
    pytests moe 200 tests/test_moe_kernel_gpu.py -k "matches_reference or graph_replay or down_mma"
    K3FUSE_MOE_DOWN_UD=6 pytests down_ud6 120 tests/test_moe_kernel_gpu.py -k down_mma
    K3FUSE_MOE_DOWN_MMA=1 ab_run downud_tp16 150 --var K3FUSE_MOE_DOWN_UD=3,6 --kinds kda --tp 16 --ms 64,16,8 --pairs 8
    ab_run downud6_tp8 100 --var K3FUSE_MOE_DOWN_UD=3,6 --kinds kda --tp 8 --ms 64,8 --pairs 6
    ab_run downud12_tp8 100 --var K3FUSE_MOE_DOWN_UD=3,12 --kinds kda --tp 8 --ms 64,8 --pairs 6
    ab_run upmma_tp8_down 80 --var K3FUSE_MOE_UP_MMA=0,1 --kinds kda --tp 8 --ms 8 --pairs 6
    K3FUSE_MOE_DOWN_UD=6 K3FUSE_PDL_CHAIN=0 timeout 90 python3 benchmarks/layer_bench.py --out "$L" --kinds kda --tp 16 \
        --ms 64 --skip eager,inductor --top 8 --tag _nopdl_ud6 > "$L/lb_nopdl_ud6.txt" 2>&1
    echo "layer no PDL chain, DOWN_UD=6 rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_nopdl_ud6.txt" | tee -a "$S"
    grep -m3 "mma_kernel" "$L/lb_nopdl_ud6.txt" | tee -a "$S"
    tar czf "$OUT/logs_s20.tgz" -C "$L" .
elif [ "$part" = s21 ]; then      # the tensor-core down's grid cap (A/B), then issue 5's rows that the down changes, every backend
    ab_run downctas_tp16 90 --var K3FUSE_MOE_DOWN_CTAS=3072,8192 --kinds kda --tp 16 --ms 64 --pairs 6
    ab_run downctas16k_tp16 90 --var K3FUSE_MOE_DOWN_CTAS=3072,16384 --kinds kda --tp 16 --ms 64 --pairs 6
    ab_run downctas_tp8 100 --var K3FUSE_MOE_DOWN_CTAS=3072,8192 --kinds kda --tp 8 --ms 64,8 --pairs 6
    for tp in 16 8; do
        ms=$([ $tp = 16 ] && echo 64 || echo 8,64)
        timeout $((tp == 16 ? 120 : 200)) python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp $tp --ms $ms --top 16 \
            --tag _d_tp$tp > "$L/lb_d_tp$tp.txt" 2>&1
        echo "layer TP$tp M=$ms rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_d_tp$tp.txt" | tee -a "$S"
        cp "$L"/layer_bench_d_tp$tp.json "$L"/layer_bench_d_tp$tp.png "$OUT/" 2>/dev/null
    done
    tar czf "$OUT/logs_s21.tgz" -C "$L" .
elif [ "$part" = s22 ]; then      # end to end at M = 64 (the tensor-core up and down by the heuristic), TP8 rows with DCTAS, moe tests
    timeout 170 python3 benchmarks/gpu_e2e_smoke.py --out "$L" --configs k3tp16 --ms 64 --steps 16 > "$L/e2e.txt" 2>&1
    echo "e2e M=64 rc=$?" | tee -a "$S"; tail -4 "$L/e2e.txt" | tee -a "$S"
    cp "$L"/gpu_e2e_smoke.json "$OUT/" 2>/dev/null
    timeout 190 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 8 --ms 8,64 --top 16 \
        --tag _c_tp8 > "$L/lb_c_tp8.txt" 2>&1
    echo "layer TP8 M=8,64 rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_c_tp8.txt" | tee -a "$S"
    cp "$L"/layer_bench_c_tp8.json "$L"/layer_bench_c_tp8.png "$OUT/" 2>/dev/null
    pytests moe 100 tests/test_moe_kernel_gpu.py -k "test_moe_experts_matches_reference"
    tar czf "$OUT/logs_s22.tgz" -C "$L" .
elif [ "$part" = s23 ]; then      # the tensor-core down at the buckets the table lacks: TP16 32, TP8 32 and 16
    ab_run downmma_tp16_32 70 --var K3FUSE_MOE_DOWN_MMA=0,1 --kinds kda --tp 16 --ms 32 --pairs 6
    ab_run downmma_tp8_32_16 100 --var K3FUSE_MOE_DOWN_MMA=0,1 --kinds kda --tp 8 --ms 32,16 --pairs 6
elif [ "$part" = s24 ]; then      # session 18's unrun split-K GEMM (mma_sk, K3FUSE_GEMV_SPLITK): tests, memcheck, tune at M = 32 / 64, layer A/B
    pytests splitk 200 tests/test_kernels_gpu.py -k splitk
    memcheck sanitizer_splitk 150 "tests/test_kernels_gpu.py::test_gemv_splitk_matches_reference[7168-3584-64]" \
        "tests/test_kernels_gpu.py::test_gemv_splitk_matches_reference[2320-1536-17]"
    timeout 280 python3 benchmarks/gpu_kernels.py --out "$L" --shapes tp16 --ms 32,64 --tune --tune-ms 32,64 \
        > "$L/gk_splitk.txt" 2>&1
    echo "gpu_kernels tune M=32,64 rc=$?" | tee -a "$S"
    cp "$L/results.json" "$OUT/gk_splitk_results.json" 2>/dev/null; cp "$L/tuning.json" "$OUT/gk_splitk_tuning.json" 2>/dev/null
    python3 - "$L/results.json" <<'PY' | tee -a "$S"
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["results"] if r.get("family") == "gemv" and "us" in r]
print(f"{'shape':>11} {'M':>3} {'cuBLAS':>7} {'tabled':>7} {'best mma_sk':>11}  config")
for key in sorted({(r["N"], r["K"], r["M"]) for r in rows}):
    rs = [r for r in rows if (r["N"], r["K"], r["M"]) == key]
    sk = [r for r in rs if r["config"]["variant"] == "mma_sk" and r.get("ok")]
    tab = next((r["us"] for r in rs if r.get("tabled")), float("nan"))
    b = min(sk, key=lambda r: r["us"]) if sk else None
    print(f"{key[0]:>5}x{key[1]:<5} {key[2]:>3} {rs[0]['cublas_us']:7.2f} {tab:7.2f} "
          f"{(b['us'] if b else float('nan')):11.2f}  {b['config'] if b else '-'}  ({len(sk)} ok of "
          f"{sum(r['config']['variant'] == 'mma_sk' for r in rs)})")
PY
    tar czf "$OUT/logs_s24.tgz" -C "$L" .
elif [ "$part" = s25 ]; then      # M = 1 per-kernel ledger: TP8 and TP16 profiles with and without the PDL chain (k3fuse only)
    for tp in 8 16; do
        for pdl in 1 0; do
            K3FUSE_PDL_CHAIN=$pdl timeout 150 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp $tp --ms 1 \
                --skip eager,inductor --top 20 --tag _m1_tp${tp}_pdl$pdl > "$L/lb_m1_tp${tp}_pdl$pdl.txt" 2>&1
            echo "layer TP$tp M=1 PDL_CHAIN=$pdl rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_m1_tp${tp}_pdl$pdl.txt" | tee -a "$S"
            cp "$L"/layer_bench_m1_tp${tp}_pdl$pdl.json "$OUT/" 2>/dev/null
        done
    done
    # the TP8 M = 1 routed experts alone, the down's knobs from the table's config (up + down per routing)
    timeout 120 python3 benchmarks/moe_sweep.py --out "$L" --tp 8 --ms 1 --from-table --knobs KS,LPR,WD --budget-s 80 \
        > "$L/moe_tp8_m1.txt" 2>&1
    echo "moe_sweep TP8 M=1 KS,LPR,WD rc=$?" | tee -a "$S"; tail -25 "$L/moe_tp8_m1.txt" | tee -a "$S"
    tar czf "$OUT/logs_s25.tgz" -C "$L" .
elif [ "$part" = s26 ]; then      # the M = 1 routed-expert configs re-tuned with rotated routings (moe_sweep --rotate 8), then in the layer
    for tp in 8 16; do
        mkdir -p "$L/sweep_tp$tp"
        timeout $((tp == 8 ? 170 : 110)) python3 benchmarks/moe_sweep.py --out "$L/sweep_tp$tp" --tp $tp --ms 1 --from-table \
            --knobs KS,SB,LPR,WD,RT,R,W --budget-s $((tp == 8 ? 140 : 80)) --write-table > "$L/moe_tp${tp}_m1_rot.txt" 2>&1
        echo "moe_sweep TP$tp M=1 rotated rc=$?" | tee -a "$S"; sed -n '/^shape/,$p' "$L/moe_tp${tp}_m1_rot.txt" | tee -a "$S"
        cp "$L/sweep_tp$tp/moe_sweep.json" "$OUT/moe_sweep_tp${tp}_m1_rot.json" 2>/dev/null
    done
    cp codegen/tuning/nvidia_h200.json "$OUT/"
    # the old table configs (A) against the re-tuned table (B), in the layer
    ab_run moecfg_tp8 150 --var K3FUSE_MOE_CONFIG=CPC=1:G=1:GROUP=0:KS=1:LPR=4:R=2:RT=1:SB=1:W=7:WD=4,table \
        --kinds kda,mla --tp 8 --ms 1 --pairs 16
    ab_run moecfg_tp16 150 --var K3FUSE_MOE_CONFIG=CPC=1:G=1:GROUP=0:KS=4:LPR=8:R=2:RT=1:SB=4:W=7:WD=2,table \
        --kinds kda,mla --tp 16 --ms 1 --pairs 16
    tar czf "$OUT/logs_s26.tgz" -C "$L" .
elif [ "$part" = s27 ]; then      # TP8 M = 1 routed down: more slots in flight, A/B'd in the layer (not in moe_sweep: there KS = 1 wins)
    for b in KS=4 SB=2 KS=2:SB=2; do
        ab_run tp8_${b//[:=]/_} 110 --var K3FUSE_MOE_CONFIG=table,$b --kinds kda --tp 8 --ms 1 --pairs 12
    done
    best=$(python3 - "$L" <<'PY'
import glob, json, sys
rows = [r for f in glob.glob(sys.argv[1] + "/layer_ab_tp8_*.json") for r in json.load(open(f))]
ok = [r for r in rows if r["diff_us"] < -1.0 and r["b_faster"] >= 10]
print(min(ok, key=lambda r: r["diff_us"])["B"] if ok else "")
PY
)
    echo "best K3FUSE_MOE_CONFIG at TP8 M=1: '${best}'" | tee -a "$S"
    if [ -n "$best" ]; then
        K3FUSE_MOE_CONFIG=$best timeout 250 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 8 --ms 1 \
            --top 16 --tag _m1_tp8 > "$L/lb_m1_tp8.txt" 2>&1
        echo "layer TP8 M=1 (K3FUSE_MOE_CONFIG=$best) rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_m1_tp8.txt" | tee -a "$S"
        cp "$L"/layer_bench_m1_tp8.json "$L"/layer_bench_m1_tp8.png "$OUT/" 2>/dev/null
    fi
    tar czf "$OUT/logs_s27.tgz" -C "$L" .
elif [ "$part" = s64 ]; then      # session 26: where the per-head MLA kernel's time goes at TP16 M = 1 (stamps per
    # phase, K3FUSE_MLA_STAMPS=1, in the layer), then its GPU tests (session 25's fallback test's new call unrun)
    timeout 300 python3 benchmarks/mla_timeline.py --out "$L" --tp 16 --ms 1 --cls 8,16 --qb 1,0 > "$L/timeline.txt" 2>&1
    echo "mla_timeline rc=$?" | tee -a "$S"; grep -v '^{' "$L/timeline.txt" | tail -120 | tee -a "$S"
    cp "$L/mla_timeline.json" "$OUT/" 2>/dev/null
    pytests heads 200 tests/test_mla_heads_gpu.py
    tar czf "$OUT/logs_s64.tgz" -C "$L" .
elif [ "$part" = s70 ]; then      # session 27: the per-head kernel's gathers by st.async into the owners (K3FUSE_MLA_PUSH=1,
    # no release cluster barriers): its GPU tests, then push against the loads at TP16 M = 1 (the per-head default,
    # clusters of 16) and, with push, per head (clusters of 8) against the three launches + q_b at TP8 M = 1
    pytests push 150 tests/test_mla_heads_gpu.py -k "push or qb_op"
    ab_run push_tp16_m1 170 --var K3FUSE_MLA_PUSH=0,1 --kinds mla --tp 16 --ms 1 --pairs 16
    K3FUSE_MLA_PUSH=1 ab_run push_heads_tp8_m1 170 --var K3FUSE_MLA_HEADS=0,1 --kinds mla --tp 8 --ms 1 --pairs 16
    tar czf "$OUT/logs_s70.tgz" -C "$L" .
elif [ "$part" = s77 ]; then      # session 28: the per-head kernel's tiles on tensor cores (K3FUSE_MLA_HEADS_MMA=1):
    # its tests first (against the CUDA-core tiles within 1e-4, the reference, bitwise push = loads), memcheck, then the
    # A/B at TP16 M = 1 (the per-head default there, clusters of 16), then every per-head test
    pytests mma 200 tests/test_mla_heads_gpu.py -k "mma_matches or bitwise"
    memcheck memcheck_mma 120 tests/test_mla_heads_gpu.py -k "mma_matches and 6-1-1024"
    ab_run mma_tp16_m1 160 --var K3FUSE_MLA_HEADS_MMA=0,1 --kinds mla --tp 16 --ms 1 --pairs 16
    pytests heads 220 tests/test_mla_heads_gpu.py
    tar czf "$OUT/logs_s77.tgz" -C "$L" .
elif [ "$part" = s135 ]; then     # session 35 (not run: written after the device time ran out): the TMA + wgmma skinny
    # GEMM (gemv variant wgmma, K3FUSE_GEMV_WGMMA=1): its GPU tests (reference, graph, PDL chain), memcheck (a cluster of
    # 8), then every K3 shape at M = 16, 32, 64 against cuBLAS and the tabled config (its candidates only), then the
    # layer A/Bs (prediction: the 5-11 MB GEMMs at 60-80% of copy where cuBLAS has 29-46%; -10..-30 us per layer at
    # M = 64)
    # (session 36: reordered to fit one 600 s call: the smoke case, then the shapes against cuBLAS and the overlay, then
    # the tests; the MoE tests moved to s136)
    # a smoke case first, short timeout: a pipeline deadlock would otherwise eat the call's timeouts one by one
    pytests wgmma_smoke 90 tests/test_kernels_gpu.py -k "wgmma_matches_reference and 7168-768-64"
    if ! grep -q "passed" "$L/log_wgmma_smoke.txt" || grep -qE "^FAILED|^ERROR" "$L/log_wgmma_smoke.txt"; then
        echo "s135: the smoke case failed; stopping (logs_s135.tgz)" | tee -a "$S"; tail -40 "$L/log_wgmma_smoke.txt"
        tar czf "$OUT/logs_s135.tgz" -C "$L" .; exit 1
    fi
    timeout 280 python3 benchmarks/gpu_kernels.py --out "$L/gk_wgmma" --shapes tp16,tp8 --ms 16,32,64 --tune \
        --variants wgmma > "$L/gk_wgmma.txt" 2>&1
    echo "gpu_kernels wgmma rc=$?" | tee -a "$S"
    python3 - "$L/gk_wgmma/results.json" <<'PY' 2>&1 | tee -a "$S"
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["results"] if r.get("family") == "gemv"]
print("N x K, M: cuBLAS us | tabled us | best wgmma us (KS, ST, BN) | its % of copy")
for key in sorted({(r["N"], r["K"], r["M"]) for r in rows}):
    rs = [r for r in rows if (r["N"], r["K"], r["M"]) == key and r.get("ok")]
    wg = [r for r in rs if r["config"]["variant"] == "wgmma"]
    tab = [r for r in rs if r.get("tabled")]
    if not rs:
        print(key, "no ok rows"); continue
    b = min(wg, key=lambda r: r["us"]) if wg else None
    print(f"{key[0]} x {key[1]}, {key[2]}: {rs[0]['cublas_us']:.2f} | {tab[0]['us'] if tab else float('nan'):.2f} | "
          + (f"{b['us']:.2f} ({b['config']['KS']}, {b['config']['ST']}, {b['config'].get('BN', 64)}) | "
             f"{b['pct_copy']:.0f}%" if b else "-"))
PY
    cp "$L/gk_wgmma/results.json" "$OUT/gk_wgmma_results.json" 2>/dev/null
    # the overlay for s136: the wgmma config at each (shape, bucket) where it beat cuBLAS (and the tabled kernel)
    python3 - "$L/gk_wgmma/results.json" "$OUT/wgmma_overlay.json" <<'PY' 2>&1 | tee -a "$S"
import json, sys
sys.path.insert(0, "benchmarks")
from make_tuning_table import build
_, entries = build([sys.argv[1]])
keep = {k: {b: {x: c[x] for x in ("variant", "KS", "ST", "BN")} for b, c in e.items() if c["variant"] == "wgmma"}
        for k, e in entries.items()}
keep = {k: e for k, e in keep.items() if e}
json.dump({"entries": keep}, open(sys.argv[2], "w"), indent=1, sort_keys=True)
print("wgmma overlay:", sum(len(e) for e in keep.values()), "(shape, bucket) entries ->", sys.argv[2])
PY
    tar czf "$OUT/logs_s135.tgz" -C "$L" .
    pytests wgmma 150 tests/test_kernels_gpu.py tests/test_streams_gpu.py -k wgmma
    memcheck memcheck_wgmma 90 tests/test_kernels_gpu.py -k "wgmma_matches_reference and 768-7168-17"
    tar czf "$OUT/logs_s135.tgz" -C "$L" .
elif [ "$part" = s139 ]; then     # session 36 (not run): the wgmma GEMM with clusters of 14-16 splits (the tuner's
    # candidates where 8 splits leave fewer than 112 CTAs: 768x7168, 1536x7168 at BN = 128, 1152x1536 at BN = 128).
    # Predicted: 768x7168 from 40-44% of copy (96 CTAs) toward 55% with 168-192; -0.5..-1 us per such GEMM standalone
    pytests wgmma_wide 150 tests/test_kernels_gpu.py -k "wgmma_matches_reference and (768-7168 or 3216-7168)"
    memcheck memcheck_wgmma_wide 90 tests/test_kernels_gpu.py -k "wgmma_matches_reference and 768-7168-17"
    timeout 200 python3 benchmarks/gpu_kernels.py --out "$L/gk_wide" --shapes 768x7168,1536x7168,1152x1536 \
        --ms 16,32,64 --tune --variants wgmma > "$L/gk_wide.txt" 2>&1
    echo "gpu_kernels wide rc=$?" | tee -a "$S"
    cp "$L/gk_wide/results.json" "$OUT/gk_wide_results.json" 2>/dev/null
    # the overlay: where the best wgmma config is a cluster of > 8 and beats the table's current entry
    python3 - "$L/gk_wide/results.json" "$OUT/wgmma_wide_overlay.json" <<'PY' 2>&1 | tee -a "$S"
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["results"] if r.get("family") == "gemv" and r.get("ok")]
keep = {}
for key in sorted({(r["N"], r["K"], r["bucket"]) for r in rows}):
    rs = [r for r in rows if (r["N"], r["K"], r["bucket"]) == key]
    tab = min((r for r in rs if r.get("tabled")), key=lambda r: r["us"], default=None)
    ref = min([rs[0]["cublas_us"]] + ([tab["us"]] if tab else []))
    b = min(rs, key=lambda r: r["us"])
    print(f"{key}: cuBLAS {rs[0]['cublas_us']:.2f} tabled {tab['us'] if tab else float('nan'):.2f} best {b['us']:.2f} "
          f"{b['config']} {b['pct_copy']:.0f}% of copy")
    if b["config"]["variant"] == "wgmma" and b["config"]["KS"] > 8 and b["us"] < 0.97 * ref:
        keep.setdefault(f"gemv:{key[0]}x{key[1]}", {})[str(key[2])] = {x: b["config"][x] for x in ("variant", "KS", "ST", "BN")}
json.dump({"entries": keep}, open(sys.argv[2], "w"), indent=1, sort_keys=True)
print("wide overlay:", sum(len(e) for e in keep.values()), "entries ->", sys.argv[2])
PY
    if grep -q '"gemv' "$OUT/wgmma_wide_overlay.json" 2>/dev/null; then
        ab_run wgmma_wide 170 --var K3FUSE_TUNING_OVERLAY=none,$OUT/wgmma_wide_overlay.json --kinds kda,mla --tp 16,8 \
            --ms 64,32 --pairs 8
    fi
    tar czf "$OUT/logs_s139.tgz" -C "$L" .
elif [ "$part" = s142 ]; then     # session 36 (not run): the MLA split kernel's cache tiles by cp.async into a two-tile
    # ring (K3FUSE_MLA_ASYNC=1): its bitwise tests (a smoke case first: a wrong wait would hang or mismatch), memcheck,
    # every MLA GPU test with it on, then the A/Bs. s128's ncu at M = 64: 2 CTAs per SM, DRAM at 28% of peak, 62-70 us
    # under ncu; at M = 64 each split has 2 tiles, so one exposed DRAM round trip per CTA instead of three.
    # Predicted: the split kernel -25..-40% at TP16 (h = 6: still 2 CTAs per SM), -10..-20 us per MLA layer at M = 64;
    # TP8 (h = 12: 1 CTA per SM with mode 1; mode 2 asks for 2 at a few spilled words, s143 compares) unclear
    pytests async_smoke 90 tests/test_mla_kernel_gpu.py -k "async_tiles_bitwise and 64-1024-6-None-1"
    if ! grep -q "passed" "$L/log_async_smoke.txt" || grep -qE "^FAILED|^ERROR" "$L/log_async_smoke.txt"; then
        echo "s142: the smoke case failed; stopping" | tee -a "$S"; tail -30 "$L/log_async_smoke.txt"
        tar czf "$OUT/logs_s142.tgz" -C "$L" .; exit 1
    fi
    pytests async 150 tests/test_mla_kernel_gpu.py -k "async_tiles_bitwise"
    memcheck memcheck_async 100 tests/test_mla_kernel_gpu.py -k "async_tiles_bitwise and 17-700-12-7"
    ab_run async_m64 150 --var K3FUSE_MLA_ASYNC=0,1 --kinds mla --tp 16,8 --ms 64 --pairs 8
    tar czf "$OUT/logs_s142.tgz" -C "$L" .
elif [ "$part" = s143 ]; then     # session 36 (not run; after s142): K3FUSE_MLA_ASYNC=1 at M = 8-32, then every MLA
    # GPU test with it on (the append + gate variant, graphs, the one-launch and PIPE paths that decline it)
    ab_run async_mid 150 --var K3FUSE_MLA_ASYNC=0,1 --kinds mla --tp 16,8 --ms 32,16,8 --pairs 8
    ab_run async2_tp8 100 --var K3FUSE_MLA_ASYNC=1,2 --kinds mla --tp 8 --ms 64,32 --pairs 8   # h = 12: 1 vs 2 CTAs/SM
    K3FUSE_MLA_ASYNC=1 pytests mla_all_async 300 tests/test_mla_kernel_gpu.py
    tar czf "$OUT/logs_s143.tgz" -C "$L" .
elif [ "$part" = s149 ]; then     # session 37 (not run): the sum of session 37's MLA defaults in one process (layer_ab --arms:
    # arm A = session 36's settings, B = the defaults). s148's single layer_bench rows showed less than the A/Bs' sum
    # (-15 us at TP16 M = 64). At TP8 M = 64 only the 4-token combine differs; at TP16 M = 16 only the ring
    ab_run s36_m64 150 --arms "K3FUSE_MLA_ASYNC=0 K3FUSE_MLA_CMMA_TOK=8 K3FUSE_MLA_CTAS_PER_SM=8; -" --kinds mla \
        --tp 16,8 --ms 64 --pairs 8
    ab_run s36_tp16 120 --arms "K3FUSE_MLA_ASYNC=0 K3FUSE_MLA_CMMA=0; -" --kinds mla --tp 16 --ms 32,16 --pairs 8
    # the split counts not yet A/B'd: TP8 M = 64 at 4 CTAs per SM (without the ring; 16 was +30 in session 32), and
    # with the ring at TP16 M = 16, 32 (2 -> 1 CTA per SM: NS 16 -> 9 and 9 -> 5, longer splits)
    ab_run tp8_ns 80 --var K3FUSE_MLA_CTAS_PER_SM=8,4 --kinds mla --tp 8 --ms 64 --pairs 8
    ab_run ring_ns_mid 90 --var K3FUSE_MLA_CTAS_PER_SM=2,1 --kinds mla --tp 16 --ms 32,16 --pairs 8
    tar czf "$OUT/logs_s149.tgz" -C "$L" .
elif [ "$part" = s151 ]; then     # session 37 (not run): the routed down's W2 tile ring (K3FUSE_MOE_DOWN_RING=1, TP16 only):
    # its bitwise tests (a smoke case first: a wrong wait would mismatch), memcheck, then the A/Bs. The down at TP16
    # M = 64 ran at 71% of copy in session 36's ncu; each owner CTA waits for RPC = 4 row blocks' tiles one after
    # another. Predicted: the down -10..-20%, -10..-20 us per layer at TP16 M = 64 (either kind), less at M = 32
    # (RPC = 2); a risk: 2 CTAs per SM instead of 4 (100 KB of ring each)
    smoke_or_stop s151 ring_smoke 120 tests/test_moe_kernel_gpu.py -k "down_ring_bit_identical and tp16 and 64"
    pytests ring 150 tests/test_moe_kernel_gpu.py -k "down_ring_bit_identical"
    K3FUSE_MOE_DOWN_MMA=1 K3FUSE_MOE_DOWN_RING=1 memcheck memcheck_ring 120 tests/test_moe_kernel_gpu.py \
        -k "down_mma_matches_reference and tp16 and 64"
    ab_run down_ring 150 --var K3FUSE_MOE_DOWN_RING=0,1 --kinds kda,mla --tp 16 --ms 64,32 --pairs 8
    # with the ring, fewer and longer owner CTAs may pay (the ring hides each next row block; the 7 of 8 non-owners
    # each hold 100 KB while they start and exit): grid cap 8192 -> 2048 (RPC 4 -> 14 at bucket 64, 2 -> 7 at 32)
    K3FUSE_MOE_DOWN_RING=1 ab_run ring_cap 120 --var K3FUSE_MOE_DOWN_CTAS=8192,2048 --kinds kda --tp 16 --ms 64,32 \
        --pairs 8
    tar czf "$OUT/logs_s151.tgz" -C "$L" .
elif [ "$part" = s152 ]; then     # session 38 (not run): the 4-token tensor-core combine with its merge-independent loads at
    # its start (K3FUSE_MLA_CMMA_PRE=N: the 4 gate values, whose epilogue loads were 4 serial round trips, and the first
    # N splits' partials; each (max, sum) pair in one pass; the other partials in chunks of 4 splits). codegen/sass.py
    # counts 15 -> 6 serial global round trips on a path (sm_90a, TP16 bucket 64; a lane at NS = 9: 10 -> 3). Bitwise.
    # Predicted: -1..-3 us per MLA layer where the combine runs (TP16 M = 32, 64; TP8 M = 16-64); more at TP8 (NS 16)
    smoke_or_stop s152 pre_smoke 120 tests/test_mla_kernel_gpu.py -k "combine_mma_pre_bitwise and 64-6-True and None and 5"
    pytests pre 150 tests/test_mla_kernel_gpu.py -k "combine_mma_pre_bitwise"
    K3FUSE_MLA_CMMA_PRE=5 memcheck memcheck_pre 100 tests/test_mla_kernel_gpu.py \
        -k "combine_mma_append_gate_and_graph and 6-True"
    ab_run cmma_pre 150 --var K3FUSE_MLA_CMMA_PRE=0,5 --kinds mla --tp 16,8 --ms 64,32 --pairs 8
    ab_run cmma_pre_tp8 60 --var K3FUSE_MLA_CMMA_PRE=0,5 --kinds mla --tp 8 --ms 16 --pairs 8
    ab_run cmma_pre_n 80 --var K3FUSE_MLA_CMMA_PRE=1,5 --kinds mla --tp 8 --ms 64 --pairs 8
    tar czf "$OUT/logs_s152.tgz" -C "$L" .
elif [ "$part" = s153 ]; then     # session 38 (not run): the wgmma split-K cluster sum with every peer value loaded before
    # the first store (K3FUSE_WG_GATHER=1: config GL). By default each of a thread's NACC / KS accumulator entries is
    # one serial distributed-shared-memory round trip (inline asm with a memory clobber after the previous store;
    # codegen/sass.py: 8 at 3584 x 7168 bucket 64 KS = 4); with GL one. Bitwise the default. Predicted: -0.3..-0.8 us
    # per wgmma kernel with KS > 1 (the table's buckets 16-64), -1..-3 us per layer at M = 16-64
    smoke_or_stop s153 gl_smoke 120 tests/test_kernels_gpu.py -k "wgmma_gather_bitwise and 768-7168-8-64 and 64"
    pytests gl 150 tests/test_kernels_gpu.py -k "wgmma_gather_bitwise"
    memcheck memcheck_gl 80 tests/test_kernels_gpu.py -k "wgmma_gather_bitwise and 768-7168-8-128 and 17"
    ab_run wg_gather 200 --var K3FUSE_WG_GATHER=0,1 --kinds kda,mla --tp 16,8 --ms 64,32,16 --pairs 8
    tar czf "$OUT/logs_s153.tgz" -C "$L" .
elif [ "$part" = s154 ]; then     # session 38 (not run): K3FUSE_MLA_EARLY=1, the three-launch MLA kernels' loads that wait on
    # nothing issued with their first ones: qabsorb's q_pe, row position and k_pe (path 4 -> 2 with the append), the
    # CUDA-core combine's (max, sum) pairs in one pass (8 -> 5 at TP8 bucket 1; codegen/sass.py). Bitwise the default.
    # Predicted: -0.3..-1 us per MLA layer where the three launches run (TP8 M = 1-64, TP16 M = 4-64)
    pytests early 150 tests/test_mla_kernel_gpu.py -k "early_loads_bitwise"
    K3FUSE_MLA_EARLY=1 memcheck memcheck_early 80 tests/test_mla_kernel_gpu.py -k "matches_reference and 3-1000 and 12"
    ab_run early_tp8 200 --var K3FUSE_MLA_EARLY=0,1 --kinds mla --tp 8 --ms 1,2,4,8 --pairs 12
    ab_run early_tp16 150 --var K3FUSE_MLA_EARLY=0,1 --kinds mla --tp 16 --ms 4,8,16 --pairs 8
    tar czf "$OUT/logs_s154.tgz" -C "$L" .
elif [ "$part" = s155 ]; then     # session 38 (not run): s152-s154 in one call, for a short device budget. All three are bitwise
    # the defaults and only remove serial round trips (codegen/sass.py), so one summed A/B decides whether to take them
    # all; s152-s154 attribute it afterwards. Smoke cases first, each stops the part on a mismatch
    smoke_or_stop s155 pre_smoke 100 tests/test_mla_kernel_gpu.py -k "combine_mma_pre_bitwise and 64-6-True and None and 5"
    smoke_or_stop s155 gl_smoke 100 tests/test_kernels_gpu.py -k "wgmma_gather_bitwise and 768-7168-8-64 and 64"
    smoke_or_stop s155 early_smoke 100 tests/test_mla_kernel_gpu.py \
        -k "early_loads_bitwise and append_gate and three_launches and 1-4096"
    pytests bitwise3 200 tests/test_mla_kernel_gpu.py tests/test_kernels_gpu.py \
        -k "combine_mma_pre_bitwise or wgmma_gather_bitwise or early_loads_bitwise"
    K3FUSE_MLA_CMMA_PRE=5 K3FUSE_MLA_EARLY=1 K3FUSE_WG_GATHER=1 memcheck memcheck3 100 tests/test_mla_kernel_gpu.py \
        tests/test_kernels_gpu.py -k "(combine_mma_append_gate_and_graph and 6-True) or (wgmma_gather_bitwise and 768-7168-8-128 and 17) or (early_loads_bitwise and append_gate and 3-1000)"
    ab_run s38_sum 180 --arms "-; K3FUSE_MLA_CMMA_PRE=5 K3FUSE_MLA_EARLY=1 K3FUSE_WG_GATHER=1" --kinds mla \
        --tp 16,8 --ms 64,16 --pairs 8
    tar czf "$OUT/logs_s155.tgz" -C "$L" .
elif [ "$part" = s156 ]; then     # session 38 (not run): the per-slot routed down at M = 1 with AX's W2 loads in batches of one
    # slot (K3FUSE_MOE_DOWN_AXB=1 with K3FUSE_MOE_DOWN_AX=1): at TP8 bucket 1 the SB kernel's round-trip chain is 23 at
    # 48 registers, AX's 2 at 122 (one 512-thread CTA per SM), AXB=1's 5 at 64 (two); session 22 measured SB and AX
    # alike at M = 1. The down is TP8 M = 1's largest item above its bytes (61% of copy, 17.1 us for 44 MB).
    # Predicted: -1..-3 us per layer at TP8 M = 1 (either kind), less at TP16 (22 MB)
    pytests axb 150 tests/test_moe_kernel_gpu.py -k "down_axb_bit_identical"
    K3FUSE_MOE_DOWN_AX=1 K3FUSE_MOE_DOWN_AXB=1 memcheck memcheck_axb 80 tests/test_moe_kernel_gpu.py \
        -k "down_axb_bit_identical and tp8 and 4-4-1"
    ab_run axb_m1 200 --arms "K3FUSE_MOE_DOWN_AX=0; K3FUSE_MOE_DOWN_AX=1 K3FUSE_MOE_DOWN_AXB=1" --kinds kda,mla \
        --tp 8,16 --ms 1 --pairs 16
    K3FUSE_MOE_DOWN_AX=1 ab_run axb_vs_ax 120 --var K3FUSE_MOE_DOWN_AXB=0,1 --kinds kda --tp 8 --ms 1,2 --pairs 12
    tar czf "$OUT/logs_s156.tgz" -C "$L" .
elif [ "$part" = s150 ]; then     # session 37 (not run): the M = 64 MLA kernels under ncu with session 37's defaults (s128's
    # lines): what is left of the split kernel's latency-bound profile with the ring (TP16) and without (TP8). First
    # the routed down's load groups once more: at TP16 M = 64 it ran at 71% of copy in session 36's ncu (373.9 MB in
    # 125.7 us), the up at 90%; UD = 6 (one load group per row block at I = 192) was +8.7 us in session 18, before the
    # ballot scans, the member lists and the per-warp epilogue
    ab_run down_ud 80 --var K3FUSE_MOE_DOWN_UD=3,6 --kinds kda --tp 16 --ms 64,32 --pairs 8
    ncu_layer m64 mla "split_kernel|combine_mma_kernel" 4 \
        ",sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
    tar czf "$OUT/logs_s150.tgz" -C "$L" .
elif [ "$part" = s148 ]; then     # session 37: the last defaults (h = 6: the tensor-core combine with 4 tokens from bucket 32,
    # 4 CTAs per SM at bucket 64 with the ring): the MLA GPU tests at M >= 16, then the MLA TP16 M = 32, 64 rows
    pytests mla_h6 150 tests/test_mla_kernel_gpu.py -k "combine_mma_matches or batched_rows or append_gate_and_graph or async_tiles_bitwise or tokens_bitwise"
    timeout 100 python3 benchmarks/layer_bench.py --out "$L" --kinds mla --tp 16 --ms 32,64 --skip eager,inductor \
        --top 16 --tag _m3264 > "$L/lb_m3264.txt" 2>&1
    echo "layer M=32,64 rc=$?" | tee -a "$S"; grep -v '^{' "$L/lb_m3264.txt" | sed -n '/^kind/,/^$/p' | tee -a "$S"
    cp "$L"/layer_bench_m3264.json "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s148.tgz" -C "$L" .
elif [ "$part" = s147 ]; then     # session 37: the final defaults (the ring at h = 6 buckets 16-64, 4 tokens per combine CTA
    # at h = 6 bucket 64 and h = 12 buckets 16-64): the MLA GPU tests s145 did not reach in its 240 s (it passed the
    # first ~76% of them), then s146's two A/Bs
    pytests mla_rest 220 tests/test_mla_kernel_gpu.py -k "(tokens_bitwise or append_gate_and_graph or pv_mma or combine_mma_matches or async) and not one_launch"
    K3FUSE_MLA_CMMA_TOK=4 ab_run cmma4_tp16 100 --var K3FUSE_MLA_CMMA=0,1 --kinds mla --tp 16 --ms 32,16 --pairs 8
    ab_run ring_ns 80 --var K3FUSE_MLA_CTAS_PER_SM=8,4 --kinds mla --tp 16 --ms 64 --pairs 8
    tar czf "$OUT/logs_s147.tgz" -C "$L" .
elif [ "$part" = s146 ]; then     # session 37: the tensor-core combine at TP16 M = 16, 32 with 4 tokens per CTA (with 8 it
    # was +0.6 / +5.8 in session 34: 24 / 12 CTAs; 4 tokens double them), then s139 (the wgmma clusters of 14-16)
    K3FUSE_MLA_CMMA_TOK=4 ab_run cmma4_tp16 100 --var K3FUSE_MLA_CMMA=0,1 --kinds mla --tp 16 --ms 32,16 --pairs 8
    # with the ring (TP16) longer splits may pay: 8 -> 4 CTAs per SM at bucket 64 (NS 16-17 -> ~9, 4 tiles per split)
    ab_run ring_ns 80 --var K3FUSE_MLA_CTAS_PER_SM=8,4 --kinds mla --tp 16 --ms 64 --pairs 8
    bash "$0" s139
elif [ "$part" = s145 ]; then     # session 37: the ring (h = 6, buckets 16-64) and the 4-token combine (bucket 64) as the
    # defaults (ASYNC_BY_HEADS / CMMA_TOK_BY_HEADS): the three-launch MLA GPU tests with them, the 4-token combine at TP8
    # M = 16, 32 (h = 12, where the combine is on tensor cores from bucket 16), the MLA M = 64 rows, end to end
    pytests mla_defaults 240 tests/test_mla_kernel_gpu.py -k "not one_launch and not head_groups"
    ab_run cmma_tok_tp8_mid 100 --var K3FUSE_MLA_CMMA_TOK=8,4 --kinds mla --tp 8 --ms 32,16 --pairs 8
    timeout 150 python3 benchmarks/layer_bench.py --out "$L" --kinds mla --tp 16,8 --ms 64 --skip inductor \
        --top 16 --tag _m64 > "$L/lb_m64.txt" 2>&1
    echo "layer M=64 rc=$?" | tee -a "$S"; grep -v '^{' "$L/lb_m64.txt" | sed -n '/^kind/,/^$/p' | tee -a "$S"
    cp "$L"/layer_bench_m64.json "$L"/layer_bench_m64.png "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s145.tgz" -C "$L" .
    timeout 120 python3 benchmarks/gpu_e2e_smoke.py --out "$L" --configs k3tp16 --ms 64,16 --steps 16 > "$L/e2e.txt" 2>&1
    echo "e2e M=64,16 rc=$?" | tee -a "$S"; tail -6 "$L/e2e.txt" | tee -a "$S"
    cp "$L"/gpu_e2e_smoke.json "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s145.tgz" -C "$L" .
elif [ "$part" = s144 ]; then     # session 37: s142 won at TP16 M = 64 (-7.8 us, 8 / 8) and lost at TP8 (+14.1, mode 1 =
    # 1 CTA per SM at h = 12). Here: s141's combine (the same lines), mode 2 at TP8 (2 CTAs per SM, ~8 spilled words),
    # and the ring at TP16 M = 16, 32
    pytests cmma_tok 200 tests/test_mla_kernel_gpu.py -k "combine_mma_tokens_bitwise"
    K3FUSE_MLA_CMMA_TOK=4 memcheck memcheck_cmma_tok 90 tests/test_mla_kernel_gpu.py -k "combine_mma_matches_reference and 40-12-None"
    ab_run cmma_tok_m64 150 --var K3FUSE_MLA_CMMA_TOK=8,4 --kinds mla --tp 16,8 --ms 64 --pairs 8
    ab_run async2_tp8 100 --var K3FUSE_MLA_ASYNC=0,2 --kinds mla --tp 8 --ms 64 --pairs 8   # h = 12: 2 CTAs/SM, spills
    ab_run async_tp16 120 --var K3FUSE_MLA_ASYNC=0,1 --kinds mla --tp 16 --ms 32,16 --pairs 8
    tar czf "$OUT/logs_s144.tgz" -C "$L" .
elif [ "$part" = s141 ]; then     # session 36 (not run): the tensor-core combine over 4 tokens per CTA
    # (K3FUSE_MLA_CMMA_TOK=4: 2x the CTAs; s128's ncu: 48 / 96 CTAs, long-scoreboard bound, 12% warps active, 15-17 us).
    # Predicted: the combine ~1.5x faster, -5..-10 us per MLA layer at M = 64, less at TP8 M = 16-32
    pytests cmma_tok 200 tests/test_mla_kernel_gpu.py -k "combine_mma_tokens_bitwise"
    K3FUSE_MLA_CMMA_TOK=4 memcheck memcheck_cmma_tok 90 tests/test_mla_kernel_gpu.py -k "combine_mma_matches_reference and 40-12-None"
    ab_run cmma_tok_m64 150 --var K3FUSE_MLA_CMMA_TOK=8,4 --kinds mla --tp 16,8 --ms 64 --pairs 8
    ab_run cmma_tok_tp8 120 --var K3FUSE_MLA_CMMA_TOK=8,4 --kinds mla --tp 8 --ms 32,16 --pairs 8
    tar czf "$OUT/logs_s141.tgz" -C "$L" .
elif [ "$part" = s140 ]; then     # session 36 (not run): why s136's whole overlay lost +8.4 us at KDA TP16 M = 16.
    # Suspect (by elimination): 3216x7168's wgmma entry at bucket 16 (8% faster standalone). The A/B of that one entry
    # over the table (16 pairs), then the op ledger of the row with and without it (which kernels move)
    OV=benchmarks/overlays/wgmma_in_proj16.json
    ab_run in_proj16 150 --var K3FUSE_TUNING_OVERLAY=none,$OV --kinds kda --tp 16 --ms 16 --pairs 16
    for v in none $OV; do
        t=$(basename "$v" .json)
        K3FUSE_TUNING_OVERLAY=$v timeout 150 python3 benchmarks/layer_bench.py --out "$L" --kinds kda --tp 16 --ms 16 \
            --skip eager,inductor --top 24 --tag "_m16_$t" > "$L/lb_m16_$t.txt" 2>&1
        echo "ledger $t rc=$?" | tee -a "$S"; grep -v '^{' "$L/lb_m16_$t.txt" | sed -n '/^kind/,$p' | cut -c1-110 \
            | tee -a "$S"
    done
    tar czf "$OUT/logs_s140.tgz" -C "$L" .
elif [ "$part" = s138 ]; then     # session 36: the H200 table's wgmma entries (buckets 16-64) as the default: the
    # tests whose routes they change (per-bucket graphs, side-stream groups), the M = 64 rows, end to end at M = 64, 16
    pytests runtime 200 tests/test_runtime_gpu.py     # 118 s on a cold cache (s138: 100 s ran out)
    pytests streams 100 tests/test_streams_gpu.py
    timeout 200 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16,8 --ms 64 --skip inductor \
        --top 16 --tag _m64 > "$L/lb_m64.txt" 2>&1
    echo "layer M=64 rc=$?" | tee -a "$S"; grep -v '^{' "$L/lb_m64.txt" | sed -n '/^kind/,/^$/p' | tee -a "$S"
    cp "$L"/layer_bench_m64.json "$L"/layer_bench_m64.png "$OUT/" 2>/dev/null
    timeout 150 python3 benchmarks/gpu_e2e_smoke.py --out "$L" --configs k3tp16 --ms 64,16 --steps 16 > "$L/e2e.txt" 2>&1
    echo "e2e M=64,16 rc=$?" | tee -a "$S"; tail -6 "$L/e2e.txt" | tee -a "$S"
    cp "$L"/gpu_e2e_smoke.json "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s138.tgz" -C "$L" .
elif [ "$part" = s137 ]; then     # session 36: s136's overlay refined (benchmarks/overlays/wgmma_s137_r1.json): the entries under 5%
    # standalone gain dropped, and the two suspects of s136's losses (3216x7168 at bucket 16: KDA TP16 M = 16 +8.4;
    # 1536x7168 at 64: KDA TP8 M = 64 +5.3); the same A/Bs
    OV=benchmarks/overlays/wgmma_s137_r1.json
    ab_run wgmma_r1_m64 150 --var K3FUSE_TUNING_OVERLAY=none,$OV --kinds kda,mla --tp 16,8 --ms 64 --pairs 8
    ab_run wgmma_r1_m32 150 --var K3FUSE_TUNING_OVERLAY=none,$OV --kinds kda,mla --tp 16,8 --ms 32,16 --pairs 8
    tar czf "$OUT/logs_s137.tgz" -C "$L" .
elif [ "$part" = s136 ]; then     # session 35 (not run): the layer A/Bs of s135's wgmma overlay (commit s135's
    # $OUT/wgmma_overlay.json as benchmarks/overlays/wgmma_s135_all.json first: the wgmma GEMM only where it won per shape),
    # then the variant forced everywhere (K3FUSE_GEMV_WGMMA=1) for comparison
    OV=benchmarks/overlays/wgmma_s135_all.json
    [ -f "$OV" ] || { echo "s136: $OV missing (s135's overlay)" | tee -a "$S"; exit 1; }
    # the member lists' owner test as rewritten in session 35's review (the scan's first-member test instead of the popc
    # rank: equivalent by construction, not yet run): the MoE tensor-core GPU tests
    pytests moe_mlist 150 tests/test_moe_kernel_gpu.py -k "member_lists or up_mma or down_mma"
    ab_run wgmma_ov_m64 150 --var K3FUSE_TUNING_OVERLAY=none,$OV --kinds kda,mla --tp 16,8 --ms 64 --pairs 8
    ab_run wgmma_ov_m32 150 --var K3FUSE_TUNING_OVERLAY=none,$OV --kinds kda,mla --tp 16,8 --ms 32,16 --pairs 8
    ab_run wgmma_all_m64 120 --var K3FUSE_GEMV_WGMMA=0,1 --kinds kda --tp 16,8 --ms 64 --pairs 8
    tar czf "$OUT/logs_s136.tgz" -C "$L" .
elif [ "$part" = s134 ]; then     # session 35, the last ~4 min of device time: two of s127's never-timed variant
    # buckets: the tensor-core down at TP8 M = 2, 4 (off by the heuristic below bucket 32; the up won -25 us at TP8 M = 4
    # in session 34), the tensor-core up at TP16 M = 16, 32 (on by the heuristic, never A/B'd)
    ab_run dmma_tp8_small 100 --var K3FUSE_MOE_DOWN_MMA=0,1 --kinds kda --tp 8 --ms 2,4 --pairs 8
    ab_run umma_tp16_mid 100 --var K3FUSE_MOE_UP_MMA=0,1 --kinds kda --tp 16 --ms 16,32 --pairs 8
    tar czf "$OUT/logs_s134.tgz" -C "$L" .
elif [ "$part" = s133 ]; then     # session 35: the member lists made the default (s129 / s131: -0.7..-4.8 us where
    # taken): every MoE GPU test and the per-bucket graph test with it, then s127's TP8 M = 2, 4 layer rows
    pytests moe_all 240 tests/test_moe_kernel_gpu.py
    pytests runtime 120 tests/test_runtime_gpu.py
    timeout 200 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 8 --ms 2,4 --top 16 --tag _tp8_m24 \
        > "$L/lb_tp8_m24.txt" 2>&1
    echo "layer TP8 M=2,4 rc=$?" | tee -a "$S"; grep -v '^{' "$L/lb_tp8_m24.txt" | sed -n '/^kind/,/^$/p' | tee -a "$S"
    cp "$L"/layer_bench_tp8_m24.json "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s133.tgz" -C "$L" .
elif [ "$part" = s132 ]; then     # session 34 (not run: written after the device time ran out): qabsorb over several
    # tokens per CTA (K3FUSE_MLA_QTB=8, opt-in; 4 at bucket 64's column splits): its bitwise GPU test, memcheck, A/Bs
    # (prediction: -4 / -8 us per MLA layer at TP16 / TP8 M = 64, about half at 32, ~0 at 8)
    pytests qtb 200 tests/test_mla_kernel_gpu.py -k "qabsorb_tokens"
    memcheck memcheck_qtb 150 tests/test_mla_kernel_gpu.py -k "qabsorb_tokens and 17"
    ab_run qtb_m64 120 --var K3FUSE_MLA_QTB=0,8 --kinds mla --tp 16,8 --ms 64,32 --pairs 8
    ab_run qtb_m8 80 --var K3FUSE_MLA_QTB=0,8 --kinds mla --tp 8 --ms 8 --pairs 8
    tar czf "$OUT/logs_s132.tgz" -C "$L" .
elif [ "$part" = s131 ]; then     # session 35: s129's follow-ups (member lists won at M = 64: -3.9 / -3.8 us; pass
    # owners lost +13.6 / +23.6, dropped): lists at M = 32 and TP8 M = 16, 8 (both tensor-core kernels there?), then
    # the down's grid cap again with the lists (a non-owner CTA now costs one load)
    ab_run mlist_m32 120 --var K3FUSE_MOE_MEMBER_LISTS=0,1 --kinds kda --tp 16,8 --ms 32 --pairs 8
    ab_run mlist_small 100 --var K3FUSE_MOE_MEMBER_LISTS=0,1 --kinds kda --tp 8 --ms 16,8 --pairs 8
    K3FUSE_MOE_MEMBER_LISTS=1 ab_run mlist_ctas 100 --var K3FUSE_MOE_DOWN_CTAS=8192,16384 --kinds kda --tp 16 --ms 64,32 \
        --pairs 8
    tar czf "$OUT/logs_s131.tgz" -C "$L" .
elif [ "$part" = s130 ]; then     # session 34 (not run): every MLA GPU test with the tensor-core combine (CMMA_BY_HEADS)
    # and PV step (default) — s124's run of the same files hit its 280 s timeout at ~58% on a cold kernel cache, no
    # failure before it; s125 ran the default-path subset (57 passed)
    pytests mla_all 560 tests/test_mla_kernel_gpu.py tests/test_mla_heads_gpu.py
    tar czf "$OUT/logs_s130.tgz" -C "$L" .
elif [ "$part" = s129 ]; then     # session 34 (not run: written after the device time ran out): the routed experts'
    # two opt-ins, K3FUSE_MOE_PASS_OWNERS (a CTA per pass of 16 members) and K3FUSE_MOE_MEMBER_LISTS (the down reads
    # member lists written by the up instead of scanning ids): their bitwise GPU tests, memcheck, paired A/Bs at M = 64
    # (predictions: each -5..-20 / -5..-10 us on the down)
    pytests moe_s34 220 tests/test_moe_kernel_gpu.py -k "pass_owners or member_lists"
    memcheck memcheck_s34 150 tests/test_moe_kernel_gpu.py -k "member_lists and tp16 and 64"
    ab_run pass_m64 110 --var K3FUSE_MOE_PASS_OWNERS=0,1 --kinds kda --tp 16,8 --ms 64 --pairs 8
    ab_run mlist_m64 110 --var K3FUSE_MOE_MEMBER_LISTS=0,1 --kinds kda --tp 16,8 --ms 64 --pairs 8
    tar czf "$OUT/logs_s129.tgz" -C "$L" .
elif [ "$part" = s128 ]; then     # session 34 (not run): where the M = 64 layer's own kernels stand after session 34's
    # changes: the MLA split kernel (TP16 48 us for ~18 us of cache bytes: not bandwidth, and the tensor-core PV step
    # did not move it at 6 heads), the tensor-core combine, the routed up / down (down ~72% of copy)
    ncu_layer m64 mla "split_kernel|combine_mma_kernel|down_mma_kernel|up_mma_kernel" 4 \
        ",sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
    tar czf "$OUT/logs_s128.tgz" -C "$L" .
elif [ "$part" = s127 ]; then     # session 34 (not run): the TP8 M = 2, 4 rows with the table's new UPMMA (A/B: M = 4
    # KDA -25.6, MLA -30.9 us), then the routed variants' buckets never timed: the tensor-core down at TP16 and TP8
    # M = 2, 4 (off by the heuristic below bucket 32), the tensor-core up at TP16 M = 16, 32 (on by the heuristic)
    timeout 200 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 8 --ms 2,4 --top 16 --tag _tp8_m24 \
        > "$L/lb_tp8_m24.txt" 2>&1
    echo "layer TP8 M=2,4 rc=$?" | tee -a "$S"; grep -v '^{' "$L/lb_tp8_m24.txt" | sed -n '/^kind/,/^$/p' | tee -a "$S"
    cp "$L"/layer_bench_tp8_m24.json "$OUT/" 2>/dev/null
    ab_run dmma_small 150 --var K3FUSE_MOE_DOWN_MMA=0,1 --kinds kda --tp 16,8 --ms 2,4 --pairs 8
    ab_run umma_tp16_mid 120 --var K3FUSE_MOE_UP_MMA=0,1 --kinds kda --tp 16 --ms 16,32 --pairs 8
    tar czf "$OUT/logs_s127.tgz" -C "$L" .
elif [ "$part" = s126 ]; then     # session 34: s119's two A/Bs (the routed experts' tensor-core variants where the tables
    # keep them off since sessions 17-18, measured then with the serial member scan), without its ncu runs
    ab_run dmma_tp16_small 140 --var K3FUSE_MOE_DOWN_MMA=0,1 --kinds kda --tp 16 --ms 8,16 --pairs 8
    ab_run umma_tp8_small 140 --var K3FUSE_MOE_UP_MMA=0,1 --kinds kda --tp 8 --ms 4,8 --pairs 8
    tar czf "$OUT/logs_s126.tgz" -C "$L" .
elif [ "$part" = s125 ]; then     # session 34: the PV step's 16-token k-blocks as a rolled loop (unrolled, ptxas spilled
    # 8 bytes at h = 12 for sm_100a): its tests, the A/B against the CUDA-core step (unrolled: TP8 M = 64 -13.2 us,
    # M = 32 -6.3), then the default-path MLA tests (CMMA at h = 12 from bucket 16, PVMMA) that s124's timeout cut
    pytests pvmma 120 tests/test_mla_kernel_gpu.py -k "pv_mma and three_launches"
    ab_run pvmma_rolled 120 --var K3FUSE_MLA_PVMMA=0,1 --kinds mla --tp 8 --ms 64,32 --pairs 8
    pytests mla_default 200 tests/test_mla_kernel_gpu.py -k "(matches_reference or graph or append) and not pv_mma and not combine_mma"
    tar czf "$OUT/logs_s125.tgz" -C "$L" .
elif [ "$part" = s124 ]; then     # session 34: the tensor-core combine (CMMA_BY_HEADS) and PV step (K3FUSE_MLA_PVMMA)
    # as defaults: every MLA GPU test with them, then the M = 64 rows for the README
    pytests mla 280 tests/test_mla_kernel_gpu.py tests/test_mla_heads_gpu.py
    timeout 220 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16,8 --ms 64 --skip inductor \
        --top 16 --tag _m64 > "$L/lb_m64.txt" 2>&1
    echo "layer M=64 rc=$?" | tee -a "$S"; grep -v '^{' "$L/lb_m64.txt" | sed -n '/^kind/,/^$/p' | tee -a "$S"
    cp "$L"/layer_bench_m64.json "$L"/layer_bench_m64.png "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s124.tgz" -C "$L" .
elif [ "$part" = s123 ]; then     # session 34: the A/Bs of s120 and s121 after s122 passed their tests
    ab_run cmma_m64 150 --var K3FUSE_MLA_CMMA=0,1 --kinds mla --tp 16,8 --ms 64 --pairs 8
    ab_run pvmma_m64 150 --var K3FUSE_MLA_PVMMA=0,1 --kinds mla --tp 16,8 --ms 64 --pairs 8
    ab_run cmma_m32 150 --var K3FUSE_MLA_CMMA=0,1 --kinds mla --tp 16,8 --ms 32,16 --pairs 8
    tar czf "$OUT/logs_s123.tgz" -C "$L" .
elif [ "$part" = s122 ]; then     # session 34: correctness before timing: the GPU tests of session 33's two opt-ins
    # (K3FUSE_MLA_CMMA, K3FUSE_MLA_PVMMA), the refactored MoE GPU tests (_variant_runs / _graph_replay_equals), memchecks
    pytests cmma 200 tests/test_mla_kernel_gpu.py -k "combine_mma"
    pytests pvmma 200 tests/test_mla_kernel_gpu.py -k "pv_mma"
    pytests moe 250 tests/test_moe_kernel_gpu.py
    memcheck memcheck_cmma 150 tests/test_mla_kernel_gpu.py -k "combine_mma_matches and 40-12"
    memcheck memcheck_pvmma 150 tests/test_mla_kernel_gpu.py -k "pv_mma and three_launches and 1-12-8"
    tar czf "$OUT/logs_s122.tgz" -C "$L" .
elif [ "$part" = s121 ]; then     # session 33 (not run: written after the device time ran out): the split kernel's PV
    # step on tensor cores (K3FUSE_MLA_PVMMA=1, opt-in): its GPU tests, memcheck, paired A/Bs at M = 64 (prediction
    # -5..-10 us per MLA layer) and at TP8 M = 1 / 8 (three launches there)
    pytests pvmma 300 tests/test_mla_kernel_gpu.py -k "pv_mma"
    memcheck memcheck_pvmma 200 tests/test_mla_kernel_gpu.py -k "pv_mma and three_launches and 1-12-8"
    ab_run pvmma_m64 150 --var K3FUSE_MLA_PVMMA=0,1 --kinds mla --tp 16,8 --ms 64 --pairs 8
    ab_run pvmma_tp8 150 --var K3FUSE_MLA_PVMMA=0,1 --kinds mla --tp 8 --ms 1,8 --pairs 8
    tar czf "$OUT/logs_s121.tgz" -C "$L" .
elif [ "$part" = s120 ]; then     # session 33 (not run: written after the device time ran out): the MLA combine on
    # tensor cores (K3FUSE_MLA_CMMA=1, opt-in): its GPU tests, memcheck, then paired A/Bs at M = 64 and 32 (prediction:
    # -10..-20 us per MLA layer at TP16 M = 64, -25..-40 at TP8)
    pytests cmma 250 tests/test_mla_kernel_gpu.py -k "combine_mma"
    memcheck memcheck_cmma 200 tests/test_mla_kernel_gpu.py -k "combine_mma_matches and 40-12"
    ab_run cmma_m64 150 --var K3FUSE_MLA_CMMA=0,1 --kinds mla --tp 16,8 --ms 64 --pairs 8
    ab_run cmma_m32 150 --var K3FUSE_MLA_CMMA=0,1 --kinds mla --tp 16,8 --ms 32,16 --pairs 8
    tar czf "$OUT/logs_s120.tgz" -C "$L" .
elif [ "$part" = s119 ]; then     # session 33 (not run: written after the device time ran out): the routed experts'
    # tensor-core variants where sessions 17-18 measured them off, with the serial scan and the barrier epilogue that
    # session 33 removed (the down at TP16 M = 8, 16: +1.3 / +2.3 then; the up at TP8 M = 8: +3.8), then ncu of the MLA
    # split and combine at M = 64 (MLA + MoE rows 1.65x / 1.49x: split 49 / 68 us for ~75 MB of cache, combine 33 / 52)
    ab_run dmma_tp16_small 150 --var K3FUSE_MOE_DOWN_MMA=0,1 --kinds kda --tp 16 --ms 8,16 --pairs 8
    ab_run umma_tp8_small 150 --var K3FUSE_MOE_UP_MMA=0,1 --kinds kda --tp 8 --ms 2,4,8 --pairs 8
    ncu_layer mla mla "split_kernel|combine_kernel|down_mma_kernel" 4 \
        ",sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
    tar czf "$OUT/logs_s119.tgz" -C "$L" .
elif [ "$part" = s118 ]; then     # session 33: the new scans where the M = 16..64 A/Bs did not reach: the up's ballot
    # scan at TP16 M = 2, 4, 8 (the table's UPMMA buckets) and the down's ballot scan + per-warp epilogue at TP8 M = 8
    ab_run ubal_small 150 --var K3FUSE_MOE_UP_BALLOT=0,1 --kinds kda --tp 16 --ms 2,4,8 --pairs 8
    ab_run we_tp8_m8 100 --var K3FUSE_MOE_DOWN_WE=0,1 --kinds kda --tp 8 --ms 8 --pairs 8
    tar czf "$OUT/logs_s118.tgz" -C "$L" .
elif [ "$part" = s117 ]; then     # session 33: the new routed-expert defaults (ballot scans, per-warp down epilogue, grid
    # caps): the MMA kernels' GPU tests, the up cap at TP8 M = 16 (heuristic, unmeasured), the M = 64 rows (k3fuse +
    # eager) for the README, the multi-layer model end to end at M = 64
    pytests moe_mma 200 tests/test_moe_kernel_gpu.py -k "up_mma or down_mma or warp_epilogue or ballot"
    ab_run up_ctas_tp8_m16 100 --var K3FUSE_MOE_UP_CTAS=3072,8192 --kinds kda --tp 8 --ms 16 --pairs 8
    timeout 200 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16,8 --ms 64 --skip inductor \
        --top 16 --tag _m64 > "$L/lb_m64.txt" 2>&1
    echo "layer M=64 rc=$?" | tee -a "$S"; grep -v '^{' "$L/lb_m64.txt" | sed -n '/^kind/,/^$/p' | tee -a "$S"
    cp "$L"/layer_bench_m64.json "$L"/layer_bench_m64.png "$OUT/" 2>/dev/null
    timeout 150 python3 benchmarks/gpu_e2e_smoke.py --out "$L" --configs k3tp16 --ms 64 --steps 16 > "$L/e2e.txt" 2>&1
    echo "e2e M=64 rc=$?" | tee -a "$S"; tail -4 "$L/e2e.txt" | tee -a "$S"
    cp "$L"/gpu_e2e_smoke.json "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s117.tgz" -C "$L" .
elif [ "$part" = s116 ]; then     # session 33: the up kernels' grid cap (UP_CTAS 3072, set when every CTA paid the
    # serial member scan) now that the scan is by ballots (K3FUSE_MOE_UP_BALLOT, default since s115)
    ab_run up_ctas_m64 150 --var K3FUSE_MOE_UP_CTAS=3072,8192 --kinds kda --tp 16,8 --ms 64 --pairs 8
    ab_run up_ctas_m64_b 150 --var K3FUSE_MOE_UP_CTAS=8192,16384 --kinds kda --tp 16,8 --ms 64 --pairs 8
    ab_run up_ctas_m32 150 --var K3FUSE_MOE_UP_CTAS=3072,8192 --kinds kda --tp 16,8 --ms 32 --pairs 8
    tar czf "$OUT/logs_s116.tgz" -C "$L" .
elif [ "$part" = s115 ]; then     # session 33: the routed-expert GPU tests with the new defaults (the down's ballot scan,
    # per-warp epilogue, grid caps), the up's ballot scan (K3FUSE_MOE_UP_BALLOT, opt-in) A/B'd at M = 64 and 32, and the
    # down's cap at TP8 M = 16 (the heuristic's DOWN_CTAS 8192 against the old 3072, unmeasured there)
    pytests moe 300 tests/test_moe_kernel_gpu.py
    ab_run up_ballot_m64 150 --var K3FUSE_MOE_UP_BALLOT=0,1 --kinds kda --tp 16,8 --ms 64 --pairs 8
    ab_run up_ballot_m32 150 --var K3FUSE_MOE_UP_BALLOT=0,1 --kinds kda --tp 16,8 --ms 32 --pairs 8
    ab_run ctas_tp8_m16 150 --var K3FUSE_MOE_DOWN_CTAS=3072,8192 --kinds kda --tp 8 --ms 16 --pairs 8
    tar czf "$OUT/logs_s115.tgz" -C "$L" .
elif [ "$part" = s114 ]; then     # session 33: the tensor-core down's grid cap with its ballot scan (K3FUSE_MOE_DOWN_WE,
    # default since s113, where TP16 M = 64's cap 3072 -> 4096 measured -21.4 us): further up at M = 64 and 32
    ab_run ctas_tp16_m64_a 150 --var K3FUSE_MOE_DOWN_CTAS=4096,8192 --kinds kda --tp 16 --ms 64 --pairs 8
    ab_run ctas_tp16_m64_b 150 --var K3FUSE_MOE_DOWN_CTAS=8192,16384 --kinds kda --tp 16 --ms 64 --pairs 8
    ab_run ctas_tp8_m64 150 --var K3FUSE_MOE_DOWN_CTAS=8192,16384 --kinds kda --tp 8 --ms 64 --pairs 8
    ab_run ctas_tp8_m64_b 150 --var K3FUSE_MOE_DOWN_CTAS=16384,28672 --kinds kda --tp 8 --ms 64 --pairs 8
    ab_run ctas_m32 150 --var K3FUSE_MOE_DOWN_CTAS=3072,8192 --kinds kda --tp 16,8 --ms 32 --pairs 8
    tar czf "$OUT/logs_s114.tgz" -C "$L" .
elif [ "$part" = s113 ]; then     # session 33: the tensor-core down's ballot scan + per-warp y epilogue
    # (K3FUSE_MOE_DOWN_WE; ncu s112: barrier stalls 11.3 beside long-scoreboard 14.2, DRAM 46%): its GPU tests (bitwise
    # the barrier epilogue), memcheck, paired A/Bs at M = 64 and 32, then the grid cap with it on at TP16
    pytests down_we 200 tests/test_moe_kernel_gpu.py -k "warp_epilogue or down_mma_matches"
    memcheck memcheck_down_we 150 tests/test_moe_kernel_gpu.py -k "warp_epilogue and tp16 and 64"
    ab_run down_we_m64 150 --var K3FUSE_MOE_DOWN_WE=0,1 --kinds kda --tp 16,8 --ms 64 --pairs 8
    ab_run down_we_m32 150 --var K3FUSE_MOE_DOWN_WE=0,1 --kinds kda --tp 16,8 --ms 32 --pairs 8
    K3FUSE_MOE_DOWN_WE=1 ab_run we_ctas_tp16 150 --var K3FUSE_MOE_DOWN_CTAS=3072,4096 --kinds kda --tp 16 --ms 64 --pairs 8
    tar czf "$OUT/logs_s113.tgz" -C "$L" .
elif [ "$part" = s112 ]; then     # session 33: what limits the routed experts' tensor-core kernels at M = 64 (down_mma
    # 148 us at ~67% of copy, up_mma 214 at ~93%, KDA TP16 in the layer without the PDL chain, s107): ncu stall
    # reasons, DRAM bytes, occupancy, per kernel, TP16 and TP8
    ncu_layer moe kda "up_mma_kernel|down_mma_kernel|combine_kernel" 3 \
        ",sm__cycles_active.avg,sm__cycles_elapsed.max,sm__ctas_launched.sum"
    tar czf "$OUT/logs_s112.tgz" -C "$L" .
elif [ "$part" = s111 ]; then     # session 32 (not run: no device time left): the MLA combine's W_UV rows in batches
    # (K3FUSE_MLA_CBATCH, bucket 64's 4x1 combine: 32 rows per warp, one L2 round trip each by its SASS): the MLA GPU
    # tests with it on (the (4, 1) split cases), memcheck, then the paired A/Bs at M = 64 (RB 8 and 4; 8 takes 252
    # registers, 2 CTAs per SM)
    pytests cbatch 150 tests/test_mla_kernel_gpu.py -k "combine_batched_rows"
    pytests streams 120 tests/test_streams_gpu.py
    memcheck memcheck_cbatch 150 tests/test_mla_kernel_gpu.py -k "combine_batched_rows and 6-True"
    ab_run cbatch8_m64 150 --var K3FUSE_MLA_CBATCH=0,8 --kinds mla --tp 16,8 --ms 64 --pairs 8
    ab_run cbatch4_m64 150 --var K3FUSE_MLA_CBATCH=0,4 --kinds mla --tp 16,8 --ms 64 --pairs 8
    tar czf "$OUT/logs_s111.tgz" -C "$L" .
elif [ "$part" = s110 ]; then     # session 32: the MLA combine at M = 64 (27.5 / 50.0 us alone, s107): its CPRE = 32
    # preloaded partials (128 registers per thread, sized for M = 1's 32 splits) against 16 (= NS at M = 64)
    ab_run mla_cpre_m64 150 --var K3FUSE_MLA_CPRE=32,16 --kinds mla --tp 16,8 --ms 64 --pairs 8
    tar czf "$OUT/logs_s110.tgz" -C "$L" .
elif [ "$part" = s109 ]; then     # session 32: the MLA kernels' GPU tests with bucket 64's new 4x1 splits among the cases
    pytests mla_splits 200 tests/test_mla_kernel_gpu.py -k "splits_match_reference or cuda_graph_replay or matches_reference"
    tar czf "$OUT/logs_s109.tgz" -C "$L" .
elif [ "$part" = s108 ]; then     # session 32: the MLA combine at M = 64 (27.5 / 50.0 us alone at TP16 / TP8, s107): its
    # VS = 4 row splits each re-read the NS = 16 partials; VS = 1 reads them once (and W_UV's rows per token in one CTA)
    ab_run mla_vs_m64 200 --var K3FUSE_MLA_VS=4,1 --kinds mla --tp 16,8 --ms 64 --pairs 8
    tar czf "$OUT/logs_s108.tgz" -C "$L" .
elif [ "$part" = s107 ]; then     # session 32: the M = 64 per-kernel ledger without the PDL chain (each kernel's own
    # time, not its wait on the previous one), TP16 and TP8, both kinds, k3fuse only: the experts' and the MLA
    # attention's kernels apart
    K3FUSE_PDL_CHAIN=0 timeout 300 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16,8 --ms 64 \
        --skip eager,inductor --top 12 --tag _m64_pdl0 > "$L/lb_m64_pdl0.txt" 2>&1
    echo "layer M=64 PDL_CHAIN=0 rc=$?" | tee -a "$S"; grep -v '^{' "$L/lb_m64_pdl0.txt" | grep -E "^(kda|mla) |^k3fuse|^ +[0-9]" \
        | cut -c1-100 | tee -a "$S"
    cp "$L"/layer_bench_m64_pdl0.json "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s107.tgz" -C "$L" .
elif [ "$part" = s106 ]; then     # session 32: the MLA split count at M = 64 once more (8 CTAs per SM, NS 17, against
    # 16, NS 32; both with one tile per split allowed), and the group streams' default at TP8 M = 32
    K3FUSE_MLA_MIN_TILES=1 ab_run mla_ctas16_m64 150 --var K3FUSE_MLA_CTAS_PER_SM=8,16 --kinds mla --tp 16,8 --ms 64 --pairs 8
    ab_run gs_tp8_m32 150 --var K3FUSE_GROUP_STREAMS=0,4 --kinds kda --tp 8 --ms 32 --pairs 8
    tar czf "$OUT/logs_s106.tgz" -C "$L" .
elif [ "$part" = s105 ]; then     # session 32: the new defaults (K3FUSE_GROUP_STREAMS=4, the MLA split kernel at 8 CTAs
    # per SM at bucket 64): GPU tests (streams, the preload test's memo fix), memcheck of the streams tests, the M = 64
    # rows (k3fuse + eager), the multi-layer model end to end at M = 64
    pytests streams 120 tests/test_streams_gpu.py
    pytests preload 120 tests/test_kernels_gpu.py -k "one_kernel_preload"
    memcheck memcheck_streams 150 tests/test_streams_gpu.py -k "group_streams"
    timeout 200 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16,8 --ms 64 --skip inductor \
        --top 16 --tag _m64 > "$L/lb_m64.txt" 2>&1
    echo "layer M=64 rc=$?" | tee -a "$S"; grep -v '^{' "$L/lb_m64.txt" | sed -n '/^kind/,/^$/p' | tee -a "$S"
    grep -A12 "bytes per op call" "$L/lb_m64.txt" | grep -E "kda tp16|linear_group|mla_append|sum" | cut -c1-100 | tee -a "$S"
    cp "$L"/layer_bench_m64.json "$L"/layer_bench_m64.png "$OUT/" 2>/dev/null
    timeout 150 python3 benchmarks/gpu_e2e_smoke.py --out "$L" --configs k3tp16 --ms 64 --steps 16 > "$L/e2e.txt" 2>&1
    echo "e2e M=64 rc=$?" | tee -a "$S"; tail -4 "$L/e2e.txt" | tee -a "$S"
    cp "$L"/gpu_e2e_smoke.json "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s105.tgz" -C "$L" .
elif [ "$part" = s104 ]; then     # session 32: which groups gain on side streams (K3FUSE_GROUP_STREAMS=N: groups of >= N
    # GEMMs; KDA's in_proj has 5-6, the MoE group 3 with the router, MLA's q_a / kv_a 2; MLA's arms of 0,4 are equal),
    # M = 32; the MLA split count at M = 32 and the fewest tiles per split at M = 64
    ab_run gs_0_4 120 --var K3FUSE_GROUP_STREAMS=0,4 --kinds kda,mla --tp 16 --ms 64 --pairs 8
    ab_run gs_4_3 120 --var K3FUSE_GROUP_STREAMS=4,3 --kinds kda,mla --tp 16 --ms 64 --pairs 8
    ab_run mla_ctas_m32 110 --var K3FUSE_MLA_CTAS_PER_SM=2,8 --kinds mla --tp 16,8 --ms 32 --pairs 8
    K3FUSE_MLA_CTAS_PER_SM=8 ab_run mla_mintiles_m64 110 --var K3FUSE_MLA_MIN_TILES=2,1 --kinds mla --tp 16,8 --ms 64 --pairs 8
    ab_run gs_m32 110 --var K3FUSE_GROUP_STREAMS=0,1 --kinds kda,mla --tp 16 --ms 32 --pairs 8
    tar czf "$OUT/logs_s104.tgz" -C "$L" .
elif [ "$part" = s103 ]; then     # session 32: a linear group's cuBLAS GEMMs on side streams at M = 64 / 32
    # (K3FUSE_GROUP_STREAMS): its GPU tests, the paired A/Bs; then the MLA split kernel's splits at M = 64
    # (K3FUSE_MLA_CTAS_PER_SM = 2, the default, against 8)
    pytests streams 150 tests/test_streams_gpu.py
    ab_run group_streams_m64 330 --var K3FUSE_GROUP_STREAMS=0,1 --kinds kda,mla --tp 16,8 --ms 64 --pairs 8
    ab_run mla_ctas_m64 150 --var K3FUSE_MLA_CTAS_PER_SM=2,8 --kinds mla --tp 16,8 --ms 64 --pairs 8
    tar czf "$OUT/logs_s103.tgz" -C "$L" .
elif [ "$part" = s102 ]; then     # session 32: the M = 64 rows with the op ledger (last rows: session 18), k3fuse only,
    # TP16 and TP8: which op holds the time above the floor at M = 64 (issue 5 asks <= 1.3x)
    timeout 450 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16,8 --ms 64 --skip eager,inductor \
        --top 16 --tag _m64_ledger > "$L/lb_m64_ledger.txt" 2>&1
    echo "layer M=64 with the op ledger rc=$?" | tee -a "$S"; grep -v '^{' "$L/lb_m64_ledger.txt" | sed -n '/^kind/,$p' \
        | cut -c1-110 | tee -a "$S"
    cp "$L"/layer_bench_m64_ledger.json "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s102.tgz" -C "$L" .
elif [ "$part" = s101 ]; then     # session 31 (run in session 32 at eff9ad4; the knob since removed): the one-launch fused_residual_norm's weight loads before the
    # chain's wait (K3FUSE_FRN_EARLY_W; session 14's K3FUSE_EARLY_WEIGHTS had only separate-process timings): its GPU
    # tests with it on, then the paired layer A/B at M = 1
    K3FUSE_FRN_EARLY_W=1 pytests frn_early_w 150 tests/test_kernels_gpu.py -k "one_kernel"
    ab_run frn_early_w 220 --var K3FUSE_FRN_EARLY_W=0,1 --kinds kda,mla --tp 16,8 --ms 1 --pairs 16
    tar czf "$OUT/logs_s101.tgz" -C "$L" .
elif [ "$part" = s100 ]; then     # session 31: kda_decode's stamps (K3FUSE_KDA_STAMPS) beside the fused_residual_norms'
    # on one time axis: when does frn 1 enter against kda_decode's wait and end? Its GPU tests with the stamps on first
    K3FUSE_KDA_STAMPS=1 pytests kda_stamps 100 tests/test_kda_kernel_gpu.py -k "decode"
    timeout 150 python3 benchmarks/frn_timeline.py --out "$L" --kinds kda --tp 16,8 --ms 1 --kda-stamps \
        > "$L/frn_timeline.txt" 2>&1
    echo "frn_timeline rc=$?" | tee -a "$S"; grep -v '^{' "$L/frn_timeline.txt" | tail -56 | tee -a "$S"
    grep '^{' "$L/frn_timeline.txt" | tee -a "$S"
    cp "$L/frn_timeline.json" "$OUT/frn_timeline_kda.json" 2>/dev/null
    tar czf "$OUT/logs_s100.tgz" -C "$L" .
elif [ "$part" = s99 ]; then      # session 31 (the knob since removed): the fused_residual_norm's statistics atomics over 8 accumulator copies
    # (K3FUSE_FRN_SPREAD): its GPU tests (and the one-launch tests after the memo-key fix), its stamps, the layer A/B;
    # first the PDL probe with a late-triggering head (do dependents of dependents enter early?)
    timeout 60 python3 benchmarks/pdl_probe.py --spin-us 5 --ctas 128 --head-us 0,3 > "$L/pdl_probe.txt" 2>&1
    echo "pdl_probe rc=$?" | tee -a "$S"; cat "$L/pdl_probe.txt" | tee -a "$S"
    pytests frn_spread 150 tests/test_kernels_gpu.py -k "one_kernel"
    K3FUSE_FRN_SPREAD=8 timeout 150 python3 benchmarks/frn_timeline.py --out "$L" --kinds kda --tp 16,8 --ms 1 \
        > "$L/frn_timeline.txt" 2>&1
    echo "frn_timeline SPREAD=8 rc=$?" | tee -a "$S"; grep -v '^{' "$L/frn_timeline.txt" | grep -A8 "stamps on" \
        | tee -a "$S"
    cp "$L/frn_timeline.json" "$OUT/frn_timeline_spread8.json" 2>/dev/null
    ab_run frn_spread 200 --var K3FUSE_FRN_SPREAD=1,8 --kinds kda --tp 16,8 --ms 1 --pairs 16
    tar czf "$OUT/logs_s99.tgz" -C "$L" .
elif [ "$part" = s98 ]; then      # session 31: where the one-launch fused_residual_norm's time goes (K3FUSE_FRN_STAMPS=1,
    # benchmarks/frn_timeline.py), KDA TP16 and TP8 M = 1; its GPU tests with the stamps on (the outputs unchanged)
    K3FUSE_FRN_STAMPS=1 pytests frn_stamps 150 tests/test_kernels_gpu.py -k "one_kernel"
    timeout 200 python3 benchmarks/frn_timeline.py --out "$L" --kinds kda --tp 16,8 --ms 1 > "$L/frn_timeline.txt" 2>&1
    echo "frn_timeline rc=$?" | tee -a "$S"; grep -v '^{' "$L/frn_timeline.txt" | tail -44 | tee -a "$S"
    cp "$L/frn_timeline.json" "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s98.tgz" -C "$L" .
elif [ "$part" = s96 ]; then      # session 31 (at 623776c; the knob since removed): kda_decode's loads of what no kernel of the step writes (S row, conv window
    # + taps, f_b row) issued before the chain's wait (K3FUSE_KDA_EARLY): every KDA GPU test with it on (among them
    # three in-place steps after a PDL GEMV in one graph), then the layer A/B
    K3FUSE_KDA_EARLY=1 pytests kda_early 150 tests/test_kda_kernel_gpu.py
    ab_run kda_early 200 --var K3FUSE_KDA_EARLY=0,1 --kinds kda --tp 16,8 --ms 1 --pairs 16
    tar czf "$OUT/logs_s96.tgz" -C "$L" .
elif [ "$part" = s97 ]; then      # session 31 (at 623776c; the knob since removed): the per-head MLA kernel's first tile loaded before the chain's wait
    # (K3FUSE_MLA_EARLY): bitwise against off, the append / q-inside tests with it on, the layer A/B, memcheck, stamps
    pytests mla_early_bitwise 120 tests/test_mla_heads_gpu.py::test_early_tile_is_bitwise_the_same
    ab_run mla_early 170 --var K3FUSE_MLA_EARLY=0,1 --kinds mla --tp 16 --ms 1,2 --pairs 16
    K3FUSE_MLA_EARLY=1 pytests mla_early 120 tests/test_mla_heads_gpu.py::test_qb_op_matches_reference \
        tests/test_mla_heads_gpu.py::test_heads_append_gate_matches_reference
    K3FUSE_MLA_EARLY=1 memcheck memcheck_mla_early 80 tests/test_mla_heads_gpu.py::test_early_tile_is_bitwise_the_same
    timeline early0 K3FUSE_MLA_EARLY=0
    timeline early1 K3FUSE_MLA_EARLY=1
    tar czf "$OUT/logs_s97.tgz" -C "$L" .
elif [ "$part" = s95 ]; then      # session 30 (run in session 31): s94, then the M = 1 rows with the op ledger (bytes per op call
    # against its kernels' device time: benchmarks/op_ledger.py), TP16 and TP8, k3fuse only, 16 layers per graph
    bash benchmarks/validate_pending.sh s94
    timeout 200 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16,8 --ms 1 --skip inductor \
        --graph-rounds 8 --top 16 --tag _m1_ledger > "$L/lb_m1_ledger.txt" 2>&1
    echo "layer M=1 with the op ledger rc=$?" | tee -a "$S"; grep -v '^{' "$L/lb_m1_ledger.txt" | sed -n '/^kind/,$p' \
        | cut -c1-100 | tee -a "$S"
    cp "$L"/layer_bench_m1_ledger.json "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s95.tgz" -C "$L" .
elif [ "$part" = s94 ]; then      # session 30: where an L2 prefetch must be issued to land (l2_probe --order)
    timeout 150 python3 benchmarks/l2_probe.py --out "$L" --order > "$L/l2_order.txt" 2>&1
    echo "l2_probe --order rc=$?" | tee -a "$S"; grep -v '^{' "$L/l2_order.txt" | tail -6 | tee -a "$S"
    cp "$L/l2_probe_order.json" "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s94.tgz" -C "$L" .
elif [ "$part" = s93 ]; then      # session 30: an L2-resident weight read against an HBM one (the ceiling of L2 prefetch)
    timeout 200 python3 benchmarks/l2_probe.py --out "$L" > "$L/l2_probe.txt" 2>&1
    echo "l2_probe rc=$?" | tee -a "$S"; grep -v '^{' "$L/l2_probe.txt" | tail -8 | tee -a "$S"
    cp "$L/l2_probe.json" "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s93.tgz" -C "$L" .
elif [ "$part" = s92 ]; then      # session 30: the M = 1 per-kernel ledger without the PDL chain (each kernel's own time,
    # not its wait on the previous one), TP16 and TP8, both kinds, k3fuse only
    K3FUSE_PDL_CHAIN=0 timeout 200 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16,8 --ms 1 \
        --skip inductor --top 16 --tag _m1_pdl0 > "$L/lb_m1_pdl0.txt" 2>&1
    echo "layer M=1 PDL_CHAIN=0 rc=$?" | tee -a "$S"; grep -v '^{' "$L/lb_m1_pdl0.txt" | grep -E "^(kda|mla) |^k3fuse|^ +[0-9]" \
        | cut -c1-90 | tee -a "$S"
    cp "$L"/layer_bench_m1_pdl0.json "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s92.tgz" -C "$L" .
elif [ "$part" = s91 ]; then      # session 30: per head against the three launches at TP8 M = 1 on today's kernel (MMA
    # tiles, pushes, cq first; last A/B'd with pushes only, session 27: +2.5 us), then every per-head GPU test on the
    # source restored after the bulk-copy tiles' removal
    ab_run heads_tp8_m1 140 --var K3FUSE_MLA_HEADS=0,1 --kinds mla --tp 8 --ms 1 --pairs 16
    pytests heads 330 tests/test_mla_heads_gpu.py
    tar czf "$OUT/logs_s91.tgz" -C "$L" .
elif [ "$part" = s90 ]; then      # session 30: how much of a row's graph time is the graph launch's own cost (s89: graph
    # 93.1 / 100.7 us against kernel sums 83.8 / 86.8 at TP16 M = 1; session 29's machine: 86.6 / 87.2): the same rows
    # with 2 layers per graph (the tables' setting) and 16, one process each, twice in alternation; the driver and clocks
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv | tee -a "$S"
    for rep in 1 2; do
        for gr in 1 8; do
            timeout 140 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16 --ms 1 --skip inductor \
                --graph-rounds $gr --tag _gr${gr}_$rep > "$L/lb_gr${gr}_$rep.txt" 2>&1
            echo "layer graph-rounds $gr ($rep) rc=$? $(grep -E '^(kda|mla) +16 ' "$L/lb_gr${gr}_$rep.txt" | tr -s ' ' | tr '\n' '|')" \
                | tee -a "$S"
            grep -E "of kernel time" "$L/lb_gr${gr}_$rep.txt" | tee -a "$S"
            cp "$L/layer_bench_gr${gr}_$rep.json" "$OUT/" 2>/dev/null
        done
    done
    tar czf "$OUT/logs_s90.tgz" -C "$L" .
elif [ "$part" = s89 ]; then      # session 30 (after s87 measured the bulk-copied tiles slower: removed): the per-head
    # GPU tests on the restored source; what limits the per-head kernel's tiles (ncu: stall reasons, L2 -> L1 bytes per
    # SM per clock; the kernel alone, 6 heads, clusters of 16) and the routed experts at TP16 M = 1 (in the layer,
    # no PDL chain); the M = 1 rows with k3fuse only (QFIRST default since session 29)
    pytests heads_sub 130 tests/test_mla_heads_gpu.py::test_qb_op_matches_reference \
        tests/test_mla_heads_gpu.py::test_qb_qfirst_is_bitwise_the_same tests/test_mla_heads_gpu.py::test_heads_push_is_bitwise_the_loads \
        tests/test_mla_heads_gpu.py::test_heads_append_gate_matches_reference
    NCUM="regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,l1tex__m_xbar2l1tex_read_bytes.sum"
    NCUM="$NCUM,dram__bytes_read.sum,gpu__time_duration.sum,sm__cycles_elapsed.max,sm__cycles_active.avg"
    NCUM="$NCUM,smsp__inst_executed.sum,launch__grid_size,launch__registers_per_thread"
    timeout 100 ncu --kernel-name regex:heads_kernel --launch-skip 2 --launch-count 1 --metrics "$NCUM" \
        python3 benchmarks/mla_tiles_probe.py --out "$L" --heads 6 --copies 4 --replays 1 > "$L/ncu_heads.txt" 2>&1
    echo "ncu heads rc=$?" | tee -a "$S"; grep -E "^  [a-z]|ERR" "$L/ncu_heads.txt" | sort -k3 -g | tail -32 | tee -a "$S"
    K3FUSE_PDL_CHAIN=0 timeout 150 ncu --kernel-name regex:"up_kernel|down_kernel" --launch-skip 2 --launch-count 2 \
        --metrics "$NCUM" python3 benchmarks/layer_bench.py --out "$L" --kinds kda --tp 16 --ms 1 \
        --skip eager,inductor --tag _ncu > "$L/ncu_moe.txt" 2>&1
    echo "ncu moe rc=$?" | tee -a "$S"; grep -E "^  [a-z_]+kernel|^  [a-z]|ERR" "$L/ncu_moe.txt" | tee -a "$S"
    timeout 200 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16,8 --ms 1 --skip eager,inductor \
        --top 12 --tag _m1_k3 > "$L/lb_m1_k3.txt" 2>&1
    echo "layer M=1 k3fuse rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_m1_k3.txt" | tee -a "$S"
    cp "$L"/layer_bench_m1_k3.json "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s89.tgz" -C "$L" .
elif [ "$part" = s87 ]; then      # session 29 (cut: the machine was taken back mid-run; run in session 30, then removed): K3FUSE_MLA_HEADS_TMA (the MMA
    # tiles' rows by bulk copies into shared memory): tests (bitwise the register loads), A/Bs TP16 M = 1 and per
    # head at TP8 M = 1 (against the three launches, TMA on), the stamps, memcheck last (cut first if time runs out)
    pytests tma 150 tests/test_mla_heads_gpu.py -k "tma"
    ab_run tma_tp16_m1 130 --var K3FUSE_MLA_HEADS_TMA=0,1 --kinds mla --tp 16 --ms 1 --pairs 16
    K3FUSE_MLA_HEADS_TMA=1 ab_run tma_heads_tp8_m1 130 --var K3FUSE_MLA_HEADS=0,1 --kinds mla --tp 8 --ms 1 --pairs 16
    timeline tma K3FUSE_MLA_HEADS_TMA=1
    memcheck memcheck_tma 90 tests/test_mla_heads_gpu.py -k "tma_is_bitwise and 1-6-1024-seq_lens0-16"
    tar czf "$OUT/logs_s87.tgz" -C "$L" .
elif [ "$part" = s86 ]; then      # session 29: K3FUSE_MLA_QFIRST=2 (also the first tile's rows after cq has landed): tests,
    # stamps, A/Bs (1 -> 2 at TP16 M = 1, 0 -> 2 at M = 2)
    pytests qfirst2 200 tests/test_mla_heads_gpu.py -k "qb"
    timeline qfirst_2 K3FUSE_MLA_QFIRST=2
    ab_run qfirst12_tp16_m1 130 --var K3FUSE_MLA_QFIRST=1,2 --kinds mla --tp 16 --ms 1 --pairs 16
    ab_run qfirst02_tp16_m2 130 --var K3FUSE_MLA_QFIRST=0,2 --kinds mla --tp 16 --ms 2 --pairs 16
    tar czf "$OUT/logs_s86.tgz" -C "$L" .
elif [ "$part" = s85 ]; then      # session 29: K3FUSE_MLA_QFIRST (cq's loads before the first tile's rows): tests, the q
    # phase's stamps both ways, A/Bs at TP16 M = 1, 2 (the per-head kernel computing q, the default there)
    pytests qfirst 200 tests/test_mla_heads_gpu.py -k "qb"
    for qf in 0 1; do timeline qfirst_$qf K3FUSE_MLA_QFIRST=$qf; done
    ab_run qfirst_tp16_m1 130 --var K3FUSE_MLA_QFIRST=0,1 --kinds mla --tp 16 --ms 1 --pairs 16
    ab_run qfirst_tp16_m2 130 --var K3FUSE_MLA_QFIRST=0,1 --kinds mla --tp 16 --ms 2 --pairs 16
    tar czf "$OUT/logs_s85.tgz" -C "$L" .
elif [ "$part" = s83 ] || [ "$part" = s84 ]; then   # session 29: the M = 1 rows, every backend + max-autotune
    # (s83: TP16, then the TP16 M = 2, 4 per-kernel ledger without the PDL chain; s84: TP8)
    tp=16; [ "$part" = s84 ] && tp=8
    timeout 300 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp $tp --ms 1 --top 16 --max-autotune \
        --tag _s29_m1_tp${tp}_mat > "$L/lb_m1_tp${tp}_mat.txt" 2>&1
    echo "layer TP$tp M=1 every backend + max-autotune rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_m1_tp${tp}_mat.txt" | tee -a "$S"
    cp "$L"/layer_bench_s29_m1_tp${tp}_mat.json "$L"/layer_bench_s29_m1_tp${tp}_mat.png "$OUT/" 2>/dev/null
    if [ "$part" = s83 ]; then
        K3FUSE_PDL_CHAIN=0 timeout 150 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16 --ms 2,4 \
            --skip eager,inductor --top 20 --tag _s29_m24_tp16_pdl0 > "$L/lb_m24_pdl0.txt" 2>&1
        echo "layer TP16 M=2,4 PDL_CHAIN=0 rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_m24_pdl0.txt" | tee -a "$S"
        cp "$L"/layer_bench_s29_m24_tp16_pdl0.json "$OUT/" 2>/dev/null
    fi
    tar czf "$OUT/logs_$part.tgz" -C "$L" .
elif [ "$part" = s82 ]; then      # session 29: s81 (the per-head tiles alone at 1-6 heads; the tile's stamps) and every
    # per-head GPU test after session 28's review refactor of the template (slot_used / slot_chunk helpers)
    bash benchmarks/validate_pending.sh s81
    pytests heads 240 tests/test_mla_heads_gpu.py
    tar czf "$OUT/logs_s82.tgz" -C "$L" .
elif [ "$part" = s81 ]; then      # written in session 28 after its device time ran out (not run): the per-head kernel alone
    # at 1-6 heads (clusters of 16, stamps): per-SM or aggregate limit of the tiles (benchmarks/mla_tiles_probe.py);
    # then the first tile's stamps in the layer with the new "t1 loads issued" phase
    timeout 200 python3 benchmarks/mla_tiles_probe.py --out "$L" --heads 1,2,3,6 > "$L/probe.txt" 2>&1
    echo "mla_tiles_probe rc=$?" | tee -a "$S"; tail -8 "$L/probe.txt" | tee -a "$S"
    cp "$L/mla_tiles_probe.json" "$OUT/" 2>/dev/null
    timeout 100 python3 benchmarks/mla_timeline.py --out "$L" --tp 16 --ms 1 --cls 16 --qb 1 > "$L/timeline.txt" 2>&1
    echo "mla_timeline rc=$?" | tee -a "$S"; grep -v '^{' "$L/timeline.txt" | tail -19 | tee -a "$S"
    tar czf "$OUT/logs_s81.tgz" -C "$L" .
elif [ "$part" = s80 ]; then      # session 28: the MMA tile's phases (stamps inside the first tile) and K3FUSE_MLA_TILE2
    # (two score chains, the softmax in every warp: one CTA barrier fewer per tile): tests, stamps both ways, A/Bs
    K3FUSE_MLA_TILE2=1 pytests tile2 150 tests/test_mla_heads_gpu.py -k "mma_matches or bitwise or (append and 1-)"
    for t2 in 0 1; do timeline tile2_$t2 K3FUSE_MLA_TILE2=$t2; done
    ab_run tile2_tp16_m1 130 --var K3FUSE_MLA_TILE2=0,1 --kinds mla --tp 16 --ms 1 --pairs 16
    K3FUSE_MLA_HEADS=1 ab_run tile2_heads_tp8_m1 130 --var K3FUSE_MLA_TILE2=0,1 --kinds mla --tp 8 --ms 1 --pairs 16
    tar czf "$OUT/logs_s80.tgz" -C "$L" .
elif [ "$part" = s79 ]; then      # session 28: the MMA tiles' loads two tiles ahead (K3FUSE_MLA_HEADS_PF=2): tests, A/Bs
    K3FUSE_MLA_HEADS_PF=2 pytests pf2 150 tests/test_mla_heads_gpu.py -k "mma_matches or bitwise or (append and 1-)"
    ab_run pf2_tp16_m1 130 --var K3FUSE_MLA_HEADS_PF=1,2 --kinds mla --tp 16 --ms 1 --pairs 16
    K3FUSE_MLA_HEADS=1 ab_run pf2_heads_tp8_m1 130 --var K3FUSE_MLA_HEADS_PF=1,2 --kinds mla --tp 8 --ms 1 --pairs 16
    ab_run pf2_tp16_m2 120 --var K3FUSE_MLA_HEADS_PF=1,2 --kinds mla --tp 16 --ms 2 --pairs 16
    tar czf "$OUT/logs_s79.tgz" -C "$L" .
elif [ "$part" = s78 ]; then      # session 28: the MMA tiles' stamps (TP16 M = 1, clusters of 16 and 8), per head with
    # MMA against the three launches at TP8 M = 1, MMA on / off at TP16 M = 2 (per head there), the mix-norm tests
    K3FUSE_MLA_HEADS_MMA=1 timeout 100 python3 benchmarks/mla_timeline.py --out "$L" --tp 16 --ms 1 --cls 16,8 --qb 1 \
        > "$L/timeline_mma1.txt" 2>&1
    echo "mla_timeline MMA=1 rc=$?" | tee -a "$S"; grep -v '^{' "$L/timeline_mma1.txt" | tail -40 | tee -a "$S"
    cp "$L/mla_timeline.json" "$OUT/mla_timeline_mma1.json" 2>/dev/null
    K3FUSE_MLA_HEADS_MMA=1 ab_run heads_mma_tp8_m1 150 --var K3FUSE_MLA_HEADS=0,1 --kinds mla --tp 8 --ms 1 --pairs 16
    ab_run mma_tp16_m2 130 --var K3FUSE_MLA_HEADS_MMA=0,1 --kinds mla --tp 16 --ms 2 --pairs 16
    pytests mixnorm 60 tests/test_kernels_gpu.py -k "mix_norm_cluster or mix_norm_push"
    tar czf "$OUT/logs_s78.tgz" -C "$L" .
elif [ "$part" = s76 ]; then      # session 27: the per-head MLA and mix-norm GPU tests after templates/_dsmem.jinja
    pytests heads 120 tests/test_mla_heads_gpu.py
    pytests mixnorm 60 tests/test_kernels_gpu.py -k "mix_norm_cluster or mix_norm_push"
    tar czf "$OUT/logs_s76.tgz" -C "$L" .
elif [ "$part" = s75 ]; then      # session 27: the TP16 rows with both pushes the default (k3fuse only), M = 1, 2;
    # MLA M = 1 once more (s74's run had 6.4 us between graph and kernel time, session 26's 0.4)
    timeout 180 python3 benchmarks/layer_bench.py --kinds kda,mla --tp 16 --ms 1,2 --top 14 --skip eager,inductor \
        --tag _s27_tp16_m12 --out "$OUT" > "$L/lb.txt" 2>&1
    echo "layer_bench tp16 m1,2 rc=$?" | tee -a "$S"; grep -E "^(kda|mla) |k3fuse .* kernels, " "$L/lb.txt" | tee -a "$S"
    timeout 80 python3 benchmarks/layer_bench.py --kinds mla --tp 16 --ms 1 --top 14 --skip eager,inductor \
        --tag _s27_mla_tp16_m1_again --out "$OUT" > "$L/lb2.txt" 2>&1
    echo "layer_bench mla tp16 m1 again rc=$?" | tee -a "$S"; grep -E "^mla |k3fuse .* kernels, " "$L/lb2.txt" | tee -a "$S"
    tar czf "$OUT/logs_s75.tgz" -C "$L" .
elif [ "$part" = s74 ]; then      # session 27: the mix-norm cluster kernel's gathers by st.async (K3FUSE_MIXNORM_PUSH=1,
    # bitwise the same): tests, memcheck, A/Bs at TP16 M = 2 (both kinds) and M = 8 (KDA); then the MLA TP16 M = 1 row
    # with the per-head kernel's pushes (the default since s70)
    pytests mixnorm 150 tests/test_kernels_gpu.py -k "mix_norm_cluster or mix_norm_push"
    memcheck memcheck_mnpush 120 tests/test_kernels_gpu.py -k "mix_norm_push_is_bitwise"
    ab_run mnpush_tp16_m2 130 --var K3FUSE_MIXNORM_PUSH=0,1 --kinds kda,mla --tp 16 --ms 2 --pairs 12
    ab_run mnpush_tp16_m8 100 --var K3FUSE_MIXNORM_PUSH=0,1 --kinds kda --tp 16 --ms 8 --pairs 12
    timeout 120 python3 benchmarks/layer_bench.py --kinds mla --tp 16 --ms 1 --top 14 --skip eager,inductor \
        --tag _s27_mla_tp16_m1 --out "$OUT" > "$L/lb.txt" 2>&1
    echo "layer_bench mla tp16 m1 rc=$?" | tee -a "$S"; grep -E "^mla |^ +[0-9.]+ +[0-9]+ " "$L/lb.txt" | head -20 | tee -a "$S"
    tar czf "$OUT/logs_s74.tgz" -C "$L" .
elif [ "$part" = s73 ]; then      # session 27: the per-head kernel's second tile loaded with the first (K3FUSE_MLA_PF2=1,
    # bitwise the same): tests, A/Bs at TP16 M = 1, 2 (per head, the default) and TP8 M = 1 (per head)
    pytests knobs 150 tests/test_mla_heads_gpu.py -k "bitwise"
    ab_run pf2_tp16_m1 150 --var K3FUSE_MLA_PF2=0,1 --kinds mla --tp 16 --ms 1 --pairs 16
    K3FUSE_MLA_HEADS=1 ab_run pf2_heads_tp8_m1 150 --var K3FUSE_MLA_PF2=0,1 --kinds mla --tp 8 --ms 1 --pairs 16
    ab_run pf2_tp16_m2 150 --var K3FUSE_MLA_PF2=0,1 --kinds mla --tp 16 --ms 2 --pairs 16
    tar czf "$OUT/logs_s73.tgz" -C "$L" .
elif [ "$part" = s72 ]; then      # session 27: the per-head tile loop's warp-level max and lazy rescale (K3FUSE_MLA_WMAX=1,
    # bitwise the same): tests, A/Bs at TP16 M = 1 and (per head) TP8 M = 1; the pushes (the default) at TP16 M = 2
    pytests knobs 150 tests/test_mla_heads_gpu.py -k "bitwise or qb_op"
    ab_run wmax_tp16_m1 150 --var K3FUSE_MLA_WMAX=0,1 --kinds mla --tp 16 --ms 1 --pairs 16
    K3FUSE_MLA_HEADS=1 ab_run wmax_heads_tp8_m1 150 --var K3FUSE_MLA_WMAX=0,1 --kinds mla --tp 8 --ms 1 --pairs 16
    ab_run push_tp16_m2 150 --var K3FUSE_MLA_PUSH=0,1 --kinds mla --tp 16 --ms 2 --pairs 16
    tar czf "$OUT/logs_s72.tgz" -C "$L" .
elif [ "$part" = s71 ]; then      # session 27: K3FUSE_MLA_PUSH: every per-head GPU test, memcheck of the pushes, the stamps
    pytests heads 220 tests/test_mla_heads_gpu.py
    memcheck memcheck_push 150 tests/test_mla_heads_gpu.py -k "push_is_bitwise and 1024"
    K3FUSE_MLA_PUSH=1 timeout 150 python3 benchmarks/mla_timeline.py --out "$L" --tp 16 --ms 1 --cls 16,8 --qb 1 \
        > "$L/timeline.txt" 2>&1
    echo "mla_timeline push rc=$?" | tee -a "$S"; grep -v '^{' "$L/timeline.txt" | tail -60 | tee -a "$S"
    cp "$L/mla_timeline.json" "$OUT/mla_timeline_push.json" 2>/dev/null
    tar czf "$OUT/logs_s71.tgz" -C "$L" .
elif [ "$part" = s69 ]; then      # session 26: the per-head default at TP16 M = 1 (clusters of 16 from the table, no
    # knob) against the three launches + q_b once more, 24 pairs
    ab_run heads_m1_table 200 --var K3FUSE_MLA_HEADS=0,1 --kinds mla --tp 16 --ms 1 --pairs 24
    tar czf "$OUT/logs_s69.tgz" -C "$L" .
elif [ "$part" = s68 ]; then      # session 26: the per-head kernel (clusters of 16, q inside) the default at TP16 M = 1:
    # its GPU tests and memcheck (the ranks' stores into each other's shared memory), the model end to end at M = 1,
    # the MLA TP16 M = 1 row (k3fuse only)
    pytests heads 200 tests/test_mla_heads_gpu.py
    memcheck memcheck_qb16 150 tests/test_mla_heads_gpu.py -k "qb_op_matches and 16 and 1024"
    timeout 200 python3 benchmarks/gpu_e2e_smoke.py --out "$L" --configs k3tp16 --ms 1 --steps 16 > "$L/e2e.txt" 2>&1
    echo "e2e rc=$?" | tee -a "$S"; tail -4 "$L/e2e.txt" | tee -a "$S"
    cp "$L"/gpu_e2e_smoke.json "$OUT/" 2>/dev/null
    timeout 150 python3 benchmarks/layer_bench.py --kinds mla --tp 16 --ms 1 --top 14 --skip eager,inductor \
        --tag _s26_mla_tp16_m1 --out "$OUT" > "$L/lb.txt" 2>&1
    echo "layer_bench mla tp16 m1 rc=$?" | tee -a "$S"; grep -E "^mla |^ +[0-9.]+ +[0-9]+ " "$L/lb.txt" | head -20 | tee -a "$S"
    tar czf "$OUT/logs_s68.tgz" -C "$L" .
elif [ "$part" = s67 ]; then      # session 26: each cluster rank merges C / CL columns (query, o_lat) and stores them
    # in every rank (s66's stamps: every rank reading every peer's C columns was DSMEM-traffic-bound, CL^2): GPU tests,
    # stamps, per head (CL = 16 where one wave allows) against three launches at M = 1 (TP16, TP8) and at TP16 M = 2
    pytests heads 200 tests/test_mla_heads_gpu.py
    timeout 200 python3 benchmarks/mla_timeline.py --out "$L" --tp 16 --ms 1 --cls 8,16 --qb 1 > "$L/timeline.txt" 2>&1
    echo "mla_timeline rc=$?" | tee -a "$S"; grep -v '^{' "$L/timeline.txt" | grep -A14 "launch 0" | tee -a "$S"
    grep '^{' "$L/timeline.txt" | tee -a "$S"
    cp "$L/mla_timeline.json" "$OUT/" 2>/dev/null
    K3FUSE_MLA_HEADS_CL=16 ab_run heads_m1 260 --var K3FUSE_MLA_HEADS=0,1 --kinds mla --tp 16,8 --ms 1 --pairs 16
    ab_run heads_m2 150 --var K3FUSE_MLA_HEADS=0,1 --kinds mla --tp 16 --ms 2 --pairs 16
    tar czf "$OUT/logs_s67.tgz" -C "$L" .
elif [ "$part" = s66 ]; then      # session 26: the per-head kernel's peer reads batched (query gather, merge) and its
    # gate read early: GPU tests, the stamps again, then per head (CL = 16 where one wave allows) against the three
    # launches at M = 1 (TP16, TP8), and per head against three launches at TP16 M = 2 (the default there)
    pytests heads 200 tests/test_mla_heads_gpu.py
    timeout 200 python3 benchmarks/mla_timeline.py --out "$L" --tp 16 --ms 1 --cls 8,16 --qb 1 > "$L/timeline.txt" 2>&1
    echo "mla_timeline rc=$?" | tee -a "$S"; grep -v '^{' "$L/timeline.txt" | grep -A16 "launch 0" | tee -a "$S"
    cp "$L/mla_timeline.json" "$OUT/" 2>/dev/null
    K3FUSE_MLA_HEADS_CL=16 ab_run heads_m1 260 --var K3FUSE_MLA_HEADS=0,1 --kinds mla --tp 16,8 --ms 1 --pairs 16
    tar czf "$OUT/logs_s66.tgz" -C "$L" .
elif [ "$part" = s65 ]; then      # session 26: the MLA rows session 25's lowering split (4f52cb0) should restore
    for spec in "16 8" "8 2,8"; do
        set -- $spec
        timeout 200 python3 benchmarks/layer_bench.py --kinds mla --tp $1 --ms $2 --top 14 --skip eager,inductor \
            --tag _s26_mla_tp$1 --out "$OUT" > "$L/lb_tp$1.txt" 2>&1
        echo "layer_bench mla tp$1 ms $2 rc=$?" | tee -a "$S"; grep -E "^mla " "$L/lb_tp$1.txt" | tee -a "$S"
    done
    tar czf "$OUT/logs_s65.tgz" -C "$L" .
elif [ "$part" = s63 ]; then      # session 25: the MLA output's cast into the attention op (its contiguous clone no longer
    # blocks it: one Inductor kernel fewer per MLA layer) and q_b inside the per-head kernel at TP16 M = 2: the
    # append / gate / qb GPU tests, then the MLA rows (k3fuse only) at TP16 M = 1, 2 and TP8 M = 1
    pytests s63 200 tests/test_mla_kernel_gpu.py tests/test_mla_heads_gpu.py -k "append or qb or graph"
    for tp in 16 8; do
        ms=1; [ $tp = 16 ] && ms=1,2
        timeout 150 python3 benchmarks/layer_bench.py --kinds mla --tp $tp --ms $ms --top 12 --skip eager,inductor \
            --tag _s25_mla_tp$tp --out "$OUT" > "$L/lb_tp$tp.txt" 2>&1
        echo "layer_bench mla tp$tp rc=$?" | tee -a "$S"; grep -E "^mla " "$L/lb_tp$tp.txt" | tee -a "$S"
    done
    tar czf "$OUT/logs_s63.tgz" -C "$L" .
elif [ "$part" = s62 ]; then      # session 25: the per-head kernel computing q itself (pass fuse_q_b_into_mla_attention):
    # GPU tests (all per-head ones: the template changed), memcheck, the MLA layer A/Bs: at TP16 M = 2 (per head by
    # default) the q_b GEMV apart or inside (K3FUSE_MLA_QB=0,1); at M = 1 the three launches + q_b GEMV against per
    # head with q inside (K3FUSE_MLA_HEADS=0,1), TP16 and TP8
    pytests heads_qb 240 tests/test_mla_heads_gpu.py
    memcheck memcheck_qb 120 tests/test_mla_heads_gpu.py -k "qb_op_matches and 8 and 2-300"
    ab_run qb_m2 150 --var K3FUSE_MLA_QB=0,1 --kinds mla --tp 16 --ms 2 --pairs 16
    ab_run qb_m1 220 --var K3FUSE_MLA_HEADS=0,1 --kinds mla --tp 16,8 --ms 1 --pairs 16
    tar czf "$OUT/logs_s62.tgz" -C "$L" .
elif [ "$part" = s61 ]; then      # session 25: session 24's review commit on the GPU (per-head + three-launch tests, the
    # counter-path graph test) with clusters of 16 (non-portable); alone CL 16 / 8 against three launches; the MLA
    # layer A/B at TP16 M = 1 with CL = 16 where alone it beat the three launches
    pytests heads_cl16 300 tests/test_mla_heads_gpu.py tests/test_mla_kernel_gpu.py
    timeout 120 python3 benchmarks/mla_splits.py --out "$L" --heads 6,12 --ms 1,2 --splits 8x8 --per-head 1 \
        --heads-cl 16,8 > "$L/mla_alone_cl16.txt" 2>&1
    echo "mla_splits per-head cl16 rc=$?" | tee -a "$S"; grep '^{' "$L/mla_alone_cl16.txt" | tee -a "$S"
    cp "$L/mla_splits.json" "$OUT/mla_splits_heads_cl16.json" 2>/dev/null
    ok=$(python3 -c "
import json
rows = json.load(open('$L/mla_splits.json'))['rows']
print(any(r['M'] == 1 and r['h'] == 6 and r['us'].get('heads:16', 1e9) < r['us'].get('8x8', 0) for r in rows))")
    echo "cl16 faster alone at h = 6 M = 1: $ok" | tee -a "$S"
    [ "$ok" = True ] && K3FUSE_MLA_HEADS_CL=16 ab_run heads16_m1 200 --var K3FUSE_MLA_HEADS=0,1 --kinds mla --tp 16 \
        --ms 1 --pairs 16
    tar czf "$OUT/logs_s61.tgz" -C "$L" .
elif [ "$part" = s60 ]; then      # session 24: the DSMEM per-head kernel's memcheck; the MLA layer A/B at TP16 / TP8, M = 1, 2
    memcheck memcheck_heads 100 tests/test_mla_heads_gpu.py -k "append_gate and 6-True and 2-64 or split_counts and 8"
    ab_run heads_m12 200 --var K3FUSE_MLA_HEADS=0,1 --kinds mla --tp 16,8 --ms 1,2 --pairs 16
    tar czf "$OUT/logs_s60.tgz" -C "$L" .
elif [ "$part" = s59 ]; then      # session 24: the per-head kernel with the weight rows split over a cluster (DSMEM merges):
    # GPU tests, alone (clusters of 8 / none), the MLA layer A/B at M = 1
    pytests heads_dsmem 200 tests/test_mla_heads_gpu.py
    timeout 100 python3 benchmarks/mla_splits.py --out "$L" --heads 6,12 --ms 1,2 --splits 8x8 --per-head 1 \
        --heads-cl 8,1 > "$L/mla_alone_dsmem.txt" 2>&1
    echo "mla_splits per-head dsmem rc=$?" | tee -a "$S"; grep '^{' "$L/mla_alone_dsmem.txt" | tee -a "$S"
    cp "$L/mla_splits.json" "$OUT/mla_splits_heads_dsmem.json" 2>/dev/null
    # the layer A/B only where the kernel alone beat the three launches (h = 6 or 12 at M = 1), to spare device time
    tps=$(python3 -c "
import json
rows = json.load(open('$L/mla_splits.json'))['rows']
print(','.join(str({6: 16, 12: 8}[r['h']]) for r in rows if r['M'] == 1 and r['us'].get('heads:8', 1e9) < r['us'].get('8x8', 0)))")
    echo "per head faster alone at TP: '${tps}'" | tee -a "$S"
    [ -n "$tps" ] && ab_run heads_m1 220 --var K3FUSE_MLA_HEADS=0,1 --kinds mla --tp "$tps" --ms 1 --pairs 16
    tar czf "$OUT/logs_s59.tgz" -C "$L" .
elif [ "$part" = s58 ]; then      # session 24: s57's layer A/B again after the fix (the knob never reached the layer's launches:
    # kernels differ 0); the dispatcher test now asserts the per-head launcher ran
    pytests heads_op 120 tests/test_mla_heads_gpu.py -k "op_in_a_cuda_graph or split_counts"
    ab_run heads_m1 220 --var K3FUSE_MLA_HEADS=0,1 --kinds mla --tp 16,8 --ms 1 --pairs 16
    tar czf "$OUT/logs_s58.tgz" -C "$L" .
elif [ "$part" = s57 ]; then      # session 24 (s56 got no machine): the clustered per-head kernel's GPU tests, alone (M = 1, 2),
    # and the MLA layer A/B at M = 1 in the same call
    pytests heads_cl 200 tests/test_mla_heads_gpu.py
    timeout 100 python3 benchmarks/mla_splits.py --out "$L" --heads 6,12 --ms 1,2 --splits 8x8,32x8 --per-head 1 \
        --heads-cl 8,1 > "$L/mla_alone_cl.txt" 2>&1
    echo "mla_splits per-head clusters rc=$?" | tee -a "$S"; grep '^{' "$L/mla_alone_cl.txt" | tee -a "$S"
    cp "$L/mla_splits.json" "$OUT/mla_splits_heads_cl.json" 2>/dev/null
    ab_run heads_m1 220 --var K3FUSE_MLA_HEADS=0,1 --kinds mla --tp 16,8 --ms 1 --pairs 16
    tar czf "$OUT/logs_s57.tgz" -C "$L" .
elif [ "$part" = s56 ]; then      # session 24: the per-head MLA kernel with clusters (multicast weight rows): GPU tests, the
    # attention alone (three launches; per head with clusters of 8 / 4 / 1; split counts at M = 1)
    pytests heads_cl 240 tests/test_mla_heads_gpu.py
    timeout 150 python3 benchmarks/mla_splits.py --out "$L" --heads 6,12 --ms 1,2,4 --splits 8x8,32x8 --per-head 1 \
        --heads-cl 8,4,1 > "$L/mla_alone_cl.txt" 2>&1
    echo "mla_splits per-head clusters rc=$?" | tee -a "$S"; grep '^{' "$L/mla_alone_cl.txt" | tee -a "$S"
    cp "$L/mla_splits.json" "$OUT/mla_splits_heads_cl.json" 2>/dev/null
    mkdir -p "$L/ns"; timeout 100 python3 benchmarks/mla_splits.py --out "$L/ns" --heads 6,12 --ms 1 --per-head 2 \
        --kv-splits 8,16,24,32 --heads-cl 8 > "$L/mla_alone_ns.txt" 2>&1
    echo "mla_splits per-head split counts rc=$?" | tee -a "$S"; grep '^{' "$L/mla_alone_ns.txt" | tee -a "$S"
    tar czf "$OUT/logs_s56.tgz" -C "$L" .
elif [ "$part" = s55 ]; then      # session 24: the per-head MLA kernel (K3FUSE_MLA_HEADS): GPU tests, memcheck, the attention
    # alone against the three launches (h = 6 / 12, M = 1, 2, 4), the MLA layer A/B at TP16 / TP8 M = 1 (16 pairs), M = 2, 4
    pytests heads 240 tests/test_mla_heads_gpu.py tests/test_mla_kernel_gpu.py -k "heads or append"
    timeout 150 python3 benchmarks/mla_splits.py --out "$L" --heads 6,12 --ms 1,2,4 --splits 8x8,32x8 --per-head 1 \
        > "$L/mla_alone.txt" 2>&1
    echo "mla_splits per-head rc=$?" | tee -a "$S"; grep '^{' "$L/mla_alone.txt" | tee -a "$S"
    cp "$L/mla_splits.json" "$OUT/mla_splits_heads.json" 2>/dev/null
    tar czf "$OUT/logs_s55.tgz" -C "$L" .
elif [ "$part" = s55b ]; then     # session 24: then its memcheck and the MLA layer A/Bs
    memcheck memcheck_heads 150 tests/test_mla_heads_gpu.py -k "append_gate and 6-True and 2-64 or op_in_a_cuda_graph"
    ab_run heads_m1 200 --var K3FUSE_MLA_HEADS=0,1 --kinds mla --tp 16,8 --ms 1 --pairs 16
    ab_run heads_m24 120 --var K3FUSE_MLA_HEADS=0,1 --kinds mla --tp 16 --ms 2,4 --pairs 8
    tar czf "$OUT/logs_s55b.tgz" -C "$L" .
elif [ "$part" = s54 ]; then      # session 24 (written in session 23): the down's WD = 1 at TP8 M = 1 confirmed with
    # 16 pairs (KDA and MLA) before it goes under the table's layer key; TP16 M = 2 / 4 too (their grids: 896 / 1792 CTAs at WD = 2)
    ab_run down_wd1_tp8 150 --var K3FUSE_MOE_CONFIG=table,WD=1 --kinds kda,mla --tp 8 --ms 1 --pairs 16
    ab_run down_wd1_m24 150 --var K3FUSE_MOE_CONFIG=table,WD=1 --kinds kda --tp 16,8 --ms 2,4 --pairs 8
    tar czf "$OUT/logs_s54.tgz" -C "$L" .
elif [ "$part" = s53 ]; then      # session 23: the routed down's grid at M = 1 (WD = 1: 896 CTAs of 4 rows, 6.8 per SM, instead of
    # 224 / 448 CTAs, where a third of the SMs carry one CTA fewer than the rest); WD = 2 at TP8 again (session 19: -2.1, 7 / 8)
    ab_run down_wd1 150 --var K3FUSE_MOE_CONFIG=table,WD=1 --kinds kda --tp 16,8 --ms 1 --pairs 12
    ab_run down_wd2_tp8 80 --var K3FUSE_MOE_CONFIG=table,WD=2 --kinds kda --tp 8 --ms 1 --pairs 12
    tar czf "$OUT/logs_s53.tgz" -C "$L" .
elif [ "$part" = s52 ]; then      # session 23: the one-launch MLA attention (9 launches) again, two processes of 16 pairs;
    # the KDA TP16 M = 2 profile with one and two launches of fused_residual_norm (why the one launch loses in the layer)
    ab_run mla_one_a 130 --var K3FUSE_MLA_ONE_KERNEL=0,1 --kinds mla --tp 16,8 --ms 1 --pairs 16
    ab_run mla_one_b 130 --var K3FUSE_MLA_ONE_KERNEL=0,1 --kinds mla --tp 16,8 --ms 1 --pairs 16
    for one in 1 4; do
        K3FUSE_FRN_ONE_MAX_M=$one timeout 100 python3 benchmarks/layer_bench.py --out "$L" --kinds kda --tp 16 --ms 2 \
            --skip eager,inductor --top 16 --tag _kda_m2_one$one > "$L/lb_kda_m2_one$one.txt" 2>&1
        echo "layer KDA TP16 M=2 K3FUSE_FRN_ONE_MAX_M=$one rc=$?" | tee -a "$S"
        sed -n '/^kind/,$p' "$L/lb_kda_m2_one$one.txt" | head -30 | tee -a "$S"
        cp "$L"/layer_bench_kda_m2_one$one.json "$OUT/" 2>/dev/null
    done
    tar czf "$OUT/logs_s52.tgz" -C "$L" .
elif [ "$part" = s51 ]; then      # session 23: the one-launch fused_residual_norm at M = 2..4 with the (row, column) pairs
    # spread over all warps: GPU tests, memcheck, the op alone against two launches, the layer A/B (one vs two launches)
    pytests frn_rows 200 tests/test_kernels_gpu.py -k "one_kernel_rows or one_kernel_preload or one_kernel"
    memcheck memcheck_frn_rows 120 tests/test_kernels_gpu.py -k "one_kernel_rows and 384-8 and True-4"
    timeout 100 python3 benchmarks/frn_profile.py --out "$L" --ks 768,384 --ms 1,2,4 --preloads 1 \
        > "$L/frn_profile.txt" 2>&1
    echo "frn_profile rc=$?" | tee -a "$S"; grep -E '^K ' "$L/frn_profile.txt" | tee -a "$S"
    cp "$L/frn_profile.json" "$OUT/" 2>/dev/null
    ab_run frn_spread 200 --var K3FUSE_FRN_ONE_MAX_M=1,4 --kinds kda,mla --tp 16,8 --ms 2,4 --pairs 8
    tar czf "$OUT/logs_s51.tgz" -C "$L" .
elif [ "$part" = s50 ]; then      # session 23: the M = 1 rows with max-autotune in the same run, TP16 and TP8
    for tp in 16 8; do
        timeout 280 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp $tp --ms 1 --top 16 --max-autotune \
            --tag _m1_tp${tp}_mat > "$L/lb_m1_tp${tp}_mat.txt" 2>&1
        echo "layer TP$tp M=1 every backend + max-autotune rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_m1_tp${tp}_mat.txt" | tee -a "$S"
        cp "$L"/layer_bench_m1_tp${tp}_mat.json "$OUT/" 2>/dev/null
    done
    tar czf "$OUT/logs_s50.tgz" -C "$L" .
elif [ "$part" = s49 ]; then      # session 23: the MLA M = 2, 4, 8 rows with the combine's preload; PRELOAD 1 vs 2 at 16 pairs
    for tp in 16 8; do
        timeout 200 python3 benchmarks/layer_bench.py --out "$L" --kinds mla --tp $tp --ms 2,4,8 --top 16 \
            --tag _mla_m248_tp$tp > "$L/lb_mla_m248_tp$tp.txt" 2>&1
        echo "layer MLA TP$tp M=2,4,8 every backend rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_mla_m248_tp$tp.txt" | tee -a "$S"
        cp "$L"/layer_bench_mla_m248_tp$tp.json "$OUT/" 2>/dev/null
    done
    ab_run pre12 150 --var K3FUSE_FRN_PRELOAD=1,2 --kinds kda,mla --tp 8,16 --ms 1 --pairs 16
    tar czf "$OUT/logs_s49.tgz" -C "$L" .
elif [ "$part" = s48 ]; then      # session 23: kda_decode on a cluster of CTAs per (token, head) (K3FUSE_KDA_CLUSTER, since removed:
    # measured no faster; the variant is in git at 54d6841, where this part runs)
    pytests kda_decode 240 tests/test_kda_kernel_gpu.py -k "decode"
    memcheck memcheck_kda_cluster 150 tests/test_kda_kernel_gpu.py -k "cluster_in_place and contiguous and 1-6"
    timeout 150 python3 benchmarks/kda_decode_bench.py --out "$L" --heads 6,12 --ms 1,2,4 --clusters 1,2,4,8 \
        > "$L/kda_bench.txt" 2>&1
    echo "kda_decode_bench rc=$?" | tee -a "$S"; sed -n '/^copy bandwidth/,$p' "$L/kda_bench.txt" | tee -a "$S"
    cp "$L/kda_decode_bench.json" "$OUT/" 2>/dev/null
    ab_run kda_cl4 150 --var K3FUSE_KDA_CLUSTER=1,4 --kinds kda --tp 16,8 --ms 1,2 --pairs 10
    ab_run kda_cl8 100 --var K3FUSE_KDA_CLUSTER=1,8 --kinds kda --tp 16,8 --ms 1 --pairs 10
    tar czf "$OUT/logs_s48.tgz" -C "$L" .
elif [ "$part" = s47 ]; then      # session 22: the MLA M = 1 rows with the combine's preload (CPRE = 32, the default now)
    timeout 190 python3 benchmarks/layer_bench.py --out "$L" --kinds mla --tp 16,8 --ms 1 --top 16 --tag _mla_m1 \
        > "$L/lb_mla_m1.txt" 2>&1
    echo "layer MLA TP16, TP8 M=1 every backend rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_mla_m1.txt" | tee -a "$S"
    cp "$L"/layer_bench_mla_m1.json "$OUT/" 2>/dev/null
elif [ "$part" = s46 ]; then      # session 22 (last): K3FUSE_MLA_CPRE (the MLA combine's first 32 partials loaded before its
    # log-sum-exp pass): GPU tests, memcheck, layer A/B at M = 1, 2
    pytests cpre 120 tests/test_mla_kernel_gpu.py -k "combine_preload"
    memcheck memcheck_cpre 100 tests/test_mla_kernel_gpu.py -k "combine_preload and (three_launches-64 or one_launch-7)"
    ab_run cpre 150 --var K3FUSE_MLA_CPRE=0,32 --kinds mla --tp 16,8 --ms 1,2 --pairs 10
    tar czf "$OUT/logs_s46.tgz" -C "$L" .
elif [ "$part" = s45 ]; then      # session 22: the M = 2, 4, 8 rows, every backend, TP16 and TP8 (the down's AX rule at TP8)
    for tp in 16 8; do
        timeout 280 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp $tp --ms 2,4,8 --top 16 \
            --tag _m248_tp$tp > "$L/lb_m248_tp$tp.txt" 2>&1
        echo "layer TP$tp M=2,4,8 every backend rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_m248_tp$tp.txt" | tee -a "$S"
        cp "$L"/layer_bench_m248_tp$tp.json "$OUT/" 2>/dev/null
    done
    tar czf "$OUT/logs_s45.tgz" -C "$L" .
elif [ "$part" = s44 ]; then      # session 22 (last): the M = 1 rows, every backend, TP16 and TP8, with this session's defaults
    for tp in 16 8; do
        timeout 270 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp $tp --ms 1 --top 16 \
            --tag _m1_tp$tp > "$L/lb_m1_tp$tp.txt" 2>&1
        echo "layer TP$tp M=1 every backend rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_m1_tp$tp.txt" | tee -a "$S"
        cp "$L"/layer_bench_m1_tp$tp.json "$OUT/" 2>/dev/null
    done
    tar czf "$OUT/logs_s44.tgz" -C "$L" .
elif [ "$part" = s43 ]; then      # session 22 (third): K3FUSE_GEMV_XS (the simt GEMVs' weight loads all ahead of their FMAs,
    # x through shared memory): GPU tests (the GEMV suite with XS forced on), memcheck, layer A/Bs at M = 1, 2
    pytests xs 100 tests/test_kernels_gpu.py -k "x_staged"
    K3FUSE_GEMV_XS=1 pytests xs_suite 120 tests/test_kernels_gpu.py -k "gemv or linear_group or rms_norm_linear"
    memcheck memcheck_xs 100 tests/test_kernels_gpu.py -k "x_staged and 1"
    ab_run xs_m1 130 --var K3FUSE_GEMV_XS=0,1 --kinds kda,mla --tp 16,8 --ms 1 --pairs 10
    ab_run xs_m2 80 --var K3FUSE_GEMV_XS=0,1 --kinds kda --tp 16,8 --ms 2 --pairs 8
    tar czf "$OUT/logs_s43.tgz" -C "$L" .
elif [ "$part" = s42 ]; then      # session 22 (second): K3FUSE_MOE_DOWN_AX (the routed down's W2 loads all ahead of its
    # FMAs, the activations through shared memory): GPU tests, memcheck (with the frn preload), layer A/Bs at M = 1
    # (TP16, TP8) and M = 2, 4; then K3FUSE_FRN_PRELOAD 1 (the default now) against 2 in the layer
    pytests ax 200 tests/test_moe_kernel_gpu.py -k "down_ax"
    memcheck memcheck_ax 160 tests/test_moe_kernel_gpu.py tests/test_kernels_gpu.py \
        -k "(down_ax and (tp16-4-2-1 or tp8-4-4-1)) or (one_kernel_preload and (True-1-1 or True-1-2 or True-4-1))"
    ab_run ax_m1 130 --var K3FUSE_MOE_DOWN_AX=0,1 --kinds kda,mla --tp 16,8 --ms 1 --pairs 10
    ab_run ax_m24 100 --var K3FUSE_MOE_DOWN_AX=0,1 --kinds kda --tp 16,8 --ms 2,4 --pairs 8
    ab_run pre12 80 --var K3FUSE_FRN_PRELOAD=1,2 --kinds kda,mla --tp 16,8 --ms 1 --pairs 8
    tar czf "$OUT/logs_s42.tgz" -C "$L" .
elif [ "$part" = s41 ]; then      # session 22 (first): K3FUSE_FRN_PRELOAD (the one launch's weight loads all ahead of its
    # FMAs: x through shared memory (1) or after a warp sync (2)): GPU tests, the kernel alone (0 / 1 / 2 against two
    # launches), ncu on 0 vs 1, then the layer A/Bs (M = 1; M = 2, 4 with the one launch on)
    pytests preload 150 tests/test_kernels_gpu.py -k "one_kernel_preload"
    timeout 100 python3 benchmarks/frn_profile.py --out "$L" --ks 768,384 --ms 1,2,4 --preloads 0,1,2 \
        > "$L/frn_profile.txt" 2>&1
    echo "frn_profile rc=$?" | tee -a "$S"; grep -E '^K ' "$L/frn_profile.txt" | tee -a "$S"
    cp "$L/frn_profile.json" "$OUT/" 2>/dev/null
    timeout 100 ncu --kernel-name regex:frn1 --launch-count 4 --section SpeedOfLight --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        python3 benchmarks/frn_profile.py --ncu-launches 1 --ks 768 --ms 1,4 --preloads 0,1 > "$L/ncu_frn.txt" 2>&1
    echo "ncu frn1 rc=$?" | tee -a "$S"
    grep -E "frn1_kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per Thread|Warp Cycles Per Issued|ERR" \
        "$L/ncu_frn.txt" | head -40 | tee -a "$S"
    ab_run pre_m1 120 --var K3FUSE_FRN_PRELOAD=0,1 --kinds kda,mla --tp 16,8 --ms 1 --pairs 10
    K3FUSE_FRN_PRELOAD=1 ab_run one_m24 100 --var K3FUSE_FRN_ONE_MAX_M=1,4 --kinds kda --tp 16 --ms 2,4 --pairs 8
    tar czf "$OUT/logs_s41.tgz" -C "$L" .
elif [ "$part" = s40 ]; then      # session 22 (first): the one-launch fused_residual_norm alone (timed, then under ncu: why
    # is bucket 4 slower, and what holds the M = 1 kernel ~4 us above its bytes); the MLA M = 1 rows with session 21's
    # q_b and group GEMV entries
    timeout 120 python3 benchmarks/frn_profile.py --out "$L" --ks 768,384 --ms 1,2,4 > "$L/frn_profile.txt" 2>&1
    echo "frn_profile rc=$?" | tee -a "$S"; grep -E '^K ' "$L/frn_profile.txt" | tee -a "$S"
    cp "$L/frn_profile.json" "$OUT/" 2>/dev/null
    timeout 150 ncu --kernel-name regex:frn1 --launch-count 4 --section SpeedOfLight --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        python3 benchmarks/frn_profile.py --ncu-launches 1 --ks 768 --ms 1,4 > "$L/ncu_frn.txt" 2>&1
    echo "ncu frn1 rc=$?" | tee -a "$S"
    grep -E "frn1_kernel|Duration|DRAM Throughput|Achieved Occupancy|Registers Per Thread|Warp Cycles Per Issued|ERR" \
        "$L/ncu_frn.txt" | head -40 | tee -a "$S"
    timeout 200 python3 benchmarks/layer_bench.py --out "$L" --kinds mla --tp 16,8 --ms 1 --top 12 --tag _mla_m1 \
        > "$L/lb_mla_m1.txt" 2>&1
    echo "layer MLA TP16, TP8 M=1 every backend rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_mla_m1.txt" | tee -a "$S"
    cp "$L"/layer_bench_mla_m1.json "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s40.tgz" -C "$L" .
elif [ "$part" = s39 ]; then      # session 21: MLA's q_b + norm (gemv_norm 1152 x 1536 at TP16, 2304 x 1536 at TP8; no
    # H200 entry: the plain GEMV's config) tuned, then A/B'd in the layer through the overlay; the one launch's
    # kernels at M = 4 (why it is slower there: s37 / s38)
    for sh in 1152x1536 2304x1536; do
        timeout 80 python3 benchmarks/fused_norm_tune.py --out "$L" --shape $sh --x bf16 > "$L/fnt_$sh.txt" 2>&1
        echo "fused_norm_tune $sh rc=$?" | tee -a "$S"; grep '^M ' "$L/fnt_$sh.txt" | tee -a "$S"
        cp "$L/fused_norm_tune.json" "$L/fnt_$sh.json" 2>/dev/null
    done
    python3 - "$L" <<'PY' | tee -a "$S"
import glob, json, sys
ent = {}
for f in glob.glob(sys.argv[1] + "/fnt_*.json"):
    rows = [r for r in json.load(open(f))["rows"] if not r["x_fp32"] and r.get("err", 1) < 1e-2 and "us" in r]
    for m in (1, 2, 4):
        rs = [r for r in rows if r["M"] == m]
        if rs:
            b = min(rs, key=lambda r: r["us"])
            ent.setdefault(f"gemv_norm:{b['N']}x{b['K']}", {})[str(m)] = dict(b["cfg"])
json.dump({"entries": ent}, open(sys.argv[1] + "/norm_overlay.json", "w"), indent=1)
print("overlay", json.dumps(ent))
PY
    cp "$L/norm_overlay.json" "$OUT/" 2>/dev/null
    ab_run qb_norm 140 --var "K3FUSE_TUNING_OVERLAY=none,$L/norm_overlay.json" --kinds mla --tp 16,8 --ms 1,2,4 --pairs 8
    K3FUSE_FRN_ONE_MAX_M=4 timeout 70 python3 benchmarks/layer_bench.py --out "$L" --kinds kda --tp 16 --ms 4 \
        --skip eager,inductor --top 12 --tag _m4_one > "$L/lb_m4_one.txt" 2>&1
    echo "layer KDA TP16 M=4 K3FUSE_FRN_ONE_MAX_M=4 rc=$?" | tee -a "$S"; sed -n '/^kind/,$p' "$L/lb_m4_one.txt" | tee -a "$S"
    tar czf "$OUT/logs_s39.tgz" -C "$L" .
elif [ "$part" = s38 ]; then      # session 21: s37 found the one launch slower at M = 2, 4 (+5.8 / +11 us per layer): the
    # statistics' warp shuffles, reduced by all 8 warps while 2 hold columns. Now only those 2 reduce.
    pytests frn_one 220 tests/test_kernels_gpu.py -k "one_kernel"
    # prediction: M = 1 -1..-2 us per layer (the 6 idle warps' ~1600 shuffles per SM, twice per layer)
    # (K3FUSE_FRN_STAT_ALL_WARPS was removed after this call: no difference)
    ab_run frn_stat 150 --var K3FUSE_FRN_STAT_ALL_WARPS=1,0 --kinds kda,mla --tp 16,8 --ms 1 --pairs 10
    ab_run frn_one_m2 150 --var K3FUSE_FRN_ONE_MAX_M=1,4 --kinds kda,mla --tp 16,8 --ms 2,4 --pairs 8
    tar czf "$OUT/logs_s38.tgz" -C "$L" .
elif [ "$part" = s37 ]; then      # session 21: the one-launch fused_residual_norm at M = 2..4 (buckets 2, 4; was M = 1 only)
    pytests frn_one 220 tests/test_kernels_gpu.py -k "one_kernel"
    memcheck frn_one_mc 110 tests/test_kernels_gpu.py -k "one_kernel_rows and 384 and 4"
    # KDA TP16 M = 2 profile: 11 kernels with two launches per fused_residual_norm; prediction: 9, -2..-5 us per layer
    ab_run frn_one_m 250 --var K3FUSE_FRN_ONE_MAX_M=1,4 --kinds kda,mla --tp 16,8 --ms 2,4 --pairs 8
    tar czf "$OUT/logs_s37.tgz" -C "$L" .
elif [ "$part" = s36 ]; then      # session 21: the one-launch MLA attention, default at TP16 M = 1 (ONE_BY_HEADS), A/B'd
    # again at M = 1, 2, 4 (was it the MMA score step that made it pay?); its layer row (rel err, 9 kernels); the
    # README rows at M = 2 and 4 (never measured)
    ab_run mla_one_m124 170 --var K3FUSE_MLA_ONE_KERNEL=0,1 --kinds mla --tp 16 --ms 1,2,4 --pairs 12
    timeout 70 python3 benchmarks/layer_bench.py --out "$L" --kinds mla --tp 16 --ms 1 --skip eager,inductor \
        --tag _m1_tp16_one > "$L/lb_m1_tp16_one.txt" 2>&1
    echo "layer MLA TP16 M=1 k3fuse (one-launch attention by default) rc=$?" | tee -a "$S"
    sed -n '/^kind/,/^$/p' "$L/lb_m1_tp16_one.txt" | tee -a "$S"
    grep -h '"k3fuse_rel_err"\|"k3fuse_kernels"' "$L/layer_bench_m1_tp16_one.json" | tee -a "$S"
    timeout 240 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16 --ms 2,4 --top 12 \
        --tag _m24_tp16 > "$L/lb_m24_tp16.txt" 2>&1
    echo "layer TP16 M=2,4 every backend rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_m24_tp16.txt" | tee -a "$S"
    cp "$L"/layer_bench_m1_tp16_one.json "$L"/layer_bench_m24_tp16.json "$L"/layer_bench_m24_tp16.png "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s36.tgz" -C "$L" .
elif [ "$part" = s35 ]; then      # the GEMV shapes the H200 table lacks (`k3fuse kernels` manifest 'tuning': the MLA group at
    # TP16 / TP8 runs on the heuristic default): tuned standalone, then A/B'd in the layer through the overlay
    timeout 330 python3 benchmarks/gpu_kernels.py --out "$L/gk" --shapes 2880x7168,3648x7168 --ms 1,2,4,8 --tune \
        > "$L/gk.txt" 2>&1
    echo "gemv tune (untabled shapes) rc=$?" | tee -a "$S"; sed -n '/shape   M/,$p' "$L/gk.txt" | tee -a "$S"
    cp "$L/gk/tuning.json" "$OUT/tuning_untabled.json" 2>/dev/null
    # merge what wins: python3 benchmarks/merge_tuning.py tuning_untabled.json (after reading the A/B)
    ab_run mla_overlay 200 --var "K3FUSE_TUNING_OVERLAY=none,$L/gk/tuning.json" --kinds mla --tp 16,8 --ms 1,2,8 \
        --pairs 8
    tar czf "$OUT/logs_s35.tgz" -C "$L" .
elif [ "$part" = s34 ]; then      # session 21 (first): TP16 M = 1 rows with max-autotune in the same run; the up kernel's knobs in the layer
    timeout 210 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16 --ms 1 --top 16 --max-autotune \
        --tag _m1_tp16_mat > "$L/lb_m1_tp16_mat.txt" 2>&1
    echo "layer TP16 M=1 every backend + max-autotune rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_m1_tp16_mat.txt" | tee -a "$S"
    cp "$L"/layer_bench_m1_tp16_mat.json "$L"/layer_bench_m1_tp16_mat.png "$OUT/" 2>/dev/null
    timeout 240 python3 benchmarks/moe_layer_tune.py --out "$L" --tp 16,8 --ms 1 --kinds kda --knobs R,W,G,CPC \
        --joint "" --pairs 8 --budget-s 190 --write-table > "$L/mlt_up.txt" 2>&1
    echo "moe_layer_tune (up knobs) TP 16,8 M 1 rc=$?" | tee -a "$S"; sed -n '/best overrides/,$p' "$L/mlt_up.txt" | tee -a "$S"
    cp "$L/moe_layer_tune.json" "$OUT/" 2>/dev/null; cp codegen/tuning/nvidia_h200.json "$OUT/"
    # the one-launch MLA attention (9 launches per MLA layer instead of 11) again: +1.1 us in session 15, before the
    # MMA score step and sessions 16-20's changes around it
    ab_run mla_one 100 --var K3FUSE_MLA_ONE_KERNEL=0,1 --kinds mla --tp 16,8 --ms 1 --pairs 12
    tar czf "$OUT/logs_s34.tgz" -C "$L" .
elif [ "$part" = s33 ]; then      # session 20: s32's A/Bs again after the fix that lets layer keys reach the kernels on variant-only entries
    ab_s29_entries
    tar czf "$OUT/logs_s33.tgz" -C "$L" .
elif [ "$part" = s32 ]; then      # session 20: the s29 table entries A/B'd by layer_ab (old config restated vs table); the layer_bench gap
    ab_s29_entries
    for sk in eager,inductor "" ; do      # k3fuse alone, then after eager + Inductor in the same process
        timeout 140 python3 benchmarks/layer_bench.py --out "$L" --kinds kda --tp 8 --ms 1 --skip "$sk" \
            --tag "_gap_${sk:-all}" > "$L/lb_gap_${sk:-all}.txt" 2>&1
        echo "layer_bench TP8 M=1 kda --skip '$sk' rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_gap_${sk:-all}.txt" | tee -a "$S"
    done
    timeout 60 python3 benchmarks/moe_layer_tune.py --out "$L" --tp 8 --ms 32 --kinds kda --knobs KS,WD --pairs 4 \
        --budget-s 25 > "$L/mlt_8_32.txt" 2>&1
    echo "moe_layer_tune TP 8 M 32 (fixed graph inputs) rc=$?" | tee -a "$S"; grep '^{' "$L/mlt_8_32.txt" | cut -c1-160 | tee -a "$S"
    tar czf "$OUT/logs_s32.tgz" -C "$L" .
elif [ "$part" = s31 ]; then      # session 20: the marginal layer-tune steps again, with the confirmation A/B; then s30
    for tm in 16:4,32 8:16,32; do
        timeout 200 python3 benchmarks/moe_layer_tune.py --out "$L" --tp "${tm%%:*}" --ms "${tm#*:}" --kinds kda \
            --knobs KS,LPR,WD,SB --pairs 8 --budget-s 120 --write-table > "$L/mlt_${tm//[:,]/_}.txt" 2>&1
        echo "moe_layer_tune TP ${tm%%:*} M ${tm#*:} rc=$?" | tee -a "$S"
        sed -n '/best overrides/,$p' "$L/mlt_${tm//[:,]/_}.txt" | tee -a "$S"
        cp "$L/moe_layer_tune.json" "$L/moe_layer_tune_${tm//[:,]/_}.json" 2>/dev/null
    done
    cp codegen/tuning/nvidia_h200.json "$OUT/"
    sweep_copies 120 90
    tar czf "$OUT/logs_s31.tgz" -C "$L" .
elif [ "$part" = s30 ]; then      # why moe_sweep ranks the TP8 M = 1 down unlike the layer: one weight copy against two (the layer's footprint)
    sweep_copies 150 120
    tar czf "$OUT/logs_s30.tgz" -C "$L" .
elif [ "$part" = s29 ]; then      # the per-slot down's knobs tuned in the layer (moe_layer_tune.py); TP / MS from the environment
    timeout 540 python3 benchmarks/moe_layer_tune.py --out "$L" --tp "${TPS:-16}" --ms "${MS:-1,2}" --kinds kda \
        --knobs KS,LPR,WD,SB --pairs 8 --budget-s 420 --write-table > "$L/mlt.txt" 2>&1
    echo "moe_layer_tune TP ${TPS:-16} M ${MS:-1,2} rc=$?" | tee -a "$S"; sed -n '/best overrides/,$p' "$L/mlt.txt" | tee -a "$S"
    cp "$L/moe_layer_tune.json" "$OUT/" 2>/dev/null; cp codegen/tuning/nvidia_h200.json "$OUT/"
    tar czf "$OUT/logs_s29.tgz" -C "$L" .
elif [ "$part" = s28 ]; then      # the routed down's knobs next to the layer-measured KS = 4 (TP8 M = 1), and KS at TP16 M = 8 (per-slot down)
    for b in KS=4:WD=2 KS=4:LPR=8 KS=4:WD=8; do
        ab_run tp8m1_${b//[:=]/_} 70 --var K3FUSE_MOE_CONFIG=table,$b --kinds kda --tp 8 --ms 1 --pairs 8
    done
    for b in KS=2 KS=4; do
        ab_run tp16m8_${b//[:=]/_} 70 --var K3FUSE_MOE_CONFIG=table,$b --kinds kda --tp 16 --ms 8 --pairs 8
    done
    tar czf "$OUT/logs_s28.tgz" -C "$L" .
elif [ "$part" = s27b ]; then     # s27's KS = 4 at TP8 M = 1 again: both kinds, and 16 layers per graph
    ab_run tp8_ks4_both 150 --var K3FUSE_MOE_CONFIG=table,KS=4 --kinds kda,mla --tp 8 --ms 1 --pairs 12
    ab_run tp8_ks4_g8 120 --var K3FUSE_MOE_CONFIG=table,KS=4 --kinds kda --tp 8 --ms 1 --pairs 10 --graph-rounds 8
    tar czf "$OUT/logs_s27b.tgz" -C "$L" .
elif [ "$part" = s26b ]; then     # issue 5's M = 1 rows with the re-tuned MoE configs (carry the table s26 wrote), every backend
    for tp in ${TPS:-8 16}; do
        timeout 280 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp $tp --ms 1 --top 16 \
            --tag _m1_tp$tp > "$L/lb_m1_tp$tp.txt" 2>&1
        echo "layer TP$tp M=1 rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_m1_tp$tp.txt" | tee -a "$S"
        cp "$L"/layer_bench_m1_tp$tp.json "$L"/layer_bench_m1_tp$tp.png "$OUT/" 2>/dev/null
    done
    tar czf "$OUT/logs_s26b.tgz" -C "$L" .
elif [ "$part" = s24b ]; then     # the split-K GEMM in the layer (its defaults, K3FUSE_GEMV_SPLITK), TP16 and TP8
    ab_run splitk 200 --var K3FUSE_GEMV_SPLITK=0,1 --kinds kda,mla --tp 16 --ms 64,32 --pairs 6
    ab_run splitk_tp8 200 --var K3FUSE_GEMV_SPLITK=0,1 --kinds kda,mla --tp 8 --ms 64 --pairs 6
    tar czf "$OUT/logs_s24b.tgz" -C "$L" .
elif [ "$part" = s18 ]; then      # issue 5's M = 64 rows with the defaults as they land: TP16 and TP8, every backend
    for tp in 16 8; do
        timeout $((tp == 16 ? 150 : 200)) python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp $tp --ms 64 --top 16 \
            --tag _m64_tp$tp > "$L/lb_m64_tp$tp.txt" 2>&1
        echo "layer TP$tp M=64 rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_m64_tp$tp.txt" | tee -a "$S"
        cp "$L"/layer_bench_m64_tp$tp.json "$L"/layer_bench_m64_tp$tp.png "$OUT/" 2>/dev/null
    done
    # per-kernel times without the PDL chain (under it a kernel's time includes its wait for its predecessor)
    K3FUSE_PDL_CHAIN=0 timeout 150 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16 --ms 1,8,64 \
        --skip eager,inductor --top 20 --tag _nopdl > "$L/lb_nopdl.txt" 2>&1
    echo "layer no PDL chain rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_nopdl.txt" | tee -a "$S"
    cp "$L"/layer_bench_nopdl.json "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s18.tgz" -C "$L" .
elif [ "$part" = s17 ]; then      # issue 5's stale rows: end to end at M = 1 and 8 (uncut), TP16 M = 64 (every backend), max-autotune at M = 1
    timeout 240 python3 benchmarks/gpu_e2e_smoke.py --out "$L" --configs k3tp16 --ms 1,8 --steps 16 > "$L/e2e.txt" 2>&1
    echo "e2e rc=$?" | tee -a "$S"; tail -4 "$L/e2e.txt" | tee -a "$S"
    cp "$L"/gpu_e2e_smoke.json "$OUT/" 2>/dev/null
    timeout 150 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16 --ms 64 --top 16 --tag _m64 \
        > "$L/lb_m64.txt" 2>&1
    echo "layer M=64 rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_m64.txt" | tee -a "$S"
    cp "$L"/layer_bench_m64.json "$L"/layer_bench_m64.png "$OUT/" 2>/dev/null
    timeout 190 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 16 --ms 1 --top 16 --max-autotune \
        --tag _mat > "$L/lb_mat.txt" 2>&1
    echo "layer max-autotune rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_mat.txt" | tee -a "$S"
    cp "$L"/layer_bench_mat.json "$L"/layer_bench_mat.png "$OUT/" 2>/dev/null
    tar czf "$OUT/logs_s17.tgz" -C "$L" .
elif [ "$part" = s14e ]; then     # end to end with EW 1 / 0 (argmax agreement against bf16's own noise); layer A/B round 4; TP8 EW 0
    for ew in 1 0; do
        K3FUSE_EARLY_WEIGHTS=$ew timeout 120 python3 benchmarks/gpu_e2e_smoke.py --out "$L/e2e$ew" --configs k3tp16 --ms 1,8 \
            --steps 16 > "$L/e2e$ew.txt" 2>&1
        echo "e2e EW=$ew rc=$?" | tee -a "$S"; tail -3 "$L/e2e$ew.txt" | tee -a "$S"
    done
    layer_arm ew1_4 1 K3FUSE_EARLY_WEIGHTS=1
    layer_arm ew0_4 1 K3FUSE_EARLY_WEIGHTS=0
    for ew in 0 1; do
        K3FUSE_EARLY_WEIGHTS=$ew timeout 90 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 8 --ms 1 --top 16 \
            --skip inductor --tag _tp8_ew$ew > "$L/lb_tp8_ew$ew.txt" 2>&1
        echo "layer tp8 EW=$ew rc=$? $(grep -E "^(kda|mla) +8 +1 " "$L/lb_tp8_ew$ew.txt" | tr -s ' ' | tr '\n' '|')" | tee -a "$S"
    done
    tar czf "$OUT/logs_s14e.tgz" -C "$L" .
elif [ "$part" = s14t ]; then     # EW default + the TP8 group entry: end to end, README table, TP8 table, a third EW A/B pair
    e2e_and_table 120 300
    timeout 100 python3 benchmarks/layer_bench.py --out "$L" --kinds kda,mla --tp 8 --ms 1,8 --top 16 --skip inductor \
        --tag _tp8 > "$L/lb_tp8.txt" 2>&1
    echo "layer tp8 rc=$?" | tee -a "$S"; sed -n '/^kind/,/^$/p' "$L/lb_tp8.txt" | tee -a "$S"
    layer_arm ew0_3 1 K3FUSE_EARLY_WEIGHTS=0
    tar czf "$OUT/logs_s14t.tgz" -C "$L" .
elif [ "$part" = s13t ]; then     # end to end, then the README table (TP16 M = 1, 8, Inductor included)
    e2e_and_table 150 400
    tar czf "$OUT/logs_s13t.tgz" -C "$L" .
else
    echo "unknown part '$part' (tests, table, fusions, s8c5, pending, pending_layer, router, s9final, topk_in_group, s10, s11, s11t, s12, s12m, s12t, s12h, s12k, s12r, s13, s13b, s13t, s13g, s13u, s14, s14g, s14t, s14e, ab, s15, s15b, s15c, s15d, s16, s16b, s16c, s16d, s17, s17b, s18, s18m, s18t, s18u, s19, s20, s21, s22, s23, s24, s24b)" >&2
    exit 2
fi
