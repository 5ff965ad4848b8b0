"""Canonicalization: rewrite the model's ATen computations into k3fuse ops, so that fusion passes match on a
small stable op set instead of on PyTorch's decompositions (which change between releases).

Fires everywhere in K3: the KDA recurrence (decay gate, beta, L2 norms, delta rule; the causal conv stays ATen),
the MLA absorbed decode attention over the latent cache, the routed latent experts, every RMSNorm (input/post-attention norms, MLA LoRA norms, routed_expert_norm, final
norm, the KDA per-head output norm), every bias-free nn.Linear, every AttnRes depth mix with 2 or more sources,
every SiTU-GLU, and the MoE router (sigmoid + correction-bias top-k + renormalisation).

Patterns are traced from tiny example inputs with the same decomposition table the backend captures with
(Inductor's), as vLLM does; scalars (eps, SiTU betas, top-k, routed scale) are pattern arguments.
"""
from __future__ import annotations

import functools

import torch
import torch.fx as fx
from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement

import k3fuse.ops  # noqa: F401  (defines torch.ops.k3fuse)

from .base import K3FusePass, PassContext

MAX_MIX_SOURCES = 12          # K3 has at most 8 block snapshots + the prefix; leave headroom for other configs
_EPS, _BETA, _LBETA, _TOPK, _SCALE, _LOWER = 1e-5, 4.0, 25.0, 2, 1.25, -5.0   # trace-time stand-ins for scalars


def _t(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype)


# ---- search / replace functions: the model's math, literally, and the k3fuse op that replaces it
def _rms_pattern(out_dtype):
    def search(x, w, eps):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return y.to(out_dtype) * w

    def replace(x, w, eps):
        return torch.ops.k3fuse.rms_norm(x, w, eps, out_dtype)
    return search, replace


def _linear_pattern():
    def search(x, w):
        return torch.nn.functional.linear(x, w)

    def replace(x, w):
        return torch.ops.k3fuse.linear(x, w)
    return search, replace


def _mix_pattern(n):
    def search(*args):
        *sources, w, eps = args
        v = torch.stack(list(sources), dim=1).float()
        logits = (v * w).sum(-1) * torch.rsqrt(v.pow(2).mean(-1) + eps)
        alpha = torch.softmax(logits, dim=1)
        return (alpha.unsqueeze(-1) * v).sum(1)

    def replace(*args):
        *sources, w, eps = args
        return torch.ops.k3fuse.attnres_mix(list(sources), w, eps)
    # register_replacement needs named parameters
    names = [f"s{i}" for i in range(n)] + ["w", "eps"]
    return _named(search, names), _named(replace, names)


def _named(fn, names):
    src = f"def f({', '.join(names)}):\n    return fn({', '.join(names)})\n"
    scope = {"fn": fn}
    exec(src, scope)
    return scope["f"]


def _situ_pattern():
    def search(gate_up, beta, lbeta):
        g, u = gate_up.float().chunk(2, dim=-1)
        s = beta * torch.tanh(g / beta) * torch.sigmoid(g)
        return (s * (lbeta * torch.tanh(u / lbeta))).to(gate_up.dtype)

    def replace(gate_up, beta, lbeta):
        return torch.ops.k3fuse.situ_glu(gate_up, beta, lbeta)
    return search, replace


def _router_pattern(renorm: bool, k: int):
    def search(x, weight, bias, scale):
        scores = torch.sigmoid(torch.nn.functional.linear(x.float(), weight.float()))
        ids = torch.topk(scores + bias.float(), k, dim=-1).indices
        w = scores.gather(1, ids)
        if renorm:
            w = w / w.sum(-1, keepdim=True)
        return ids, w * scale

    def replace(x, weight, bias, scale):
        return torch.ops.k3fuse.router_topk(x, weight, bias, k, renorm, scale)
    return search, replace


