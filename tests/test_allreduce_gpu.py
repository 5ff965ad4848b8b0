"""In-kernel all-reduce + mix-norm on a GPU (skipped without CUDA).

Single GPU: "emulated ranks" (compiler/peer_buffers.emulated_world): W regions on one device, each rank's GEMV +
all-reduce kernel on its own CUDA stream, all in flight at once (W * M CTAs co-resident: W * M <= 64 here).
Every rank must produce the reference (the unsplit o_proj + ops.py math), bit-identical to every other rank and to
the TP = 1 mix-norm kernel fed with the rank-order fp32 sum of the partials. Several steps without zeroing, a
CUDA graph replayed several times, and a rank that never launches (the others time out and report it).
Several GPUs: W processes on the symmetric-memory backend against NCCL all_reduce + the separate kernels
(skipped unless torch.cuda.device_count() >= 2).
"""
import os
import time

# More hardware work queues than the default 8, so that W rank streams + the current stream do not share one
# (a rank's GEMV queued behind another rank's spinning kernel would only run after the timeout). Read when the
# CUDA context is created: the GPU command sets it too.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

from _check import rel  # noqa: E402
from _launch import multi_gpu_worlds, run_gpu_workers  # noqa: E402

from k3fuse import ops  # noqa: E402
from k3fuse import peer_buffers as pbuf  # noqa: E402
from k3fuse.codegen import fused_residual_norm as frn  # noqa: E402
from k3fuse.codegen import mixnorm_allreduce as mar  # noqa: E402

H, K = 7168, 1536          # the TP8 o_proj slice per rank (K3_MODEL.md section 8); the full K is W * K here


