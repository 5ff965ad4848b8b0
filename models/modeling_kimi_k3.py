"""Kimi K3 decode model (../shared/K3_MODEL.md), written as modeling code: nn.Linear, explicit math, functional
collectives for tensor parallelism. Nothing here is pre-fused; finding the fusions is the compiler's job.

`model(input_ids [M], cache)` runs one decode step for M sequences, advances `cache` in place and returns
logits [M, vocab]. Under TP = t (a process group given as `tp_group`), weights are sharded as vLLM shards them
(K3_MODEL.md section 7); every rank computes identical logits.
"""
from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import KimiK3Config

try:  # functional collectives trace into _c10d_functional ops under torch.compile
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
except ImportError:  # pragma: no cover - torch built without distributed
    dist = None
    funcol = None


# ----------------------------------------------------------------------------------------------- primitives
class RMSNorm(nn.Module):
    """Normalizes in fp32, casts to `out_dtype` (the activation dtype), then multiplies by the weight."""

    def __init__(self, dim: int, eps: float, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out_dtype = out_dtype or x.dtype
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(out_dtype) * self.weight


def situ_glu(gate_up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-GLU on a [..., 2I] = [gate | up] projection, in fp32: beta tanh(g/beta) sigmoid(g) * lb tanh(u/lb)."""
    g, u = gate_up.float().chunk(2, dim=-1)
    s = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    return (s * (linear_beta * torch.tanh(u / linear_beta))).to(gate_up.dtype)


class TP:
    """The tensor-parallel group of a model (rank 0 of 1 when there is none)."""

    def __init__(self, group=None):
        self.group = group
        if group is not None:
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        else:
            self.rank, self.size = 0, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        return funcol.all_reduce(x, "sum", self.group)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        g = funcol.all_gather_tensor(x.contiguous(), gather_dim=0, group=self.group)  # [t*M, n]
        return g.view(self.size, x.shape[0], x.shape[1]).permute(1, 0, 2).reshape(x.shape[0], -1)

    def split(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"{what} = {n} does not divide by tensor-parallel size {self.size}")
        return n // self.size


def _shard(p: nn.Parameter, dim: int, chunks: int = 1):
    """Mark how a parameter is cut from the full (TP = 1) tensor: along `dim`, `chunks` sub-blocks cut alike."""
    p._k3_shard = (dim, chunks)
    return p


def _linear(i: int, o: int, dtype, shard: int | None = None, chunks: int = 1) -> nn.Linear:
    lin = nn.Linear(i, o, bias=False, dtype=dtype)
    if shard is not None:
        _shard(lin.weight, shard, chunks)
    return lin


# ----------------------------------------------------------------------------------------------- Attention Residuals
class AttnRes(nn.Module):
    """One depth mix: softmax over sources of (w . v) / rms(v), w = res_norm.weight * res_proj.weight (fp32)."""

    def __init__(self, hidden: int, eps: float, dtype):
        super().__init__()
        self.res_norm = nn.Module()
        self.res_norm.weight = nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.res_proj = nn.Linear(hidden, 1, bias=False, dtype=dtype)
        self.eps = eps

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        if len(sources) == 1:  # no completed block: the mix is the prefix itself
            return sources[0].float()
        w = self.res_norm.weight.float() * self.res_proj.weight.float().view(-1)
        v = torch.stack(sources, dim=1).float()                       # [M, n, H]
        logits = (v * w).sum(-1) * torch.rsqrt(v.pow(2).mean(-1) + self.eps)
        alpha = torch.softmax(logits, dim=1)
        return (alpha.unsqueeze(-1) * v).sum(1)                         # [M, H] fp32


# ----------------------------------------------------------------------------------------------- KDA
class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: KimiK3Config, tp: TP, dtype):
        super().__init__()
        H, dh = cfg.hidden_size, cfg.kda_head_dim
        self.tp = tp
        self.heads = tp.split(cfg.num_kda_heads, "linear_attn_config.num_heads")
        self.head_dim = dh
        P = self.heads * dh
        self.P = P
        self.q_proj = _linear(H, P, dtype, 0)
        self.k_proj = _linear(H, P, dtype, 0)
        self.v_proj = _linear(H, P, dtype, 0)
        self.g_proj = _linear(H, P, dtype, 0)          # full-rank output gate
        self.f_a_proj = _linear(H, dh, dtype)          # low-rank decay, replicated
        self.f_b_proj = _linear(dh, P, dtype, 0)
        self.b_proj = _linear(H, self.heads, dtype, 0)
        K = cfg.conv_kernel_size
        self.q_conv1d = _shard(nn.Parameter(torch.empty(P, K)), 0)     # fp32 depthwise taps
        self.k_conv1d = _shard(nn.Parameter(torch.empty(P, K)), 0)
        self.v_conv1d = _shard(nn.Parameter(torch.empty(P, K)), 0)
        self.A_log = _shard(nn.Parameter(torch.empty(self.heads)), 0)
        self.dt_bias = _shard(nn.Parameter(torch.empty(P)), 0)
        self.o_norm = nn.Parameter(torch.ones(dh))
        self.o_proj = _linear(P, H, dtype, 1)
        self.newest_tap_last = cfg.conv_newest_tap_last
        self.lower_bound = cfg.kda_gate_lower_bound
        self.eps = cfg.rms_norm_eps

    def _conv(self, x: torch.Tensor, state: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv step. state [M, K-1, C] holds the last K-1 pre-conv inputs, oldest first."""
        window = torch.cat([state, x.unsqueeze(1)], dim=1)           # [M, K, C], newest last
        state.copy_(window[:, 1:])
        taps = w if self.newest_tap_last else w.flip(-1)             # [C, K]
        return F.silu((window.float() * taps.t().unsqueeze(0)).sum(1))

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
        M, h, d = x.shape[0], self.heads, self.head_dim
        P = self.P
        q0, k0, v0 = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        go = self.g_proj(x)
        a = self.f_b_proj(self.f_a_proj(x))
        b = self.b_proj(x)
        # one conv state holds [q | k | v] channels
        qs, ks, vs = conv_state[..., :P], conv_state[..., P:2 * P], conv_state[..., 2 * P:]
        q = self._conv(q0, qs, self.q_conv1d).view(M, h, d)
        k = self._conv(k0, ks, self.k_conv1d).view(M, h, d)
        v = self._conv(v0, vs, self.v_conv1d).view(M, h, d)
        # decay gate, beta, L2 norms (fp32)
        g = self.lower_bound * torch.sigmoid(self.A_log.float().exp().view(1, h, 1)
                                             * (a.float() + self.dt_bias.float()).view(M, h, d))
        beta = torch.sigmoid(b.float())                                # [M, h]
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * d ** -0.5
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        # delta rule, state S [M, h, V, K] fp32
        St = S * g.exp().unsqueeze(2)
        p = (St * k.unsqueeze(2)).sum(-1)                              # S k   [M, h, V]
        u = beta.unsqueeze(-1) * (v - p)
        St = St + u.unsqueeze(-1) * k.unsqueeze(2)
        S.copy_(St)
        o = (St * q.unsqueeze(2)).sum(-1)                              # S q   [M, h, V]
        # gated RMSNorm per head (fp32)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.float()
        o = o * torch.sigmoid(go.float().view(M, h, d))
        return self.o_proj(o.reshape(M, P).to(x.dtype))                # partial sum under TP


# ----------------------------------------------------------------------------------------------- MLA
class MultiLatentAttention(nn.Module):
    def __init__(self, cfg: KimiK3Config, tp: TP, dtype):
        super().__init__()
        H = cfg.hidden_size
        self.heads = tp.split(cfg.num_attention_heads, "num_attention_heads")
        self.nope, self.rope, self.vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        self.q_a_proj = _linear(H, cfg.q_lora_rank, dtype)
        self.kv_a_proj_with_mqa = _linear(H, cfg.kv_lora_rank + self.rope, dtype)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.mla_lora_norm_eps, dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.mla_lora_norm_eps, dtype)
        self.q_b_proj = _linear(cfg.q_lora_rank, self.heads * (self.nope + self.rope), dtype, 0)
        self.kv_b_proj = _linear(cfg.kv_lora_rank, self.heads * (self.nope + self.vd), dtype, 0)
        self.g_proj = _linear(H, self.heads * self.vd, dtype, 0)
        self.o_proj = _linear(self.heads * self.vd, H, dtype, 1)
        self.scale = (self.nope + self.rope) ** -0.5

    def forward(self, x: torch.Tensor, cache: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        M, h = x.shape[0], self.heads
        cq = self.q_a_layernorm(self.q_a_proj(x))
        ckv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(ckv[:, :self.kv_lora])
        k_pe = ckv[:, self.kv_lora:]
        q = self.q_b_proj(cq).view(M, h, self.nope + self.rope)
        q_nope, q_pe = q[..., :self.nope], q[..., self.nope:]
        # append [latent | k_pe] at position seq_lens before attending (the token sees itself)
        rows = torch.arange(M, device=x.device)
        cache[rows, seq_lens] = torch.cat([latent, k_pe], dim=-1)
        c, kpe = cache[..., :self.kv_lora].float(), cache[..., self.kv_lora:].float()   # [M, T, 512], [M, T, 64]
        w_kv = self.kv_b_proj.weight.view(h, self.nope + self.vd, self.kv_lora).float()
        w_uk, w_uv = w_kv[:, :self.nope], w_kv[:, self.nope:]          # [h, 128, 512] each
        q_lat = torch.einsum("mhn,hnc->mhc", q_nope.float(), w_uk)     # absorbed query [M, h, 512]
        s = (torch.einsum("mhc,mtc->mht", q_lat, c) + torch.einsum("mhr,mtr->mht", q_pe.float(), kpe)) * self.scale
        T = cache.shape[1]
        valid = torch.arange(T, device=x.device).view(1, 1, T) <= seq_lens.view(M, 1, 1)
        p = torch.softmax(s.masked_fill(~valid, float("-inf")), dim=-1)
        o_lat = torch.einsum("mht,mtc->mhc", p, c)
        o = torch.einsum("mhc,hvc->mhv", o_lat, w_uv)                  # [M, h, 128]
        o = o * torch.sigmoid(self.g_proj(x).float().view(M, h, self.vd))
        return self.o_proj(o.reshape(M, h * self.vd).to(x.dtype))


# ----------------------------------------------------------------------------------------------- MLPs
class SiTUGLUMLP(nn.Module):
    """[gate | up] column-parallel, down row-parallel: returns a partial sum under TP (caller reduces)."""

    def __init__(self, cfg: KimiK3Config, hidden: int, inter: int, tp: TP, dtype, what: str):
        super().__init__()
        local = tp.split(inter, what)
        self.gate_up_proj = _linear(hidden, 2 * local, dtype, 0, chunks=2)
        self.down_proj = _linear(local, hidden, dtype, 1)
        self.beta, self.lbeta = cfg.activation_situ_beta, cfg.activation_situ_linear_beta

    def forward(self, x):
        return self.down_proj(situ_glu(self.gate_up_proj(x), self.beta, self.lbeta))


class Router(nn.Module):
    def __init__(self, cfg: KimiK3Config, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts))
        self.top_k, self.scale, self.renorm = (cfg.num_experts_per_token, cfg.routed_scaling_factor,
                                               cfg.norm_topk_prob)

    def forward(self, x):
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))            # [M, E] fp32
        ids = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1).indices
        w = scores.gather(1, ids)
        if self.renorm:
            w = w / w.sum(-1, keepdim=True)
        return ids, w * self.scale


