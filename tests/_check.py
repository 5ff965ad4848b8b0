"""Shared checks: rel (the GPU tests poison outputs with NaN before a kernel runs), entries (a compiled module's PTX
by kernel), ptxas_report (ptxas's registers and spills by kernel) and compiled_steps (the tiny K3 compiled with chosen
passes, a few decode steps)."""
import re

import torch


def rel(out, ref):
    """Relative error in fp64; fails first if any output is non-finite (unwritten NaN poison included)."""
    out = out.double()
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    return ((out - ref.double()).norm() / ref.double().norm()).item()


def entries(ptx):
    """{kernel name (as in the template: split_kernel, combine_mma_kernel, ...): body} of the PTX's entry functions."""
    out = {}
    for p in re.split(r"\.visible \.entry ", ptx)[1:]:
        name = re.match(r"kernel_cutlass_([a-z0-9_]+?_kernel)", p)
        out[name.group(1) if name else p[:40]] = p
    return out


def ptxas_report(src, name, arch, tmp_path, capfd):
    """{entry (split_kernel, down_mma_kernel, ...): (registers, spill store bytes, spill load bytes)} from ptxas's
    remarks when the rendered source is compiled for arch (a module named `name` under tmp_path). A name seen
    several times (ptxas may report an entry more than once) keeps its last report."""
    import cutlass.cute as cute
    from k3fuse.codegen import compile as kcompile
    mod = kcompile._import_source(src, name, tmp_path)
    capfd.readouterr()
    cute.compile(mod.ENTRY, *mod.fake_args(), options=f"--gpu-arch {arch} --enable-tvm-ffi remarks{{ptx}}")
    out = "".join(capfd.readouterr())
    rep = {}
    for seg in out.split("Compiling entry function")[1:]:
        m = re.search(r"kernel_cutlass_([a-z0-9_]+?_kernel)", seg[:400])
        regs = re.search(r"Used (\d+) registers", seg)
        sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", seg)
        assert m and regs and sp, seg[:1000]
        rep[m.group(1)] = (int(regs.group(1)), int(sp.group(1)), int(sp.group(2)))
    assert rep, out[-2000:]
    return rep


def compiled_steps(cfg, dtype, M=3, steps=2, seed=0, **options):
    """Compile KimiK3ForCausalLM(cfg) with backend="k3fuse" (inner compiler "eager" unless options say otherwise)
    and decode `steps` random tokens for M sequences. Returns (logits [steps, M, V], cache, the pipeline summary)."""
    from k3fuse.backend import LAST_PIPELINES
    from k3fuse.models import KimiK3ForCausalLM
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = KimiK3ForCausalLM(cfg, dtype=dtype).requires_grad_(False)
    compiled = torch.compile(model, backend="k3fuse", fullgraph=True,
                             options={"inner_compiler": "eager", **options})
    cache = model.new_cache(M, 8)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        out = torch.stack([compiled(torch.randint(0, cfg.vocab_size, (M,), generator=g), cache)
                           for _ in range(steps)])
    return out, cache, LAST_PIPELINES[-1].summary


def lower_with_kernels(gm, monkeypatch, with_kernel, op, applies):
    """Run the lowering on gm as if exactly the ops in `with_kernel` had CUDA kernels and KERNEL_APPLIES[op] were
    `applies`; returns (names of the ops lowered, op counts after)."""
    from k3fuse import lowering
    from k3fuse.backend import decompositions
    from k3fuse.pipeline import op_counts
    monkeypatch.setattr(lowering, "_has_kernel", lambda o, dev: o.name() in with_kernel)
    monkeypatch.setitem(lowering.KERNEL_APPLIES, op, applies)
    lowered = lowering.lower_unkerneled_ops(gm, decompositions())
    return lowered, op_counts(gm.graph)
