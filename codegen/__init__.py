"""k3fuse.codegen: jinja2 templates -> CuTe DSL kernels, per op, static shape, batch bucket, tuning config and arch.

Importing this package is cheap: nothing here imports `cutlass` until a kernel is compiled.

Layout (one module per kernel family, its configs beside it):
  render.py    jinja2 environment over the k3fuse.templates package data
  cache.py     on-disk kernel cache (key = sha256(source, arch, DSL version)), atomic writes
  compile.py   cute.compile with a named arch, memoised in-process, backed by the disk cache
  buckets.py   batch buckets 1..64
  tuning.py    per-GPU tuning tables (tuning/<gpu>.json) with a heuristic default
  gemv.py, fused_residual_norm.py, prefetch.py   kernel families
  registry.py  CUDA implementations of the k3fuse ops (torch.library.register_kernel)
  kernels_cli.py  `k3fuse kernels ...`
"""
from .buckets import BUCKETS, bucket_for  # noqa: F401
