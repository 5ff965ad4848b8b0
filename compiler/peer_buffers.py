"""Peer-mapped staging buffers for the in-kernel collectives (codegen/mixnorm_allreduce.py: all-reduce + mix-norm;
codegen/allgather_oneshot.py: all-gather).

Every rank of a tensor-parallel group owns one region of bytes that every other rank can load from and store to
(NVLink peer mappings). Its layout (`BufferLayout`, the kernels bake the same offsets in):

    [0, 2 * slot_bytes)            2 staging slots, each [max_m, hidden] (sized for fp32; the kernels store bf16 rows)
    [flag_off, +flag_bytes)        flags int32 [max_world, max_m]: flags[src][row] = the last epoch at which rank
                                   `src` published `row` of its partial into its slot (written BY the peers)
    [cnt_off, +CNT_WORDS * 4)      counters int32: epoch, CTA arrival count, error record, this rank's id
                                   (local use only; peers never touch them)
  the all-gather's own copy of the same three parts, so the two collectives never share a slot, a flag or an
  epoch (they run in the same step, in any interleaving across ranks; separate state needs no proof):
    [ag_off, +2 * ag_slot_bytes)   2 gather slots, each max_m rows of up to ag_row_cap bytes (rows packed at the
                                   kernel's chunk width)
    [ag_flag_off, +flag_bytes)     gather flags int32 [max_world, max_m]
    [ag_cnt_off, +CNT_WORDS * 4)   gather counters (same word meanings)

`ptrs` is a device int64 tensor [world] of the regions' base addresses as this process sees them (own one
included); a kernel gets it and the rank id and derives every peer address from it.

Backends:
  symmetric   torch.distributed._symmetric_memory (empty + rendezvous -> buffer_ptrs), one process per GPU.
              NVLink multicast is never used: this module sets TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (rendezvous would
              otherwise create a multicast object where the driver offers one) and NCCL_NVLS_ENABLE=0 (NCCL's
              NVLS algorithms create them too) with os.environ.setdefault at import, so set them yourself before
              torch.distributed initialises if this module is imported late. The signal pads that rendezvous also
              maps are left to torch's own ops: our flags live in the region above.
  emulated    `emulated_world(W, ...)`: W regions in one process on one device, one PeerBuffers per "rank", all
              sharing the same pointer table. Runs the real kernels with W CUDA streams standing in for W GPUs
              (tests and benchmarks on a single GPU; also constructible on CPU for bookkeeping tests).

Epochs start at 1 (flags start at 0, so no flag looks published). Nothing is zeroed between steps: the kernels
re-arm the arrival counter and advance the epoch themselves. After a timeout (error record set) the ranks'
epochs no longer agree: `reset()` on every rank (collective for the symmetric backend) before the next step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

# Before anything creates a communicator or a symmetric-memory handle (see the module docstring).
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch

from k3fuse.codegen import knobs

MAX_M = 64          # the largest batch bucket (codegen/buckets.py)
MAX_WORLD = 8       # flags rows reserved per region; the kernels index flags[src] with src < world <= MAX_WORLD
CNT_WORDS = 16      # counter area, int32 words
# counter word indices (the template uses the same numbers)
C_EPOCH, C_ARRIVE, C_ERR, C_ERR_RANK, C_ERR_ROW, C_ERR_SRC, C_ERR_EPOCH, C_RANK = range(8)
ERR_TIMEOUT = 1
COLLECTIVES = ("allreduce", "allgather")


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


@dataclass(frozen=True)
class BufferLayout:
    hidden: int
    max_m: int = MAX_M
    max_world: int = MAX_WORLD
    gather_row_bytes: int = 0           # the largest per-rank row an all-gather may carry; 0: one bf16 row of hidden

    @property
    def row_bytes(self) -> int:          # one bf16 row in a slot (rows are packed at this stride)
        return self.hidden * 2

    @property
    def slot_bytes(self) -> int:         # room for fp32 rows, 256-byte aligned
        return _round_up(self.max_m * self.hidden * 4, 256)

    @property
    def flag_off(self) -> int:
        return 2 * self.slot_bytes

    @property
    def flag_bytes(self) -> int:
        return _round_up(self.max_world * self.max_m * 4, 256)

    @property
    def cnt_off(self) -> int:
        return self.flag_off + self.flag_bytes

    # -- the all-gather's part (after the all-reduce's, whose offsets stay what they were)
    @property
    def ag_row_cap(self) -> int:
        return _round_up(self.gather_row_bytes or self.hidden * 2, 16)

    @property
    def ag_slot_bytes(self) -> int:
        return _round_up(self.max_m * self.ag_row_cap, 256)

    @property
    def ag_off(self) -> int:
        return _round_up(self.cnt_off + CNT_WORDS * 4, 256)

    @property
    def ag_flag_off(self) -> int:
        return self.ag_off + 2 * self.ag_slot_bytes

    @property
    def ag_cnt_off(self) -> int:
        return self.ag_flag_off + self.flag_bytes

    @property
    def total_bytes(self) -> int:
        return _round_up(self.ag_cnt_off + CNT_WORDS * 4, 256)

    def flag_cnt_offsets(self, kind: str = "allreduce") -> tuple[int, int]:
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {kind!r}")
        return (self.flag_off, self.cnt_off) if kind == "allreduce" else (self.ag_flag_off, self.ag_cnt_off)

    def template_params(self) -> dict:
        return dict(MAX_M=self.max_m, MAX_WORLD=self.max_world, SLOT_BYTES=self.slot_bytes,
                    ROW_BYTES=self.row_bytes, FLAG_OFF=self.flag_off, CNT_OFF=self.cnt_off)

    def gather_template_params(self, chunk_bytes: int) -> dict:
        """Offsets of the all-gather kernel for rows of chunk_bytes (packed at that stride in a slot)."""
        if chunk_bytes % 16 or not 0 < chunk_bytes <= self.ag_row_cap:
            raise ValueError(f"gather row of {chunk_bytes} B: needs a multiple of 16 in 16..{self.ag_row_cap}")
        return dict(MAX_M=self.max_m, MAX_WORLD=self.max_world, SLOT_OFF=self.ag_off,
                    SLOT_BYTES=self.ag_slot_bytes, ROW_BYTES=chunk_bytes, FLAG_OFF=self.ag_flag_off,
                    CNT_OFF=self.ag_cnt_off)


class PeerBuffers:
    """One rank's view of a group's peer-mapped regions (see the module docstring)."""

    def __init__(self, world: int, rank: int, layout: BufferLayout, region: torch.Tensor, ptrs: torch.Tensor,
                 backend: str, group=None, handle=None, keepalive=()):
        if not 1 <= world <= layout.max_world:
            raise ValueError(f"world {world} outside 1..{layout.max_world}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside 0..{world - 1}")
        if region.dtype != torch.uint8 or region.numel() < layout.total_bytes:
            raise ValueError("region must be a uint8 tensor of at least layout.total_bytes")
        self.world, self.rank, self.layout, self.backend = world, rank, layout, backend
        self.region = region                  # this rank's own region (uint8)
        self.ptrs = ptrs                      # int64 [world] on region.device
        self.group, self.handle = group, handle
        self._keepalive = keepalive           # the other emulated ranks' regions
        self.device = region.device
        # the GEMV's output: a local scratch with a fixed address (CUDA graphs bake it in); the all-reduce kernel
        # copies it into the epoch's slot, so the slot choice can stay on the device
        self.partial = torch.empty(layout.max_m, layout.hidden, dtype=torch.bfloat16, device=self.device)
        self._init_counters()

    # -- views of this rank's own region (kind: "allreduce" or "allgather", each has its own flags and counters)
    def counters(self, kind: str = "allreduce") -> torch.Tensor:
        off = self.layout.flag_cnt_offsets(kind)[1]
        return self.region[off:off + CNT_WORDS * 4].view(torch.int32)

    def flags(self, kind: str = "allreduce") -> torch.Tensor:
        L = self.layout
        off = L.flag_cnt_offsets(kind)[0]
        return self.region[off:off + L.max_world * L.max_m * 4].view(torch.int32).view(L.max_world, L.max_m)

    def gather_slot(self, s: int, M: int, chunk_bytes: int) -> torch.Tensor:
        """All-gather slot s (0 or 1) as uint8 [M, chunk_bytes] rows."""
        L = self.layout
        off = L.ag_off + s * L.ag_slot_bytes
        return self.region[off:off + M * chunk_bytes].view(M, chunk_bytes)

    def slot(self, s: int, M: Optional[int] = None) -> torch.Tensor:
        """Slot s (0 or 1) as bf16 [M, hidden] rows."""
        L = self.layout
        M = L.max_m if M is None else M
        off = s * L.slot_bytes
        return self.region[off:off + M * L.row_bytes].view(torch.bfloat16).view(M, L.hidden)

    # -- state
    def _init_counters(self) -> None:
        for kind in COLLECTIVES:
            self.flags(kind).zero_()
            c = self.counters(kind)
            c.zero_()
            c[C_EPOCH] = 1
            c[C_RANK] = self.rank

    def epoch(self, kind: str = "allreduce") -> int:
        return int(self.counters(kind)[C_EPOCH].item())

    def error(self, kind: str = "allreduce") -> Optional[dict]:
        """The first error the `kind` kernels recorded on this rank, or None."""
        c = self.counters(kind).tolist()
        if c[C_ERR] == 0:
            return None
        return dict(code=c[C_ERR], rank=c[C_ERR_RANK], row=c[C_ERR_ROW], missing_src=c[C_ERR_SRC],
                    epoch=c[C_ERR_EPOCH])

    def reset(self) -> None:
        """Zero flags and counters of both collectives, epochs back to 1. Collective: every rank must call it with
        no kernel in flight (the symmetric backend brackets it with group barriers so no peer flags a zeroed
        region early)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._barrier()
        self._init_counters()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._barrier()

    def _barrier(self) -> None:
        if self.backend == "symmetric":
            import torch.distributed as dist
            dist.barrier(group=self.group)

    def __repr__(self) -> str:
        return (f"PeerBuffers({self.backend}, rank {self.rank}/{self.world}, hidden {self.layout.hidden}, "
                f"max_m {self.layout.max_m}, {self.layout.total_bytes} B)")

    # -- constructors
    @classmethod
    def symmetric(cls, group=None, hidden: int = 7168, max_m: int = MAX_M) -> "PeerBuffers":
        """Collective over `group` (default: the world): one region per rank in torch symmetric memory."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem
        group = group or dist.group.WORLD
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        layout = BufferLayout(hidden, max_m)
        dev = torch.device("cuda", torch.cuda.current_device())
        try:    # the CUDA backend: plain cuMem peer mappings (NVSHMEM / NCCL windows are not needed here)
            if symm_mem.get_backend(dev) is None:
                symm_mem.set_backend("CUDA")
        except Exception:   # older torch, or a backend already fixed by an earlier allocation: keep it
            pass
        region = symm_mem.empty(layout.total_bytes, dtype=torch.uint8, device=dev)
        handle = symm_mem.rendezvous(region, group)
        ptrs = torch.tensor([int(p) for p in handle.buffer_ptrs], dtype=torch.int64, device=dev)
        pb = cls(world, rank, layout, region, ptrs, "symmetric", group=group, handle=handle)
        torch.cuda.synchronize(dev)
        dist.barrier(group=group)     # every region zeroed before any peer can flag into it
        return pb


def emulated_world(world: int, hidden: int = 7168, max_m: int = MAX_M, device="cuda") -> list[PeerBuffers]:
    """W in-process "ranks" on one device: rank r's PeerBuffers, r = 0..W-1, sharing one pointer table."""
    layout = BufferLayout(hidden, max_m)
    device = torch.device(device)
    regions = [torch.empty(layout.total_bytes, dtype=torch.uint8, device=device) for _ in range(world)]
    ptrs = torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64, device=device)
    return [PeerBuffers(world, r, layout, regions[r], ptrs, "emulated", keepalive=tuple(regions))
            for r in range(world)]


