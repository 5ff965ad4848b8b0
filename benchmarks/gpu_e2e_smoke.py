"""End-to-end smoke on one GPU: the K3 decode step compiled by k3fuse (generated kernels on) vs eager, in bf16,
over several decode steps, then replayed as a CUDA graph.

    python3 benchmarks/gpu_e2e_smoke.py [--out DIR] [--configs tiny,wide,wide_all,k3tp16] [--ms 1,8] [--steps 16]

Configs: "tiny" (every structural feature; widths too small for most kernels: exercises the fallbacks) and
"wide" (tiny's structure at hidden 1024 with K3-like per-rank projection widths, so the GEMV and fused
residual-norm kernels run), "wide_all" (wide with every expert chosen: no top-k flips from bf16 rounding), and "k3tp16" (K3's per-rank widths at
TP16 in 4 layers, both layer kinds and a block boundary). Prints one table row per (config, M) and writes JSON under --out.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch

from k3fuse.models import KimiK3Config, KimiK3ForCausalLM
from k3fuse.models.config import PRESETS

WIDE = {**PRESETS["tiny"], "hidden_size": 1024, "vocab_size": 4096,
        "linear_attn_config": {**PRESETS["tiny"]["linear_attn_config"], "num_heads": 8, "head_dim": 128},
        "num_attention_heads": 8, "q_lora_rank": 256, "kv_lora_rank": 128, "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32, "v_head_dim": 64, "routed_expert_hidden_size": 512, "moe_intermediate_size": 256,
        "intermediate_size": 1024}


# K3's per-rank widths at TP16 (hidden 7168, 6 KDA / MLA heads, expert width 192, dense MLP 1152, q/kv LoRA and
# latent experts full) in 4 layers: dense layer 0, KDA, MLA, KDA, AttnRes blocks of 2 (a boundary at layer 2).
# 128 experts instead of 896 (top-16 kept) so that the CPU init stays short; the expert kernels see K3's widths.
def k3_tp16_4layers():
    d = KimiK3Config().to_dict()
    d["linear_attn_config"] = {**d["linear_attn_config"], "num_heads": 6, "kda_layers": [1, 2, 4],
                               "full_attn_layers": [3]}
    d.update(num_hidden_layers=4, attn_res_block_size=2, vocab_size=8192, num_attention_heads=6,
             moe_intermediate_size=3072 // 16, intermediate_size=18432 // 16, num_experts=128)
    return d


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _copy_state(dst, src):
    for d, s_ in zip(dst.conv_state + dst.recurrent_state + dst.latent_cache,
                     src.conv_state + src.recurrent_state + src.latent_cache):
        if d is not None:
            d.copy_(s_)
    dst.seq_lens.copy_(src.seq_lens)


@torch.no_grad()
def run(name, cfg, M, steps=16, inner="eager", baseline=False):
    """Compiled (bf16) vs eager (bf16) over `steps` decode steps; both also against the same weights in fp32 eager,
    so that a compiled-vs-eager gap can be told apart from bf16 noise that eager has as well."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(cfg, dtype=torch.bfloat16).cuda().requires_grad_(False)
    m32 = KimiK3ForCausalLM(cfg, dtype=torch.float32).cuda().requires_grad_(False)
    m32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    compiled = torch.compile(model, backend="k3fuse", fullgraph=True, dynamic=False,
                             options={"inner_compiler": inner})
    ce, cc, c32 = model.new_cache(M, 64), model.new_cache(M, 64), m32.new_cache(M, 64)
    ct = model.new_cache(M, 64)     # teacher-forced: eager's state copied in before every compiled step
    # baseline: plain torch.compile (Inductor) teacher-forced the same way, for the bf16 noise of any compiler
    ind = torch.compile(model, fullgraph=True, dynamic=False) if baseline else None
    ci, base = (model.new_cache(M, 64) if baseline else None), []
    g = torch.Generator().manual_seed(1)
    errs, errs32, eager32, forced, same, same_forced = [], [], [], [], True, True
    agree = {"forced": [], "eager_bf16_vs_fp32": []}      # argmax agreement per row and step
    gaps = []       # for a forced mismatch: eager's logit gap between its argmax and the compiled one, in logit stds
    t0 = time.perf_counter()
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (M,), generator=g).cuda()
        _copy_state(ct, ce)
        if ind is not None:
            _copy_state(ci, ce)
        a, b, f, t = model(ids, ce), compiled(ids, cc), m32(ids, c32), compiled(ids, ct)
        if ind is not None:
            base.append(rel(ind(ids, ci), a))
        errs.append(rel(b, a))
        errs32.append(rel(b, f))
        eager32.append(rel(a, f))
        forced.append(rel(t, a))
        ia, it = a.argmax(-1), t.argmax(-1)
        same &= bool(torch.equal(ia, b.argmax(-1)))
        same_forced &= bool(torch.equal(ia, it))
        agree["forced"] += (ia == it).tolist()
        agree["eager_bf16_vs_fp32"] += (ia == f.argmax(-1)).tolist()
        af = a.float()
        for r in (ia != it).nonzero().flatten().tolist():
            gaps.append(((af[r, ia[r]] - af[r, it[r]]) / af[r].std()).item())
    del m32, c32
    compile_s = time.perf_counter() - t0
    # CUDA graph: capture one compiled step on a copy of the state, replay, compare with eager
    static_ids = torch.randint(0, cfg.vocab_size, (M,), generator=g).cuda()
    snap = [t.clone() if t is not None else None for t in cc.conv_state + cc.recurrent_state + cc.latent_cache]
    lens = cc.seq_lens.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        compiled(static_ids, cc)                      # warm the graph's exact inputs
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(static_ids, cc)
    for t, v in zip(cc.conv_state + cc.recurrent_state + cc.latent_cache, snap):
        if t is not None:
            t.copy_(v)
    cc.seq_lens.copy_(lens)
    out.fill_(float("nan"))                           # poison: the replay must write it
    graph.replay()
    ref = model(static_ids, ce)
    torch.cuda.synchronize()
    graph_err = rel(out, ref)
    # replay timing (median of 20), same state each time is fine for a smoke timing
    ts = []
    for _ in range(20):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return {"config": name, "M": M, "inner": inner, "steps": steps, "max_rel_err": max(errs),
            "max_rel_err_vs_fp32": max(errs32), "eager_bf16_max_rel_err_vs_fp32": max(eager32),
            "forced_max_rel_err": max(forced),
            "inductor_forced_max_rel_err": max(base) if base else None, "forced_argmax_equal": same_forced, "argmax_equal": same, "graph_rel_err": graph_err,
            "forced_argmax_agree": sum(agree["forced"]) / len(agree["forced"]),
            "eager_bf16_vs_fp32_argmax_agree": sum(agree["eager_bf16_vs_fp32"]) / len(agree["eager_bf16_vs_fp32"]),
            "forced_mismatch_max_gap_std": max(gaps) if gaps else 0.0,
            "graph_replay_us": sorted(ts)[len(ts) // 2], "compile_s": round(compile_s, 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--configs", default="tiny,wide,wide_all,k3tp16")
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--inner", default="eager", choices=["eager", "inductor"])
    ap.add_argument("--baseline", action="store_true", help="also plain Inductor, teacher-forced (bf16 noise)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    rows = []
    # wide_all: every expert chosen, so bf16 rounding differences cannot flip a top-k choice
    wide_all = {**WIDE, "num_experts_per_token": WIDE["num_experts"]}
    configs = {"tiny": PRESETS["tiny"], "wide": WIDE, "wide_all": wide_all, "k3tp16": k3_tp16_4layers()}
    for name in args.configs.split(","):
        for M in map(int, args.ms.split(",")):
            try:
                rows.append(run(name, KimiK3Config.from_dict(configs[name]), M, args.steps, args.inner, args.baseline))
            except Exception as e:  # keep going: one table with every outcome
                rows.append({"config": name, "M": M, "error": f"{type(e).__name__}: {e}"[:300]})
            print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_e2e_smoke.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)
    # forced: every compiled step starts from eager's state (per-step error); free-running: vs eager, vs fp32
    print(f"\n{'config':<8} {'M':>3} {'forced':>9} {'f.argmax=':>9} {'vs eager':>9} {'vs fp32':>9} {'eager/fp32':>10} "
          f"{'argmax=':>8} {'graph err':>10} {'replay us':>10} {'inductor forced':>15} {'f.agree':>8} "
          f"{'bf16/fp32 agree':>15} {'gap/std':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['config']:<8} {r['M']:>3} ERROR {r['error']}")
        else:
            print(f"{r['config']:<8} {r['M']:>3} {r['forced_max_rel_err']:>9.2e} {str(r['forced_argmax_equal']):>9} "
                  f"{r['max_rel_err']:>9.2e} {r['max_rel_err_vs_fp32']:>9.2e} "
                  f"{r['eager_bf16_max_rel_err_vs_fp32']:>10.2e} {str(r['argmax_equal']):>8} "
                  f"{r['graph_rel_err']:>10.2e} {r['graph_replay_us']:>10.1f} "
                  f"{r['inductor_forced_max_rel_err'] or float('nan'):>15.2e} {r['forced_argmax_agree']:>8.3f} "
                  f"{r['eager_bf16_vs_fp32_argmax_agree']:>15.3f} {r['forced_mismatch_max_gap_std']:>8.3f}")


if __name__ == "__main__":
    main()
