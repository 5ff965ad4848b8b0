"""A compiled kernel's SASS read without a GPU: where its warps wait for global memory, and how many of those waits
are serial round trips.

Why: at M = 1 about two thirds of the layer's time above the HBM floor sits in latency-bound kernels (kda_decode,
the fused_residual_norms, the MLA kernels; PERF_NOTES session 30), and their time is a chain of dependent memory
round trips, not bytes. ptxas decides where loads issue and where warps wait for them (CUTEDSL.md pitfall 3), so the
chain is read off the machine code, not the template.

How: on sm_70 and later every instruction carries control bits in the top of its 128-bit encoding (bits 105-125:
stall, yield, write barrier, read barrier, wait mask, reuse). A variable-latency instruction (LDG ...) names the
scoreboard (0-5) it releases when its data has arrived; an instruction that needs that data waits on the scoreboard
in its wait mask. A wait on a scoreboard with global loads outstanding is exposed global latency. The round trips
on a path form a chain: a load issued after the path has waited k round trips has landed after k + 1 at the earliest,
so a wait that releases it puts the path at k + 1 or more (it is `serial` in the listing when it moves the path).
`path` is the longest such chain through the control flow (the branches' arms are alternatives, a loop body counts
once: back edges are dropped; jump tables are followed), a reading aid for a warp's critical chain, not a cycle model.

    python -m k3fuse.codegen.sass CUBIN_OR_DIR [--kernel SUBSTR] [-v]

(a `k3fuse kernels --out DIR` folder: every kernel.cubin under it.) Needs nvdisasm (`pip install
nvidia-cuda-nvdisasm`) or cuobjdump.
"""
from __future__ import annotations

import argparse
import glob
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

# Global-memory reads whose data a later instruction waits for: LDG, generic LD (global in these kernels), returning
# atomics. LDGSTS (cp.async) and bulk copies complete through their own groups / mbarriers, not a register.
GLOBAL_READ = re.compile(r"^(LDG|LD|ATOMG|ATOM)(\.|$)")
NO_BARRIER = 7


@dataclass
class Instr:
    addr: int
    text: str          # the instruction without its predicate, e.g. "LDG.E.128 R64, desc[UR6][R74.64]"
    stall: int
    wbar: int          # scoreboard released when the result is written (7: none)
    rbar: int          # scoreboard released when the sources are read (7: none)
    wait: int          # mask of scoreboards waited on before issue
    guarded: bool = False   # under a predicate (@P0 ...): a branch or exit that may fall through

    @property
    def opcode(self) -> str:
        return self.text.split(None, 1)[0] if self.text else ""

    @property
    def global_read(self) -> bool:
        return bool(GLOBAL_READ.match(self.opcode))


@dataclass
class Wait:
    at: Instr
    loads: list        # the global loads (Instr) this wait is the first to need
    serial: bool       # it moves the chain: one of them was issued after the last round trip the code waited for
    loop: bool         # inside a loop body (a backward branch spans it)


@dataclass
class Report:
    name: str
    instrs: list
    waits: list = field(default_factory=list)

    @property
    def global_reads(self) -> int:
        return sum(i.global_read for i in self.instrs)

    @property
    def serial(self) -> int:
        return sum(w.serial for w in self.waits)

    path: int = 0       # the most serial round trips along one path (see the module docstring)


def find_tool(name: str) -> Optional[str]:
    """The path of a CUDA binary tool (nvdisasm, cuobjdump): on PATH, else from an nvidia-cuda-* wheel; None if
    neither has it."""
    try:
        import nvidia
        found = [f for d in nvidia.__path__ for f in glob.glob(f"{d}/*/bin/{name}")]
    except ImportError:
        found = []
    return shutil.which(name) or (found[0] if found else None)


