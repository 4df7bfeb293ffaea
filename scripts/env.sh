# Sourced by scripts/run.sh, scripts/test.sh and .ci/gpu-run: sets PY to a Python that has the
# workspace installed. Inside an active virtual environment (or a python3 that lives in one,
# as on the GPU machine) that environment is used; otherwise .venv is made, seeing the system's
# packages, so a machine's own CUDA torch is used as is. Without any torch, torch 2.14.1 (CUDA
# 13.0) is installed. With a .gpu-wheels/ folder this Python can take every wheel of (the GPU
# machine with no network, see scripts/gpu-wheels.sh) everything installs from it, offline.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
  [ -x .venv/bin/python ] || "$PY" -m venv --system-site-packages .venv
  PY=$ROOT/.venv/bin/python
fi
export PY
pip=("$PY" -m pip install -q --disable-pip-version-check)
# The wheels' folder serves the interpreter it was filled for (the GPU machine's Python 3.12): a
# checkout carrying it may run elsewhere too, where it is ignored (a part of its pinned set would
# break the rest).
offline_wheels() {
  [ -d .gpu-wheels ] && "$PY" -c 'import glob, sys
from pip._vendor.packaging import tags, utils
ok = set(tags.sys_tags())
wheels = glob.glob(".gpu-wheels/*.whl")
others = [w for w in wheels if not ok & set(utils.parse_wheel_filename(w.rsplit("/", 1)[1])[3])]
if others or not wheels:
    print(".gpu-wheels/ is not for this Python (installing online instead):", *others or ["no wheels"],
          sep="\n  ", file=sys.stderr)
sys.exit(bool(others or not wheels))'
}
if offline_wheels; then
  "${pip[@]}" --no-index --no-deps .gpu-wheels/*.whl
  "${pip[@]}" --no-index --no-deps --no-build-isolation -e .
else
  "$PY" -c "import torch" 2>/dev/null || "${pip[@]}" "torch==2.14.1"
  "${pip[@]}" -e ".[build,test]"
fi