class LatentMoE(nn.Module):
    def __init__(self, cfg: KimiK3Config, tp: TP, dtype):
        super().__init__()
        H, D, E = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts
        self.tp = tp
        inter = tp.split(cfg.moe_intermediate_size, "moe_intermediate_size")
        self.gate = Router(cfg, dtype)
        self.routed_expert_down_proj = _linear(H, D, dtype)
        self.routed_expert_up_proj = _linear(D, H, dtype)
        self.routed_expert_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.experts = nn.Module()    # stacked experts, split on the intermediate width under TP
        self.experts.w13_weight = _shard(nn.Parameter(torch.empty(E, 2 * inter, D, dtype=dtype)), 1, 2)
        self.experts.w2_weight = _shard(nn.Parameter(torch.empty(E, D, inter, dtype=dtype)), 2)
        self.shared_experts = SiTUGLUMLP(cfg, H, cfg.shared_intermediate_size, tp, dtype,
                                         "num_shared_experts * moe_intermediate_size")
        self.beta, self.lbeta = cfg.activation_situ_beta, cfg.activation_situ_linear_beta

    def forward(self, x):
        ids, w = self.gate(x)                                          # [M, k]
        z = self.routed_expert_down_proj(x)                            # [M, D]
        w13 = self.experts.w13_weight[ids]                             # [M, k, 2I, D]
        w2 = self.experts.w2_weight[ids]                               # [M, k, D, I]
        h = torch.einsum("md,mkid->mki", z, w13)
        y = torch.einsum("mki,mkdi->mkd", situ_glu(h, self.beta, self.lbeta), w2)
        r = (y.float() * w.unsqueeze(-1)).sum(1).to(x.dtype)          # partial latent sum under TP
        r = self.routed_expert_norm(self.tp.all_reduce(r))
        routed = self.routed_expert_up_proj(r)
        shared = self.tp.all_reduce(self.shared_experts(x))
        return routed + shared


