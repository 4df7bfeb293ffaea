"""Toy kernel used by the workspace tests: `scale(x, alpha) -> x * alpha` (float32, CUDA)."""

import torch

from ._ops import add_op_namespace_prefix, ops


@torch.library.register_fake(add_op_namespace_prefix("scale"))
def _scale_fake(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return torch.empty_like(x)


def scale(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return ops.scale(x, alpha)


__all__ = ["scale"]