def _kda_pattern():
    """Steps 3-6 of the KDA decode step, as the model writes them (the state write is the returned St)."""
    def search(q, k, v, a, dt_bias, A_log, b, S, lower):
        M, h, d = q.shape
        g = lower * torch.sigmoid(A_log.float().exp().view(1, h, 1) * (a.float() + dt_bias.float()).view(M, h, d))
        beta = torch.sigmoid(b.float())
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * d ** -0.5
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        St = S * g.exp().unsqueeze(2)
        p = (St * k.unsqueeze(2)).sum(-1)
        u = beta.unsqueeze(-1) * (v - p)
        St = St + u.unsqueeze(-1) * k.unsqueeze(2)
        return (St * q.unsqueeze(2)).sum(-1), St

    def replace(q, k, v, a, dt_bias, A_log, b, S, lower):
        return torch.ops.k3fuse.kda_recurrent(q, k, v, a, dt_bias, A_log, b, S, lower)
    return search, replace


def _mla_pattern(shared_latent: bool):
    """MLA absorbed attention over the (already appended) latent cache, up to o before the output gate.
    Functionalization replays a view per use, so in an fp32 graph (no cast) each use of the latent has its own
    slice of the cache, while a cast (bf16) is one node with two users: one variant each."""
    def search(q_nope, q_pe, cache, kv_b, seq_lens, scale):
        M, h, n = q_nope.shape
        C = kv_b.shape[1]
        c, kpe = cache[..., :C].float(), cache[..., C:].float()
        c2 = c if shared_latent else cache[..., :C].float()
        w_kv = kv_b.view(h, kv_b.shape[0] // h, C).float()
        w_uk, w_uv = w_kv[:, :n], w_kv[:, n:]
        q_lat = torch.einsum("mhn,hnc->mhc", q_nope.float(), w_uk)
        s = (torch.einsum("mhc,mtc->mht", q_lat, c) + torch.einsum("mhr,mtr->mht", q_pe.float(), kpe)) * scale
        T = cache.shape[1]
        valid = torch.arange(T, device=cache.device).view(1, 1, T) <= seq_lens.view(M, 1, 1)
        p = torch.softmax(s.masked_fill(~valid, float("-inf")), dim=-1)
        o_lat = torch.einsum("mht,mtc->mhc", p, c2)
        return torch.einsum("mhc,hvc->mhv", o_lat, w_uv)

    def replace(q_nope, q_pe, cache, kv_b, seq_lens, scale):
        return torch.ops.k3fuse.mla_attention(q_nope, q_pe, cache, kv_b, seq_lens, scale)
    return search, replace


def _experts_pattern():
    """Routed latent experts: gathered per-token weights, SiTU-GLU, weighted fp32 combine."""
    def search(z, ids, w, w13, w2, beta, lbeta):
        h = torch.einsum("md,mkid->mki", z, w13[ids])
        g, u = h.float().chunk(2, dim=-1)
        s = beta * torch.tanh(g / beta) * torch.sigmoid(g)
        a = (s * (lbeta * torch.tanh(u / lbeta))).to(h.dtype)
        y = torch.einsum("mki,mkdi->mkd", a, w2[ids])
        return (y.float() * w.unsqueeze(-1)).sum(1).to(z.dtype)

    def replace(z, ids, w, w13, w2, beta, lbeta):
        return torch.ops.k3fuse.moe_experts(z, ids, w, w13, w2, beta, lbeta)
    return search, replace


def _block_patterns(dt: torch.dtype) -> PatternMatcherPass:
    """Round 0: whole blocks (KDA recurrence, MLA attention, routed experts), before their parts are taken."""
    blocks = PatternMatcherPass(pass_name="k3fuse_canon_0")
    reg = functools.partial(register_replacement, trace_fn=fwd_only, skip_duplicates=True)
    M, h, d = 3, 2, 8
    s, r = _kda_pattern()
    reg(s, r, [_t(M, h, d), _t(M, h, d), _t(M, h, d), _t(M, h * d, dtype=dt), _t(h * d), _t(h), _t(M, h, dtype=dt),
               _t(M, h, d, d), _LOWER], pass_dicts=blocks, scalar_workaround={"lower": _LOWER})
    q = _t(M, h, 12, dtype=dt)       # q_nope / q_pe are slices of one projection
    for shared in (True, False):
        s, r = _mla_pattern(shared)
        reg(s, r, [q[..., :8], q[..., 8:], _t(M, 5, 12, dtype=dt), _t(h * 16, 8, dtype=dt),
                   torch.zeros(M, dtype=torch.int64), _SCALE], pass_dicts=blocks, scalar_workaround={"scale": _SCALE})
    s, r = _experts_pattern()
    reg(s, r, [_t(M, 6, dtype=dt), torch.zeros(M, 2, dtype=torch.int64), _t(M, 2), _t(4, 10, 6, dtype=dt),
               _t(4, 6, 5, dtype=dt), _BETA, _LBETA], pass_dicts=blocks,
        scalar_workaround={"beta": _BETA, "lbeta": _LBETA})
    return blocks


@functools.lru_cache(maxsize=None)
def _patterns(dt: torch.dtype, topks: tuple[int, ...]) -> tuple[PatternMatcherPass, ...]:
    """Patterns for a graph whose activations are `dt` (fp32 math inside). Two rounds: composite patterns first
    (router, mix, SiTU), then the ones they contain (linear, norm). The matcher ignores dtype arguments in
    its first match and re-checks by re-tracing, so one graph dtype per pattern set keeps the replacements'
    dtypes right."""
    first, second = PatternMatcherPass(pass_name="k3fuse_canon_1"), PatternMatcherPass(pass_name="k3fuse_canon_2")
    reg = functools.partial(register_replacement, trace_fn=fwd_only, skip_duplicates=True)
    for shape in [(3, 10), (3, 2, 10)]:            # dense MLP [M, 2I] and experts [M, k, 2I]
        s, r = _situ_pattern()
        reg(s, r, [_t(*shape, dtype=dt), _BETA, _LBETA], pass_dicts=first,
            scalar_workaround={"beta": _BETA, "lbeta": _LBETA})
    for n in range(2, MAX_MIX_SOURCES + 1):
        s, r = _mix_pattern(n)
        reg(s, r, [_t(3, 16, dtype=dt) for _ in range(n)] + [_t(16), _EPS], pass_dicts=first,
            scalar_workaround={"eps": _EPS})
    for k in topks:
        for renorm in (True, False):
            s, r = _router_pattern(renorm, k)
            ex = [_t(3, 16, dtype=dt), _t(max(8, k + 1), 16, dtype=dt), _t(max(8, k + 1)), _SCALE]
            reg(s, r, ex, pass_dicts=first, scalar_workaround={"scale": _SCALE}, extra_check=_topk_is(k))
    s, r = _linear_pattern()
    reg(s, r, [_t(3, 16, dtype=dt), _t(8, 16, dtype=dt)], pass_dicts=second)
    # ordered (a set's order changes between processes): bf16 -> bf16 first, so a norm over a mix rounded to bf16
    # (HF's variant) takes the rounding as part of its input rather than leaving it outside
    for i, o in dict.fromkeys([(dt, dt), (torch.float32, dt), (torch.float32, torch.float32)]):
        s, r = _rms_pattern(o)
        reg(s, r, [_t(3, 16, dtype=i), _t(16, dtype=o), _EPS], pass_dicts=second, scalar_workaround={"eps": _EPS})
    return _block_patterns(dt), first, second


def activation_dtype(graph: fx.Graph) -> torch.dtype:
    """The graph's activation dtype: the most common dtype of its 2-D+ floating-point inputs (the weights)."""
    import collections
    c = collections.Counter()
    for n in graph.nodes:
        v = n.meta.get("val") if n.op == "placeholder" else None
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 2:
            c[v.dtype] += 1
    return c.most_common(1)[0][0] if c else torch.float32


def _topk_is(k):
    def check(match):
        return all(n.args[1] == k for n in match.nodes if n.target == torch.ops.aten.topk.default)
    return check


class Canonicalize(K3FusePass):
    name = "canonicalize"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        topks = tuple(sorted({n.args[1] for n in graph.nodes if n.target == torch.ops.aten.topk.default}))
        return sum(p.apply(graph) for p in _patterns(activation_dtype(graph), topks))