class DenseMLP(nn.Module):
    def __init__(self, cfg: KimiK3Config, tp: TP, dtype):
        super().__init__()
        self.tp = tp
        self.mlp = SiTUGLUMLP(cfg, cfg.hidden_size, cfg.intermediate_size, tp, dtype, "intermediate_size")

    def forward(self, x):
        return self.tp.all_reduce(self.mlp(x))


# ----------------------------------------------------------------------------------------------- decoder
class KimiK3DecoderLayer(nn.Module):
    def __init__(self, cfg: KimiK3Config, layer: int, tp: TP, dtype):
        super().__init__()
        self.layer_idx, self.kind, self.tp = layer, cfg.layer_kind(layer), tp
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        self.attn_res = AttnRes(H, cfg.attn_res_eps, dtype)
        self.mlp_res = AttnRes(H, cfg.attn_res_eps, dtype)
        self.self_attn = (KimiDeltaAttention if self.kind == "kda" else MultiLatentAttention)(cfg, tp, dtype)
        self.mlp = LatentMoE(cfg, tp, dtype) if cfg.is_moe_layer(layer) else DenseMLP(cfg, tp, dtype)
        self.block_size = cfg.attn_res_block_size
        self.fp32_norm = cfg.attn_res_mix_fp32_norm

    def _norm(self, norm: RMSNorm, mix: torch.Tensor, dtype) -> torch.Tensor:
        return norm(mix if self.fp32_norm else mix.to(dtype), out_dtype=dtype)

    def forward(self, prefix, blocks: list, mlp_out, cache: "KimiK3Cache"):
        """Steps 1-5 of K3_MODEL.md section 3. Returns (prefix, mlp_out); appends to `blocks` at a boundary."""
        prefix, x = self.mix_input(prefix, blocks, mlp_out)
        return self.body(x, prefix, blocks, cache)

    def mix_input(self, prefix, blocks: list, mlp_out):
        """Step 1: the previous MLP output joins the prefix (a block starts at a boundary), then the depth mix over
        the completed blocks and the prefix, normed. Returns (prefix, x)."""
        l, B = self.layer_idx, self.block_size
        if mlp_out is not None:
            prefix = prefix + mlp_out
        if l % B == 0:
            blocks.append(prefix)
        nb = math.ceil(l / B)
        return prefix, self._norm(self.input_layernorm, self.attn_res(blocks[:nb] + [prefix]), prefix.dtype)

    def body(self, x, prefix, blocks: list, cache: "KimiK3Cache"):
        """Steps 2-5 from the normed input x: attention, all-reduce, prefix update, the MLP's depth mix + norm, the
        MLP. Returns (prefix, mlp_out)."""
        l, B = self.layer_idx, self.block_size
        write = l % B == 0
        nb = math.ceil(l / B)
        if self.kind == "kda":
            a = self.self_attn(x, cache.conv_state[l], cache.recurrent_state[l])
        else:
            a = self.self_attn(x, cache.latent_cache[l], cache.seq_lens)
        a = self.tp.all_reduce(a)
        prefix = a if write else prefix + a
        x = self._norm(self.post_attention_layernorm, self.mlp_res(blocks[:nb + int(write)] + [prefix]), x.dtype)
        return prefix, self.mlp(x)


