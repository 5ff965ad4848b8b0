"""Peer-mapped staging buffers for in-kernel all-reduces (codegen/mixnorm_allreduce.py).

Every rank of a tensor-parallel group owns one region of bytes that every other rank can load from and store to
(NVLink peer mappings). Its layout (`BufferLayout`, the kernels bake the same offsets in):

    [0, 2 * slot_bytes)            2 staging slots, each [max_m, hidden] (sized for fp32; the kernels store bf16 rows)
    [flag_off, +flag_bytes)        flags int32 [max_world, max_m]: flags[src][row] = the last epoch at which rank
                                   `src` published `row` of its partial into its slot (written BY the peers)
    [cnt_off, +CNT_WORDS * 4)      counters int32: epoch, CTA arrival count, error record, this rank's id
                                   (local use only; peers never touch them)

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

MAX_M = 64          # the largest batch bucket (codegen/buckets.py)
MAX_WORLD = 8       # flags rows reserved per region; the kernels index flags[src] with src < world <= MAX_WORLD
CNT_WORDS = 16      # counter area, int32 words
# counter word indices (the template uses the same numbers)
C_EPOCH, C_ARRIVE, C_ERR, C_ERR_RANK, C_ERR_ROW, C_ERR_SRC, C_ERR_EPOCH, C_RANK = range(8)
ERR_TIMEOUT = 1


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


@dataclass(frozen=True)
class BufferLayout:
    hidden: int
    max_m: int = MAX_M
    max_world: int = MAX_WORLD

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

    @property
    def total_bytes(self) -> int:
        return _round_up(self.cnt_off + CNT_WORDS * 4, 256)

    def template_params(self) -> dict:
        return dict(MAX_M=self.max_m, MAX_WORLD=self.max_world, SLOT_BYTES=self.slot_bytes,
                    ROW_BYTES=self.row_bytes, FLAG_OFF=self.flag_off, CNT_OFF=self.cnt_off)


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

    # -- views of this rank's own region
    def counters(self) -> torch.Tensor:
        L = self.layout
        return self.region[L.cnt_off:L.cnt_off + CNT_WORDS * 4].view(torch.int32)

    def flags(self) -> torch.Tensor:
        L = self.layout
        return self.region[L.flag_off:L.flag_off + L.max_world * L.max_m * 4].view(torch.int32).view(
            L.max_world, L.max_m)

    def slot(self, s: int, M: Optional[int] = None) -> torch.Tensor:
        """Slot s (0 or 1) as bf16 [M, hidden] rows."""
        L = self.layout
        M = L.max_m if M is None else M
        off = s * L.slot_bytes
        return self.region[off:off + M * L.row_bytes].view(torch.bfloat16).view(M, L.hidden)

    # -- state
    def _init_counters(self) -> None:
        self.flags().zero_()
        c = self.counters()
        c.zero_()
        c[C_EPOCH] = 1
        c[C_RANK] = self.rank

    def epoch(self) -> int:
        return int(self.counters()[C_EPOCH].item())

    def error(self) -> Optional[dict]:
        """The first error the kernels recorded on this rank, or None."""
        c = self.counters().tolist()
        if c[C_ERR] == 0:
            return None
        return dict(code=c[C_ERR], rank=c[C_ERR_RANK], row=c[C_ERR_ROW], missing_src=c[C_ERR_SRC],
                    epoch=c[C_ERR_EPOCH])

    def reset(self) -> None:
        """Zero flags and counters, epoch back to 1. Collective: every rank must call it with no kernel in flight
        (the symmetric backend brackets it with group barriers so no peer flags a zeroed region early)."""
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
