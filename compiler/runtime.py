"""Decode runtime: one CUDA graph per batch bucket.

    step = torch.compile(model, backend="k3fuse", dynamic=False)
    cache = model.new_cache(max_batch, max_seq_len)
    decode = BucketedDecoder(step, cache)
    logits = decode(input_ids)            # input_ids [M]: sequence i lives in cache row i

A step with M tokens runs at the smallest batch bucket B >= M (codegen/buckets.py: 1, 2, 4, ..., 64): the ids are
padded to B and the step sees the first B rows of the cache, so the compiler specializes on B only (at most 7
graphs, each with its kernels tuned for B) and, on CUDA, each bucket is captured once as a CUDA graph and replayed.
Rows M..B-1 are scratch: their state is overwritten by the padding token's step, and their seq_lens are reset to 0
before every step so that a scratch row never writes past its MLA cache. A batch larger than the largest bucket
runs un-graphed at its exact size (the compiler's fallback path for M > 64).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .codegen.buckets import BUCKETS
from .models import KimiK3Cache


def _rows(cache: KimiK3Cache, b: int) -> KimiK3Cache:
    """The first b rows of every cache tensor: views, so a step's in-place updates land in `cache`."""
    cut = lambda xs: [x[:b] if x is not None else None for x in xs]
    return KimiK3Cache(cut(cache.conv_state), cut(cache.recurrent_state), cut(cache.latent_cache),
                       cache.seq_lens[:b])


def _state(cache: KimiK3Cache) -> list[torch.Tensor]:
    return [t for t in cache.conv_state + cache.recurrent_state + cache.latent_cache if t is not None] + [
        cache.seq_lens]


class BucketedDecoder:
    """Runs `step(ids, cache) -> logits` at batch buckets, replaying one CUDA graph per bucket on CUDA.

    step: the compiled decode step (any callable with the model's signature works, e.g. the eager model).
    cache: the decode state for the largest batch that will be used; sequence i is row i.
    buckets: batch sizes to specialize on (default codegen.buckets.BUCKETS, capped at the cache's batch).
    cuda_graphs: capture and replay CUDA graphs (default: when the cache is on a CUDA device).
    pad_token: the token id fed to scratch rows.
    """

    def __init__(self, step: Callable, cache: KimiK3Cache, buckets: tuple[int, ...] = BUCKETS,
                 cuda_graphs: Optional[bool] = None, pad_token: int = 0):
        self.step, self.cache, self.pad_token = step, cache, int(pad_token)
        self.max_batch = cache.batch_size
        self.buckets = tuple(b for b in sorted(set(buckets)) if b <= self.max_batch)
        if not self.buckets:
            raise ValueError(f"no bucket fits the cache's batch of {self.max_batch} (buckets {buckets})")
        self.device = cache.seq_lens.device
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs the cache on a CUDA device")
        self._ids = {b: torch.full((b,), self.pad_token, dtype=torch.int64, device=self.device) for b in self.buckets}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket_for(self, m: int) -> Optional[int]:
        """Smallest bucket >= m, or None (m above every bucket: the step runs at its exact size, un-graphed)."""
        return next((b for b in self.buckets if b >= m), None)

    @torch.no_grad()
    def reset(self, rows) -> None:
        """Clear the state of `rows` (an index, slice or list) for new sequences: zero state, seq_lens 0."""
        for t in _state(self.cache):
            t[rows] = 0

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be [M], got {tuple(input_ids.shape)}")
        m = input_ids.shape[0]
        if not 1 <= m <= self.max_batch:
            raise ValueError(f"batch of {m} tokens; this decoder's cache holds 1..{self.max_batch} sequences")
        b = self.bucket_for(m)
        if b is None:
            return self.step(input_ids.to(self.device), _rows(self.cache, m))
        ids = self._ids[b]
        ids[:m].copy_(input_ids)
        ids[m:].fill_(self.pad_token)
        self.cache.seq_lens[m:b].zero_()          # scratch rows restart, never past the end of their cache
        if not self.cuda_graphs:
            return self.step(ids, _rows(self.cache, b))[:m]
        if b not in self._graphs:
            self._graphs[b] = self._capture(b)
        graph, out = self._graphs[b]
        graph.replay()
        return out[:m].clone()                    # the static output is overwritten by the next replay

    def _capture(self, b: int):
        """Warm up (compiles kernels; must not be captured) on a snapshot of the state, restore it, capture."""
        from .codegen.prefetch import join_pending
        rows = _rows(self.cache, b)
        snap = [t.clone() for t in _state(rows)]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.step(self._ids[b], rows)
            join_pending()
        torch.cuda.current_stream(self.device).wait_stream(side)
        for t, s in zip(_state(rows), snap):
            t.copy_(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.step(self._ids[b], rows)
            join_pending()                        # side-stream prefetches must rejoin inside the capture
        return graph, out
