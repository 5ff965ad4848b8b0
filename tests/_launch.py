"""Launch worker scripts, one process per rank: gloo worlds for the CPU tensor-parallel tests, GPU worlds for the
multi-GPU collective tests."""
import os
import subprocess
import sys
from pathlib import Path


def run_workers(script: str, world: int, args: list, env: dict | None = None, timeout: int = 300) -> None:
    """Start tests/<script> once per rank r as `python script r *args`; every rank must exit 0 (its log otherwise)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    worker = str(Path(__file__).parent / script)
    procs = [subprocess.Popen([sys.executable, worker, str(r), *map(str, args)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-4000:]}"


def finish_worker() -> None:
    """The last call of a gloo rank script, after dist.destroy_process_group(): flush and leave with os._exit(0),
    skipping interpreter finalization, where gloo's threads can abort the process ("terminate called without an
    active exception": seen once in a CI run of the TP property test, not reproduced in 24 local worlds)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch_ranks(script: str, world: int, tmp: Path, seed: int, timeout: int = 300) -> None:
    """A gloo world on CPU: worker argv = rank, world, store file, tmp dir, seed."""
    env = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")} if os.path.exists("/sys/class/net/lo") \
        else {}
    run_workers(script, world, [world, tmp / "store", tmp, seed], env, timeout)


# NVLink multicast stays off on the lent multi-GPU machines, also in the processes the tests start
MULTICAST_OFF = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")


def multi_gpu_worlds() -> list[int]:
    """The TP worlds a multi-GPU test is parametrized over: 2, and 4 / 8 where the machine has that many GPUs."""
    import torch
    return [w for w in (2, 4, 8) if w <= max(torch.cuda.device_count(), 2)]


def run_gpu_workers(script: str, world: int, tmp: Path, env: dict | None = None, timeout: int = 600) -> None:
    """One process per GPU: worker argv = rank, world, tmp dir; multicast off. Skips the calling test on a machine
    with fewer than `world` GPUs."""
    import pytest
    import torch
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs (have {torch.cuda.device_count()})")
    run_workers(script, world, [world, tmp], {**MULTICAST_OFF, **(env or {})}, timeout)
