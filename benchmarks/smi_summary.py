"""Summarise an `nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,<reasons>
--format=csv,noheader,nounits -lms N` log: per column min / median / max, and how often each clock-event reason was
active. Used by validate_pending.sh to tell a slowdown of the GPU's clocks from a slower kernel.

    python3 benchmarks/smi_summary.py smi.csv
"""
from __future__ import annotations

import statistics
import sys

COLUMNS = ("sm MHz", "mem MHz", "power W", "temp C")
# nvidia-smi's clocks_event_reasons bits (nvml.h, nvmlClocksEventReason*)
REASONS = {0x1: "idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
           0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}


def summarise(lines) -> dict:
    """{column: (min, median, max)} over the numeric rows, 'reasons': {name: fraction of rows}, 'rows': n. Lines that
    are not samples (an error message, a blank) are skipped."""
    cols, masks = [[] for _ in COLUMNS], []
    for line in lines:
        f = [x.strip() for x in line.split(",")]
        if len(f) != len(COLUMNS) + 2:
            continue
        try:
            vals = [float(x) for x in f[1:1 + len(COLUMNS)]]
            mask = int(f[-1], 16)
        except ValueError:
            continue
        for c, v in zip(cols, vals):
            c.append(v)
        masks.append(mask)
    out = {name: (min(c), statistics.median(c), max(c)) for name, c in zip(COLUMNS, cols) if c}
    n = len(masks)
    out["reasons"] = {name: round(sum(1 for m in masks if m & bit) / n, 3) for bit, name in REASONS.items()
                      if n and any(m & bit for m in masks)}
    out["rows"] = n
    return out


def main():
    with open(sys.argv[1]) as f:
        s = summarise(f)
    if not s["rows"]:
        print(f"smi: no samples in {sys.argv[1]}")
        return
    cols = "; ".join(f"{k} {s[k][0]:g} / {s[k][1]:g} / {s[k][2]:g}" for k in COLUMNS if k in s)
    reasons = ", ".join(f"{k} {v:.0%}" for k, v in s["reasons"].items()) or "none"
    print(f"smi ({s['rows']} samples, min / median / max): {cols}; clock-event reasons active: {reasons}")


if __name__ == "__main__":
    main()
