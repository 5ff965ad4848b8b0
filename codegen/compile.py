"""Compile rendered CuTe DSL sources for a named arch, through the disk cache, memoised in-process.

A rendered template is a Python module that defines
    ENTRY        the @cute.jit host function
    fake_args()  example arguments for cute.compile (fake tensors with symbolic batch dims, a fake env stream)
It is compiled with TVM-FFI (`--enable-tvm-ffi`): the compiled function takes torch tensors directly and launches
on torch.cuda.current_stream() (so it can be captured in a CUDA graph).

`cutlass` is imported here lazily, at the first compile.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from .cache import KernelCache, cache_key, dsl_version

log = logging.getLogger("k3fuse.codegen")



def export_name(key: str) -> str:
    """Exported symbol of a kernel's shared object: unique per kernel (shared objects with the same symbol
    names clash once loaded into one process: the H200 run of 2026-11-29 got CUDA error 98 from the second)."""
    return f"k3fuse_kernel_{key[:24]}"
ARCHES = ("sm_90a", "sm_100a", "sm_103a", "sm_100f")

_lock = threading.Lock()  # cute.compile is not thread-safe
_memo: dict[tuple[str, bool], "CompiledKernel"] = {}


@dataclass
class CompiledKernel:
    key: str
    arch: str
    source: str
    files: dict[str, str] = field(default_factory=dict)  # name -> path in the cache entry
    fn: Optional[Callable] = None                        # callable on a GPU (None for compile-only)
    compile_s: float = 0.0
    cached: bool = False

    def __call__(self, *args: Any) -> Any:
        if self.fn is None:
            self.fn = _load_so(self)
        return self.fn(*args)


def current_arch() -> str:
    """Target arch of the current CUDA device (sm_90a on Hopper, sm_100a/sm_103a on Blackwell)."""
    import torch
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}a"


def _import_source(source: str, key: str, workdir: Path):
    path = workdir / f"k3fuse_kernel_{key[:16]}.py"
    path.write_text(source)
    name = f"k3fuse_generated_{key[:16]}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # the DSL's AST preprocessor looks the module up
    spec.loader.exec_module(mod)
    return mod


def _find_cc() -> Optional[str]:
    for cc in (os.environ.get("CC"), "gcc", "cc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _load_so(k: CompiledKernel) -> Callable:
    import cutlass.cute as cute
    so = k.files.get("kernel.so")
    if so is None:
        raise RuntimeError("kernel has no shared object in the cache entry")
    mod = cute.runtime.load_module(so, enable_tvm_ffi=True)
    return getattr(mod, export_name(k.key))


def _build(source: str, arch: str, key: str) -> tuple[dict[str, bytes], Any, float]:
    import cutlass.cute as cute
    work = Path(tempfile.mkdtemp(prefix="k3fuse-build-"))
    try:
        mod = _import_source(source, key, work)
        dump = work / "dump"
        dump.mkdir()
        t0 = time.perf_counter()
        compiled = cute.compile(mod.ENTRY, *mod.fake_args(),
                                options=f"--gpu-arch {arch} --enable-tvm-ffi --keep-ptx --keep-cubin --dump-dir {dump}")
        dt = time.perf_counter() - t0
        files = {"kernel.py": source.encode()}
        for ext in ("ptx", "cubin"):
            found = sorted(dump.glob(f"*.{ext}"))
            if found:
                files[f"kernel.{ext}"] = found[0].read_bytes()
        cc = _find_cc()
        if cc is not None:
            try:
                obj = work / "kernel.o"
                compiled.export_to_c(str(obj), function_name=export_name(key))
                libs = cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)
                rpaths = sorted({f"-Wl,-rpath,{os.path.dirname(p)}" for p in libs})
                subprocess.run([cc, "-shared", "-o", str(work / "kernel.so"), str(obj), *libs, *rpaths],
                               check=True, capture_output=True)
                files["kernel.so"] = (work / "kernel.so").read_bytes()
            except Exception as e:  # the in-process function still works; only the disk hit is lost
                log.info("k3fuse: kernel %s not exported as a shared object (%s)", key[:12], e)
        return files, compiled, dt
    finally:
        shutil.rmtree(work, ignore_errors=True)


def compile_source(source: str, arch: str, *, load: bool = True, cache: Optional[KernelCache] = None,
                   meta: Optional[dict] = None) -> CompiledKernel:
    """Compile (or fetch from cache) one rendered kernel for `arch`.

    load=True returns a kernel with a callable (needs a GPU to call); load=False only makes sure the
    artifacts (source, PTX, cubin) exist, which works without a GPU.
    """
    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHES}")
    cache = cache or KernelCache()
    key = cache_key(source, arch)
    memo_key = (str(cache.root), key)
    with _lock:
        k = _memo.get(memo_key)
        if k is not None and (k.fn is not None or not load):
            return k
        entry = cache.load(key)
        if entry is not None:
            k = CompiledKernel(key, arch, source, entry["files"], cached=True)
            if load:
                try:
                    k.fn = _load_so(k)
                except Exception as e:
                    log.warning("k3fuse: cached kernel %s could not be loaded (%s); rebuilding", key[:12], e)
                    cache.invalidate(key)
                    entry = None
            if entry is not None:
                _memo[memo_key] = k
                return k
        files, compiled, dt = _build(source, arch, key)
        entry = cache.store(key, files, dict(meta or {}, arch=arch, dsl_version=dsl_version(), compile_s=round(dt, 3)))
        k = CompiledKernel(key, arch, source, entry["files"], fn=compiled, compile_s=dt)
        _memo[memo_key] = k
        return k


def clear_memo(keep: Optional[list] = None) -> None:
    """Forget every in-process compiled kernel (this module's and the kernel families' memos). keep: a list that
    receives the forgotten kernels, so that CUDA graphs captured with them stay valid (benchmarks/layer_ab.py
    captures one graph per knob value in one process)."""
    from . import (allgather_oneshot, fused_residual_norm, gemv, kda_recurrent, mixnorm_allreduce, mla_attention,
                   moe_experts, prefetch, router_topk)
    with _lock:
        if keep is not None:
            keep.extend(_memo.values())
        _memo.clear()
    for mod in (gemv, fused_residual_norm, prefetch, kda_recurrent, mla_attention, moe_experts, router_topk,
                mixnorm_allreduce, allgather_oneshot):
        if keep is not None:
            keep.extend(mod._built.values())
        mod._built.clear()
