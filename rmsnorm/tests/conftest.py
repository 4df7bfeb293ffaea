"""Fixtures for the rmsnorm tests: the pure-PyTorch reference (CPU) and the built kernel (GPU)."""

import importlib.util
import pathlib
import sys

import pytest

MEMBER_DIR = pathlib.Path(__file__).resolve().parents[1]
KERNEL = "rmsnorm"


def _module_from_file(name: str, path: pathlib.Path):
    # The reference is a plain file of the package, loaded without the package's
    # __init__ (which imports the native extension).
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def reference():
    return _module_from_file(f"{KERNEL}_reference", MEMBER_DIR / "torch-ext" / KERNEL / "reference.py")


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
