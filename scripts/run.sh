#!/usr/bin/env bash
# The main job: install, print what can run here; on a CUDA machine also build every kernel
# and run a short demo of each.
source "$(dirname "$0")/env.sh"
"$PY" -m prime_kernels status
if "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  "$PY" -m prime_kernels build
  "$PY" -m prime_kernels status
  "$PY" scripts/demo.py
else
  echo "no CUDA device here: not building or running the kernels (the status above says why)"
fi
