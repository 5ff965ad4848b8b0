"""Bytes per k3fuse op of a compiled layer, against the GPU time of the kernels each op launched: the ledger that says
which kernel and which bytes a layer row's time above its floor sits in (issue 5).

    rows = op_bytes(gm, num_experts=E, experts_read=k)      # the post-pass graph (k3fuse.backend.LAST_PIPELINES)
    add_times(rows, profiler_events)                          # per op call, its kernels' device time
    print(format_ledger(ledger_rows(rows, copy_bw)))

Bytes of an op call: every tensor it reads (each input node once), what it returns, and the tensors it writes in
place (its schema's `Tensor(a!)` arguments) once more. Stacked expert weights ([E, ...], E = num_experts) count
experts_read of E (the chosen experts; at M = 1 exactly top-k). Activations are included: at M = 1 they are a few KB.
The MLA cache counts whole (all T rows), the layer floor only the rows up to seq_lens.
"""
from __future__ import annotations

import collections

import torch
import torch.fx as fx


def _tensors(v):
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _tensors(x)


def _nbytes(t: torch.Tensor, num_experts: int | None, experts_read: int | None) -> int:
    b = t.numel() * t.element_size()
    if num_experts and experts_read is not None and t.dim() == 3 and t.shape[0] == num_experts:
        b = b // num_experts * min(experts_read, num_experts)
    return b


def _is_k3fuse(n: fx.Node) -> bool:
    return n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "k3fuse"


def op_bytes(gm: fx.GraphModule, num_experts: int | None = None, experts_read: int | None = None) -> list[dict]:
    """One row per k3fuse op node, in program order: op (its name), read / written bytes (see the module doc)."""
    rows = []
    for n in gm.graph.nodes:
        if not _is_k3fuse(n):
            continue
        nb = lambda t: _nbytes(t, num_experts, experts_read)
        seen, read = set(), 0
        for a in _flat(n.args, n.kwargs):
            if isinstance(a, fx.Node) and a not in seen:
                seen.add(a)
                read += sum(nb(t) for t in _tensors(a.meta.get("val")))
        written = sum(nb(t) for t in _tensors(n.meta.get("val")))
        schema = n.target._schema
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                v = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
                if isinstance(v, fx.Node):
                    written += sum(nb(t) for t in _tensors(v.meta.get("val")))
        rows.append(dict(op=schema.name.split("::")[-1], read_bytes=read, written_bytes=written))
    return rows


def _flat(args, kwargs):
    out = []
    fx.node.map_aggregate((args, kwargs), out.append)
    return out


def _device_us(e) -> float:
    for name in ("device_time_total", "cuda_time_total"):
        v = getattr(e, name, None)
        if v is not None:
            return float(v)
    return 0.0


def add_times(rows: list[dict], events) -> int:
    """Each row's `us`: the device time of the kernels its op call launched, from torch.profiler events (CPU ops
    recorded with their CUDA kernels). Op calls are matched by name and occurrence (the k-th call of an op is the k-th
    row of that op): the outermost k3fuse op events only (a reference implementation that calls other k3fuse ops
    nests them). Returns how many rows got a time: none when no event carries device time (a CPU-only profile, or
    kernels the profiler did not attribute to their op), so that a ledger never shows zeros as times."""
    def outer(e):
        p = e.cpu_parent
        while p is not None:
            if p.name.startswith("k3fuse::"):
                return False
            p = p.cpu_parent
        return True
    calls = collections.defaultdict(list)
    for e in sorted((e for e in events if e.name.startswith("k3fuse::") and outer(e)),
                    key=lambda e: e.time_range.start):
        calls[e.name.split("::")[-1]].append(_device_us(e))
    if not any(t > 0 for ts in calls.values() for t in ts):
        return 0
    seen = collections.Counter()
    got = 0
    for r in rows:
        k = seen[r["op"]]
        seen[r["op"]] += 1
        ts = calls.get(r["op"], [])
        if k < len(ts):
            r["us"] = round(ts[k], 2)
            got += 1
    return got


def ledger_rows(rows: list[dict], copy_bw: float) -> list[dict]:
    """The ledger (what layer_bench stores): per op call its MB moved, their floor at copy_bw (bytes / s), its us."""
    return [dict(op=r["op"], MB=round((r["read_bytes"] + r["written_bytes"]) / 1e6, 3),
                 floor_us=round((r["read_bytes"] + r["written_bytes"]) / copy_bw * 1e6, 2),
                 **({"us": r["us"]} if "us" in r else {})) for r in rows]


def format_ledger(ledger: list[dict]) -> str:
    """ledger_rows' rows as a table: op, MB, floor us, its kernels' us and the excess; a total line (its us and
    excess only where the rows have times)."""
    lines = [f"  {'op':<32} {'MB':>8} {'floor us':>9} {'us':>8} {'above':>7}"]
    timed = any("us" in r for r in ledger)
    for r in ledger:
        t = r.get("us")
        lines.append(f"  {r['op']:<32} {r['MB']:>8.2f} {r['floor_us']:>9.2f} "
                     + (f"{t:>8.2f} {t - r['floor_us']:>+7.2f}" if t is not None else f"{'-':>8} {'-':>7}"))
    mb, fl = sum(r["MB"] for r in ledger), sum(r["floor_us"] for r in ledger)
    t = sum(r.get("us", 0.0) for r in ledger)
    lines.append(f"  {'sum':<32} {mb:>8.2f} {fl:>9.2f} " + (f"{t:>8.2f} {t - fl:>+7.2f}" if timed
                                                            else f"{'-':>8} {'-':>7}"))
    return "\n".join(lines)
