"""Launch a gloo world of worker scripts (one process per rank) for the CPU tensor-parallel tests."""
import os
import subprocess
import sys
from pathlib import Path


def launch_ranks(script: str, world: int, tmp: Path, seed: int, timeout: int = 300) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    worker = str(Path(__file__).parent / script)
    procs = [subprocess.Popen([sys.executable, worker, str(r), str(world), str(tmp / "store"), str(tmp), str(seed)],
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
