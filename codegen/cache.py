"""On-disk kernel cache.

An entry is a directory <cache_dir>/<key[:2]>/<key>/ holding the rendered source (kernel.py), the PTX, the cubin,
the exported shared object (kernel.so, when a C compiler is available) and meta.json, which records the sha256
of every other file. Entries are written into a temporary directory beside their final place and renamed in
one step (os.replace), so a reader never sees half an entry. An entry whose files do not match meta.json (or
whose meta.json does not parse) is deleted and reported as a miss, so the caller rebuilds it.

key = sha256(rendered source, target arch, cutlass DSL version, cache format version).
Default location ~/.cache/k3fuse/kernels, overridden by K3FUSE_CACHE_DIR.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional
from . import knobs

log = logging.getLogger("k3fuse.codegen")

FORMAT = "k3fuse-kernel-cache-v1"


def cache_dir() -> Path:
    d = knobs.env("K3FUSE_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "k3fuse" / "kernels"


@functools.lru_cache(maxsize=1)
def dsl_version() -> str:
    """The installed nvidia-cutlass-dsl version, read from package metadata (does not import cutlass)."""
    from importlib import metadata
    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        try:
            import cutlass  # noqa: F401  (the GPU machine carries the DSL without dist-info)
            return getattr(cutlass, "__version__", "unknown")
        except Exception:  # pragma: no cover
            return "unknown"


def cache_key(source: str, arch: str, version: Optional[str] = None) -> str:
    h = hashlib.sha256()
    for part in (FORMAT, arch, version if version is not None else dsl_version(), source):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class KernelCache:
    def __init__(self, root: Optional[Path] = None):
        self.root = Path(root) if root is not None else cache_dir()

    def entry_dir(self, key: str) -> Path:
        return self.root / key[:2] / key

    def load(self, key: str) -> Optional[dict]:
        """meta dict (with 'dir' and 'files' {name: path}) for a valid entry, else None (corrupt entries removed)."""
        d = self.entry_dir(key)
        if not d.is_dir():
            return None
        try:
            meta = json.loads((d / "meta.json").read_text())
            if meta.get("key") != key or meta.get("format") != FORMAT:
                raise ValueError("key/format mismatch")
            for name, digest in meta["sha256"].items():
                if _sha(d / name) != digest:
                    raise ValueError(f"{name}: checksum mismatch")
        except Exception as e:  # corrupt: delete, caller rebuilds
            log.warning("k3fuse: kernel cache entry %s is corrupt (%s); rebuilding", key[:12], e)
            self.invalidate(key)
            return None
        meta["dir"] = str(d)
        meta["files"] = {name: str(d / name) for name in meta["sha256"]}
        return meta

    def store(self, key: str, files: dict[str, bytes], meta: dict) -> dict:
        """Atomically publish an entry made of `files` (name -> bytes); returns what load() would."""
        final = self.entry_dir(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key[:12]}.", dir=final.parent))
        try:
            digests = {}
            for name, data in files.items():
                (tmp / name).write_bytes(data)
                digests[name] = hashlib.sha256(data).hexdigest()
            meta = dict(meta, key=key, format=FORMAT, sha256=digests)
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
            if final.exists():  # a stale or concurrent entry: replace it
                self.invalidate(key)
            try:
                os.replace(tmp, final)
            except OSError:  # another process published the same key first: keep theirs
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        out = self.load(key)
        assert out is not None
        return out

    def invalidate(self, key: str) -> None:
        d = self.entry_dir(key)
        if d.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".del.{key[:12]}.", dir=d.parent))
            try:
                os.replace(d, trash / "x")
            except OSError:
                pass
            shutil.rmtree(trash, ignore_errors=True)
