# generated from common/conftest.py: edit there and run scripts/sync_common.py
"""Fixtures of a member's tests: the pure-PyTorch reference (CPU) and the built kernel (GPU).

The member is the folder above this one, and its kernel is named after it. The `gpu` marker is
declared once, in the workspace's pyproject.toml, which these tests always run under.
"""

import pathlib
import sys

import pytest

MEMBER_DIR = pathlib.Path(__file__).resolve().parents[1]
KERNEL = MEMBER_DIR.name

# kernel_package.py beside this file (the tests import it too; both members' copies are the same file)
sys.path.append(str(pathlib.Path(__file__).resolve().parent))
import kernel_package  # noqa: E402


@pytest.fixture(scope="session")
def reference():
    return kernel_package.load_reference(MEMBER_DIR)


@pytest.fixture(scope="session")
def kernel():
    """The kernel module, loaded the way users load it; skips with the loader's reason."""
    try:
        import prime_kernels
    except ImportError:
        pytest.skip("prime_kernels is not importable: install the workspace (pip install -e .)")
    reason = prime_kernels.unavailable_reason(KERNEL)
    if reason is not None:
        pytest.skip(reason)
    return prime_kernels.load(KERNEL)
