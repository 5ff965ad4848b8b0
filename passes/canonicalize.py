"""Canonicalization: rewrite the model's ATen computations into k3fuse ops, so that fusion passes match on a
small stable op set instead of on PyTorch's decompositions (which change between releases).

Fires everywhere in K3: every RMSNorm (input/post-attention norms, MLA LoRA norms, routed_expert_norm, final
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
_EPS, _BETA, _LBETA, _TOPK, _SCALE = 1e-5, 4.0, 25.0, 2, 1.25   # trace-time stand-ins for pattern scalars


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


@functools.lru_cache(maxsize=None)
def _patterns(dt: torch.dtype, topks: tuple[int, ...]) -> tuple[PatternMatcherPass, PatternMatcherPass]:
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
    for i, o in {(dt, dt), (torch.float32, dt), (torch.float32, torch.float32)}:
        s, r = _rms_pattern(o)
        reg(s, r, [_t(3, 16, dtype=i), _t(16, dtype=o), _EPS], pass_dicts=second, scalar_workaround={"eps": _EPS})
    return first, second


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
        first, second = _patterns(activation_dtype(graph), topks)
        return first.apply(graph) + second.apply(graph)
