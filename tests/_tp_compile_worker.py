"""One rank of the compiled tensor-parallel tests (tests/test_passes.py); run as a script, one process per rank.

    python _tp_compile_worker.py RANK WORLD INIT_FILE OUT_DIR SEED

In a gloo world of 4 ranks: TP = 4 (all ranks), then TP = 2 (ranks {0,1} and {2,3}). Each compiles the tiny model
with backend="k3fuse" (all passes, eager inner compiler), runs 3 decode steps (and TP = 4 again in bf16) with M = 3 next to the eager model
and saves both logits and the pipeline summary to OUT_DIR/tp{t}_rank{r}.pt.
"""
import sys

import torch
import torch.distributed as dist

from k3fuse.backend import LAST_PIPELINES
from k3fuse.models import PRESETS, KimiK3Config, KimiK3ForCausalLM

M, STEPS = 3, 3


@torch.no_grad()
def run(cfg, seed, group, dtype=torch.float32):
    torch.manual_seed(seed)
    model = KimiK3ForCausalLM(cfg, tp_group=group, dtype=dtype).requires_grad_(False)
    compiled = torch.compile(model, backend="k3fuse", fullgraph=True, options={"inner_compiler": "eager"})
    ce, cc = model.new_cache(M, 8), model.new_cache(M, 8)
    g = torch.Generator().manual_seed(seed + 1)
    eager, comp = [], []
    for _ in range(STEPS):
        ids = torch.randint(0, cfg.vocab_size, (M,), generator=g)
        eager.append(torch.ops._c10d_functional.wait_tensor(model(ids, ce)).clone())
        comp.append(compiled(ids, cc).clone())
    return {"eager": torch.stack(eager), "compiled": torch.stack(comp), "summary": LAST_PIPELINES[-1].summary}


def main():
    rank, world, init_file, out, seed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cfg = KimiK3Config.preset("tiny")
    g2 = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    torch.save(run(cfg, seed, dist.group.WORLD), f"{out}/tp4_rank{rank}.pt")
    torch.save(run(cfg, seed, g2[rank // 2]), f"{out}/tp2_rank{rank}.pt")
    # bf16: every expert chosen, so a rounding difference cannot flip a top-k choice (which changes logits O(1))
    all_experts = KimiK3Config.from_dict({**PRESETS["tiny"], "num_experts_per_token": PRESETS["tiny"]["num_experts"]})
    torch.save(run(all_experts, seed, dist.group.WORLD, torch.bfloat16), f"{out}/tp4bf16_rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from _launch import finish_worker
    finish_worker()
