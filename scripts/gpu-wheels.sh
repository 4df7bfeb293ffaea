#!/usr/bin/env bash
# Fill .gpu-wheels/ for a GPU machine with no network (docs/GPU_MACHINE.md): the wheels its image
# lacks, for its Python 3.12 on x86-64 manylinux. scripts/env.sh (and so .ci/gpu-run) installs the
# folder offline with --no-deps, so the set is pinned whole. Run it where PyPI is reachable; extra
# NAME==VERSION specs may be given as arguments.
#   - the workspace's own pins (pyproject.toml: kernels, kernels-data), tomlkit;
#   - the benchmarks' peers: liger-kernel (rmsnorm), nvidia-cutlass;
#   - what `kernels lock` imports through sigstore (tests/test_consumer_readme.py runs `kernels lock
#     --help`; without these it dies on `import cryptography`): pip's resolution of sigstore 4.5.1's
#     dependencies for Python 3.12 on 2026-12-05, checked by running `kernels lock --help` over a bare
#     huggingface_hub + pytest + requests. typing-extensions: pydantic needs a recent one.
# The H200 image already holds torch 2.11 (CUDA 13.0), Triton, pytest, huggingface_hub, requests,
# urllib3, certifi and rich (/work/.library/device/KINDS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.gpu-wheels
mkdir -p "$dest"
pins=$(python3 -c 'import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(" ".join(d for d in deps if d.startswith(("kernels==", "kernels-data=="))))')
# shellcheck disable=SC2086  # $pins: one word per spec
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dest" \
  $pins tomlkit==0.15.3 liger-kernel==0.8.5 nvidia-cutlass==4.2.0.0 \
  sigstore==4.5.1 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 tuf==7.0.1 securesystemslib==1.6.0 \
  rfc8785==0.1.4 pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 \
  sigstore-rekor-types==0.0.18 sigstore-models==0.0.6 rfc3161-client==1.0.9 id==1.6.1 pyjwt==2.15.1 \
  platformdirs==4.14.9 typing-extensions==4.16.0 "$@"
ls -1 "$dest"
du -sh "$dest"
