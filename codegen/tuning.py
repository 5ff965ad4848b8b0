"""Per-GPU tuning tables: codegen/tuning/<gpu>.json (package data), with a heuristic default.

Table format:
  {"gpu": "NVIDIA H200", "measured": "<date, command>",
   "entries": {"<family>:<N>x<K>": {"<bucket>": {config...}, ...}, ...}}
A lookup misses (and the family's heuristic default is used) for GPUs and shapes not in a table.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Optional

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


def lookup(family: str, shape: tuple[int, ...], bucket: int, gpu: Optional[str] = None) -> Optional[dict]:
    gpu = gpu if gpu is not None else current_gpu()
    if gpu is None:
        return None
    entry = load_table(gpu).get(shape_key(family, shape))
    if not entry:
        return None
    cfg = entry.get(str(bucket))
    return dict(cfg) if cfg else None


def write_table(gpu: str, entries: dict, measured: str, path: Optional[Path] = None) -> Path:
    path = path or TABLE_DIR / f"{gpu}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"gpu": gpu, "measured": measured, "entries": entries}, indent=1, sort_keys=True) + "\n")
    load_table.cache_clear()
    return path
