"""`k3fuse kernels`: render and compile the kernels a model config needs, without a GPU, and write them out.

    k3fuse kernels --config {tiny,k3} --tp T --batch 1,8,64 --arch sm_90a --out DIR [--jobs N]
    python -m k3fuse.codegen.kernels_cli ...

Writes DIR/<kernel>/kernel.py (the rendered CuTe DSL source), kernel.ptx, kernel.cubin, and DIR/manifest.json
listing each kernel: name, op, family, template, shapes, bucket, config, arch, files (and what was skipped, why).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

from . import knobs

PLAN_CONTEXT = 1024     # the MLA split kernels' plan: the tile pipeline depends on the split grid (mla_attention)
PLAN_SMS = 132


def _pad(n: int, m: int = 16) -> int:
    return -(-n // m) * m


def gemm_shapes(cfg, tp: int) -> dict[str, tuple[int, int]]:
    """Per-rank decode GEMM shapes (N, K) of a KimiK3Config at tensor parallelism tp (K3_MODEL.md section 8)."""
    H = cfg.hidden_size
    P = cfg.kda_proj_size
    nk = cfg.num_kda_heads
    hd = cfg.kda_head_dim
    nh = cfg.num_attention_heads
    sh = {
        "kda.in_proj": (_pad(4 * P // tp + hd + nk // tp), H),
        "kda.f_b": (P // tp, hd),
        "mla.qkv_a": (cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim, H),
        "mla.q_b": (nh // tp * cfg.qk_head_dim, cfg.q_lora_rank),
        "mla.g_proj": (nh // tp * cfg.v_head_dim, H),
        "attn.o_proj": (H, P // tp),
        "shared.gate_up": (2 * cfg.shared_intermediate_size // tp, H),
        "shared.down": (H, cfg.shared_intermediate_size // tp),
        "routed.down": (cfg.routed_expert_hidden_size, H),
        "routed.up": (H, cfg.routed_expert_hidden_size),
        "dense.gate_up": (2 * cfg.intermediate_size // tp, H),
        "dense.down": (H, cfg.intermediate_size // tp),
        "lm_head": (cfg.vocab_size // tp, H),
    }
    return sh


def group_shapes(cfg, tp: int) -> dict[str, tuple[list[int], int]]:
    """Per-rank k3fuse::linear_group members ([N_i], K) that pass fuse_shared_input_linears forms (see its
    docstring): the KDA and MLA projections of the normed input; the MoE's routed down + shared gate_up at TP = 1
    only (under TP the MoE split takes them apart first)."""
    H = cfg.hidden_size
    P = cfg.kda_proj_size
    nh = cfg.num_attention_heads
    out = {
        "kda.q_k_v_g_fa_b": ([P // tp] * 4 + [cfg.kda_head_dim, cfg.num_kda_heads // tp], H),
        "mla.qa_kva_g": ([cfg.q_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim, nh // tp * cfg.v_head_dim], H),
    }
    if tp == 1:
        out["moe.down_sharedgateup"] = ([cfg.routed_expert_hidden_size, 2 * cfg.shared_intermediate_size], H)
    return out


def _qb_cluster(cfg, tp: int, b: int) -> Optional[int]:
    """The cluster size of the per-head MLA kernel where it computes q itself at bucket b (pass
    fuse_q_b_into_mla_attention's op; mla_attention.qb_plan_reason, the launcher's rule), else None."""
    from . import mla_attention as ma
    h, n, v, r, C = (cfg.num_attention_heads // tp, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim,
                     cfg.kv_lora_rank)
    if ma.head_groups(h) != 1 or ma.qb_plan_reason(b, h, n, v, r, C, cfg.q_lora_rank, PLAN_CONTEXT, PLAN_SMS):
        return None
    return ma.heads_cluster(ma.heads_splits(b, h, PLAN_CONTEXT, PLAN_SMS), b, h)


def plan(config: str, tp: int, batches: list[int], arch: str) -> tuple[list[dict], list[dict]]:
    """Kernel jobs for a config: (jobs, skipped)."""
    from k3fuse.models.config import KimiK3Config
    from . import fused_residual_norm as frn
    from . import gemv
    from .buckets import bucket_for
    cfg = KimiK3Config.preset(config)
    jobs, skipped = [], []
    buckets = sorted({b for b in (bucket_for(m) for m in batches) if b is not None})
    for m in batches:
        if bucket_for(m) is None:
            skipped.append(dict(op="*", batch=m, reason=f"M={m} is outside the buckets: unfused path"))
    seen: dict = {}
    for name, (N, K) in gemm_shapes(cfg, tp).items():
        for b in buckets:
            why = gemv.supports(N, K, b)
            if why:
                skipped.append(dict(op="k3fuse::linear", name=name, shape=dict(N=N, K=K), bucket=b, reason=why))
                continue
            routed, why_not = gemv.route(N, K, b, gpu=_gpu_for(arch), arch=arch)
            c = routed or gemv.config_for(N, K, b, gpu=_gpu_for(arch))     # a forced variant's (e.g. wgmma) if any
            key = ("gemv", N, K, b, json.dumps(c, sort_keys=True))
            if key in seen:
                seen[key]["uses"].append(name)
                continue
            seen[key] = dict(family="gemv", op="k3fuse::linear", uses=[name], shape=dict(N=N, K=K), bucket=b,
                             config=c, name=f"gemv_{c['variant']}_{N}x{K}_b{b}",
                             used_at_runtime=routed is not None, note=why_not or "")
            jobs.append(seen[key])
    for name, (Ns, K) in group_shapes(cfg, tp).items():
        for b in buckets:
            why = gemv.group_supports(Ns, K, b)
            if why:
                skipped.append(dict(op="k3fuse::linear_group", name=name, shape=dict(N=Ns, K=K), bucket=b,
                                    reason=why))
                continue
            c = gemv.group_config_for(Ns, K, b, gpu=_gpu_for(arch))
            why = gemv.group_supports(Ns, K, b, c)
            if why:     # the table names a variant with no grouped form (wgmma): the group runs per member there
                skipped.append(dict(op="k3fuse::linear_group", name=name, shape=dict(N=Ns, K=K), bucket=b,
                                    reason=f"{why}; the members run as k3fuse::linear"))
                continue
            routed, why_not = gemv.group_route(Ns, K, b, gpu=_gpu_for(arch), arch=arch)
            jobs.append(dict(family="gemv", op="k3fuse::linear_group", uses=[name], shape=dict(N=Ns, K=K), bucket=b,
                             config=c, name=f"gemv_group_{c['variant']}_{'-'.join(map(str, Ns))}x{K}_b{b}",
                             used_at_runtime=routed is not None, note=why_not or None))
    # pass fuse_situ_glu_into_linear_group: the MoE group (TP = 1) with the SiTU-GLU epilogue on the shared gate_up,
    # where its kernel applies (simt buckets); elsewhere the lowering splits it into the plain group above + SiTU
    from . import registry
    for name, (Ns, K) in group_shapes(cfg, tp).items():
        if not name.endswith("sharedgateup"):
            continue
        for b in buckets:
            c, why = gemv.group_situ_route(Ns, K, b, (len(Ns) - 1,), gpu=_gpu_for(arch))
            if why:
                skipped.append(dict(op="k3fuse::linear_group_situ", name=name, shape=dict(N=Ns, K=K), bucket=b,
                                    reason=f"split back into linear_group + situ_glu: {why}"))
                continue
            jobs.append(dict(family="gemv", op="k3fuse::linear_group_situ", uses=[name], shape=dict(N=Ns, K=K),
                             bucket=b, config=c, fusion=dict(situ_members=[len(Ns) - 1],
                                                             beta=cfg.activation_situ_beta,
                                                             lbeta=cfg.activation_situ_linear_beta),
                             name=f"gemv_group_situ_{'-'.join(map(str, Ns))}x{K}_b{b}"))
    # pass fuse_router_into_linear_group: that group with the router's rows as a last, fp32-output member, where its
    # kernel applies (simt buckets); elsewhere the lowering splits it into the SiTU group above + router_logits
    for name, (Ns, K) in group_shapes(cfg, tp).items():
        if not name.endswith("sharedgateup"):
            continue
        Nr = list(Ns) + [cfg.num_experts]
        for b in buckets:
            c, why = gemv.group_router_route(Nr, K, b, (len(Ns) - 1,), gpu=_gpu_for(arch))
            if why:
                skipped.append(dict(op="k3fuse::linear_group_router", name=name + "_router", shape=dict(N=Nr, K=K),
                                    bucket=b, reason=f"split back into linear_group_situ + router_logits: {why}"))
                continue
            jobs.append(dict(family="gemv", op="k3fuse::linear_group_router", uses=[name + "_router"],
                             shape=dict(N=Nr, K=K), bucket=b, config=c,
                             fusion=dict(situ_members=[len(Ns) - 1], beta=cfg.activation_situ_beta,
                                         lbeta=cfg.activation_situ_linear_beta, f32_members=[len(Nr) - 1]),
                             name=f"gemv_group_router_{'-'.join(map(str, Nr))}x{K}_b{b}"))
            if registry.topk_in_group_enabled():    # the router's selection in the same launch (opt-in)
                # in the launcher's member order (registry.router_topk_members: the router's rows first)
                j, _, si = registry.router_topk_members(len(Ns), len(Ns) - 1)
                Nt = list(Ns)
                Nt.insert(j, cfg.num_experts)
                tk = (j, cfg.num_experts_per_token, cfg.norm_topk_prob, cfg.routed_scaling_factor)
                why = gemv.group_topk_supports(Nt, c, (j,), tk)
                if why:
                    skipped.append(dict(op="k3fuse::linear_group_router_topk", name=name + "_router_topk",
                                        shape=dict(N=Nt, K=K), bucket=b, reason=why))
                    continue
                jobs.append(dict(jobs[-1], op="k3fuse::linear_group_router_topk", uses=[name + "_router_topk"],
                                 shape=dict(N=Nt, K=K),
                                 fusion=dict(jobs[-1]["fusion"], topk=list(tk), f32_members=[j],
                                             situ_members=[si]),
                                 name=f"gemv_group_router_topk_{'-'.join(map(str, Nt))}x{K}_b{b}"))
    # pass fuse_rms_norm_into_linear: the GEMVs behind an RMSNorm, fused where codegen's predicate says the kernel
    # applies (registry.KERNEL_APPLIES: M <= 4, weights up to the measured size), else split back into norm + the
    # plain GEMV above
    shapes = gemm_shapes(cfg, tp)
    for name in ("mla.q_b", "routed.up"):
        N, K = shapes[name]
        for b in buckets:
            why = registry.rms_norm_linear_split_reason(b, N * K * 2, (N, K), gpu=_gpu_for(arch))
            if name == "mla.q_b" and _qb_cluster(cfg, tp, b):
                why = "computed inside the per-head MLA attention (k3fuse::mla_qb_append_attention_)"
            if why:
                skipped.append(dict(op="k3fuse::rms_norm_linear", name=name, shape=dict(N=N, K=K), bucket=b,
                                    reason=why))
                continue
            fusion = dict(norm=True, eps=cfg.rms_norm_eps, x_fp32=False)
            jobs.append(dict(family="gemv", op="k3fuse::rms_norm_linear", uses=[name], shape=dict(N=N, K=K),
                             bucket=b, config=gemv.default_fused_config(N, K, b, fusion, gpu=_gpu_for(arch)),
                             fusion=fusion,
                             name=f"gemv_norm_{N}x{K}_b{b}"))
    H = cfg.hidden_size
    nb_max = min(cfg.num_attn_res_blocks, frn.MAX_BLOCKS)   # a mix sees up to ceil(l / B) blocks
    for addend in (False, True):
        for prefix in (True, False):
            for nb in range(0, nb_max + 1):
                if not prefix and nb == 0:
                    continue
                jobs.append(dict(family="fused_residual_norm", op="k3fuse::fused_residual_norm",
                                 shape=dict(H=H, blocks=nb), bucket=None,
                                 config=dict(addend=addend, prefix=prefix, norm=True,
                                             fp32_norm=cfg.attn_res_mix_fp32_norm,
                                             mix_eps=cfg.attn_res_eps, norm_eps=cfg.rms_norm_eps,
                                             wm_pair=True),     # AttnRes's two weight factors (the pass)
                                 name=f"mixnorm_h{H}_nb{nb}{'_add' if addend else ''}{'' if prefix else '_restart'}"))
    # at M <= 4 without an all-reduce (TP = 1) the projection + mix-norm are one launch (fused_residual_norm_onekernel,
    # one kernel per bucket 1 / 2 / 4) where one_kernel_reason allows (K3's TP = 1 widths do not: K > ONE_MAX_K; the
    # per-rank widths on one GPU of benchmarks/layer_bench.py do)
    one_buckets = [b for b in buckets if b <= frn.one_max_m()]     # buckets 1, 2, 4 (sorted)
    if tp == 1 and one_buckets:
        for name, addend in (("attn.o_proj", False), ("shared.down", True), ("dense.down", False)):
            _, K = shapes[name]
            for b in one_buckets:
                why = frn.one_kernel_reason(b, H, K, 0, True, "", None)
                if why:
                    skipped.append(dict(op="k3fuse::fused_residual_norm", name=name, shape=dict(H=H, K=K), bucket=b,
                                        reason=f"one launch: {why}"))
                    continue
                for prefix in (True, False):
                    for nb in range(0 if prefix else 1, nb_max + 1):
                        jobs.append(dict(family="fused_residual_norm", op="k3fuse::fused_residual_norm", uses=[name],
                                         shape=dict(H=H, K=K, blocks=nb), bucket=b,
                                         config=dict(addend=addend, prefix=prefix, norm=True, one_kernel=True,
                                                     fp32_norm=cfg.attn_res_mix_fp32_norm, mix_eps=cfg.attn_res_eps,
                                                     norm_eps=cfg.rms_norm_eps, wm_pair=True),
                                         name=f"frn1_{name.replace('.', '_')}_k{K}_nb{nb}{'' if prefix else '_restart'}"
                                              f"{f'_b{b}' if b > 1 else ''}"))
    jobs.append(dict(family="prefetch_l2", op="k3fuse::prefetch_l2", shape={}, bucket=None, config={},
                     name="prefetch_l2"))
    # in-kernel collectives over peer buffers (K3FUSE_INKERNEL_COLLECTIVES=1), for 2 <= TP <= 8
    from . import mixnorm_allreduce
    if 2 <= tp <= mixnorm_allreduce.MAX_WORLD:
        note = "K3FUSE_INKERNEL_COLLECTIVES=1 only"
        for j in [j for j in jobs if j["family"] == "fused_residual_norm"]:
            # an addend is either complete (added after the reduction) or the MoE split's partial (before it)
            for paddend in ((False, True) if j["config"]["addend"] else (False,)):
                c = dict(j["config"], world=tp, paddend=paddend, addend=j["config"]["addend"] and not paddend)
                jobs.append(dict(j, family="mixnorm_allreduce", config=c,
                                 name=f"{j['name']}_ar{tp}{'_padd' if paddend else ''}", note=note))
        E, D = cfg.num_experts, cfg.routed_expert_hidden_size
        row = E // tp * 4 + D // tp * 2          # the MoE split's packed row: fp32 logits (bit-cast) | z shard
        jobs.append(dict(family="allgather_oneshot", op="k3fuse::all_gather", shape=dict(row_bytes=row, world=tp),
                         bucket=None, config={}, name=f"allgather_w{tp}_{row}B", note=note))
    from . import router_topk
    if router_topk.supports(cfg.num_experts, cfg.num_experts_per_token) is None:
        jobs.append(dict(family="router_topk", op="k3fuse::topk_from_logits",
                         shape=dict(E=cfg.num_experts, k=cfg.num_experts_per_token), bucket=None,
                         config=dict(renormalize=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor),
                         name=f"router_topk_e{cfg.num_experts}_k{cfg.num_experts_per_token}"))
    # the router logits' fp32-output GEMV (M <= router_topk.GEMV_MAX_M; the MoE split gives each rank E / tp rows)
    En, H = cfg.num_experts, cfg.hidden_size
    Nr = En // tp if tp > 1 and En % tp == 0 else En
    for b in sorted({bucket_for(m) for m in batches if bucket_for(m) and bucket_for(m) <= router_topk.GEMV_MAX_M}):
        rc = gemv.fp32_out_config(Nr, H, b)
        if gemv.supports(Nr, H, b, rc) is None:
            jobs.append(dict(family="gemv", op="k3fuse::router_logits", shape=dict(N=Nr, K=H), bucket=b, config=rc,
                             fusion=dict(y_fp32=True), name=f"router_logits_gemv_{Nr}x{H}_b{b}_fp32"))
    # decode attention and routed experts
    from . import kda_recurrent, moe_experts
    # the KDA step as pass fuse_kda_conv_gated_norm leaves it: kda_decode (conv, f_b, recurrence, gated norm)
    d, adt = cfg.kda_head_dim, "bfloat16"
    fused = dict(kc=cfg.conv_kernel_size, fk=d, newest_last=cfg.conv_newest_tap_last, x=adt, f=adt, g=adt, o=adt,
                 eps=cfg.rms_norm_eps)
    why = kda_recurrent.supports_fused(d, fused["kc"], fused["fk"], adt)
    if why:
        skipped.append(dict(op="k3fuse::kda_decode", shape=dict(d=d), reason=why))
    else:
        jobs.append(dict(family="kda_recurrent", op="k3fuse::kda_decode", shape=dict(d=d), bucket=None,
                         config=dict(a_dtype=adt, b_dtype=adt, lower_bound=cfg.kda_gate_lower_bound, fused=fused),
                         name=f"kda_decode_d{d}_k{fused['kc']}"))
    from . import mla_attention
    h, n, v, r, C = (cfg.num_attention_heads // tp, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim,
                     cfg.kv_lora_rank)
    groups = mla_attention.head_groups(h)
    h = h // groups if groups > 1 else h            # TP < 8: the head-group kernel, launched `groups` times
    why = mla_attention.supports(h, n, v, r, C)
    if why:
        skipped.append(dict(op="k3fuse::mla_attention", shape=dict(h=h, n=n, v=v, r=r, C=C), reason=why))
    else:
        by_splits: dict = {}                        # one kernel per (QS, VS, tile pipeline) the requested buckets use
        by_cl: dict = {}                            # the per-head kernel (one per cluster size) where it is the default
        for b in buckets:
            if groups == 1 and mla_attention.heads_choice(b, h) \
                    and mla_attention.heads_reason(b, h, n, v, r, C, PLAN_SMS) is None:
                ns = mla_attention.heads_splits(b, h, PLAN_CONTEXT, PLAN_SMS)
                by_cl.setdefault(mla_attention.heads_cluster(ns, b, h), []).append(b)
                continue
            # the tile pipeline as the launcher takes it at a 1024-token context on 132 SMs (H100 / H200): where the
            # split grid fits one CTA per SM; other contexts may launch the same splits with the other choice
            ns = mla_attention.n_splits(b, PLAN_CONTEXT, PLAN_SMS, h=h)
            splits = mla_attention.fit_splits(n, v, C, mla_attention.splits_for(b, h))
            pipe = mla_attention.pipe_for(b, h, mla_attention.mma_scores(mla_attention.padded_heads(h), r, C)) \
                and b * ns <= PLAN_SMS
            # the combine on tensor cores, as the launcher chooses it (the bucket in CMMA_BY_HEADS)
            cmma = mla_attention.combine_mma_on(b, h, v, C, ns)
            ctok = mla_attention.combine_tokens_for(b, h, v, C) if cmma else 8
            asy = mla_attention.async_for(b, h, r, C, pipe)     # the cp.async ring's mode (0: off)
            by_splits.setdefault(splits + (pipe, cmma, ctok, asy), []).append(b)
        for (qs, vs, pipe, cmma, ctok, asy), bs in by_splits.items():
            # one head group: pass fuse_mla_append_and_gate's op (the cache append + output gate variant); more:
            # its CUDA impl falls back to the plain kernel per group (the append runs once, in ATen)
            fused = groups == 1
            jobs.append(dict(family="mla_attention",
                             op="k3fuse::mla_append_attention_" if fused else "k3fuse::mla_attention",
                             shape=dict(h=h, n=n, v=v, r=r, C=C), bucket=bs[0],
                             config=dict(scale=(n + r) ** -0.5, splits=[qs, vs], buckets=bs, pipe=pipe,
                                         **({"cmma": True} if cmma else {}),
                                         **({"asy": asy} if asy else {}), **({"ctok": ctok} if ctok != 8 else {}),
                                         **({"append_eps": cfg.mla_lora_norm_eps, "gate": True, "out": "bfloat16"}
                                            if fused else {})),
                             name=f"mla_{'append_' if fused else ''}attention_h{h}_c{C}_qs{qs}_vs{vs}"
                                  f"{'_pipe' if pipe else ''}{'_cmma' if cmma else ''}"
                                  f"{'_tok4' if ctok != 8 else ''}{'_async' if asy else ''}",
                             **({"note": f"{groups} head-group launches per call"} if groups > 1 else {})))
        for cl, bs in by_cl.items():
            # pass fuse_q_b_into_mla_attention's op: the kernel computes q itself where its cluster splits W_qb
            ql = cfg.q_lora_rank
            qb = all(_qb_cluster(cfg, tp, b) == cl for b in bs)
            jobs.append(dict(family="mla_attention",
                             op="k3fuse::mla_qb_append_attention_" if qb else "k3fuse::mla_append_attention_",
                             shape=dict(h=h, n=n, v=v, r=r, C=C, **({"q_lora": ql} if qb else {})), bucket=bs[0],
                             config=dict(variant="heads", scale=(n + r) ** -0.5, buckets=bs, cluster=cl,
                                         append_eps=cfg.mla_lora_norm_eps, gate=True, out="bfloat16",
                                         **({"q_eps": cfg.mla_lora_norm_eps, "qfirst": mla_attention.qfirst_on()}
                                            if qb else {}),
                                         # what build_heads reads from the environment: the gathers, the tiles
                                         push=cl > 1 and mla_attention.push_on(),
                                         mma=mla_attention.heads_mma(r, C)),
                             name=f"mla_{'qb_' if qb else ''}append_attention_heads_h{h}_c{C}_cl{cl}"))
    E, D, KT = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.num_experts_per_token
    I = cfg.moe_intermediate_size // tp
    for b in buckets:
        why = moe_experts.supports(E, I, D, KT, b)
        if why:
            skipped.append(dict(op="k3fuse::moe_experts", shape=dict(E=E, I=I, D=D, k=KT), bucket=b, reason=why))
            continue
        kc = moe_experts.config_for(E, I, D, KT, b, gpu=_gpu_for(arch))     # the tuned table's, as at run time
        jobs.append(dict(family="moe_experts", op="k3fuse::moe_experts", shape=dict(E=E, I=I, D=D, k=KT), bucket=b,
                         config=dict(beta=cfg.activation_situ_beta, lbeta=cfg.activation_situ_linear_beta, kernel=kc),
                         name=f"moe_experts_e{E}_i{I}_d{D}_k{KT}_b{b}"))
    return jobs, skipped


def _gpu_for(arch: str) -> Optional[str]:
    return {"sm_90a": "nvidia_h200"}.get(arch)


def build_job(job: dict, arch: str):
    from . import fused_residual_norm as frn
    from . import gemv, prefetch
    if job["family"] == "gemv" and job["op"] == "k3fuse::linear_group":
        s = job["shape"]
        return gemv.build_group(s["N"], s["K"], job["bucket"], job["config"], arch=arch, load=False)
    if job["family"] == "gemv" and job["op"] in ("k3fuse::linear_group_situ", "k3fuse::linear_group_router",
                                                 "k3fuse::linear_group_router_topk"):
        s, f = job["shape"], job["fusion"]
        return gemv.build_group(s["N"], s["K"], job["bucket"], job["config"], arch=arch, load=False,
                                situ=(tuple(f["situ_members"]), f["beta"], f["lbeta"]),
                                f32=tuple(f.get("f32_members", ())), topk=f.get("topk"))
    if job["family"] == "gemv":
        s = job["shape"]
        return gemv.build(s["N"], s["K"], job["bucket"], job["config"], arch=arch, load=False,
                          fusion=job.get("fusion"))
    if job["family"] == "fused_residual_norm" and job["config"].get("one_kernel"):
        c, sh = job["config"], job["shape"]
        return frn.build_one(sh["H"], sh["K"], sh["blocks"], c["addend"], c["prefix"], c["fp32_norm"], c["mix_eps"],
                             c["norm_eps"], c["wm_pair"], arch=arch, load=False, bm=job["bucket"])
    if job["family"] == "fused_residual_norm":
        c = job["config"]
        return frn.build_mix_norm(job["shape"]["H"], job["shape"]["blocks"], c["addend"], c["prefix"], c["norm"],
                                  c["fp32_norm"], c["mix_eps"], c["norm_eps"], arch=arch, load=False,
                                  wm_pair=c.get("wm_pair", False))
    if job["family"] == "prefetch_l2":
        return prefetch.build(arch=arch, load=False)
    if job["family"] == "kda_recurrent":
        from . import kda_recurrent
        c = job["config"]
        return kda_recurrent.build(job["shape"]["d"], c["a_dtype"], c["b_dtype"], c["lower_bound"], arch=arch,
                                   load=False, fused=c.get("fused"))
    if job["family"] == "mla_attention":
        from . import mla_attention
        s = job["shape"]
        c = job["config"]
        if c.get("variant") == "heads":
            return mla_attention.build_heads(s["h"], s["n"], s["v"], s["r"], s["C"], c["scale"], arch=arch, load=False,
                                             append_eps=c["append_eps"], gate=c["gate"], out_dtype=c["out"],
                                             cl=c["cluster"],
                                             qb=(s["q_lora"], c["q_eps"]) if "q_lora" in s else None)
        return mla_attention.build(s["h"], s["n"], s["v"], s["r"], s["C"], c["scale"], arch=arch, load=False,
                                   splits=c["splits"], append_eps=c.get("append_eps"), gate=c.get("gate", False),
                                   out_dtype=c.get("out", "float32"), pipe=c.get("pipe", False),
                                   cmma=c.get("cmma", False), asy=int(c.get("asy", 0)),
                                   ctok=c.get("ctok", 8))
    if job["family"] == "moe_experts":
        from . import moe_experts
        s, c = job["shape"], job["config"]
        return moe_experts.build(s["E"], s["I"], s["D"], s["k"], job["bucket"], c["beta"], c["lbeta"],
                                 cfg=c.get("kernel"), arch=arch, load=False)
    if job["family"] == "mixnorm_allreduce":
        from . import mixnorm_allreduce
        c = job["config"]
        return mixnorm_allreduce.build(job["shape"]["H"], job["shape"]["blocks"], c["world"], c["addend"], c["prefix"],
                                       c["norm"], c["fp32_norm"], c["mix_eps"], c["norm_eps"], arch=arch, load=False,
                                       has_paddend=c["paddend"])
    if job["family"] == "allgather_oneshot":
        from . import allgather_oneshot
        s = job["shape"]
        return allgather_oneshot.build(s["row_bytes"], s["world"], arch=arch, load=False)
    if job["family"] == "router_topk":
        from . import router_topk
        s, c = job["shape"], job["config"]
        return router_topk.build(s["E"], s["k"], c["renormalize"], c["scale"], arch=arch, load=False)
    raise ValueError(job["family"])


def _run_job(args):
    job, arch = args
    try:
        t = time.perf_counter()
        k = build_job(job, arch)
        return dict(job, key=k.key, cached=k.cached, seconds=round(time.perf_counter() - t, 3), src=k.files)
    except Exception as e:  # reported in the manifest
        return dict(job, error=f"{type(e).__name__}: {str(e)[:2000]}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="k3fuse kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="k3", help="model preset (tiny, k3)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--batch", default="1,8,64", help="comma-separated batch sizes M")
    ap.add_argument("--arch", default="sm_90a", help="sm_90a, sm_100a, sm_103a, sm_100f")
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", "-j", type=int, default=1, help="parallel compile processes")
    ap.add_argument("--only", default="", help="comma-separated families to build (gemv, fused_residual_norm, "
                                               "prefetch_l2, kda_recurrent, mla_attention, moe_experts, "
                                               "mixnorm_allreduce, allgather_oneshot, router_topk)")
    ap.add_argument("--sass", action="store_true", help="read each kernel's SASS (codegen/sass.py: exposed "
                                                         "global-load waits, the longest round-trip chain) into the "
                                                         "manifest; needs nvdisasm or cuobjdump")
    a = ap.parse_args(argv)
    if a.sass:
        from . import sass
        if sass.find_disassembler() is None:
            ap.error("--sass needs nvdisasm or cuobjdump (pip install nvidia-cuda-nvdisasm)")
    batches = [int(b) for b in a.batch.split(",") if b]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from . import tuning
    with tuning.recording() as consulted:           # which tuning-table entries the plan took, for the manifest
        jobs, skipped = plan(a.config, a.tp, batches, a.arch)
    entries = [dict(key=k, bucket=b, source=src) for (k, b), src in sorted(consulted.items())]
    tuning_info = dict(gpu_table=_gpu_for(a.arch), overlay=knobs.env(tuning.OVERLAY_VAR) or None,
                       entries=entries)
    if a.only:
        fams = set(a.only.split(","))
        jobs = [j for j in jobs if j["family"] in fams]
    t0 = time.perf_counter()
    if a.jobs > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(a.jobs, mp_context=mp.get_context("spawn")) as ex:
            done = list(ex.map(_run_job, [(j, a.arch) for j in jobs]))
    else:
        done = [_run_job((j, a.arch)) for j in jobs]
    kernels, failed = [], []
    for d in done:
        if "error" in d:
            failed.append(d)
            print(f"FAILED {d['name']}: {d['error'][:300]}", file=sys.stderr)
            continue
        kd = out / d["name"]
        kd.mkdir(exist_ok=True)
        files = {}
        for fname, src in sorted(d.pop("src").items()):
            if fname.endswith((".py", ".ptx", ".cubin")):
                shutil.copyfile(src, kd / fname)
                files[fname.rsplit(".", 1)[1]] = f"{d['name']}/{fname}"
        d["files"] = files
        d["arch"] = a.arch
        if a.sass:     # per entry function: global loads, exposed waits, the longest chain of round trips
            d["sass"] = {r.name: dict(global_loads=r.global_reads, waits=len(r.waits), path=r.path)
                         for r in sass.read(str(out / files["cubin"]))}
        kernels.append(d)
    from .cache import dsl_version
    from .fused_residual_norm import mixnorm_cluster, mixnorm_push
    from .render import pdl_chain
    manifest = dict(config=a.config, tp=a.tp, batch=batches, arch=a.arch, dsl_version=dsl_version(),
                    pdl_chain=pdl_chain(), mixnorm_cluster=mixnorm_cluster(), mixnorm_push=mixnorm_push(),
                    # the K3FUSE_* variables set for this build (codegen/knobs.py), so that a folder says what it holds
                    knobs={r["name"]: r["value"] for r in knobs.describe() if r["value"] is not None},
                    tuning=tuning_info, kernels=kernels, skipped=skipped, failed=failed,
                    seconds=round(time.perf_counter() - t0, 2))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{len(kernels)} kernels for {a.config} tp={a.tp} batch={a.batch} {a.arch} in {manifest['seconds']} s "
          f"-> {out}/manifest.json ({len(skipped)} skipped, {len(failed)} failed)")
    none = sum(e["source"] == "none" for e in entries)
    print(f"tuning: {len(entries) - none} of {len(entries)} table lookups found an entry "
          f"(table {tuning_info['gpu_table'] or 'none for ' + a.arch}"
          f"{', overlay ' + tuning_info['overlay'] if tuning_info['overlay'] else ''}); {none} took the heuristic "
          "default (manifest.json 'tuning')")
    if a.sass:
        rows = sorted(((f["path"], f"{k['name']}:{fn}") for k in kernels for fn, f in k["sass"].items()), reverse=True)
        print("sass: the longest round-trip chains (manifest.json 'sass'): "
              + ", ".join(f"{n} {p}" for p, n in rows[:5]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
