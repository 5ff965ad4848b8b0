"""One rank of the property-based TP test (tests/test_passes.py): compile a given small config at TP = WORLD with
all passes (eager inner compiler) and compare with the eager model on the same ranks.

    python _tp_property_worker.py RANK WORLD INIT_FILE OUT_DIR SEED      (OUT_DIR/config.json holds the config)
"""
import json
import sys

import torch
import torch.distributed as dist

from k3fuse.backend import LAST_PIPELINES
from k3fuse.models import KimiK3Config, KimiK3ForCausalLM


@torch.no_grad()
def main():
    rank, world, init_file, out, seed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    spec = json.load(open(f"{out}/config.json"))
    cfg = KimiK3Config.from_dict(spec["config"])
    torch.manual_seed(seed)
    model = KimiK3ForCausalLM(cfg, tp_group=dist.group.WORLD).requires_grad_(False)
    compiled = torch.compile(model, backend="k3fuse", fullgraph=True, options={"inner_compiler": "eager"})
    M = spec["M"]
    ce, cc = model.new_cache(M, 4), model.new_cache(M, 4)
    g = torch.Generator().manual_seed(seed)
    errs = []
    for _ in range(2):
        ids = torch.randint(0, cfg.vocab_size, (M,), generator=g)
        a = torch.ops._c10d_functional.wait_tensor(model(ids, ce))
        b = compiled(ids, cc)
        errs.append(((b.double() - a.double()).norm() / a.double().norm()).item())
    if rank == 0:
        s = LAST_PIPELINES[-1].summary
        with open(f"{out}/result.json", "w") as f:       # closed before finish_worker's os._exit
            json.dump({"errs": errs, "matches": {p["name"]: p["matches"] for p in s["passes"]}}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from _launch import finish_worker
    finish_worker()
