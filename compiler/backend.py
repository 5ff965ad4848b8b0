"""The `k3fuse` torch.compile backend.

Dynamo hands us the decode step as an FX graph; AOTAutograd turns it into a functionalized inference ATen graph
(input mutations of the decode cache kept as trailing copy_ nodes); the k3fuse pipeline rewrites it; the inner
compiler (Inductor by default, or eager) runs the result.
"""
from __future__ import annotations

import itertools
import logging
from collections import Counter

import torch
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.aot_autograd import make_boxed_func

from .lowering import lower_unkerneled_ops
from .options import K3FuseOptions
from .pipeline import Pipeline

logger = logging.getLogger("k3fuse")
_graph_ids = itertools.count()

# The last pipelines run in this process (for tools and tests: summaries, pass match counts).
LAST_PIPELINES: list[Pipeline] = []


def decompositions():
    # Inductor's table: the same decompositions the passes' patterns are traced with.
    from torch._inductor.decomposition import select_decomp_table
    return select_decomp_table()


def k3fuse_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, mode: str | None = None):
    opts = K3FuseOptions.from_user(options)
    if mode not in (None, "default"):
        raise ValueError(f"k3fuse: torch.compile mode {mode!r} is not supported; use options={{...}}")
    _warn_unknown_variables()
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs):
        raise RuntimeError("k3fuse compiles inference graphs: call the model under torch.no_grad() or "
                           "torch.inference_mode(), or freeze its parameters (requires_grad_(False))")
    if opts.use_kernels and any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs):
        _load_kernels()

    def fw_compiler(aten_gm: torch.fx.GraphModule, aten_inputs):
        pipe = Pipeline(opts, graph_id=next(_graph_ids))
        aten_gm = pipe(aten_gm)
        LAST_PIPELINES.append(pipe)
        del LAST_PIPELINES[:-16]
        if opts.inner_compiler == "eager":
            return make_boxed_func(aten_gm.forward)
        # Inductor: ops without a kernel on this device go back to ATen so that Inductor fuses them
        pipe.summary["lowered_to_aten"] = op_counter(lower_unkerneled_ops(aten_gm, decompositions()))
        pipe.dump(aten_gm, f"{len(pipe.passes):02d}.lowered.py")
        pipe.write_summary()
        from torch._inductor.compile_fx import compile_fx_inner
        return compile_fx_inner(aten_gm, aten_inputs)

    return aot_module_simplified(gm, example_inputs, fw_compiler=fw_compiler, decompositions=decompositions(),
                                 keep_inference_input_mutations=True)


_warned_unknown: set = set()


def _warn_unknown_variables():
    """One warning per process for each K3FUSE_* variable that k3fuse does not read (removed or misspelt): it does
    nothing, and an A/B run with it would measure nothing."""
    from k3fuse.codegen import knobs
    new = [u for u in knobs.unknown_set() if u not in _warned_unknown]
    if new:
        _warned_unknown.update(new)
        logger.warning("k3fuse: ignoring %s; `k3fuse knobs` lists the variables k3fuse reads", "; ".join(new))


def op_counter(names) -> dict:
    return dict(sorted(Counter(names).items()))


def _load_kernels():
    """Register the generated-kernel CUDA implementations of the k3fuse ops, when codegen is available."""
    try:
        from k3fuse.codegen import registry
    except ImportError as e:  # codegen pieces missing: the reference implementations run
        logger.info("k3fuse: generated kernels unavailable (%s); using reference implementations", e)
        return
    registry.register()
