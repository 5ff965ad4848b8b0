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
        if self.skip_reason:
            logger.debug("k3fuse pass %s skipped: %s", self.name, self.skip_reason)
        elif self.matches == 0 and ctx.expect_matches:
            logger.warning("k3fuse pass %s found no match in a graph where it was expected to", self.name)
        else:
            logger.debug("k3fuse pass %s: %d matches", self.name, self.matches)
        return self.matches
