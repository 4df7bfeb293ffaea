# Sourced by scripts/run.sh and scripts/test.sh: a .venv with the workspace installed in it.
# The venv sees the system's packages, so a machine's own CUDA build of torch is used as is;
# without one, torch 2.14.1 (CUDA 13.0) is installed. With a .gpu-wheels/ folder (a GPU machine
# with no network, see ../shared/tools/gpu-wheels.sh) everything installs from it, offline.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv --system-site-packages .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
pip_quiet=(-q --disable-pip-version-check)
if [ -d .gpu-wheels ]; then
  python -m pip install "${pip_quiet[@]}" --no-index --no-deps .gpu-wheels/*.whl
  python -m pip install "${pip_quiet[@]}" --no-index --no-deps --no-build-isolation -e .
else
  python -c "import torch" 2>/dev/null || python -m pip install "${pip_quiet[@]}" "torch==2.14.1"
  python -m pip install "${pip_quiet[@]}" -e ".[build,test]"
fi
