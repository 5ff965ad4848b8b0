"""One-shot in-kernel all-gather (codegen/allgather_oneshot.py) on a GPU (skipped without CUDA).

Single GPU: emulated ranks (compiler/peer_buffers.emulated_world), each rank's gather on its own CUDA stream, all in
flight at once. The chunks are random bits (NaN payloads included) at the byte widths the MoE split gathers
(packed router logits + z shard at TP = W); every rank's output must equal torch.cat of the ranks' chunks
bit for bit (rank-major = all_gather_into_tensor's layout, or row-major = cat along the last dim), over
NaN-poisoned outputs, several steps, CUDA graph replays, both collectives in the same step, and a rank that never
launches (the others time out and report it).
Several GPUs: W processes on the symmetric-memory backend against NCCL all_gather_into_tensor (tests/
_allgather_worker.py; skipped unless torch.cuda.device_count() >= 2).
"""
import os
import time

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")   # see tests/test_allreduce_gpu.py

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

from _launch import multi_gpu_worlds, run_gpu_workers  # noqa: E402
from k3fuse import peer_buffers as pbuf  # noqa: E402
from k3fuse.codegen import allgather_oneshot as ag  # noqa: E402
from k3fuse.codegen import fused_residual_norm as frn  # noqa: E402
from k3fuse.codegen import mixnorm_allreduce as mar  # noqa: E402
from k3fuse.models.config import KimiK3Config  # noqa: E402

CFG = KimiK3Config()
H = CFG.hidden_size
POISON = 0x7FC07FC0          # two bf16 NaNs / one fp32 NaN per int32 word


def packed_cols(t: int) -> int:
    """bf16 columns of the split pass's merged gather at TP = t (fp32 logits bit-cast, then the z shard)."""
    return CFG.num_experts // t * 2 + CFG.routed_expert_hidden_size // t


def bits(t):
    return t.contiguous().view(torch.uint8)


class Gather:
    """One gather's buffers for W ranks: inputs at fixed addresses (graphs bake them in), NaN-poisoned outputs."""

    def __init__(self, W, M, C, dtype=torch.bfloat16, layout="rank_major"):
        self.W, self.M, self.C, self.dtype, self.layout = W, M, C, dtype, layout
        self.x = [torch.empty(M, C, dtype=dtype, device="cuda") for _ in range(W)]
        shape = (W * M, C) if layout == "rank_major" else (M, W * C)
        self.out = [torch.empty(shape, dtype=dtype, device="cuda") for _ in range(W)]
        self.row_bytes = C * self.x[0].element_size()
        self.refill()
        self.poison()

    def refill(self):
        for t in self.x:
            w = t.view(torch.int32)
            w.copy_(torch.randint(-2**31, 2**31 - 1, w.shape, dtype=torch.int32, device="cuda"))

    def poison(self):
        for t in self.out:
            t.view(torch.int32).fill_(POISON)

    def reference(self):
        return torch.cat(self.x, 0 if self.layout == "rank_major" else 1)

    def launch(self, peer, r, timeout_ns=ag.TIMEOUT_NS):
        ag.all_gather_oneshot(self.x[r], peer, out=self.out[r], layout=self.layout, timeout_ns=timeout_ns)


def run(g, ranks, streams, which=None, timeout_ns=ag.TIMEOUT_NS):
    cur = torch.cuda.current_stream()
    which = range(len(ranks)) if which is None else which
    for r in which:
        streams[r].wait_stream(cur)
    for r in which:
        with torch.cuda.stream(streams[r]):
            g.launch(ranks[r], r, timeout_ns)
    for r in which:
        cur.wait_stream(streams[r])


def check(g, ranks):
    torch.cuda.synchronize()
    for pb in ranks:
        ag.check_error(pb)
    ref = bits(g.reference())
    for r in range(g.W):
        assert torch.equal(bits(g.out[r]), ref), f"rank {r}: not the concatenation of the chunks"


def warm(g, ranks, timeout_ns=ag.TIMEOUT_NS):
    ag.build_for(ranks[0], g.row_bytes, timeout_ns)


@pytest.mark.parametrize("M", [1, 8])
def test_world_of_one(M):
    ranks = pbuf.emulated_world(1, H)
    g = Gather(1, M, packed_cols(8))
    for step in range(3):
        g.refill()
        g.poison()
        g.launch(ranks[0], 0)
        check(g, ranks)
        assert ranks[0].epoch("allgather") == 2 + step