ENV_FLAG = "K3FUSE_INKERNEL_COLLECTIVES"     # "1": the registry may route collectives to the in-kernel path


def inkernel_enabled() -> bool:
    return knobs.env(ENV_FLAG) == "1"


_by_group: dict = {}


def for_group(group=None, hidden: int = 7168, max_m: int = MAX_M) -> PeerBuffers:
    """The process's PeerBuffers for a group (created collectively at the first call, then reused)."""
    import torch.distributed as dist
    group = group or dist.group.WORLD
    key = (group.group_name, hidden, max_m)
    pb = _by_group.get(key)
    if pb is None:
        pb = _by_group[key] = PeerBuffers.symmetric(group, hidden, max_m)
    return pb


def resolve(group_name: str, device, hidden: int = 7168, max_m: int = MAX_M):
    """(PeerBuffers, None) for the group named by a functional collective's group_name, or (None, why not).

    Every rank of a group reaches the same answer for the same call (it depends on the environment flag, the group
    and the shapes the caller checked, all equal across ranks), which the kernels need: a rank that took the
    in-kernel path while a peer took NCCL would wait for flags that never come (and time out). The first call
    per (group, hidden, max_m) allocates and rendezvous collectively: make it outside a CUDA-graph capture (the
    eager warm-up step does); inside a capture with no buffers yet this returns (None, ...) on every rank."""
    if not inkernel_enabled():
        return None, f"{ENV_FLAG} != 1"
    if not group_name:
        return None, "no process group (TP = 1)"
    device = torch.device(device)
    if device.type != "cuda":
        return None, "not a CUDA tensor"
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return None, "torch.distributed not initialised"
    from torch.distributed.distributed_c10d import _resolve_process_group
    try:
        group = _resolve_process_group(group_name)
    except Exception as e:    # an unknown name: let the functional collective raise its own error
        return None, f"group {group_name!r} not resolvable: {e}"
    world = dist.get_world_size(group)
    if world == 1:
        return None, "world size 1"
    if world > MAX_WORLD:
        return None, f"world size {world} > {MAX_WORLD}"
    if device.index is not None and device.index != torch.cuda.current_device():
        return None, "tensor not on the current CUDA device"
    key = (group.group_name, hidden, max_m)
    if key not in _by_group and torch.cuda.is_current_stream_capturing():
        return None, "peer buffers not created yet and a CUDA graph is being captured"
    return for_group(group, hidden, max_m), None
