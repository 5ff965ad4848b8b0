#!/bin/bash
# Which kernel family moves the compiled model away from eager: the e2e smoke with each family turned off in turn.
#   bash benchmarks/bisect_e2e.sh CONFIG M STEPS   (on the GPU, after benchmarks/on_device.sh's preamble)
CFG=${1:-wide_all}; M=${2:-1}; STEPS=${3:-3}
for off in none linear fused_residual_norm kda_recurrent mla_attention moe_experts ALL; do
  if [ "$off" = ALL ]; then env="K3FUSE_KERNELS=0"; else env="K3FUSE_DISABLE_KERNELS=$off"; fi
  r=$(env $env python3 benchmarks/gpu_e2e_smoke.py --out /tmp --configs $CFG --ms $M --steps $STEPS 2>/dev/null \
      | grep '^{' | tail -1 | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print(r.get('forced_max_rel_err'), r.get('max_rel_err'), r.get('error',''))")
  echo "$CFG M=$M off=$off forced/free: $r"
done