CASES = [(W, M) for W in (2, 4, 8) for M in (1, 8)]


@pytest.mark.parametrize("W,M", CASES)
def test_emulated_gather_steps(W, M):
    """Consecutive steps at the packed width of TP = W: epochs advance, counters re-arm, nothing zeroed; the
    all-reduce's counters are not touched (separate state)."""
    torch.manual_seed(100 * W + M)
    ranks = pbuf.emulated_world(W, H)
    streams = [torch.cuda.Stream() for _ in range(W)]
    g = Gather(W, M, packed_cols(W))
    warm(g, ranks)
    for step in range(4):
        g.refill()
        g.poison()
        run(g, ranks, streams)
        check(g, ranks)
        for pb in ranks:
            c = pb.counters("allgather").tolist()
            assert c[pbuf.C_EPOCH] == 2 + step and c[pbuf.C_ARRIVE] == 0, c[:8]
            assert pb.epoch() == 1


@pytest.mark.parametrize("W,M,dtype,cols,layout", [
    (4, 8, torch.bfloat16, packed_cols(4), "row_major"),
    (8, 1, torch.float32, CFG.num_experts // 8, "rank_major"),       # the router logits alone, fp32
    (2, 8, torch.bfloat16, H // 2, "row_major"),                     # the up-projection slice (no AR fusion)
    (8, 8, torch.uint8, 48, "rank_major")])
def test_emulated_gather_layouts_and_dtypes(W, M, dtype, cols, layout):
    torch.manual_seed(W + M + cols)
    ranks = pbuf.emulated_world(W, H)
    streams = [torch.cuda.Stream() for _ in range(W)]
    g = Gather(W, M, cols, dtype, layout)
    warm(g, ranks)
    for _ in range(2):
        g.refill()
        g.poison()
        run(g, ranks, streams)
        check(g, ranks)


@pytest.mark.parametrize("W,M", [(2, 8), (8, 8)])
def test_emulated_gather_varying_batch_and_width(W, M):
    """Batches and widths change step to step on the same buffers: rows' flags lag by epochs (>= tolerates it)."""
    torch.manual_seed(3 * W + M)
    ranks = pbuf.emulated_world(W, H)
    streams = [torch.cuda.Stream() for _ in range(W)]
    for m, cols in ((M, packed_cols(W)), (1, packed_cols(W)), (M, H // W), (M // 2, packed_cols(W)), (M, 8)):
        g = Gather(W, m, cols)
        warm(g, ranks)
        run(g, ranks, streams)
        check(g, ranks)


@pytest.mark.parametrize("W,M", [(2, 1), (4, 8), (8, 8)])
def test_emulated_gather_cuda_graph(W, M):
    torch.manual_seed(31 * W + M)
    ranks = pbuf.emulated_world(W, H)
    streams = [torch.cuda.Stream() for _ in range(W)]
    g = Gather(W, M, packed_cols(W))
    warm(g, ranks)
    run(g, ranks, streams)
    check(g, ranks)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(g, ranks, streams)
    torch.cuda.synchronize()
    assert all(pb.epoch("allgather") == 2 for pb in ranks), "capture must not run the kernels"
    for rep in range(5):
        g.refill()
        g.poison()
        graph.replay()
        check(g, ranks)
        assert all(pb.epoch("allgather") == 3 + rep for pb in ranks)


@pytest.mark.parametrize("W,M", [(2, 1), (4, 8)])
def test_gather_and_allreduce_in_one_step(W, M):
    """Each rank: all-reduce + mix-norm, then the gather, then the all-reduce again, on its stream (as a layer
    would); ranks run in any interleaving. Separate slots / flags / epochs: both stay correct, eager and replayed."""
    torch.manual_seed(5 * W + M)
    ranks = pbuf.emulated_world(W, H)
    streams = [torch.cuda.Stream() for _ in range(W)]
    g = Gather(W, M, packed_cols(W))
    warm(g, ranks)
    parts = [torch.empty(M, H, dtype=torch.bfloat16, device="cuda") for _ in range(W)]
    prefix = (torch.randn(M, H, device="cuda")).to(torch.bfloat16)
    blocks_buf = torch.randn(M, 8, H, device="cuda").to(torch.bfloat16)
    blocks = [blocks_buf[:, i] for i in range(3)]
    w_mix = torch.randn(H, device="cuda") * 0.05
    norm_w = (torch.randn(H, device="cuda") * 0.5 + 1).to(torch.bfloat16)
    outs = [[torch.empty(M, H, dtype=torch.bfloat16, device="cuda") for _ in range(W)] for _ in range(2)]
    newps = [[torch.empty(M, H, dtype=torch.bfloat16, device="cuda") for _ in range(W)] for _ in range(2)]
    mar.build(H, 3, W, False, True, True, False)

    def refill():
        g.refill()
        g.poison()
        for p in parts:
            p.copy_(torch.randn(M, H, device="cuda").to(torch.bfloat16))
        for t in sum(outs + newps, []):
            t.fill_(float("nan"))

    def step():
        cur = torch.cuda.current_stream()
        for s in streams:
            s.wait_stream(cur)
        for r in reversed(range(W)):           # launch order across ranks does not matter
            with torch.cuda.stream(streams[r]):
                mar.mixnorm_allreduce(ranks[r].partial[:M].copy_(parts[r]), None, prefix, blocks, w_mix, norm_w,
                                      1e-5, 1e-5, ranks[r], out=outs[0][r], new_prefix=newps[0][r])
                g.launch(ranks[r], r)
                mar.mixnorm_allreduce(ranks[r].partial[:M], None, newps[0][r], blocks, w_mix, norm_w, 1e-5, 1e-5,
                                      ranks[r], out=outs[1][r], new_prefix=newps[1][r])
        for s in streams:
            cur.wait_stream(s)

    def verify():
        check(g, ranks)
        for pb in ranks:
            mar.check_error(pb)
        acc = parts[0].float()
        for p in parts[1:]:
            acc = acc + p.float()
        y = acc.to(torch.bfloat16)
        en, ep = frn.mix_norm(y, None, prefix, blocks, w_mix, norm_w, 1e-5, 1e-5, False)
        en2, ep2 = frn.mix_norm(y, None, ep, blocks, w_mix, norm_w, 1e-5, 1e-5, False)
        for r in range(W):
            for got, exp in ((outs[0][r], en), (newps[0][r], ep), (outs[1][r], en2), (newps[1][r], ep2)):
                assert torch.isfinite(got.float()).all()
                d = (got.float() != exp.float()).float().mean().item()
                assert d < 1e-3, f"rank {r}: {d:.2e} of elements differ from the TP=1 kernel"

    for _ in range(2):
        refill()
        step()
        verify()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        refill()
        graph.replay()
        verify()
    assert all(pb.epoch() == 2 * 5 + 1 and pb.epoch("allgather") == 5 + 1 for pb in ranks)


def test_missing_rank_times_out():
    """Rank 1 never launches: rank 0 gives up after the timeout, leaves its output poisoned, records the missing
    peer; after reset() on every rank a full step works."""
    W, M, timeout_ns = 2, 2, 200_000_000
    torch.manual_seed(9)
    ranks = pbuf.emulated_world(W, H)
    streams = [torch.cuda.Stream() for _ in range(W)]
    g = Gather(W, M, packed_cols(8))
    warm(g, ranks, timeout_ns)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run(g, ranks, streams, which=[0], timeout_ns=timeout_ns)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    assert dt < 10 * timeout_ns * 1e-9 + 1.0, f"took {dt:.2f} s"
    with pytest.raises(RuntimeError, match=r"all-gather timed out on rank 0 of 2: row \d never got peer 1's flag "
                                           r"for epoch 1"):
        ag.check_error(ranks[0])
    assert (g.out[0].view(torch.int32) == POISON).all(), "a timed-out row must not be written"
    assert ranks[0].epoch("allgather") == 2 and ranks[0].counters("allgather")[pbuf.C_ARRIVE] == 0
    mar.check_error(ranks[0])          # the all-reduce's record is separate
    ag.check_error(ranks[1])
    for pb in ranks:
        pb.reset()
    g.poison()
    run(g, ranks, streams)
    check(g, ranks)


# ------------------------------------------------------------------------------------------ several GPUs
@pytest.mark.slow
@pytest.mark.parametrize("W", multi_gpu_worlds())
def test_symmetric_memory_multi_process(W, tmp_path):
    run_gpu_workers("_allgather_worker.py", W, tmp_path, dict(K3FUSE_INKERNEL_COLLECTIVES="1"))
