"""Per-GPU tuning tables: codegen/tuning/<gpu>.json (package data), with a heuristic default.

Table format:
  {"gpu": "NVIDIA H200", "measured": "<date, command>",
   "entries": {"<family>:<N>x<K>": {"<bucket>": {config...}, ...}, ...}}
A lookup misses (and the family's heuristic default is used) for GPUs and shapes not in a table.

K3FUSE_TUNING_OVERLAY=PATH names a file in the same format whose bucket configs are laid over the table's, key by
key and one level into nested dicts, for any GPU (also one without a packaged table): a table of one's own GPU
without editing the package, and how benchmarks/layer_ab.py A/Bs one kernel's config in the layer (--var
K3FUSE_TUNING_OVERLAY=none,cand.json). Where the table has no entry for the bucket, the overlay's config is taken
alone, so it should be complete for its family. The file is read once per path, and memos of table-derived answers
(`memo`) are keyed by the path: a process can switch files between compiles; an edit in place is not seen.
"""
from __future__ import annotations

import contextlib
import functools
import json
import re
from pathlib import Path
from typing import Optional

from . import knobs

TABLE_DIR = Path(__file__).parent / "tuning"


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia_h200'."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


@functools.lru_cache(maxsize=None)
def current_gpu() -> Optional[str]:
    """Slug of the current CUDA device's name (cached: device 0's view of the process)."""
    try:
        import torch
        if torch.cuda.is_available():
            return gpu_slug(torch.cuda.get_device_name())
    except Exception:
        pass
    return None


@functools.lru_cache(maxsize=None)
def load_table(gpu: str) -> dict:
    path = TABLE_DIR / f"{gpu}.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text()).get("entries", {})
    except (OSError, ValueError):
        return {}


def shape_key(family: str, shape: tuple[int, ...]) -> str:
    return f"{family}:" + "x".join(str(s) for s in shape)


OVERLAY_VAR = "K3FUSE_TUNING_OVERLAY"
_MEMOS = []
_recording: Optional[set] = None


def memo(fn):
    """functools.lru_cache for functions whose answer comes from the tables: the key includes the overlay in force."""
    cached = functools.lru_cache(maxsize=None)(lambda _overlay, *a: fn(*a))

    @functools.wraps(fn)
    def wrapper(*a):
        return cached(knobs.env(OVERLAY_VAR), *a)
    wrapper.cache_clear = cached.cache_clear
    _MEMOS.append(wrapper)
    return wrapper


@functools.lru_cache(maxsize=None)
def _load_overlay(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{OVERLAY_VAR}={path!r}: no such file") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{OVERLAY_VAR}={path!r}: not a readable JSON tuning table ({e})") from None
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, dict) or not all(
            isinstance(e, dict) and all(isinstance(c, dict) for c in e.values()) for e in entries.values()):
        raise ValueError(f"{OVERLAY_VAR}={path!r}: wants {{\"entries\": {{\"<family>:<shape>\": "
                         f"{{\"<bucket>\": {{config}}}}}}}} (codegen/tuning.py)")
    return entries


def overlay() -> dict:
    """The entries of the K3FUSE_TUNING_OVERLAY file ('' or 'none': no overlay), read once per path: lookups run on
    the launch path (gemv.route per call), so no file system access there."""
    path = knobs.env(OVERLAY_VAR)
    return {} if path in ("", "none") else _load_overlay(path)


@contextlib.contextmanager
def recording():
    """Collects {(family:shape key, bucket): source} for every lookup inside the block, source "table", "overlay",
    "table+overlay" or "none" (the family's heuristic default then); table-derived memos are cleared first, so that
    each is asked: which table entries a compile consults, and which kernels run on defaults."""
    global _recording
    for m in _MEMOS:
        m.cache_clear()
    seen, prev = {}, _recording
    _recording = seen
    try:
        yield seen
    finally:
        _recording = prev


def lookup(family: str, shape: tuple[int, ...], bucket: int, gpu: Optional[str] = None) -> Optional[dict]:
    key = shape_key(family, shape)
    over = overlay().get(key, {}).get(str(bucket))
    gpu = gpu if gpu is not None else current_gpu()
    entry = load_table(gpu).get(key) if gpu is not None else None
    cfg = dict((entry or {}).get(str(bucket)) or {})
    if _recording is not None:
        _recording[(key, bucket)] = "+".join(n for n, hit in (("table", cfg), ("overlay", over)) if hit) or "none"
    for k, v in (over or {}).items():           # key by key, one level into nested dicts (the MoE's `layer` knobs)
        cfg[k] = dict(cfg[k], **v) if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
    return cfg or None


def write_table(gpu: str, entries: dict, measured: str, path: Optional[Path] = None) -> Path:
    path = path or TABLE_DIR / f"{gpu}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"gpu": gpu, "measured": measured, "entries": entries}, indent=1, sort_keys=True) + "\n")
    load_table.cache_clear()
    return path
