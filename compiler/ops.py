"""The k3fuse op set: torch custom ops (namespace `k3fuse`) that canonicalization rewrites the captured graph into
and that fusion passes and code generation work on.

Each op has a reference implementation (CPU and any device without a generated kernel) written as plain,
higher-precision math, and a fake implementation for tracing. Generated kernels register CUDA implementations
from `k3fuse.codegen`; where none applies the reference runs.
"""
from __future__ import annotations

from typing import Optional

import torch

LIB = "k3fuse"


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _situ(gate_up: torch.Tensor, beta: float, lbeta: float) -> torch.Tensor:
    g, u = gate_up.float().chunk(2, dim=-1)
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (lbeta * torch.tanh(u / lbeta))


def _mix(sources: list[torch.Tensor], w: torch.Tensor, eps: float) -> torch.Tensor:
    if len(sources) == 1:
        return sources[0].float()
    v = torch.stack(sources, dim=1).float()
    logits = (v * w.float()).sum(-1) * torch.rsqrt(v.pow(2).mean(-1) + eps)
    return (torch.softmax(logits, dim=1).unsqueeze(-1) * v).sum(1)


def _all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    if not group_name:
        return x
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", group_name))


@torch.library.custom_op(f"{LIB}::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """all_gather_into_tensor + wait: [M, ...] per rank -> [group_size * M, ...], rank-major. An op of its own so that
    a CUDA impl can replace the collective (codegen/allgather_oneshot.py, in-kernel over peer buffers)."""
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x, group_size, group_name))


@all_gather.register_fake
def _(x, group_size, group_name):
    return x.new_empty(group_size * x.shape[0], *x.shape[1:])


# ------------------------------------------------------------------------------------------------ basic ops
@torch.library.custom_op(f"{LIB}::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T, fp32 accumulate, output in x's dtype."""
    return (x.float() @ weight.float().t()).to(x.dtype)


@linear.register_fake
def _(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op(f"{LIB}::linear_group", mutates_args=())
def linear_group(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """[linear(x, w) for w in weights]: GEMVs that share their input (pass `fuse_shared_input_linears`), one
    launch on CUDA. The same math per weight as `linear`, so the values are bit-identical to separate calls."""
    return [(x.float() @ w.float().t()).to(x.dtype) for w in weights]


@linear_group.register_fake
def _(x, weights):
    return [x.new_empty(*x.shape[:-1], w.shape[0]) for w in weights]


@torch.library.custom_op(f"{LIB}::linear_group_situ", mutates_args=())
def linear_group_situ(x: torch.Tensor, weights: list[torch.Tensor], situ_member: int, beta: float,
                      linear_beta: float) -> list[torch.Tensor]:
    """linear_group(x, weights) with output `situ_member` replaced by situ_glu(that output, beta, linear_beta): the
    grouped GEMV with a SiTU-GLU epilogue on one [gate; up] member (pass `fuse_situ_glu_into_linear_group`). Written
    in k3fuse ops, so that where its kernel does not apply the lowering's inlined reference is the two ops."""
    outs = list(torch.ops.k3fuse.linear_group(x, weights))
    outs[situ_member] = torch.ops.k3fuse.situ_glu(outs[situ_member], beta, linear_beta)
    return outs


def _group_fakes(x, weights, situ_member):
    """The grouped GEMV's member outputs; the SiTU member's (situ_member >= 0) is half as wide."""
    return [x.new_empty(*x.shape[:-1], w.shape[0] // 2 if i == situ_member else w.shape[0])
            for i, w in enumerate(weights)]


@linear_group_situ.register_fake
def _(x, weights, situ_member, beta, linear_beta):
    return _group_fakes(x, weights, situ_member)


@torch.library.custom_op(f"{LIB}::linear_group_router", mutates_args=())
def linear_group_router(x: torch.Tensor, weights: list[torch.Tensor], router_weight: torch.Tensor, situ_member: int,
                        beta: float, linear_beta: float) -> list[torch.Tensor]:
    """The group's outputs (linear_group, or linear_group_situ where situ_member >= 0) followed by the router's fp32
    logits x @ router_weight^T: the router rows as one more member of the grouped GEMV, with an fp32 output (pass
    `fuse_router_into_linear_group`). Written in k3fuse ops, so that where its kernel does not apply the lowering's
    inlined reference is the group op + router_logits."""
    if situ_member >= 0:
        outs = list(torch.ops.k3fuse.linear_group_situ(x, weights, situ_member, beta, linear_beta))
    else:
        outs = list(torch.ops.k3fuse.linear_group(x, weights))
    return outs + [torch.ops.k3fuse.router_logits(x, router_weight)]


@linear_group_router.register_fake
def _(x, weights, router_weight, situ_member, beta, linear_beta):
    return _group_fakes(x, weights, situ_member) + [x.new_empty(x.shape[0], router_weight.shape[0],
                                                                dtype=torch.float32)]


@torch.library.custom_op(f"{LIB}::linear_group_router_topk", mutates_args=())
def linear_group_router_topk(x: torch.Tensor, weights: list[torch.Tensor], router_weight: torch.Tensor,
                             bias: torch.Tensor, top_k: int, renormalize: bool, scale: float, situ_member: int,
                             beta: float, linear_beta: float) -> list[torch.Tensor]:
    """linear_group_router's group outputs, then topk_from_logits of its logits: [*outs, ids, weights] (pass
    `fuse_topk_into_linear_group_router`; on CUDA, where the group's config has 256 threads, the selection runs in
    the grouped GEMV's last CTA). Written in k3fuse ops, so that where its kernel does not apply the lowering's inlined reference
    is the two ops."""
    outs = list(torch.ops.k3fuse.linear_group_router(x, weights, router_weight, situ_member, beta, linear_beta))
    ids, w = torch.ops.k3fuse.topk_from_logits(outs[-1], bias, top_k, renormalize, scale)
    return outs[:-1] + [ids, w]


@linear_group_router_topk.register_fake
def _(x, weights, router_weight, bias, top_k, renormalize, scale, situ_member, beta, linear_beta):
    M = x.shape[0]
    return _group_fakes(x, weights, situ_member) + [x.new_empty(M, top_k, dtype=torch.int64),
                                                    x.new_empty(M, top_k, dtype=torch.float32)]


@torch.library.custom_op(f"{LIB}::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """Normalize in fp32, cast to out_dtype, multiply by weight (K3_MODEL.md notation)."""
    return _rms(x, eps).to(out_dtype) * weight


@rms_norm.register_fake
def _(x, weight, eps, out_dtype):
    return x.new_empty(x.shape, dtype=torch.promote_types(out_dtype, weight.dtype))


@torch.library.custom_op(f"{LIB}::rms_norm_linear", mutates_args=())
def rms_norm_linear(x: torch.Tensor, norm_w: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """linear(rms_norm(x, norm_w, eps, weight.dtype), weight): the GEMV with an RMSNorm prologue (pass
    `fuse_rms_norm_into_linear`). Written in k3fuse ops, so that where its kernel does not apply the lowering's
    inlined reference is the two ops, each lowered on its own (the linear keeps its GEMV kernel)."""
    return torch.ops.k3fuse.linear(torch.ops.k3fuse.rms_norm(x, norm_w, eps, weight.dtype), weight)


@rms_norm_linear.register_fake
def _(x, norm_w, eps, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=weight.dtype)


@torch.library.custom_op(f"{LIB}::situ_glu", mutates_args=())
def situ_glu(gate_up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-GLU over [..., 2I] = [gate | up], fp32 inside, output in the input dtype."""
    return _situ(gate_up, beta, linear_beta).to(gate_up.dtype)


@situ_glu.register_fake
def _(gate_up, beta, linear_beta):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.custom_op(f"{LIB}::attnres_mix", mutates_args=())
def attnres_mix(sources: list[torch.Tensor], w: torch.Tensor, eps: float) -> torch.Tensor:
    """AttnRes depth mix over sources (block snapshots, then the prefix), fp32 [M, H]."""
    return _mix(sources, w, eps)


@attnres_mix.register_fake
def _(sources, w, eps):
    return sources[-1].new_empty(sources[-1].shape, dtype=torch.float32)


@torch.library.custom_op(f"{LIB}::router_topk", mutates_args=())
def router_topk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with correction bias (for choosing only): (expert ids [M, k] int64, weights [M, k] fp32)."""
    return _topk(x.float() @ weight.float().t(), bias, top_k, renormalize, scale)


def _topk(logits, bias, top_k, renormalize, scale):
    s = torch.sigmoid(logits)
    ids = torch.topk(s + bias.float(), top_k, dim=-1).indices
    w = s.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return ids, w * scale


@torch.library.custom_op(f"{LIB}::router_logits", mutates_args=())
def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Router logits in fp32: x [M, H] @ weight[E', H]^T (E' = a rank's share of the experts after the MoE split)."""
    return x.float() @ weight.float().t()


@router_logits.register_fake
def _(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


@torch.library.custom_op(f"{LIB}::topk_from_logits", mutates_args=())
def topk_from_logits(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The second half of router_topk, on gathered fp32 logits [M, E]."""
    return _topk(logits, bias, top_k, renormalize, scale)


@topk_from_logits.register_fake
def _(logits, bias, top_k, renormalize, scale):
    M = logits.shape[0]
    return logits.new_empty(M, top_k, dtype=torch.int64), logits.new_empty(M, top_k, dtype=torch.float32)


@router_topk.register_fake
def _(x, weight, bias, top_k, renormalize, scale):
    M = x.shape[0]
    return x.new_empty(M, top_k, dtype=torch.int64), x.new_empty(M, top_k, dtype=torch.float32)


@torch.library.custom_op(f"{LIB}::moe_experts", mutates_args=())
def moe_experts(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                beta: float, linear_beta: float) -> torch.Tensor:
    """Routed latent experts: sum_k weights[:, k] * W2_e SiTU-GLU(W13_e z), e = ids[:, k]; fp32 sum, output in
    z's dtype. w13 [E, 2I, D], w2 [E, D, I] (I is the rank's share under TP: the result is then partial)."""
    # the same contractions and rounding points as a straightforward model (bf16 GEMMs, fp32 combine)
    h = torch.einsum("md,mkid->mki", z, w13[ids])
    a = _situ(h, beta, linear_beta).to(z.dtype)
    y = torch.einsum("mki,mkdi->mkd", a, w2[ids])
    return (y.float() * weights.unsqueeze(-1).float()).sum(1).to(z.dtype)


@moe_experts.register_fake
def _(z, ids, weights, w13, w2, beta, linear_beta):
    return z.new_empty(z.shape[0], w2.shape[1])


# ------------------------------------------------------------------------------------------------ attention / experts
@torch.library.custom_op(f"{LIB}::kda_recurrent", mutates_args=())
def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor,
                  A_log: torch.Tensor, b: torch.Tensor, S: torch.Tensor,
                  lower_bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA decode steps 3-6 (K3_MODEL.md section 4) after the causal conv: q, k, v [M, h, d] (post-conv, SiLU'd),
    decay input a [M, h*d], beta input b [M, h], state S [M, h, d(v), d(k)] fp32. Returns (o [M, h, d] fp32, read
    after the write; the new state)."""
    M, h, d = q.shape
    g = lower_bound * torch.sigmoid(A_log.float().exp().view(1, h, 1) * (a.float() + dt_bias.float()).view(M, h, d))
    beta = torch.sigmoid(b.float())
    q = q.float() * torch.rsqrt(q.float().pow(2).sum(-1, keepdim=True) + 1e-6) * d ** -0.5
    k = k.float() * torch.rsqrt(k.float().pow(2).sum(-1, keepdim=True) + 1e-6)
    St = S * g.exp().unsqueeze(2)
    u = beta.unsqueeze(-1) * (v.float() - (St * k.unsqueeze(2)).sum(-1))      # S k
    St = St + u.unsqueeze(-1) * k.unsqueeze(2)
    return (St * q.unsqueeze(2)).sum(-1), St                                  # S q, after the write


@kda_recurrent.register_fake
def _(q, k, v, a, dt_bias, A_log, b, S, lower_bound):
    return q.new_empty(q.shape, dtype=torch.float32), torch.empty_like(S)


def _causal_conv(x, state, taps, newest_tap_last: bool):
    """The model's causal depthwise conv step, functional: x [M, C], state [M, K-1, C] (oldest first), taps [C, K].
    Returns (SiLU(conv) fp32 [M, C], the new state [M, K-1, C])."""
    window = torch.cat([state, x.unsqueeze(1)], dim=1)
    w = taps if newest_tap_last else taps.flip(-1)
    return torch.nn.functional.silu((window.float() * w.t().unsqueeze(0)).sum(1)), window[:, 1:]


@torch.library.custom_op(f"{LIB}::kda_decode", mutates_args=())
def kda_decode(q0: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, conv_state: torch.Tensor, q_taps: torch.Tensor,
               k_taps: torch.Tensor, v_taps: torch.Tensor, fa: torch.Tensor, f_b: torch.Tensor, dt_bias: torch.Tensor,
               A_log: torch.Tensor, b: torch.Tensor, go: torch.Tensor, o_norm: torch.Tensor, S: torch.Tensor,
               lower_bound: float, eps: float, newest_tap_last: bool,
               out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole KDA decode step between the projections and o_proj (K3_MODEL.md section 4; pass
    `fuse_kda_conv_gated_norm`): causal conv state update + SiLU of the pre-conv q0, k0, v0 [M, P] (one conv state
    [M, K-1, 3P] = [q | k | v]), the f_b projection of f_a's output fa [M, r] (f_b [P, r]), then kda_recurrent,
    then the gated RMSNorm per head: rms(o) * o_norm * sigmoid(go). Returns (o [M, P] in out_dtype, the new
    state S, the new conv state)."""
    M, P = q0.shape
    h = A_log.shape[0]
    d = P // h
    convs, states = [], []
    for i, (x, w) in enumerate(((q0, q_taps), (k0, k_taps), (v0, v_taps))):
        y, st = _causal_conv(x, conv_state[..., i * P:(i + 1) * P], w, newest_tap_last)
        convs.append(y.view(M, h, d))
        states.append(st)
    a = linear._init_fn(fa, f_b)                                       # the f_b projection (k3fuse::linear)
    o, S_new = kda_recurrent._init_fn(*convs, a, dt_bias, A_log, b, S, lower_bound)
    o = _rms(o, eps) * o_norm.float() * torch.sigmoid(go.float().view(M, h, d))
    return o.reshape(M, P).to(out_dtype), S_new, torch.cat(states, dim=-1)


@kda_decode.register_fake
def _(q0, k0, v0, conv_state, q_taps, k_taps, v_taps, fa, f_b, dt_bias, A_log, b, go, o_norm, S, lower_bound, eps,
      newest_tap_last, out_dtype):
    return q0.new_empty(q0.shape, dtype=out_dtype), torch.empty_like(S), torch.empty_like(conv_state)


@torch.library.custom_op(f"{LIB}::kda_decode_", mutates_args=("conv_state", "S"))
def kda_decode_(q0: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, conv_state: torch.Tensor, q_taps: torch.Tensor,
                k_taps: torch.Tensor, v_taps: torch.Tensor, fa: torch.Tensor, f_b: torch.Tensor,
                dt_bias: torch.Tensor, A_log: torch.Tensor, b: torch.Tensor, go: torch.Tensor, o_norm: torch.Tensor,
                S: torch.Tensor, lower_bound: float, eps: float, newest_tap_last: bool,
                out_dtype: torch.dtype) -> torch.Tensor:
    """kda_decode writing the new S and conv state into S and conv_state (pass `write_kda_state_in_place`, where the
    graph only copied them back into the cache). Returns o."""
    o, S_new, conv_new = kda_decode._init_fn(q0, k0, v0, conv_state, q_taps, k_taps, v_taps, fa, f_b, dt_bias, A_log,
                                             b, go, o_norm, S, lower_bound, eps, newest_tap_last, out_dtype)
    S.copy_(S_new)
    conv_state.copy_(conv_new)
    return o


@kda_decode_.register_fake
def _(q0, k0, v0, conv_state, q_taps, k_taps, v_taps, fa, f_b, dt_bias, A_log, b, go, o_norm, S, lower_bound, eps,
      newest_tap_last, out_dtype):
    return q0.new_empty(q0.shape, dtype=out_dtype)


@torch.library.custom_op(f"{LIB}::mla_attention", mutates_args=())
def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, kv_b: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """MLA decode attention, absorbed (K3_MODEL.md section 5, steps 5-6), over a cache that already holds the new
    token at position seq_lens: q_nope [M, h, n], q_pe [M, h, r], cache [M, T, kv_lora + r], kv_b [h*(n+v), kv_lora].
    Positions > seq_lens are masked. Returns o [M, h, v] fp32 (before the output gate)."""
    M, h, n = q_nope.shape
    C = kv_b.shape[1]
    w = kv_b.float().view(h, -1, C)
    c, kpe = cache[..., :C].float(), cache[..., C:].float()
    q_lat = torch.einsum("mhn,hnc->mhc", q_nope.float(), w[:, :n])           # absorbed query
    s = (torch.einsum("mhc,mtc->mht", q_lat, c) + torch.einsum("mhr,mtr->mht", q_pe.float(), kpe)) * scale
    valid = torch.arange(cache.shape[1], device=cache.device).view(1, 1, -1) <= seq_lens.view(M, 1, 1)
    p = torch.softmax(s.masked_fill(~valid, float("-inf")), dim=-1)
    # contiguous: a custom op's output must have the fake's strides, and on CUDA einsum returns an [h, M, v] buffer
    return torch.einsum("mhc,hvc->mhv", torch.einsum("mht,mtc->mhc", p, c), w[:, n:]).contiguous()


@mla_attention.register_fake
def _(q_nope, q_pe, cache, kv_b, seq_lens, scale):
    M, h, n = q_nope.shape
    return q_nope.new_empty(M, h, kv_b.shape[0] // h - n, dtype=torch.float32)


@torch.library.custom_op(f"{LIB}::mla_append_attention_", mutates_args=("cache",))
def mla_append_attention_(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kv_norm_w: torch.Tensor,
                          kv_eps: float, norm_dtype: torch.dtype, cache: torch.Tensor, kv_b: torch.Tensor,
                          seq_lens: torch.Tensor, scale: float, gate: Optional[torch.Tensor],
                          out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """The MLA decode step around its attention (pass `fuse_mla_append_and_gate`, K3_MODEL.md section 5 steps 2, 4,
    6-7): the new token's cache row [RMSNorm(ckv[:, :C]; kv_norm_w) | ckv[:, C:]] is written IN PLACE at
    cache[m, seq_lens[m]] (C = kv_b.shape[1]), then mla_attention over the cache, then the output gate
    o * sigmoid(gate) if gate ([M, h * v]) is given, cast to out_dtype if given. Written in the ops it replaces, so
    it is the unfused graph's math bit for bit."""
    C = kv_b.shape[1]
    latent = torch.ops.k3fuse.rms_norm(ckv[:, :C], kv_norm_w, kv_eps, norm_dtype)
    row = torch.cat([latent, ckv[:, C:]], dim=-1)
    cache[torch.arange(ckv.shape[0], device=cache.device), seq_lens] = row.to(cache.dtype)
    o = torch.ops.k3fuse.mla_attention(q_nope, q_pe, cache, kv_b, seq_lens, scale)
    if gate is not None:
        o = o * torch.sigmoid(gate.float().reshape(o.shape))
    return o if out_dtype is None else o.to(out_dtype)


@mla_append_attention_.register_fake
def _(q_nope, q_pe, ckv, kv_norm_w, kv_eps, norm_dtype, cache, kv_b, seq_lens, scale, gate, out_dtype):
    M, h, n = q_nope.shape
    return q_nope.new_empty(M, h, kv_b.shape[0] // h - n, dtype=out_dtype or torch.float32)


@torch.library.custom_op(f"{LIB}::mla_qb_append_attention_", mutates_args=("cache",))
def mla_qb_append_attention_(cq: torch.Tensor, q_norm_w: torch.Tensor, q_eps: float, w_qb: torch.Tensor, heads: int,
                             ckv: torch.Tensor, kv_norm_w: torch.Tensor, kv_eps: float, norm_dtype: torch.dtype,
                             cache: torch.Tensor, kv_b: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                             gate: Optional[torch.Tensor], out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """mla_append_attention_ with the query's projection in front (pass `fuse_q_b_into_mla_attention`, K3_MODEL.md
    section 5 steps 1 and 3): q = rms_norm_linear(cq, q_norm_w, q_eps, w_qb) viewed [M, heads, n + r] (cq: q_a_proj's
    output before q_a_layernorm; w_qb [heads * (n + r), q_lora]; r = cache's width - kv_lora), q_nope = q[..., :n],
    q_pe = q[..., n:]. Written in the ops it replaces, so it is the unfused graph's math bit for bit."""
    M = cq.shape[0]
    q = torch.ops.k3fuse.rms_norm_linear(cq, q_norm_w, q_eps, w_qb).view(M, heads, -1)
    n = q.shape[-1] - (cache.shape[-1] - kv_b.shape[1])
    return torch.ops.k3fuse.mla_append_attention_(q[..., :n], q[..., n:], ckv, kv_norm_w, kv_eps, norm_dtype, cache,
                                                  kv_b, seq_lens, scale, gate, out_dtype)


@mla_qb_append_attention_.register_fake
def _(cq, q_norm_w, q_eps, w_qb, heads, ckv, kv_norm_w, kv_eps, norm_dtype, cache, kv_b, seq_lens, scale, gate,
      out_dtype):
    n = w_qb.shape[0] // heads - (cache.shape[-1] - kv_b.shape[1])
    return cq.new_empty(cq.shape[0], heads, kv_b.shape[0] // heads - n, dtype=out_dtype or torch.float32)


# ------------------------------------------------------------------------------------------------ fused ops
@torch.library.custom_op(f"{LIB}::fused_residual_norm", mutates_args=())
def fused_residual_norm(o: torch.Tensor, w_o: torch.Tensor, addend: Optional[torch.Tensor],
                        prefix: Optional[torch.Tensor], blocks: list[torch.Tensor], w_mix: torch.Tensor,
                        norm_w: Optional[torch.Tensor], mix_eps: float, norm_eps: float, group_name: str,
                        fp32_norm: bool, addend_partial: bool = False,
                        w_mix_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention-output / MLP-output fusion of K3 (pass `fuse_attn_out_allreduce_attnres_norm`):

        y = bf16(o @ w_o^T)                        row-parallel projection (o_proj, MLP down_proj)
        y = all_reduce(y)                          if group_name (absent at TP = 1)
        y = y + addend                             if addend (the MoE's routed output, already complete; with
                                                   addend_partial it is this rank's share, added BEFORE the
                                                   reduction, which then also completes it)
        new_prefix = y  if prefix is None  else  prefix + y    (restart at an AttnRes block boundary)
        mix = AttnRes mix over blocks + [new_prefix] with score vector w_mix (times w_mix_scale, in fp32, if
                                                   given: AttnRes's res_norm.weight * res_proj.weight, a product
                                                   of two parameters the kernel forms instead of a separate launch)
        normed = RMSNorm(mix; norm_w) in o's dtype (mix rounded first unless fp32_norm); mix itself if no norm_w

    Returns (normed, new_prefix). At a block boundary new_prefix is also the new block snapshot.
    """
    dt = o.dtype
    y = (o.float() @ w_o.float().t()).to(dt)
    if addend is not None and addend_partial:
        y = addend + y
    y = _all_reduce(y, group_name)
    if addend is not None and not addend_partial:
        y = addend + y
    new_prefix = y if prefix is None else prefix + y
    if w_mix_scale is not None:
        w_mix = w_mix.float() * w_mix_scale.float()
    mix = _mix(list(blocks) + [new_prefix], w_mix, mix_eps)
    if norm_w is None:
        return mix.clone(), new_prefix.clone()
    if not fp32_norm:
        mix = mix.to(dt)
    return _rms(mix, norm_eps).to(dt) * norm_w, new_prefix.clone()


@fused_residual_norm.register_fake
def _(o, w_o, addend, prefix, blocks, w_mix, norm_w, mix_eps, norm_eps, group_name, fp32_norm, addend_partial=False,
      w_mix_scale=None):
    M, N = o.shape[0], w_o.shape[0]
    normed = o.new_empty(M, N, dtype=o.dtype if norm_w is not None else torch.float32)
    return normed, o.new_empty(M, N)


@torch.library.custom_op(f"{LIB}::prefetch_l2", mutates_args=("token",))
def prefetch_l2(token: torch.Tensor, weights: list[torch.Tensor], budget_bytes: int) -> None:
    """Bring up to budget_bytes of `weights` into L2 while a collective runs. A hint: no effect on values.
    `token` is a 1-element buffer the op is said to write, so graph passes keep it (it has no outputs).
    On CPU it does nothing; on CUDA the codegen registers a bulk-prefetch kernel on a side stream."""
    return None


# ------------------------------------------------------------------------------------------------ streams
@torch.library.custom_op(f"{LIB}::side_linear_situ", mutates_args=())
def side_linear_situ(x: torch.Tensor, weight: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-GLU(x @ weight^T): the shared expert's up half. On CUDA it runs on a side stream and returns at once;
    `stream_join` on its output makes the current stream wait (the routed path runs in between)."""
    return _situ((x.float() @ weight.float().t()).to(x.dtype), beta, linear_beta).to(x.dtype)


@side_linear_situ.register_fake
def _(x, weight, beta, linear_beta):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


@torch.library.custom_op(f"{LIB}::stream_join", mutates_args=())
def stream_join(x: torch.Tensor) -> torch.Tensor:
    """The value of x, once the side-stream work that produced it is done (a copy: ops may not alias inputs)."""
    return x.clone()


@stream_join.register_fake
def _(x):
    return torch.empty_like(x)


