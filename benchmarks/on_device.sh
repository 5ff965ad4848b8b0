#!/bin/bash
# Run a command on the lent H200 with nvidia-cutlass-dsl staged from .cutedsl/ (../shared/device/stage-cutedsl)
# and k3fuse installed editable:   bash benchmarks/on_device.sh python3 benchmarks/layer_bench.py --out $OUT
set -e
mkdir -p "$HOME/cutedsl-site"
[ -d "$HOME/cutedsl-site/nvidia_cutlass_dsl" ] || tar xJf .cutedsl/cutedsl-4.8.1-cp312.tar.xz -C "$HOME/cutedsl-site"
export PYTHONPATH=$HOME/cutedsl-site:$HOME/cutedsl-site/nvidia_cutlass_dsl/dsl_packages:$PWD:$PWD/benchmarks:$PYTHONPATH
export K3FUSE_CACHE_DIR=${K3FUSE_CACHE_DIR:-$HOME/k3cache}
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
set +e
"$@"
