#!/usr/bin/env bash
# Fill .gpu-wheels/ for the H200 machine (docs/GPU_MACHINE.md): ../shared/tools/gpu-wheels.sh,
# plus what `kernels lock` imports through sigstore and that machine's image lacks (its package
# list: /work/.library/device/KINDS.md; it has requests, urllib3, certifi, rich). tests/
# test_consumer_readme.py runs `kernels lock --help`; without these it dies on `import
# cryptography`. scripts/env.sh installs the folder with --no-deps, so the set is pinned: pip's
# resolution of sigstore 4.5.1's dependencies for Python 3.12 on 2026-12-05, checked by running
# `kernels lock --help` over a bare huggingface_hub + pytest + requests. typing-extensions: pydantic
# needs a recent one, and the image's version is not listed.
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash ../shared/tools/gpu-wheels.sh sigstore==4.5.1 \
  cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 tuf==7.0.1 securesystemslib==1.6.0 rfc8785==0.1.4 \
  pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 \
  sigstore-rekor-types==0.0.18 sigstore-models==0.0.6 rfc3161-client==1.0.9 id==1.6.1 pyjwt==2.15.1 \
  platformdirs==4.14.9 typing-extensions==4.16.0 "$@"
