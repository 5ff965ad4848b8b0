"""Merge a tuning table file (gpu_kernels.py's <out>/tuning.json, moe_layer_tune's results, a hand-written overlay)
into the package's table codegen/tuning/<gpu>.json, bucket by bucket.

    python3 benchmarks/merge_tuning.py NEW.json [--gpu nvidia_h200] [--replace] [--table-dir DIR]

Buckets the package table does not have are added; buckets it has are kept unless --replace (then the new config
replaces the old one, except its `layer` knobs and variant keys, which were measured in the layer and stay). The
usual way in (session 20): tune standalone, A/B in the layer with
`layer_ab.py --var K3FUSE_TUNING_OVERLAY=none,NEW.json`, merge what won.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))



def merge(table: dict, new: dict, replace: bool = False) -> list[str]:
    """Merges new's entries into table's (both {"entries": {key: {bucket: cfg}}}), in place; returns what changed,
    one line per (key, bucket)."""
    from k3fuse.codegen import moe_experts
    keep = moe_experts.VARIANT_KEYS + (moe_experts.LAYER_KEY,)    # measured in the layer, as moe_sweep keeps them
    changed = []
    entries = table.setdefault("entries", {})
    for key, per_bucket in sorted(new.get("entries", {}).items()):
        old = entries.setdefault(key, {})
        for b, cfg in sorted(per_bucket.items(), key=lambda kv: int(kv[0])):
            existed = b in old
            if existed and not replace:
                continue
            kept = {k: v for k, v in old.get(b, {}).items() if k in keep and k not in cfg}
            old[b] = dict(cfg, **kept)
            changed.append(f"{key} bucket {b}: {'replaced' if existed else 'added'}")
    return changed


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("new")
    ap.add_argument("--gpu", default="nvidia_h200", help="the table's slug (codegen/tuning/<gpu>.json)")
    ap.add_argument("--replace", action="store_true", help="also replace buckets the table has")
    ap.add_argument("--table-dir", help="default: the package's codegen/tuning")
    a = ap.parse_args(argv)
    from k3fuse.codegen import tuning
    path = Path(a.table_dir or tuning.TABLE_DIR) / f"{a.gpu}.json"
    table = json.loads(path.read_text()) if path.is_file() else {"gpu": a.gpu, "entries": {}}
    new = json.loads(Path(a.new).read_text())
    changed = merge(table, new, a.replace)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print("\n".join(changed) or "nothing to merge", f"\n-> {path}")


if __name__ == "__main__":
    main()
