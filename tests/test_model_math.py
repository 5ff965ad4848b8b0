"""The Kimi K3 decode model's mathematics against independent formulas written out from
/work/shared/K3_MODEL.md (sections 3-6), one component at a time, then composed.

Every reference below is a literal, per-token / per-head loop in float64 that reads the model's weights but
none of the model's helper functions. Errors are relative: ||a - b|| / ||b||.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from k3fuse.models import KimiK3Config, KimiK3ForCausalLM, situ_glu
from k3fuse.models.modeling_kimi_k3 import TP, KimiDeltaAttention, LatentMoE, MultiLatentAttention, Router

D64 = torch.float64


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to(D64), b.detach().to(D64)
    return ((a - b).norm() / b.norm()).item()


def f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(D64).clone()


def tiny(**over) -> KimiK3Config:
    d = dict(KimiK3Config.preset("tiny").to_dict())
    lac = dict(d["linear_attn_config"], **over.pop("linear_attn_config", {}))
    d.update(over, linear_attn_config=lac)
    return KimiK3Config.from_dict(d)


@torch.no_grad()
def randomize_(module: nn.Module, scale: float = 1.0):
    """Fresh random weights: projections ~ 1/sqrt(fan_in), vectors near 1 (norms) or O(1)."""
    for name, p in module.named_parameters():
        if p.dim() >= 2 and not name.endswith("conv1d"):
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5 * scale)
        elif "norm" in name:
            p.copy_(1.0 + 0.3 * torch.randn_like(p))
        else:
            p.copy_(torch.randn_like(p) * 0.7)


# ----------------------------------------------------------------------------------------------- spec formulas
def sigmoid(x):
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x):
    return x * sigmoid(x)


def situ_ref(g, u):
    """K3_MODEL.md section 1: s = 4 tanh(g/4) sigmoid(g); u' = 25 tanh(u/25); out = s * u'."""
    return 4.0 * torch.tanh(g / 4.0) * sigmoid(g) * (25.0 * torch.tanh(u / 25.0))


def rms_ref(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def mix_ref(sources, w):
    """Section 3: logit_i = (w . v_i) / sqrt(mean(v_i^2) + 1e-5); softmax over i; sum alpha_i v_i."""
    logits = [(v * w).sum(-1) / torch.sqrt((v * v).mean(-1) + 1e-5) for v in sources]   # each [M]
    mx = torch.stack(logits).max(0).values
    e = [torch.exp(lg - mx) for lg in logits]
    z = sum(e)
    return sum((ei / z).unsqueeze(-1) * v for ei, v in zip(e, sources))


def glu_mlp_ref(x, w_gate_up, w_down):
    """SiTU-GLU MLP: the gate is the first half of the [gate, up] projection."""
    inter = w_gate_up.shape[0] // 2
    gu = x @ w_gate_up.T
    return situ_ref(gu[..., :inter], gu[..., inter:]) @ w_down.T


# ----------------------------------------------------------------------------------------------- KDA reference
class KDARef:
    """Section 4, literally: one sequence, one head at a time, float64."""

    def __init__(self, mod: KimiDeltaAttention):
        self.h, self.d = mod.heads, mod.head_dim
        self.P = self.h * self.d
        self.W = {n: f64(getattr(mod, n).weight) for n in
                  ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "f_b_proj", "b_proj", "o_proj")}
        self.conv_w = torch.cat([f64(mod.q_conv1d), f64(mod.k_conv1d), f64(mod.v_conv1d)])   # [3P, 4]
        self.A_log, self.dt_bias, self.o_norm = f64(mod.A_log), f64(mod.dt_bias), f64(mod.o_norm)

    def step(self, x, hist, S):
        """x [M, H]; hist[m] = [x_{t-3}, x_{t-2}, x_{t-1}] pre-conv [q|k|v] (oldest first), updated in place;
        S[m][h] = [V, K] state, updated in place. Returns y [M, H]."""
        W, d, P = self.W, self.d, self.P
        ys = []
        for m in range(x.shape[0]):
            xm = x[m]
            q0, k0, v0 = W["q_proj"] @ xm, W["k_proj"] @ xm, W["v_proj"] @ xm
            go = W["g_proj"] @ xm
            a = W["f_b_proj"] @ (W["f_a_proj"] @ xm)
            b = W["b_proj"] @ xm
            xt = torch.cat([q0, k0, v0])
            x3, x2, x1 = hist[m]
            cw = self.conv_w
            yc = silu(cw[:, 0] * x3 + cw[:, 1] * x2 + cw[:, 2] * x1 + cw[:, 3] * xt)
            hist[m] = [x2, x1, xt]
            q, k, v = yc[:P], yc[P:2 * P], yc[2 * P:]
            outs = []
            for hh in range(self.h):
                sl = slice(hh * d, (hh + 1) * d)
                g = -5.0 * sigmoid(torch.exp(self.A_log[hh]) * (a[sl] + self.dt_bias[sl]))
                beta = sigmoid(b[hh])
                qh = q[sl] / torch.sqrt((q[sl] ** 2).sum() + 1e-6) * d ** -0.5
                kh = k[sl] / torch.sqrt((k[sl] ** 2).sum() + 1e-6)
                Sh = S[m][hh] * torch.exp(g)[None, :]
                p = Sh @ kh
                u = beta * (v[sl] - p)
                Sh = Sh + torch.outer(u, kh)
                o = Sh @ qh                                   # read after the write
                S[m][hh] = Sh
                o = o / torch.sqrt((o ** 2).mean() + 1e-5) * self.o_norm
                outs.append(o * sigmoid(go[sl]))
            ys.append(W["o_proj"] @ torch.cat(outs))
        return torch.stack(ys)


def _kda_module(cfg, seed_scale=1.0):
    mod = KimiDeltaAttention(cfg, TP(None), torch.float32)
    randomize_(mod, seed_scale)
    with torch.no_grad():
        mod.A_log.uniform_(-1.5, 1.5)          # spread the decay over (e^-5, 1)
        mod.dt_bias.normal_(0, 1.0)
    return mod


@torch.no_grad()
def test_situ_glu_matches_spec_formula(seed):
    I = 37
    gu = torch.randn(5, 3, 2 * I, dtype=D64) * 12.0          # wide range: both tanh saturate somewhere
    out = situ_glu(gu, 4.0, 25.0)
    ref = situ_ref(gu[..., :I], gu[..., I:])
    assert out.shape == (5, 3, I) and out.dtype == D64
    assert rel(out, ref) < 1e-6
    # the gate is the FIRST half: swapping the halves must give something else
    assert rel(situ_glu(torch.cat([gu[..., I:], gu[..., :I]], -1), 4.0, 25.0), ref) > 0.1
    # bf16 in, bf16 out, fp32 inside
    gb = gu.to(torch.bfloat16)
    ob = situ_glu(gb, 4.0, 25.0)
    assert ob.dtype == torch.bfloat16
    assert rel(ob, situ_ref(f64(gb)[..., :I], f64(gb)[..., I:])) < 1e-2


@torch.no_grad()
def test_kda_single_step_from_random_state(seed):
    cfg = KimiK3Config.preset("tiny")
    mod = _kda_module(cfg)
    ref = KDARef(mod)
    M, h, d, P = 3, mod.heads, mod.head_dim, mod.P
    x = torch.randn(M, cfg.hidden_size)
    conv = torch.randn(M, 3, 3 * P)
    S = torch.randn(M, h, d, d) * 0.5
    hist = [[f64(conv[m, j]) for j in range(3)] for m in range(M)]
    S_ref = [[f64(S[m, hh]) for hh in range(h)] for m in range(M)]
    y_ref = ref.step(f64(x), hist, S_ref)
    y = mod(x, conv, S)
    assert y.shape == (M, cfg.hidden_size)
    assert rel(y, y_ref) < 2e-5
    assert rel(S, torch.stack([torch.stack(r) for r in S_ref])) < 2e-5
    assert rel(conv, torch.stack([torch.stack(r) for r in hist])) < 1e-6


@torch.no_grad()
def test_kda_multi_step_recurrence_and_conv_state(seed):
    cfg = KimiK3Config.preset("tiny")
    mod = _kda_module(cfg)
    ref = KDARef(mod)
    M, h, d, P, N = 2, mod.heads, mod.head_dim, mod.P, 6
    conv = torch.zeros(M, 3, 3 * P)            # a new sequence starts from zeros
    S = torch.zeros(M, h, d, d)
    hist = [[torch.zeros(3 * P, dtype=D64)] * 3 for _ in range(M)]
    S_ref = [[torch.zeros(d, d, dtype=D64) for _ in range(h)] for _ in range(M)]
    pre_conv = []                              # [q0 | k0 | v0] of every step, for the conv-state check
    for t in range(N):
        x = torch.randn(M, cfg.hidden_size)
        pre_conv.append(torch.cat([mod.q_proj(x), mod.k_proj(x), mod.v_proj(x)], -1))
        y = mod(x, conv, S)
        y_ref = ref.step(f64(x), hist, S_ref)
        assert rel(y, y_ref) < 3e-5, f"step {t}"
        assert rel(S, torch.stack([torch.stack(r) for r in S_ref])) < 3e-5, f"step {t}"
        # conv state = the last 3 PRE-conv inputs, oldest first (zeros before the first token)
        expect = [torch.zeros(M, 3 * P)] * max(0, 2 - t) + pre_conv[max(0, t - 2):]
        assert torch.equal(conv, torch.stack(expect, 1)), f"step {t}"
    # the state really carries information: a fresh state gives a different output for the same token
    x = torch.randn(M, cfg.hidden_size)
    y_carry = mod(x, conv.clone(), S.clone())
    y_fresh = mod(x, torch.zeros_like(conv), torch.zeros_like(S))
    assert rel(y_carry, y_fresh) > 1e-2


@torch.no_grad()
def test_kda_conv_orientation_flag_flips_the_taps(seed):
    """conv_newest_tap_last (UNCONFIRMED in the spec) = False is the same as reversed taps with it True."""
    cfg = KimiK3Config.preset("tiny")
    mod = _kda_module(cfg)
    flipped = KimiDeltaAttention(tiny(conv_newest_tap_last=False), TP(None), torch.float32)
    flipped.load_state_dict(mod.state_dict())
    for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
        getattr(flipped, n).copy_(getattr(mod, n).flip(-1))
    M, P = 2, mod.P
    x, conv, S = torch.randn(M, cfg.hidden_size), torch.randn(M, 3, 3 * P), torch.randn(M, mod.heads, 16, 16)
    y1 = mod(x, conv.clone(), S.clone())
    y2 = flipped(x, conv.clone(), S.clone())
    assert rel(y2, y1) < 1e-6
    for n in ("q_conv1d", "k_conv1d", "v_conv1d"):   # same taps, other orientation: a different output
        getattr(flipped, n).copy_(getattr(mod, n))
    assert rel(flipped(x, conv.clone(), S.clone()), y1) > 1e-2


# ----------------------------------------------------------------------------------------------- MLA reference
class MLARef:
    """Section 5 WITHOUT absorption: k_nope = W_UK c, v = W_UV c per token, ordinary softmax attention."""

    def __init__(self, mod: MultiLatentAttention, cfg: KimiK3Config):
        self.h, self.nope, self.rope, self.vd, self.r = (mod.heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                         cfg.v_head_dim, cfg.kv_lora_rank)
        self.Wqa, self.Wkva = f64(mod.q_a_proj.weight), f64(mod.kv_a_proj_with_mqa.weight)
        self.wqn, self.wkvn = f64(mod.q_a_layernorm.weight), f64(mod.kv_a_layernorm.weight)
        self.Wqb, self.Wkvb = f64(mod.q_b_proj.weight), f64(mod.kv_b_proj.weight)
        self.Wg, self.Wo = f64(mod.g_proj.weight), f64(mod.o_proj.weight)

    def step(self, x, hist):
        """x [M, H]; hist[m] = list of (c_t [512], kpe_t [64]) already cached; the new token is appended."""
        nope, rope, vd, r = self.nope, self.rope, self.vd, self.r
        ys = []
        for m in range(x.shape[0]):
            cq = rms_ref(self.Wqa @ x[m], self.wqn, 1e-6)
            ckv = self.Wkva @ x[m]
            hist[m].append((rms_ref(ckv[:r], self.wkvn, 1e-6), ckv[r:]))   # append BEFORE attending
            q = self.Wqb @ cq
            gate = sigmoid(self.Wg @ x[m])
            outs = []
            for hh in range(self.h):
                qh = q[hh * (nope + rope):(hh + 1) * (nope + rope)]            # [q_nope | q_pe]
                rows = self.Wkvb[hh * (nope + vd):(hh + 1) * (nope + vd)]
                W_UK, W_UV = rows[:nope], rows[nope:]
                keys = torch.stack([torch.cat([W_UK @ c, kpe]) for c, kpe in hist[m]])   # [T, 192]
                vals = torch.stack([W_UV @ c for c, _ in hist[m]])                     # [T, 128]
                s = keys @ qh / math.sqrt(nope + rope)
                p = torch.exp(s - s.max())
                p = p / p.sum()
                outs.append((p @ vals) * gate[hh * vd:(hh + 1) * vd])
            ys.append(self.Wo @ torch.cat(outs))
        return torch.stack(ys)


@torch.no_grad()
def test_mla_absorbed_equals_unabsorbed_over_decode_steps(seed):
    cfg = KimiK3Config.preset("tiny")
    mod = MultiLatentAttention(cfg, TP(None), torch.float32)
    randomize_(mod)
    ref = MLARef(mod, cfg)
    M, T, width = 3, 12, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    seq_lens = torch.tensor([0, 3, 7])
    # history rows hold random cached tokens; everything past seq_len is large garbage that must be masked
    cache = torch.randn(M, T, width) * 50.0
    hist = []
    for m in range(M):
        L = int(seq_lens[m])
        cache[m, :L] = torch.randn(L, width)
        hist.append([(f64(cache[m, t, :cfg.kv_lora_rank]), f64(cache[m, t, cfg.kv_lora_rank:])) for t in range(L)])
    for step in range(4):
        x = torch.randn(M, cfg.hidden_size)
        y = mod(x, cache, seq_lens)
        y_ref = ref.step(f64(x), hist)
        assert rel(y, y_ref) < 2e-5, f"step {step}"
        for m in range(M):   # the new token was written at position seq_len (before attending)
            L = int(seq_lens[m])
            c_new, kpe_new = hist[m][-1]
            assert rel(cache[m, L], torch.cat([c_new, kpe_new])) < 1e-6
        seq_lens = seq_lens + 1


# ----------------------------------------------------------------------------------------------- router / MoE
def router_ref(x, Wr, bias, k, scale=1.0):
    """Section 6: s = sigmoid(x W_r^T); ids = top-k of s + bias (choosing only); w = s[ids] / sum s[ids]."""
    ids, ws = [], []
    for m in range(x.shape[0]):
        s = sigmoid(Wr @ x[m])
        order = sorted(range(len(s)), key=lambda e: -(s[e] + bias[e]).item())[:k]
        sel = s[order]
        ids.append(order)
        ws.append(sel / sel.sum() * scale)
    return ids, ws


@torch.no_grad()
def test_router_bias_only_chooses(seed):
    cfg = tiny(routed_scaling_factor=2.5)
    router = Router(cfg, torch.float32)
    M, E, k = 4, cfg.num_experts, cfg.num_experts_per_token
    router.weight.copy_(torch.randn(E, cfg.hidden_size) * cfg.hidden_size ** -0.5 * 3)
    x = torch.randn(M, cfg.hidden_size)
    s = sigmoid(f64(x) @ f64(router.weight).T)
    # bias: small noise, plus a large push for the lowest-scored expert of row 0 and a large pull on its best
    bias = torch.randn(E) * 0.01
    lo, hi = int(s[0].argmin()), int(s[0].argmax())
    bias[lo] += 2.0
    bias[hi] -= 2.0
    router.e_score_correction_bias.copy_(bias)
    ids, w = router(x)
    ids_ref, w_ref = router_ref(f64(x), f64(router.weight), f64(bias), k, 2.5)
    unbiased_ids, _ = router_ref(f64(x), f64(router.weight), torch.zeros(E, dtype=D64), k)
    assert set(unbiased_ids[0]) != set(ids_ref[0]), "the bias must change row 0's selection"
    assert lo in ids[0].tolist() and hi not in ids[0].tolist()
    for m in range(M):
        got = dict(zip(ids[m].tolist(), w[m].tolist()))
        want = dict(zip(ids_ref[m], w_ref[m].tolist()))
        assert set(got) == set(want)
        for e in want:
            assert abs(got[e] - want[e]) < 1e-6 * 2.5
        assert abs(sum(got.values()) - 2.5) < 1e-5          # renormalised (then scaled) un-biased scores


class MoERef:
    def __init__(self, mod: LatentMoE, cfg: KimiK3Config):
        self.Wr, self.bias = f64(mod.gate.weight), f64(mod.gate.e_score_correction_bias)
        self.k, self.scale = cfg.num_experts_per_token, cfg.routed_scaling_factor
        self.Wdown, self.Wup = f64(mod.routed_expert_down_proj.weight), f64(mod.routed_expert_up_proj.weight)
        self.wnorm = f64(mod.routed_expert_norm.weight)
        self.w13, self.w2 = f64(mod.experts.w13_weight), f64(mod.experts.w2_weight)
        self.Wsgu = f64(mod.shared_experts.gate_up_proj.weight)
        self.Wsd = f64(mod.shared_experts.down_proj.weight)

    def __call__(self, x):
        ids, ws = router_ref(x, self.Wr, self.bias, self.k, self.scale)
        I = self.w2.shape[-1]
        out = []
        for m in range(x.shape[0]):
            z = self.Wdown @ x[m]
            r = torch.zeros_like(z)
            for e, w in zip(ids[m], ws[m]):
                h = self.w13[e] @ z
                r = r + w * (self.w2[e] @ situ_ref(h[:I], h[I:]))
            r = rms_ref(r, self.wnorm, 1e-5)
            out.append(self.Wup @ r + glu_mlp_ref(x[m], self.Wsgu, self.Wsd))
        return torch.stack(out)


@torch.no_grad()
def test_latent_moe_matches_per_token_per_expert_loop(seed):
    cfg = KimiK3Config.preset("tiny")
    mod = LatentMoE(cfg, TP(None), torch.float32)
    randomize_(mod, scale=2.0)
    mod.gate.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(5, cfg.hidden_size)
    y = mod(x)
    ref = MoERef(mod, cfg)(f64(x))
    assert y.shape == x.shape
    assert rel(y, ref) < 1e-5
    # the routed path matters: scaling routed_expert_norm's weight changes the output
    mod.routed_expert_norm.weight.mul_(2.0)
    assert rel(mod(x), ref) > 1e-3


# ----------------------------------------------------------------------------------------------- AttnRes bookkeeping
def attn_res_ref(emb, L, B, attn_fns, mlp_fns, w_attn, w_mlp, w_out, ln_in, ln_post, eps=1e-5, record=None):
    """Section 3 as an independent loop over layers. Returns h (the final mix, before the final norm)."""
    prefix, blocks, mlp_out = emb, [], None
    for l in range(L):
        nb, write = math.ceil(l / B), (l % B == 0)
        if l > 0:
            prefix = prefix + mlp_out                      # 1. the previous MLP output lands here
        if write:
            assert len(blocks) == l // B
            blocks.append(prefix)                          # 2. blocks[l / B] = prefix
        src = blocks[:nb] + [prefix]
        x = rms_ref(mix_ref(src, w_attn[l]), ln_in[l], eps)   # 3.
        a = attn_fns[l](x)
        prefix = a if write else prefix + a                # 4.
        src2 = blocks[:nb + int(write)] + [prefix]
        x2 = rms_ref(mix_ref(src2, w_mlp[l]), ln_post[l], eps)  # 5.
        mlp_out = mlp_fns[l](x2)
        if record is not None:
            record.append({"attn_src": src, "attn_in": x, "mlp_src": src2})
    prefix = prefix + mlp_out
    final_src = blocks + [prefix]
    if record is not None:
        record.append({"final_src": final_src})
    return mix_ref(final_src, w_out)


class StubAttn(nn.Module):
    """Stands in for KDA / MLA: y = tanh(x W^T), records its input."""

    def __init__(self, H):
        super().__init__()
        self.W = nn.Parameter(torch.randn(H, H) * H ** -0.5 * 1.5)
        self.seen = []

    def forward(self, x, *state):
        self.seen.append(x.clone())
        return torch.tanh(x @ self.W.T)


class StubMLP(nn.Module):
    def __init__(self, H):
        super().__init__()
        self.W = nn.Parameter(torch.randn(H, H) * H ** -0.5)

    def forward(self, x):
        return 0.7 * torch.sin(x @ self.W.T)


def _layers_cfg(L, B, H=32):
    full = [l for l in range(1, L + 1) if l % 3 == 0]
    kda = [l for l in range(1, L + 1) if l not in full]
    return tiny(num_hidden_layers=L, attn_res_block_size=B, hidden_size=H,
                linear_attn_config={"kda_layers": kda, "full_attn_layers": full})


@pytest.mark.parametrize("L,B", [(5, 1), (6, 2), (7, 2), (7, 3), (9, 3), (8, 4), (6, 4), (3, 4)])
@torch.no_grad()
def test_attn_res_bookkeeping_with_stub_layers(seed, L, B):
    cfg = _layers_cfg(L, B)
    model = KimiK3ForCausalLM(cfg).eval()
    H, M = cfg.hidden_size, 3
    cache = model.new_cache(M, 4)
    for layer in model.model.layers:
        layer.self_attn = StubAttn(H)
        layer.mlp = StubMLP(H)
    seen = {}   # what the model's three kinds of mix are given

    def hook(key):
        def pre(mod, args):
            seen.setdefault(key, []).append([t.clone() for t in args[0]])
        return pre

    for l, layer in enumerate(model.model.layers):
        layer.attn_res.register_forward_pre_hook(hook(("attn", l)))
        layer.mlp_res.register_forward_pre_hook(hook(("mlp", l)))
    model.model.final_res.register_forward_pre_hook(hook(("final", 0)))

    ids = torch.randint(0, cfg.vocab_size, (M,))
    logits = model(ids, cache)

    lay = model.model.layers
    emb = f64(model.model.embed_tokens.weight)[ids]
    rec = []
    h = attn_res_ref(
        emb, L, B,
        [lambda x, W=f64(l.self_attn.W): torch.tanh(x @ W.T) for l in lay],
        [lambda x, W=f64(l.mlp.W): 0.7 * torch.sin(x @ W.T) for l in lay],
        [f64(l.attn_res.res_norm.weight) * f64(l.attn_res.res_proj.weight).view(-1) for l in lay],
        [f64(l.mlp_res.res_norm.weight) * f64(l.mlp_res.res_proj.weight).view(-1) for l in lay],
        f64(model.model.final_res.res_norm.weight) * f64(model.model.final_res.res_proj.weight).view(-1),
        [f64(l.input_layernorm.weight) for l in lay], [f64(l.post_attention_layernorm.weight) for l in lay],
        record=rec)
    logits_ref = rms_ref(h, f64(model.model.norm.weight), 1e-5) @ f64(model.lm_head.weight).T

    assert len(seen[("final", 0)][0]) == math.ceil(L / B) + 1 == cfg.num_attn_res_blocks + 1
    for l in range(L):
        for kind in ("attn", "mlp"):
            got, want = seen[(kind, l)][0], rec[l][kind + "_src"]
            assert len(got) == len(want), (kind, l)
            for i, (g, w) in enumerate(zip(got, want)):
                assert rel(g, w) < 1e-5, (kind, l, i)
        assert rel(lay[l].self_attn.seen[0], rec[l]["attn_in"]) < 1e-5, l
    for g, w in zip(seen[("final", 0)][0], rec[-1]["final_src"]):
        assert rel(g, w) < 1e-5
    assert rel(logits, logits_ref) < 1e-5

    # layer 0, no completed block: the attention mix is the embedding itself (x = RMSNorm(embedding))
    assert len(seen[("attn", 0)][0]) == 1
    assert rel(lay[0].self_attn.seen[0], rms_ref(emb, f64(lay[0].input_layernorm.weight), 1e-5)) < 1e-6
    # block 0 is the embedding; block j > 0 is the prefix AFTER adding layer jB-1's MLP output, i.e. the
    # input prefix of layer jB (which is not the prefix that layer jB-1's MLP mix saw)
    blocks = seen[("final", 0)][0][:-1]
    assert rel(blocks[0], emb) < 1e-6
    for j in range(1, len(blocks)):
        assert rel(blocks[j], seen[("attn", j * B)][0][-1]) < 1e-6
        assert rel(blocks[j], seen[("mlp", j * B - 1)][0][-1]) > 1e-3


# ----------------------------------------------------------------------------------------------- whole model
class ModelRef:
    """The whole decode step composed from the references above (section 3 loop + sections 4-6)."""

    def __init__(self, model: KimiK3ForCausalLM, M: int):
        cfg = model.config
        self.cfg, self.lay = cfg, model.model.layers
        self.emb = f64(model.model.embed_tokens.weight)
        self.head, self.fnorm = f64(model.lm_head.weight), f64(model.model.norm.weight)
        self.w_out = f64(model.model.final_res.res_norm.weight) * f64(model.model.final_res.res_proj.weight).view(-1)
        self.attn, self.mlp, self.state = [], [], []
        for l, layer in enumerate(self.lay):
            a = layer.self_attn
            if layer.kind == "kda":
                P, h, d = a.P, a.heads, a.head_dim
                self.attn.append(KDARef(a))
                self.state.append(([[torch.zeros(3 * P, dtype=D64)] * 3 for _ in range(M)],
                                   [[torch.zeros(d, d, dtype=D64) for _ in range(h)] for _ in range(M)]))
            else:
                self.attn.append(MLARef(a, cfg))
                self.state.append([[] for _ in range(M)])
            if l == 0:
                Wgu, Wd = f64(layer.mlp.mlp.gate_up_proj.weight), f64(layer.mlp.mlp.down_proj.weight)
                self.mlp.append(lambda x, Wgu=Wgu, Wd=Wd: glu_mlp_ref(x, Wgu, Wd))
            else:
                self.mlp.append(MoERef(layer.mlp, cfg))

    def step(self, ids):
        fns = []
        for l, layer in enumerate(self.lay):
            if layer.kind == "kda":
                fns.append(lambda x, l=l: self.attn[l].step(x, *self.state[l]))
            else:
                fns.append(lambda x, l=l: self.attn[l].step(x, self.state[l]))
        w = lambda r: f64(r.res_norm.weight) * f64(r.res_proj.weight).view(-1)
        h = attn_res_ref(self.emb[ids], self.cfg.num_hidden_layers, self.cfg.attn_res_block_size, fns, self.mlp,
                         [w(l.attn_res) for l in self.lay], [w(l.mlp_res) for l in self.lay], self.w_out,
                         [f64(l.input_layernorm.weight) for l in self.lay],
                         [f64(l.post_attention_layernorm.weight) for l in self.lay])
        return rms_ref(h, self.fnorm, 1e-5) @ self.head.T


@torch.no_grad()
def test_whole_model_matches_composed_reference(seed):
    cfg = KimiK3Config.preset("tiny")
    model = KimiK3ForCausalLM(cfg)
    M, steps = 3, 3
    ref = ModelRef(model, M)
    cache = model.new_cache(M, 8)
    for t in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (M,))
        logits = model(ids, cache)
        assert logits.shape == (M, cfg.vocab_size) and logits.dtype == torch.float32
        assert cache.seq_lens.tolist() == [t + 1] * M
        assert rel(logits, ref.step(ids)) < 1e-5, f"step {t}"


@torch.no_grad()
def test_whole_model_deterministic_and_bf16(seed):
    cfg = KimiK3Config.preset("tiny")
    M = 3
    ids = [torch.randint(0, cfg.vocab_size, (M,)) for _ in range(2)]

    def run(s, dtype=torch.float32):
        torch.manual_seed(s)
        model = KimiK3ForCausalLM(cfg, dtype=dtype)
        cache = model.new_cache(M, 4)
        out = [model(i, cache) for i in ids]
        return model, cache, torch.stack(out)

    m1, c1, l1 = run(seed)
    m2, _, l2 = run(seed)
    for (n, p), (_, q) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(p, q), n
    assert torch.equal(l1, l2)
    assert c1.seq_lens.tolist() == [2] * M
    assert l1.shape == (2, M, cfg.vocab_size) and torch.isfinite(l1).all()
    _, _, l3 = run(seed + 1)
    assert rel(l3, l1) > 0.1

    mb, cb, lb = run(seed, torch.bfloat16)
    assert lb.dtype == torch.bfloat16 and torch.isfinite(lb.float()).all()
    assert cb.conv_state[0].dtype == torch.bfloat16 and cb.recurrent_state[0].dtype == torch.float32
    assert cb.latent_cache[3].dtype == torch.bfloat16
    assert mb.model.layers[0].self_attn.A_log.dtype == torch.float32
    assert mb.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32

    # bf16 vs fp32 with the same (rounded) weights. With top-3 of 8 a bf16 rounding can flip an expert choice
    # (a discrete jump in the output), so compare where every expert is chosen.
    cfg = tiny(num_experts_per_token=cfg.num_experts)
    _, _, l32 = run(seed)
    _, _, l16 = run(seed, torch.bfloat16)
    assert rel(l16, l32) < 0.15


@torch.no_grad()
def test_forward_rejects_non_1d_ids():
    model = KimiK3ForCausalLM(KimiK3Config.preset("tiny"))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(2, 1, dtype=torch.long), model.new_cache(2, 4))


class _FakeDist:
    """Stands in for torch.distributed so that TP(group) sees rank 0 of `size` (construction only)."""

    def __init__(self, size):
        self.size = size

    def get_rank(self, group):
        return 0

    def get_world_size(self, group):
        return self.size


@pytest.mark.parametrize("over,tp,field", [
    ({}, 3, "num_heads"),
    ({"linear_attn_config": {"num_heads": 6}, "num_attention_heads": 6}, 3, "moe_intermediate_size"),
    ({}, 8, "num_heads"),
    ({"vocab_size": 510}, 4, "vocab_size"),
])
def test_tp_size_that_does_not_divide_raises_at_construction(monkeypatch, over, tp, field):
    import k3fuse.models.modeling_kimi_k3 as mk
    monkeypatch.setattr(mk, "dist", _FakeDist(tp))
    with pytest.raises(ValueError, match=f"{field}.*does not divide by tensor-parallel size {tp}"):
        KimiK3ForCausalLM(tiny(**over), tp_group=object())


# ----------------------------------------------------------------------------------------------- config
def test_config_defaults_and_from_dict():
    c = KimiK3Config.from_dict({})
    assert c == KimiK3Config()
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size, c.rms_norm_eps) == (7168, 93, 163840, 1e-5)
    assert not c.tie_word_embeddings
    assert (c.num_kda_heads, c.kda_head_dim, c.kda_proj_size, c.conv_kernel_size) == (96, 128, 12288, 4)
    assert c.kda_gate_lower_bound == -5.0
    assert (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
            c.v_head_dim, c.qk_head_dim) == (96, 1536, 512, 128, 64, 128, 192)
    assert (c.num_experts, c.num_experts_per_token, c.routed_expert_hidden_size, c.moe_intermediate_size,
            c.shared_intermediate_size, c.intermediate_size, c.routed_scaling_factor) == \
        (896, 16, 3584, 3072, 6144, 33792, 1.0)
    assert c.attn_res_block_size == 12
    assert c.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="unknown"):
        KimiK3Config.from_dict({"hidden_sise": 8})
    with pytest.raises(ValueError, match="preset"):
        KimiK3Config.preset("k4")


def test_preset_k3_facts():
    c = KimiK3Config.preset("k3")
    kinds = [c.layer_kind(l) for l in range(93)]
    mla = [l for l, k in enumerate(kinds) if k == "mla"]
    assert mla == list(range(3, 92, 4)) + [92] and len(mla) == 24
    assert kinds.count("kda") == 69
    assert kinds[91] == kinds[92] == "mla"
    assert c.num_attn_res_blocks == 8
    assert not c.is_moe_layer(0) and all(c.is_moe_layer(l) for l in range(1, 93))
    assert sorted(c.linear_attn_config["full_attn_layers"]) == [l + 1 for l in mla]   # stored 1-based


def test_preset_tiny_has_every_structural_feature():
    c = KimiK3Config.preset("tiny")
    kinds = {c.layer_kind(l) for l in range(c.num_hidden_layers)}
    assert kinds == {"kda", "mla"}
    assert c.num_hidden_layers > c.attn_res_block_size and c.num_attn_res_blocks >= 2     # a block boundary
    assert not c.is_moe_layer(0) and c.is_moe_layer(c.num_hidden_layers - 1)
    assert c.num_shared_experts > 0 and c.num_experts_per_token < c.num_experts
    assert c.routed_expert_hidden_size < c.hidden_size                                    # a real latent
    assert c.hidden_size < 256 and c.vocab_size <= 1024


@pytest.mark.parametrize("lac,match", [
    ({"kda_layers": [1, 2, 3, 4, 5], "full_attn_layers": [4, 6]}, "both"),        # layer 4 twice
    ({"kda_layers": [1, 2, 3], "full_attn_layers": [4, 6]}, "missing"),          # layer 5 missing
    ({"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4, 6, 7]}, "out of range"),
    ({"kda_layers": [0, 1, 2, 3, 5], "full_attn_layers": [4, 6]}, "out of range"),  # 0 is not 1-based
])
def test_inconsistent_layer_lists_are_clear_errors(lac, match):
    with pytest.raises(ValueError, match=match):
        tiny(linear_attn_config=lac)


def test_layer_count_without_matching_lists_is_an_error():
    with pytest.raises(ValueError, match="linear_attn_config"):
        KimiK3Config.from_dict({"num_hidden_layers": 10})
