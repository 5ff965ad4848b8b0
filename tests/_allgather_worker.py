"""One rank of tests/test_allgather_gpu.py::test_symmetric_memory_multi_process (one process per GPU).

argv: rank world tmpdir. On the symmetric-memory backend (no multicast), every rank:
  - gathers random-bit chunks at the MoE split's widths (packed logits + z at TP = world; the up-projection slice)
    with all_gather_oneshot (rank-major and row-major) and all_gather_cuda_or_none (through the group name, as the
    registry would), against NCCL all_gather_into_tensor: bit-identical; eager steps, then a CUDA graph replayed;
  - runs fused_residual_norm_ar_or_none with addend_partial=True (the MoE split's routed slice) against the op's
    reference on the functional NCCL all-reduce (bf16 rel err < 1e-2) and every other rank (bit-identical).
Exit status 0 = pass.
"""
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("K3FUSE_INKERNEL_COLLECTIVES", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _check import rel  # noqa: E402

E, D, H, K = 896, 3584, 7168, 1536


def bits(t):
    return t.contiguous().view(torch.uint8)


def main():
    rank, world, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=rank, world_size=world, device_id=dev)
    from k3fuse import ops
    from k3fuse import peer_buffers as pbuf
    from k3fuse.codegen import allgather_oneshot as ag
    from k3fuse.codegen import mixnorm_allreduce as mar

    group = dist.group.WORLD
    name = group.group_name
    peer, why = pbuf.resolve(name, dev, hidden=H)       # collective: every rank creates its region here
    assert peer is not None, why
    assert peer.world == world and peer.rank == rank and peer.epoch("allgather") == 1

    gen = torch.Generator(device="cpu").manual_seed(4321 + rank)

    def rand_bits(M, C, dtype=torch.bfloat16):
        n = C * torch.tensor([], dtype=dtype).element_size() // 4
        return torch.randint(-2**31, 2**31 - 1, (M, n), generator=gen, dtype=torch.int32).to(dev).view(dtype)

    widths = [E // world * 2 + D // world, H // world]
    for M in (1, 2, 4, 8, 16, 32, 64):     # every batch bucket
        for C in widths:
            ag.build_for(peer, C * 2)
            dist.barrier()      # every rank compiled before any kernel can spin on a peer's compile
            x = rand_bits(M, C)
            out_rm = torch.empty(world * M, C, dtype=torch.bfloat16, device=dev)
            out_cat = torch.empty(M, world * C, dtype=torch.bfloat16, device=dev)

            def step():
                ag.all_gather_oneshot(x, peer, out=out_rm)
                ag.all_gather_oneshot(x, peer, out=out_cat, layout="row_major")

            def check(tag):
                torch.cuda.synchronize()
                ag.check_error(peer)
                ref = torch.empty(world * M, C, dtype=torch.bfloat16, device=dev)
                dist.all_gather_into_tensor(ref, x)
                assert torch.equal(bits(out_rm), bits(ref)), f"{tag}: rank-major vs NCCL all_gather_into_tensor"
                cat = ref.view(world, M, C).permute(1, 0, 2).reshape(M, world * C)
                assert torch.equal(bits(out_cat), bits(cat)), f"{tag}: row-major vs cat of the NCCL gather"
                via = ag.all_gather_cuda_or_none(x, name, world)
                assert via is not None, "all_gather_cuda_or_none declined"
                torch.cuda.synchronize()
                assert torch.equal(bits(via), bits(ref)), f"{tag}: all_gather_cuda_or_none"

            for s in range(3):
                out_rm.view(torch.int32).fill_(0x7FC07FC0)
                out_cat.view(torch.int32).fill_(0x7FC07FC0)
                x.view(torch.int32).copy_(rand_bits(M, C).view(torch.int32))
                step()
                check(f"M={M} C={C} eager {s}")
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            dist.barrier()
            for rep in range(3):
                out_rm.view(torch.int32).fill_(0x7FC07FC0)
                out_cat.view(torch.int32).fill_(0x7FC07FC0)
                x.view(torch.int32).copy_(rand_bits(M, C).view(torch.int32))
                g.replay()
                check(f"M={M} C={C} replay {rep}")

    # fused_residual_norm with the MoE split's partial addend, through the registry-facing entry point
    gsame = torch.Generator(device="cpu").manual_seed(1234)

    def g_(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gsame) * scale).to(torch.bfloat16).to(dev)

    M, nb = 8, 3
    o_full, w_full = g_(M, world * K), g_(H, world * K, scale=(world * K) ** -0.5)
    o = o_full[:, rank * K:(rank + 1) * K].contiguous()
    w = w_full[:, rank * K:(rank + 1) * K].contiguous()
    ys = g_(M, H // world)
    share = torch.nn.functional.pad(ys, [rank * (H // world), H - (rank + 1) * (H // world)])
    p = g_(M, H)
    blocks_buf = g_(M, 8, H)
    blocks = [blocks_buf[:, i] for i in range(nb)]
    w_mix = (torch.randn(H, generator=gsame) * 0.05).to(dev)
    norm_w = g_(H, scale=0.5) + 1
    mar.build(H, nb, world, False, True, True, False, has_paddend=True)
    dist.barrier()
    res = mar.fused_residual_norm_ar_or_none(o, w, share, p, blocks, w_mix, norm_w, 1e-5, 1e-5, name, False, True)
    assert res is not None, "fused_residual_norm_ar_or_none declined"
    torch.cuda.synchronize()
    mar.check_error(peer)
    out, newp = res
    rn, rp = ops.fused_residual_norm._init_fn(o, w, share, p, blocks, w_mix, norm_w, 1e-5, 1e-5, name, False, True)

    assert rel(out, rn) < 1e-2 and rel(newp, rp) < 1e-2, "partial addend vs the op's reference (NCCL)"
    outs = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(outs, out)
    assert all(torch.equal(x, outs[0]) for x in outs), "ranks differ"
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: ok")


if __name__ == "__main__":
    main()
