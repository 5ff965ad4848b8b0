"""Options of the k3fuse backend: `torch.compile(model, backend="k3fuse", options={...})`."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from k3fuse.codegen import knobs

INNER_COMPILERS = ("inductor", "eager")


@dataclass(frozen=True)
class K3FuseOptions:
    # Where to write, per compiled graph, the graph before/after each pass and summary.json.
    # Default: $K3FUSE_DEBUG_DIR, else nothing is written.
    debug_dir: str | None = None
    # What runs the graph after the k3fuse passes: "inductor" (default) or "eager" (fx interpreter; fast tests).
    inner_compiler: str = "inductor"
    # Passes to run, by name (None = the whole pipeline in its fixed order). Canonicalization always runs.
    passes: tuple[str, ...] | None = None
    # L2 prefetch budget in bytes (H200 L2: 60 MiB).
    prefetch_budget_bytes: int = 60 * 2**20
    # Launch generated CuTe DSL kernels for k3fuse ops on CUDA (False: the ops' reference implementations).
    use_kernels: bool = True
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_user(cls, options: dict | None) -> "K3FuseOptions":
        options = dict(options or {})
        valid = sorted(f.name for f in fields(cls) if f.name != "extra")
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"k3fuse: unknown option(s) {unknown}; valid options are {valid}")
        if options.get("debug_dir") is None and knobs.env("K3FUSE_DEBUG_DIR"):
            options["debug_dir"] = knobs.env("K3FUSE_DEBUG_DIR")
        inner = options.get("inner_compiler", "inductor")
        if inner not in INNER_COMPILERS:
            raise ValueError(f"k3fuse: inner_compiler must be one of {INNER_COMPILERS}, got {inner!r}")
        if options.get("passes") is not None:
            options["passes"] = tuple(options["passes"])
        return cls(**options)