@dataclass
class KimiK3Cache:
    """Decode state, one entry per layer (None where the layer kind has no such state)."""
    conv_state: list          # KDA: [M, K-1, 3 * P_local] activation dtype, last K-1 pre-conv [q | k | v]
    recurrent_state: list     # KDA: [M, heads_local, V, K] fp32
    latent_cache: list        # MLA: [M, max_seq_len, kv_lora + rope] activation dtype
    seq_lens: torch.Tensor    # [M] int64: tokens already in the MLA caches

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]


class KimiK3Model(nn.Module):
    def __init__(self, cfg: KimiK3Config, tp: TP, dtype):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.vocab_local = tp.split(cfg.vocab_size, "vocab_size")
        self.embed_tokens = nn.Embedding(self.vocab_local, cfg.hidden_size, dtype=dtype)
        _shard(self.embed_tokens.weight, 0)
        self.layers = nn.ModuleList(KimiK3DecoderLayer(cfg, l, tp, dtype) for l in range(cfg.num_hidden_layers))
        self.final_res = AttnRes(cfg.hidden_size, cfg.attn_res_eps, dtype)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def embed(self, ids):
        if self.tp.size == 1:
            return self.embed_tokens(ids)
        start = self.tp.rank * self.vocab_local           # vocab-parallel: masked lookup + all-reduce
        local = ids - start
        inside = (local >= 0) & (local < self.vocab_local)
        e = self.embed_tokens(torch.where(inside, local, 0)) * inside.unsqueeze(-1).to(self.embed_tokens.weight.dtype)
        return self.tp.all_reduce(e)

    def forward(self, input_ids, cache: KimiK3Cache):
        prefix = self.embed(input_ids)
        blocks: list[torch.Tensor] = []
        mlp_out = None
        for layer in self.layers:
            prefix, mlp_out = layer(prefix, blocks, mlp_out, cache)
        prefix = prefix + mlp_out
        h = self.final_res(blocks + [prefix])
        return self.norm(h if self.cfg.attn_res_mix_fp32_norm else h.to(prefix.dtype), out_dtype=prefix.dtype)


