#!/usr/bin/env bash
# Builds every member here for the GPU machine's torch (2.11.0+cu130: /work/.library/device/KINDS.md),
# so that a device call carrying the variant folders this prints skips its own compile:
# `prime-kernels build` keeps a variant built elsewhere from the same sources
# (builder.carried_variant), and .ci/gpu-run builds there after all when one does not load.
# The environment (torch's CUDA wheels, ~4.6 GB) lives outside the checkout and is made once.
# Usage: scripts/gpu-prebuild.sh   (GPU_TORCH=2.11.0 and GPU_VENV=<dir> override the defaults)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
TORCH=${GPU_TORCH:-2.11.0}
VENV=${GPU_VENV:-/tmp/prime-kernels-torch-$TORCH}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# torch named with the workspace, so that its `torch>=2.11` cannot move it to another release
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==$TORCH" -e ".[build]"
"$VENV/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null \
  || { echo "$VENV does not hold torch $TORCH" >&2; exit 1; }
PRIME_KERNELS_REQUIRE=1 "$VENV/bin/python" -m prime_kernels build >&2
variant=$("$VENV/bin/python" -c 'from prime_kernels import builder; print(builder.toolchain().variant())' 2>/dev/null)
echo "carry these (with .gpu-wheels) in the device call:"
ls -d */build/"$variant"