def find_disassembler() -> Optional[list]:
    """The command that prints SASS with encodings for a cubin path appended: nvdisasm -c -hex, else cuobjdump
    -sass; None if neither is installed."""
    nd = find_tool("nvdisasm")
    if nd:
        return [nd, "-c", "-hex"]
    co = find_tool("cuobjdump")
    return [co, "-sass"] if co else None


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* (0x[0-9a-f]{16}) \*/")
_HI = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
_LABEL = re.compile(r"^(\.L_\w+):\s*$")
_FUNC = re.compile(r"(?:Function : |^\.text\.)(\S+)")


def parse(sass: str) -> dict:
    """{function name: [Instr]} from nvdisasm -c -hex or cuobjdump -sass output (each instruction's low encoding word
    on its line, the high word, which holds the control bits, on the next). nvdisasm's branch labels (`(.L_x_5)) are
    replaced by their addresses, as cuobjdump prints them."""
    funcs: dict = {}
    labels: dict = {}
    cur = None
    pending = None
    want = []                       # labels waiting for the address of the next instruction
    for line in sass.splitlines():
        m = _FUNC.search(line)
        if m and "/*" not in line:
            cur = funcs.setdefault(m.group(1).rstrip(":"), [])
            continue
        m = _LABEL.match(line)
        if m:
            want.append(m.group(1))
            continue
        m = _LINE.search(line)
        if m and cur is not None:
            raw = m.group(2).strip()
            text = re.sub(r"^@!?U?P\w+\s+", "", raw)
            pending = (int(m.group(1), 16), text, text != raw)
            for name in want:
                labels[name] = pending[0]
            want = []
            continue
        m = _HI.match(line)
        if m and pending is not None:
            hi = int(m.group(1), 16)
            cur.append(Instr(pending[0], pending[1], (hi >> 41) & 15, (hi >> 46) & 7, (hi >> 49) & 7,
                             (hi >> 52) & 63, pending[2]))
            pending = None
    for instrs in funcs.values():
        for i in instrs:
            if "`(" in i.text:
                i.text = re.sub(r"`\((\.L_\w+)\)", lambda m: hex(labels.get(m.group(1), -1)), i.text)
    return funcs


def _target(ins: Instr) -> Optional[int]:
    m = re.search(r"\b0x([0-9a-f]+)\b", ins.text) if ins.opcode.startswith("BRA") else None
    return int(m.group(1), 16) if m else None


def loops(instrs: list) -> list:
    """(start, end) address ranges of loop bodies: a branch to an address before its own."""
    return [(t, i.addr) for i in instrs if (t := _target(i)) is not None and t < i.addr]


def _blocks(instrs: list) -> tuple:
    """Basic blocks (lists of indices into instrs) in address order and their forward successors (block indices;
    back edges dropped)."""
    at = {i.addr: n for n, i in enumerate(instrs)}
    lead = {0}
    for n, i in enumerate(instrs):
        if i.opcode.startswith(("BRA", "BRX", "JMP", "EXIT", "RET")):
            lead.add(n + 1)
            t = _target(i)
            if t in at:
                lead.add(at[t])
    lead = sorted(x for x in lead if x < len(instrs))
    blocks = [list(range(a, b)) for a, b in zip(lead, lead[1:] + [len(instrs)])]
    first = {b[0]: k for k, b in enumerate(blocks)}
    succ = []
    for k, b in enumerate(blocks):
        last = instrs[b[-1]]
        out = []
        t = _target(last)
        if t is not None and t in at and at[t] in first and t > last.addr:
            out.append(first[at[t]])
        ends = last.opcode.startswith(("BRA", "BRX", "JMP", "EXIT", "RET")) and not last.guarded
        if not ends and k + 1 < len(blocks):
            out.append(k + 1)
        succ.append(out)
    # an indirect branch (BRX: a switch's jump table) may go to any later block that nothing else enters
    entered = {j for out in succ for j in out}
    for k, b in enumerate(blocks):
        if instrs[b[-1]].opcode.startswith(("BRX", "JMX")):
            succ[k] = [j for j in range(k + 1, len(blocks)) if j not in entered]
    return blocks, succ


