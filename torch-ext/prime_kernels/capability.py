"""Compute capabilities: kernel-builder's strings ("9.0a") and the exact-match rule.

prime-kernels compiles architecture-specific code (`sm_90a`: wgmma, setmaxnreg), which runs on
exactly one capability; so a variant is usable only when the device's (major, minor) equals one
of the capabilities it was compiled for. No forward compatibility, no PTX fallback.
"""

from __future__ import annotations

import re

_ARCH = re.compile(r"(\d+)\.(\d+)([af]?)(\+PTX)?")

# The first nvcc that can compile each capability (CUDA release notes).
MIN_NVCC = {(9, 0): (12, 0), (10, 0): (12, 8), (10, 3): (12, 9), (12, 0): (12, 8), (12, 1): (12, 9)}


def parse(arch: str) -> tuple[int, int]:
    """"9.0a" -> (9, 0). Raises ValueError naming the string for anything else."""
    m = _ARCH.fullmatch(arch)
    if not m:
        raise ValueError(f"not a CUDA capability: {arch!r} (expected e.g. \"9.0a\")")
    return int(m.group(1)), int(m.group(2))


_SM_NAME = re.compile(r"(?:sm_|compute_)?(\d+)(\d)([af]?)")


def from_sm_name(text: str) -> str | None:
    """"sm_100a" (or "100a", "compute_90a") -> "10.0a", the form build.toml wants; None if it is not one."""
    m = _SM_NAME.fullmatch(text)
    return f"{m.group(1)}.{m.group(2)}{m.group(3)}" if m else None


def sm_name(arch: str) -> str:
    """"9.0a" -> "sm_90a"."""
    m = _ARCH.fullmatch(arch)
    if not m:
        raise ValueError(f"not a CUDA capability: {arch!r}")
    return f"sm_{m.group(1)}{m.group(2)}{m.group(3)}"


def device_sm(capability: tuple[int, int]) -> str:
    """(9, 0) -> "sm_90"."""
    return f"sm_{capability[0]}{capability[1]}"


def gencode(arch: str) -> str:
    """nvcc flag embedding machine code for exactly this capability ("9.0a" -> compute_90a/sm_90a)."""
    sm = sm_name(arch)
    return f"-gencode=arch=compute_{sm[3:]},code={sm}"


def mismatch_reason(archs: list[str] | tuple[str, ...], capability: tuple[int, int]) -> str | None:
    """None when `capability` equals one of `archs`, else "built for sm_90a, this device is sm_100"."""
    if any(parse(a) == capability for a in archs):
        return None
    built = ", ".join(sm_name(a) for a in sorted(archs)) or "no capability"
    return f"built for {built}, this device is {device_sm(capability)}"
