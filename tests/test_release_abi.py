"""kernel-abi-check, kernel-builder's ABI checks, on every built extension: the toy member's, and
each workspace member's (scripts/test.sh builds them all before pytest).

abi3 (Python 3.9) must pass everywhere. manylinux_2_28 must pass for kernel-builder's variants; a
local development build compiled on a glibc >= 2.32 host fails it (`__libc_single_threaded`, from
libstdc++'s headers), which is reported as an expected failure naming the file and the symbols,
and is why `prime-kernels check-upload` refuses to upload local variants."""

import os
import pathlib

import pytest

from toy_workspace import REPO
from prime_kernels import builder
from prime_kernels.workspace import read_workspace

MEMBERS = list(read_workspace(REPO))


def _unavailable(reason: str):
    """Skips here; in CI, where every member is built and the test extra installed, fails."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI=1)")
    pytest.skip(reason)


@pytest.fixture(scope="module", autouse=True)
def kernel_abi_check():
    try:
        import kernel_abi_check  # noqa: F401
    except ImportError:
        _unavailable("kernel-abi-check is not installed: pip install -e '.[test]'")


@pytest.fixture(params=["toy", *MEMBERS])
def extensions(request) -> list[pathlib.Path]:
    """Every built `.abi3.so` of one member, across its variants."""
    member = request.param
    root = request.getfixturevalue("built_toy") if member == "toy" else REPO
    found = [so for v in builder.variant_dirs(root / member / "build") for so in sorted(v.glob("*.abi3.so"))]
    if not found:
        _unavailable(f"{member} has no built extension: `prime-kernels build {member}` (scripts/test.sh builds every member)")
    return found


def test_every_extension_passes_abi3(extensions):
    failures = [line for so in extensions for line in builder.abi_failures(so, checks=[builder.ABI3_CHECK])]
    assert not failures, "\n".join(failures)


def test_every_extension_passes_manylinux(extensions):
    expected, failures = [], []
    for so in extensions:
        lines = builder.abi_failures(so, checks=[builder.MANYLINUX])
        (expected if builder.is_development_build(so.parent) else failures).extend(lines)
    assert not failures, "\n".join(failures)
    if expected:
        pytest.xfail("local development build, not uploadable: " + "; ".join(expected))