def _step(ins: Instr, pending: dict, depth: int) -> tuple:
    """One instruction on a path: (the loads its wait releases, the path's round-trip depth after it). pending
    {scoreboard: [(load, depth at its issue)]} is updated in place. A load issued at depth d has landed at d + 1 at
    the earliest, so a wait that releases it moves the path to at least d + 1: the round trips on a path are a chain
    of waits, each on a load issued after the previous one returned."""
    hit = []
    for b in range(6):
        if ins.wait >> b & 1 and pending[b]:
            hit += pending[b]
            pending[b] = []
    if hit:
        depth = max(depth, max(d + 1 for _, d in hit))
    if ins.global_read and ins.wbar != NO_BARRIER:
        pending[ins.wbar].append((ins, depth))
    return [l for l, _ in hit], depth


def global_waits(name: str, instrs: list) -> Report:
    """The exposed global-load waits of one function in code order, and the most serial ones along a path."""
    rep = Report(name, instrs)
    spans = loops(instrs)
    pending = {b: [] for b in range(6)}
    depth = 0
    for ins in instrs:                      # code order: every wait, for the listing
        hit, new = _step(ins, pending, depth)
        if hit:
            rep.waits.append(Wait(ins, hit, new > depth, any(s <= ins.addr <= e for s, e in spans)))
        depth = new
    blocks, succ = _blocks(instrs)
    best: dict = {0: (0, {b: [] for b in range(6)})}     # block -> (depth, pending) of its deepest predecessor
    for k, b in enumerate(blocks):         # address order is a topological order once back edges are dropped
        if k not in best:
            continue
        depth, pend = best[k]
        pend = {x: list(v) for x, v in pend.items()}
        for n in b:
            _, depth = _step(instrs[n], pend, depth)
        rep.path = max(rep.path, depth)
        for j in succ[k]:
            if j not in best or best[j][0] < depth:
                best[j] = (depth, pend)
    return rep


def read(path: str, kernel: str = "") -> list:
    """[Report] for every function (whose name contains kernel) of a cubin, or of every kernel.cubin under a folder."""
    cmd = find_disassembler()
    if cmd is None:
        raise RuntimeError("no nvdisasm or cuobjdump: pip install nvidia-cuda-nvdisasm")
    p = Path(path)
    cubins = sorted(p.rglob("*.cubin")) if p.is_dir() else [p]
    out = []
    for c in cubins:
        sass = subprocess.run(cmd + [str(c)], capture_output=True, text=True, check=True).stdout
        for name, instrs in parse(sass).items():
            if kernel in name:
                rep = global_waits(name, instrs)
                rep.name = f"{c.parent.name}:{short(name)}" if p.is_dir() else short(name)
                out.append(rep)
    return out


def short(name: str) -> str:
    """kernel_cutlass_combine_mma_kernel_tensorptr... -> combine_mma_kernel"""
    m = re.match(r"(?:kernel_cutlass_)?(.*?_kernel)", name)
    return m.group(1) if m else name[:60]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3fuse.codegen.sass", description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a cubin, or a folder (e.g. k3fuse kernels --out DIR)")
    ap.add_argument("--kernel", default="", help="only functions whose name contains this")
    ap.add_argument("-v", "--verbose", action="store_true", help="list every exposed wait")
    a = ap.parse_args(argv)
    reps = read(a.path, a.kernel)
    print(f"{'kernel':60s} {'instrs':>6s} {'LDG':>4s} {'waits':>5s} {'serial':>6s} {'path':>4s}")
    for r in reps:
        print(f"{r.name[:60]:60s} {len(r.instrs):6d} {r.global_reads:4d} {len(r.waits):5d} {r.serial:6d} "
              f"{r.path:4d}")
        if a.verbose:
            for w in r.waits:
                first = min(w.loads, key=lambda i: i.addr)
                print(f"    {w.at.addr:#06x} {w.at.text[:44]:44s} <- {len(w.loads):2d} load(s) from {first.addr:#06x} "
                      f"{first.opcode:14s}{' serial' if w.serial else ''}{' loop' if w.loop else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
