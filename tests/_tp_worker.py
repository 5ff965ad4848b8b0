"""One rank of the tensor-parallel tests (tests/test_model_tp.py); run as a script, one process per rank.

    python _tp_worker.py RANK WORLD INIT_FILE OUT_DIR SEED

In a gloo world of WORLD = 4 ranks it runs the tiny model at TP = 4 (all ranks) and TP = 2 (ranks {0,1} and
{2,3}), 3 decode steps with M = 3 and the token ids the test draws from SEED, and saves each rank's logits to
OUT_DIR/tp{t}_rank{r}.pt. Ranks 0-2 also try TP = 3, which must fail at construction with a ValueError; the
message goes to OUT_DIR/tp3_rank{r}.txt.
"""
import sys

import torch
import torch.distributed as dist

from k3fuse.models import KimiK3Config, KimiK3ForCausalLM

M, STEPS = 3, 3


def token_ids(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (M,), generator=g) for _ in range(STEPS)]


@torch.no_grad()
def decode(cfg, seed, group=None):
    torch.manual_seed(seed)
    model = KimiK3ForCausalLM(cfg, tp_group=group)
    cache = model.new_cache(M, 8)
    return torch.stack([model(ids, cache) for ids in token_ids(cfg, seed)])


def main():
    rank, world, init_file, out, seed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cfg = KimiK3Config.preset("tiny")
    # every rank takes part in creating every group
    g2 = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    g3 = dist.new_group([0, 1, 2])
    torch.save(decode(cfg, seed, dist.group.WORLD), f"{out}/tp4_rank{rank}.pt")
    torch.save(decode(cfg, seed, g2[rank // 2]), f"{out}/tp2_rank{rank}.pt")
    if rank < 3:
        try:
            KimiK3ForCausalLM(cfg, tp_group=g3)
            msg = "NO ERROR"
        except ValueError as e:
            msg = f"ValueError: {e}"
        with open(f"{out}/tp3_rank{rank}.txt", "w") as f:
            f.write(msg)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from _launch import finish_worker
    finish_worker()
