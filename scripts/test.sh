#!/usr/bin/env bash
# Every test: builds every member first (a kernel that does not compile fails here), then pytest,
# which also runs kernel-abi-check on every built extension. GPU tests run where a GPU of the
# right capability is present and skip with the reason elsewhere.
source "$(dirname "$0")/env.sh"
"$PY" -m prime_kernels build
"$PY" -m pytest "$@"
