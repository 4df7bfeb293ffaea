"""prime-kernels: the front door to the workspace's kernels.

    import prime_kernels
    prime_kernels.status()                 # {"flash_moe": "available", "rmsnorm": "<reason>"}
    if prime_kernels.is_available("rmsnorm"):
        rmsnorm = prime_kernels.load("rmsnorm")
    prime_kernels.load("rmsnorm", version=2)   # another Hub release than the pinned one

The kernels are those of the workspace (the checkout found through $PRIME_KERNELS_WORKSPACE or
from the current directory upwards), else those of the release this package was tested with
(its shipped `release.toml`). A kernel is refused, with a reason that names the fix, unless the
GPU's compute capability is exactly one its variant was compiled for. Importing this package
needs no GPU, nvcc or network; torch and kernels are imported on first use.
"""

from __future__ import annotations

import functools

from .registry import KernelStatus
from .workspace import HubPin, KernelSpec, ManifestError, read_kernels

__all__ = [
    "KERNELS",
    "HubPin",
    "KernelSpec",
    "KernelStatus",
    "ManifestError",
    "spec",
    "is_available",
    "unavailable_reason",
    "load",
    "status",
]


@functools.cache
def _specs() -> dict[str, KernelSpec]:
    # Read once per process: the workspace (or its absence) as seen from the first caller's cwd.
    return read_kernels()


def __getattr__(name: str):
    # KERNELS is read from the manifests on first access, not at import.
    if name == "KERNELS":
        return tuple(_specs())
    raise AttributeError(f"module 'prime_kernels' has no attribute {name!r}")


def spec(name: str) -> KernelSpec:
    """The kernel's manifest data. Unknown name: KeyError listing the known ones."""
    specs = _specs()
    if name not in specs:
        raise KeyError(f"unknown kernel {name!r}; known kernels: {', '.join(specs)}")
    return specs[name]


def _resolve(name: str, device=None, version: int | None = None, revision: str | None = None):
    from .registry import resolve

    return resolve(spec(name), device, version=version, revision=revision)


def unavailable_reason(name: str, device=None, *, version: int | None = None, revision: str | None = None) -> str | None:
    """None when `load(name, device, version=, revision=)` would succeed, else why not and what to do about it."""
    return _resolve(name, device, version, revision).reason


def is_available(name: str, device=None, *, version: int | None = None, revision: str | None = None) -> bool:
    return unavailable_reason(name, device, version=version, revision=revision) is None


def load(name: str, device=None, *, version: int | None = None, revision: str | None = None):
    """Import the kernel's module for `device` (default: the current CUDA device).

    `version=N` or `revision="<branch, tag or commit>"` choose the Hub release, overriding the
    consumer's kernels.lock, the workspace's pin and the shipped one (in that order of precedence).
    They do not skip `LOCAL_KERNELS` or a local build, which come before the Hub.
    Raises RuntimeError(reason) when it cannot run there; no native code is imported then.
    """
    from .registry import import_kernel

    resolution = _resolve(name, device, version, revision)
    if resolution.reason is not None:
        raise RuntimeError(f"prime_kernels: cannot load {name}: {resolution.reason}")
    return import_kernel(spec(name), resolution)


def status(device=None) -> dict[str, KernelStatus]:
    """{kernel: "available" or the reason it is not}.

    Each value is a str; it also carries `.source` and `.location` (where it would load from) and
    `.pin` (the Hub pin used, with `.pin.origin` and `.pin.path`: which file chose it)."""
    return {name: KernelStatus(_resolve(name, device)) for name in _specs()}
