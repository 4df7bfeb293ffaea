"""The tests' error measure against a truth tensor."""

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius norms, in fp64) of `a` against the truth `b`; 0 when both are
    zero, and huge (so any tolerance fails) when only `b` is."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()
