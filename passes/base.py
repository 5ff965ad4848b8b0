"""Base class of k3fuse graph passes (vLLM `InductorPass` style: a stable name, a uuid from the source)."""
from __future__ import annotations

import hashlib
import inspect
import logging

import torch.fx as fx

import k3fuse.ops  # noqa: F401  (the k3fuse op set the passes rewrite into)

logger = logging.getLogger("k3fuse.passes")


class PassContext:
    """What a pass may know besides the graph: options and facts about the target."""

    def __init__(self, prefetch_budget_bytes: int = 60 * 2**20, expect_matches: bool = True):
        self.prefetch_budget_bytes = prefetch_budget_bytes
        # On a K3 decode graph every pass is expected to match; a pass that finds nothing warns.
        self.expect_matches = expect_matches


class K3FusePass:
    """A pass rewrites an ATen FX graph in place and counts its matches."""

    name: str = "unnamed"

    def __init__(self):
        self.matches = 0
        self.skip_reason: str | None = None   # set by a pass that does not apply to this graph (e.g. TP = 1)

    def uuid(self) -> str:
        """Changes when the source of the pass's module changes (for compile caches)."""
        src = inspect.getsource(inspect.getmodule(type(self)))
        src += inspect.getsource(inspect.getmodule(K3FusePass))
        return hashlib.sha256(src.encode()).hexdigest()

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def __call__(self, graph: fx.Graph, ctx: PassContext | None = None) -> int:
        ctx = ctx or PassContext()
        self.skip_reason = None
        self.matches = self.apply(graph, ctx)
        graph.lint()
        if self.matches:
            fill_missing_vals(graph)
        if self.skip_reason:
            logger.debug("k3fuse pass %s skipped: %s", self.name, self.skip_reason)
        elif self.matches == 0 and ctx.expect_matches:
            logger.warning("k3fuse pass %s found no match in a graph where it was expected to", self.name)
        else:
            logger.debug("k3fuse pass %s: %d matches", self.name, self.matches)
        return self.matches


def fill_missing_vals(graph: fx.Graph) -> int:
    """Inductor's invariant (fx_passes/README.md): every node carries meta["val"]. A node a pass created without one
    gets it by running its target on its inputs' fake values (nodes in topological order, so inputs come first).
    Later passes and the lowering (compiler/lowering.py traces inlined ops from these values) rely on it.
    Returns the number of nodes filled."""
    import torch
    from torch._guards import detect_fake_mode
    from torch.utils._pytree import tree_map
    todo = [n for n in graph.nodes if n.op == "call_function" and "val" not in n.meta]
    if not todo:
        return 0
    mode = detect_fake_mode([n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)])
    if mode is None:            # a graph traced without fake values (a hand-built test graph): nothing to follow
        return 0
    done = 0
    for n in todo:
        try:
            args, kwargs = tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a, (n.args, n.kwargs))
            with mode:
                n.meta["val"] = n.target(*args, **kwargs)
            done += 1
        except Exception as e:  # leave it: only consumers that need the value will say so
            logger.debug("k3fuse: no fake value for %s (%s): %s", n.name, n.target, e)
    return done
