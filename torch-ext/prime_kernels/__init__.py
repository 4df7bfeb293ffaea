"""prime-kernels: the front door to the workspace's kernels.

    import prime_kernels
    prime_kernels.status()                 # {"flash_moe": "available", "rmsnorm": "<reason>"}
    if prime_kernels.is_available("rmsnorm"):
        rmsnorm = prime_kernels.load("rmsnorm")

A kernel is refused, with a reason that names the fix, unless the GPU's compute capability is
exactly one its variant was compiled for. Importing this package needs no GPU, nvcc or network;
torch and kernels are imported on first use.
"""

from __future__ import annotations

import functools

from .workspace import KernelSpec, ManifestError, read_workspace

__all__ = [
    "KERNELS",
    "KernelSpec",
    "ManifestError",
    "spec",
    "is_available",
    "unavailable_reason",
    "load",
    "status",
]


@functools.cache
def _specs() -> dict[str, KernelSpec]:
    return read_workspace()


def __getattr__(name: str):
    # KERNELS is read from the workspace manifest on first access, not at import.
    if name == "KERNELS":
        return tuple(_specs())
    raise AttributeError(f"module 'prime_kernels' has no attribute {name!r}")


def spec(name: str) -> KernelSpec:
    """The member's manifest data. Unknown name: KeyError listing the known ones."""
    specs = _specs()
    if name not in specs:
        raise KeyError(f"unknown kernel {name!r}; known kernels: {', '.join(specs)}")
    return specs[name]


def _resolve(name: str, device=None):
    from .registry import resolve

    return resolve(spec(name), device)


def unavailable_reason(name: str, device=None) -> str | None:
    """None when `load(name, device)` would succeed, else why not and what to do about it."""
    return _resolve(name, device).reason


def is_available(name: str, device=None) -> bool:
    return unavailable_reason(name, device) is None


def load(name: str, device=None):
    """Import the kernel's module for `device` (default: the current CUDA device).

    Raises RuntimeError(reason) when it cannot run there; no native code is imported then.
    """
    from .registry import import_kernel

    resolution = _resolve(name, device)
    if resolution.reason is not None:
        raise RuntimeError(f"prime_kernels: cannot load {name}: {resolution.reason}")
    return import_kernel(spec(name), resolution)


def status(device=None) -> dict[str, str]:
    """{kernel: "available" or the reason it is not}."""
    return {name: unavailable_reason(name, device) or "available" for name in _specs()}