def bf(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


class Case:
    """Inputs of one step for W ranks: per-rank o / w_o K-slices, the replicated AttnRes state."""

    def __init__(self, W, M, nb=3, addend=False, prefix=True, fp32_norm=False):
        self.W, self.M, self.fp32_norm = W, M, fp32_norm
        self.o = [bf(M, K) for _ in range(W)]
        self.w = [bf(H, K, scale=(W * K) ** -0.5) for _ in range(W)]
        self.addend = bf(M, H) if addend else None
        self.prefix = bf(M, H) if prefix else None
        self.blocks_buf = bf(M, 8, H)
        self.blocks = [self.blocks_buf[:, i] for i in range(nb)]
        self.w_mix = torch.randn(H, device="cuda") * 0.05
        self.norm_w = bf(H, scale=0.5) + 1
        self.out = [torch.empty(M, H, device="cuda", dtype=torch.bfloat16) for _ in range(W)]
        self.newp = [torch.empty(M, H, device="cuda", dtype=torch.bfloat16) for _ in range(W)]
        self.poison()

    def poison(self):
        for t in self.out + self.newp:
            t.fill_(float("nan"))

    def refill(self):
        """New per-rank inputs in place (the addresses a CUDA graph captured stay valid)."""
        for t in self.o:
            t.copy_(bf(*t.shape))

    def launch_rank(self, peer, r, timeout_ns=mar.TIMEOUT_NS):
        mar.fused_residual_norm_ar(self.o[r], self.w[r], self.addend, self.prefix, self.blocks, self.w_mix,
                                   self.norm_w, 1e-5, 1e-5, peer, self.fp32_norm, out=self.out[r],
                                   new_prefix=self.newp[r], timeout_ns=timeout_ns)

    def reference(self):
        o, w = torch.cat(self.o, dim=1), torch.cat(self.w, dim=1)
        return ops.fused_residual_norm._init_fn(o, w, self.addend, self.prefix, self.blocks, self.w_mix,
                                                self.norm_w, 1e-5, 1e-5, "", self.fp32_norm)

    def tp1_kernel_on(self, partials):
        """The TP = 1 mix-norm kernel on bf16(sum of the partials in fp32, rank order): what every rank must equal."""
        acc = partials[0].float()
        for p in partials[1:]:
            acc = acc + p.float()
        return frn.mix_norm(acc.to(torch.bfloat16), self.addend, self.prefix, self.blocks, self.w_mix, self.norm_w,
                            1e-5, 1e-5, self.fp32_norm)


def run_ranks(case, ranks, streams, which=None, timeout_ns=mar.TIMEOUT_NS, paddends=None):
    """Launch the ranks (all, or `which`) each on its own stream, forked from and joined to the current stream.
    Every rank's GEMV is enqueued before any rank's all-reduce kernel, so a spinning kernel is never ahead of a
    peer's GEMV in a shared hardware queue (fused_residual_norm_ar is exactly these two launches).
    paddends: per-rank partial addends (addend_partial=True) instead of case.addend."""
    cur = torch.cuda.current_stream()
    which = range(len(ranks)) if which is None else which
    for r in which:
        streams[r].wait_stream(cur)
    for r in which:
        with torch.cuda.stream(streams[r]):
            mar.gemv_into(case.o[r], case.w[r], ranks[r].partial[:case.M])
    for r in which:
        with torch.cuda.stream(streams[r]):
            mar.mixnorm_allreduce(ranks[r].partial[:case.M], case.addend if paddends is None else paddends[r],
                                  case.prefix, case.blocks, case.w_mix, case.norm_w, 1e-5, 1e-5, ranks[r],
                                  case.fp32_norm, out=case.out[r], new_prefix=case.newp[r], timeout_ns=timeout_ns,
                                  addend_partial=paddends is not None)
    for r in which:
        cur.wait_stream(streams[r])


def same_to_rounding(a, b, what):
    """Bit-identical is expected (same code, same values); allow a rare 1-ulp bf16 flip in case ptxas contracts a
    mul + add differently in the two kernels, and say so (the report reads the -s output)."""
    if torch.equal(a, b):
        return
    a, b = a.float(), b.float()
    diff = a != b
    frac = diff.float().mean().item()
    ulp = (b.abs() * 2.0 ** -7).clamp_min(1e-30)
    worst = ((a - b).abs() / ulp)[diff].max().item()
    print(f"NOTE {what}: not bit-identical: {frac:.2e} of elements differ, worst {worst:.2f} bf16 ulp")
    assert frac < 1e-3 and worst <= 1.0, f"{what}: {frac:.2e} differ, worst {worst:.2f} ulp"


def check_step(case, ranks):
    torch.cuda.synchronize()
    for pb in ranks:
        mar.check_error(pb)
    rn, rp = case.reference()
    for r in range(case.W):
        assert rel(case.out[r], rn) < 1e-2 and rel(case.newp[r], rp) < 1e-2, f"rank {r}"
        assert torch.equal(case.out[r], case.out[0]) and torch.equal(case.newp[r], case.newp[0]), \
            f"rank {r} not bit-identical to rank 0"
    en, ep = case.tp1_kernel_on([pb.partial[:case.M] for pb in ranks])
    same_to_rounding(case.out[0], en, "normed vs the TP=1 mix-norm kernel")
    same_to_rounding(case.newp[0], ep, "new_prefix vs the TP=1 mix-norm kernel")


def warm(case, ranks):
    """Compile / load every kernel before anything spins (rank 0's kernel must not wait on a peer's compile)."""
    from k3fuse.codegen import gemv
    mar.build(H, len(case.blocks), case.W, case.addend is not None, case.prefix is not None, True, case.fp32_norm)
    cfg, _ = gemv.route(H, K, case.M)
    if cfg is not None:
        gemv.build(H, K, gemv.bucket_for(case.M), cfg)


@pytest.mark.parametrize("M", [1, 8])
def test_world_of_one_is_the_tp1_path(M):
    """W = 1 through the host API: the whole protocol with one rank, equal to the TP = 1 kernels to the bit."""
    torch.manual_seed(M)
    case = Case(1, M, nb=3, addend=True, prefix=True)
    ranks = pbuf.emulated_world(1, H)
    for step in range(3):
        case.refill()
        case.poison()
        case.launch_rank(ranks[0], 0)
        check_step(case, ranks)
        assert ranks[0].epoch() == 2 + step


CASES = [(W, M) for W in (2, 4, 8) for M in (1, 8)]


@pytest.mark.parametrize("W,M", CASES)
def test_emulated_ranks_steps(W, M):
    """Several consecutive steps: epochs advance by one per step, arrival counters re-arm, nothing is zeroed."""
    torch.manual_seed(1000 * W + M)
    case = Case(W, M, nb=3, addend=(M == 8), prefix=True)
    ranks = pbuf.emulated_world(W, H)
    streams = [torch.cuda.Stream() for _ in range(W)]
    warm(case, ranks)
    for step in range(4):
        case.refill()
        case.poison()
        run_ranks(case, ranks, streams)
        check_step(case, ranks)
        for pb in ranks:
            c = pb.counters().tolist()
            assert c[pbuf.C_EPOCH] == 2 + step and c[pbuf.C_ARRIVE] == 0, c[:8]


@pytest.mark.parametrize("W,M", [(2, 1), (4, 8), (8, 8)])
def test_emulated_ranks_varying_batch(W, M):
    """A step with fewer rows after a full one: rows' flags lag by epochs, which the >= test tolerates."""
    torch.manual_seed(7 * W + M)
    ranks = pbuf.emulated_world(W, H)
    streams = [torch.cuda.Stream() for _ in range(W)]
    for m in (M, 1, M, M):
        case = Case(W, m, nb=0, addend=True, prefix=False, fp32_norm=True)
        warm(case, ranks)
        run_ranks(case, ranks, streams)
        check_step(case, ranks)


@pytest.mark.parametrize("W,M", [(2, 1), (4, 8), (8, 8)])
def test_emulated_ranks_cuda_graph(W, M):
    torch.manual_seed(31 * W + M)
    case = Case(W, M, nb=8, addend=False, prefix=True)
    ranks = pbuf.emulated_world(W, H)
    streams = [torch.cuda.Stream() for _ in range(W)]
    warm(case, ranks)
    run_ranks(case, ranks, streams)            # eager step first (epoch 1 -> 2)
    check_step(case, ranks)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run_ranks(case, ranks, streams)
    torch.cuda.synchronize()
    assert all(pb.epoch() == 2 for pb in ranks), "capture must not run the kernels"
    for rep in range(5):
        case.refill()
        case.poison()
        g.replay()
        check_step(case, ranks)
        assert all(pb.epoch() == 3 + rep for pb in ranks)


def test_missing_rank_times_out():
    """Rank 1 never launches: rank 0's kernel gives up after the timeout, leaves its outputs alone, and
    check_error names the rank, the row and the missing peer."""
    W, M, timeout_ns = 2, 2, 200_000_000
    torch.manual_seed(5)
    case = Case(W, M)
    ranks = pbuf.emulated_world(W, H)
    streams = [torch.cuda.Stream() for _ in range(W)]
    mar.build(H, 3, W, False, True, True, False, timeout_ns=timeout_ns)
    warm(case, ranks)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run_ranks(case, ranks, streams, which=[0], timeout_ns=timeout_ns)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    assert dt < 10 * timeout_ns * 1e-9 + 1.0, f"took {dt:.2f} s"
    with pytest.raises(RuntimeError, match=r"rank 0 of 2: row \d never got peer 1's flag for epoch 1"):
        mar.check_error(ranks[0])
    assert torch.isnan(case.out[0].float()).all(), "a timed-out row must not be written"
    assert ranks[0].epoch() == 2 and ranks[0].counters()[pbuf.C_ARRIVE] == 0, "still arrives and re-arms"
    mar.check_error(ranks[1])
    # recovery: reset every rank, then a full step works again
    for pb in ranks:
        pb.reset()
    case.poison()
    run_ranks(case, ranks, streams)
    check_step(case, ranks)


@pytest.mark.parametrize("W,M", [(2, 1), (4, 8), (8, 8)])
def test_emulated_ranks_partial_addend(W, M):
    """addend_partial (passes/split_moe_across_ranks.py): rank r's routed up-projection slice, zero-padded to
    [M, H] as the pass builds it, joins r's partial inside the kernel before the reduction. Every rank equals the
    op's math (complete addend, unsplit GEMV) to bf16 noise, the TP = 1 mix-norm kernel on bf16(rank-order fp32 sum
    of bf16(addend_r + y_r)) to the bit, and every other rank to the bit. Steps, then a CUDA graph replayed."""
    torch.manual_seed(77 * W + M)
    case = Case(W, M, nb=3, addend=False, prefix=True)
    n = H // W
    shares = []
    for r in range(W):
        a = torch.zeros(M, H, dtype=torch.bfloat16, device="cuda")
        a[:, r * n:(r + 1) * n] = bf(M, n)
        shares.append(a)
    ranks = pbuf.emulated_world(W, H)
    streams = [torch.cuda.Stream() for _ in range(W)]
    warm(case, ranks)
    mar.build(H, 3, W, False, True, True, False, has_paddend=True)

    def check():
        torch.cuda.synchronize()
        for pb in ranks:
            mar.check_error(pb)
        o, w = torch.cat(case.o, dim=1), torch.cat(case.w, dim=1)
        rn, rp = ops.fused_residual_norm._init_fn(o, w, sum(shares), case.prefix, case.blocks, case.w_mix,
                                                  case.norm_w, 1e-5, 1e-5, "", False)
        parts = [(shares[r].float() + ranks[r].partial[:M].float()).to(torch.bfloat16) for r in range(W)]
        en, ep = case.tp1_kernel_on(parts)
        for r in range(W):
            assert rel(case.out[r], rn) < 1e-2 and rel(case.newp[r], rp) < 1e-2, f"rank {r}"
            assert torch.equal(case.out[r], case.out[0]) and torch.equal(case.newp[r], case.newp[0]), f"rank {r}"
        same_to_rounding(case.out[0], en, "normed (partial addend) vs the TP=1 mix-norm kernel")
        same_to_rounding(case.newp[0], ep, "new_prefix (partial addend) vs the TP=1 mix-norm kernel")

    for step in range(3):
        case.refill()
        case.poison()
        run_ranks(case, ranks, streams, paddends=shares)
        check()
        assert all(pb.epoch() == 2 + step for pb in ranks)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run_ranks(case, ranks, streams, paddends=shares)
    for rep in range(3):
        case.refill()
        case.poison()
        g.replay()
        check()


# ------------------------------------------------------------------------------------------ several GPUs
@pytest.mark.slow
@pytest.mark.parametrize("W", multi_gpu_worlds())
def test_symmetric_memory_multi_process(W, tmp_path):
    run_gpu_workers("_allreduce_worker.py", W, tmp_path)