def init_tensor(name: str, shape, generator: torch.Generator, num_layers: int, device=None) -> torch.Tensor:
    """The initial value of the (full, unsharded) parameter `name`: scales keep activations O(1) through the layers."""
    g, leaf = generator, name.rsplit(".", 1)[-1]
    randn = functools.partial(torch.randn, shape, generator=g, device=device)
    if "norm" in name and leaf == "weight" or name.endswith("o_norm"):
        return 1.0 + 0.1 * randn()
    if name.endswith("res_proj.weight"):
        return randn() * shape[-1] ** -0.5 * 2
    if leaf.endswith("conv1d"):
        return randn() * 0.5
    if leaf == "A_log":
        return torch.rand(shape, generator=g, device=device) * 2 - 1
    if leaf == "dt_bias":
        return randn() * 0.5
    if leaf == "e_score_correction_bias":
        return randn() * 0.1
    if name.endswith("embed_tokens.weight"):
        return randn()
    # projections [..., out, in]: 1/sqrt(fan_in); outputs added to the residual also / sqrt(2L)
    std = shape[-1] ** -0.5
    if any(s in name for s in ("o_proj", "down_proj", "w2_weight", "up_proj")) and "gate_up" not in name:
        std /= math.sqrt(2 * num_layers)
    return randn() * std


