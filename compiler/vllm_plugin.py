"""k3fuse inside vLLM's torch.compile pipeline (docs/VLLM.md).

    k3fuse.k3fuse_vllm_pass     a vLLM InductorPass for CompilationConfig's post_grad_custom_post_pass hook
    k3fuse.vllm_plugin.register the `vllm.general_plugins` entry point (registers the k3fuse ops in every process)

vLLM runs the pass on each post-grad piece and compile range, after its own post-grad passes (noop elimination,
fuse_allreduce_rms, ...) and before its IR lowering and fix_functionalization. The pass runs, in order:
`canonicalize_vllm` (vLLM's ops -> what the k3fuse patterns match), `canonicalize` (ATen -> k3fuse ops),
`fuse_attn_out_allreduce_attnres_norm`, then `restore_vllm` (vLLM's ops back where nothing was fused).

This module imports only the standard library at import time: `import k3fuse` must not import vLLM. The pass class
derives from vLLM's InductorPass, so it is built on first use (`K3FuseVllmPass`, `k3fuse_vllm_pass` below), or at
once when vLLM is already imported (vLLM resolves `"k3fuse.k3fuse_vllm_pass"` by a dict lookup in the package).
"""
from __future__ import annotations

import hashlib
import inspect
import logging
import sys
from k3fuse.codegen import knobs

logger = logging.getLogger("k3fuse.vllm")

PASS_NAME = "k3fuse.k3fuse_vllm_pass"        # the name for -cc '{"inductor_passes": {...}}'
_built: dict = {}


def _build_class():
    if "K3FuseVllmPass" in _built:
        return _built["K3FuseVllmPass"]
    _load_kernels()
    import torch.fx as fx
    from vllm.compilation.passes.inductor_pass import InductorPass

    import k3fuse
    from k3fuse.passes.base import PassContext
    from k3fuse.passes.canonicalize import Canonicalize
    from k3fuse.passes.canonicalize_vllm import CanonicalizeVllm, restore_vllm
    from k3fuse.passes.fuse_attn_out_allreduce_attnres_norm import FuseAttnOutAllReduceAttnResNorm

    class K3FuseVllmPass(InductorPass):
        """k3fuse's canonicalization and fusion on one vLLM post-grad piece.

        max_tokens: apply only to compile ranges that end at or below it (the decode batch sizes; the k3fuse kernels
        cover M <= 64); None (default, or $K3FUSE_VLLM_MAX_TOKENS) applies to every range. Matches per call are in
        `last` and appended to `history` (the last 64 calls)."""

        def __init__(self, max_tokens: int | None = None):
            self.max_tokens = max_tokens
            self.last: dict = {}
            self.history: list[dict] = []

        def _passes(self):
            return [CanonicalizeVllm(), Canonicalize(), FuseAttnOutAllReduceAttnResNorm()]

        def is_applicable_for_range(self, compile_range) -> bool:
            return self.max_tokens is None or compile_range.end <= self.max_tokens

        def __call__(self, graph: fx.Graph) -> None:
            ctx = PassContext(expect_matches=False)      # most pieces of a model hold no fusion site
            record = {}
            for p in self._passes():
                p(graph, ctx)
                record[p.name] = p.matches
                if isinstance(p, CanonicalizeVllm):
                    record["vllm_ops"] = dict(p.counts)
            record["restored"] = restore_vllm(graph)
            graph.eliminate_dead_code()
            self.last = record
            self.history.append(record)
            del self.history[:-64]
            logger.info("k3fuse (vLLM piece): %s", record)

        def uuid(self) -> str:
            state = {"k3fuse": k3fuse.__version__, "max_tokens": self.max_tokens,
                     "passes": [p.uuid() for p in self._passes()],
                     "plugin": hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()}
            return InductorPass.hash_dict(state)

        def __reduce__(self):                             # pickles by reference to this module (vLLM workers)
            return (K3FuseVllmPass, (self.max_tokens,))

        def __repr__(self):
            return f"K3FuseVllmPass(max_tokens={self.max_tokens})"

    K3FuseVllmPass.__module__ = __name__
    K3FuseVllmPass.__qualname__ = "K3FuseVllmPass"
    _built["K3FuseVllmPass"] = K3FuseVllmPass
    return K3FuseVllmPass


def _default_pass():
    if "k3fuse_vllm_pass" not in _built:
        _built["k3fuse_vllm_pass"] = _build_class()(knobs.integer("K3FUSE_VLLM_MAX_TOKENS", None))
        # also in the package's namespace dict: vLLM looks "k3fuse.k3fuse_vllm_pass" up in k3fuse.__dict__
        pkg = sys.modules.get("k3fuse")
        if pkg is not None:
            pkg.__dict__["k3fuse_vllm_pass"] = _built["k3fuse_vllm_pass"]
    return _built["k3fuse_vllm_pass"]


def __getattr__(name):
    if name == "K3FuseVllmPass":
        return _build_class()
    if name == "k3fuse_vllm_pass":
        return _default_pass()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def k3fuse_getattr(name):
    """The top-level package's lazy attributes (k3fuse.__getattr__)."""
    if name == "k3fuse_vllm_pass":
        return _default_pass()
    raise AttributeError(f"module 'k3fuse' has no attribute {name!r}")


def _load_kernels() -> None:
    """The CUDA implementations of the k3fuse ops (generated kernels), as the k3fuse backend loads them; without
    them the reference implementations run."""
    try:
        from k3fuse.codegen import registry
        registry.register()
    except Exception as e:  # noqa: BLE001 - codegen absent or broken: the reference implementations run
        logger.info("k3fuse: generated kernels unavailable in vLLM (%s); reference implementations", e)


def register() -> None:
    """`vllm.general_plugins` entry point, run in every vLLM process (API server, engine core, workers): registers
    the k3fuse custom ops and their CUDA kernels (a worker loading a cached compiled piece calls torch.ops.k3fuse.*
    without running the pass) and makes
    "k3fuse.k3fuse_vllm_pass" resolvable. Idempotent. Enables nothing by itself: the pass is turned on through
    the compilation config (docs/VLLM.md)."""
    import k3fuse.ops  # noqa: F401  (torch.ops.k3fuse.*)
    _load_kernels()
    try:
        _default_pass()
    except ImportError as e:                          # a vLLM without the compilation package: ops only
        logger.warning("k3fuse: vLLM pass unavailable (%s); k3fuse ops registered", e)


if "vllm.config" in sys.modules and "k3fuse" in sys.modules:
    # Imported inside a vLLM process (e.g. CompilationConfig resolving "k3fuse.k3fuse_vllm_pass" imports k3fuse
    # and then looks the name up in k3fuse.__dict__, without getattr): build the pass now.
    try:
        _default_pass()
    except Exception as e:  # noqa: BLE001 - never break `import k3fuse`
        logger.debug("k3fuse: vLLM pass not built at import (%s)", e)