class KimiK3ForCausalLM(nn.Module):
    def __init__(self, config: KimiK3Config, tp_group=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.tp = TP(tp_group)
        self.dtype = dtype
        self._check_tp(config)
        # Draw the init seed BEFORE building the modules: nn.Linear's own init consumes the global RNG in
        # proportion to the (per-rank, TP-dependent) parameter sizes.
        seed = int(torch.randint(0, 2**31 - 1, (1,), device="cpu").item())
        self.model = KimiK3Model(config, self.tp, dtype)
        self.lm_head = _linear(config.hidden_size, self.tp.split(config.vocab_size, "vocab_size"), dtype, 0)
        self.reset_parameters(seed)

    def _check_tp(self, cfg):
        for n, what in [(cfg.num_kda_heads, "linear_attn_config.num_heads"),
                        (cfg.num_attention_heads, "num_attention_heads"),
                        (cfg.moe_intermediate_size, "moe_intermediate_size"),
                        (cfg.shared_intermediate_size, "num_shared_experts * moe_intermediate_size"),
                        (cfg.intermediate_size, "intermediate_size"), (cfg.vocab_size, "vocab_size")]:
            self.tp.split(n, what)

    # ---- weights ----
    def _local(self, name: str, p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """The slice of the full (TP = 1) tensor `full` that this rank holds as `p`."""
        spec = getattr(p, "_k3_shard", None)
        if spec is None or self.tp.size == 1:
            if full.shape != p.shape:
                raise ValueError(f"{name}: expected {tuple(p.shape)}, got {tuple(full.shape)}")
            return full
        dim, chunks = spec
        parts = full.chunk(chunks, dim=dim)
        return torch.cat([c.chunk(self.tp.size, dim=dim)[self.tp.rank] for c in parts], dim=dim)

    def _full_shape(self, p) -> list[int]:
        shape = list(p.shape)
        spec = getattr(p, "_k3_shard", None)
        if spec is not None:
            shape[spec[0]] *= self.tp.size
        return shape

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None):
        """Deterministic under torch.manual_seed (or `seed`), identical for every TP size (each rank draws the full
        tensor and keeps its slice). Scales keep activations O(1) through the layers."""
        base = int(torch.randint(0, 2**31 - 1, (1,), device="cpu").item()) if seed is None else int(seed)
        L = self.config.num_hidden_layers
        for name, p in self.named_parameters():
            if p.is_meta:        # a model built on the meta device (shapes only, e.g. to inspect the K3 graph)
                continue
            g = torch.Generator().manual_seed(base + zlib.crc32(name.encode()))
            full = init_tensor(name, self._full_shape(p), g, L)
            p.copy_(self._local(name, p, full.to(p.dtype)))

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]):
        """Load an unsharded (TP = 1) state dict with this module's names, keeping this rank's slices."""
        params = dict(self.named_parameters())
        missing = sorted(set(params) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(params))
        if missing or unexpected:
            raise KeyError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, p in params.items():
            p.copy_(self._local(name, p, state_dict[name].to(p.dtype)))

    # ---- decode ----
    def new_cache(self, batch_size: int, max_seq_len: int, device=None, dtype=None) -> KimiK3Cache:
        cfg, dtype = self.config, dtype or self.dtype
        device = device or self.lm_head.weight.device
        conv, rec, lat = [], [], []
        for layer in self.model.layers:
            a = layer.self_attn
            if layer.kind == "kda":
                conv.append(torch.zeros(batch_size, cfg.conv_kernel_size - 1, 3 * a.P, dtype=dtype, device=device))
                rec.append(torch.zeros(batch_size, a.heads, a.head_dim, a.head_dim, dtype=torch.float32,
                                       device=device))
                lat.append(None)
            else:
                conv.append(None)
                rec.append(None)
                lat.append(torch.zeros(batch_size, max_seq_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                       dtype=dtype, device=device))
        return KimiK3Cache(conv, rec, lat, torch.zeros(batch_size, dtype=torch.int64, device=device))

    def forward(self, input_ids: torch.Tensor, cache: KimiK3Cache) -> torch.Tensor:
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be [M] (one new token per sequence), got {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        if cache.batch_size != input_ids.shape[0]:
            raise ValueError(f"cache was made for batch {cache.batch_size}, input_ids has {input_ids.shape[0]}")
        kv = next((c for c in cache.conv_state + cache.latent_cache if c is not None), None)
        if kv is not None and kv.dtype != self.dtype:
            raise TypeError(f"cache dtype {kv.dtype} does not match the model dtype {self.dtype}")
        if input_ids.device != self.lm_head.weight.device or cache.seq_lens.device != input_ids.device:
            raise ValueError(f"input_ids on {input_ids.device}, cache on {cache.seq_lens.device}, model on "
                             f"{self.lm_head.weight.device}: they must be on one device")
        h = self.model(input_ids, cache)
        logits = self.tp.all_gather_last(self.lm_head(h))
        cache.seq_lens.add_(1)
        return logits
