"""`nn.Module` layers in the kernels-community convention, for `kernels.kernelize`.

A layer has no constructor and no state of its own: `kernelize` swaps it in for the forward of a
module of the user's model (a class decorated with
`kernels.use_kernel_forward_from_hub("RMSNormResidualMXFP8")`), and the forward then reads that
module's attributes.
"""

from __future__ import annotations

import torch
from torch import nn

from . import fused_rmsnorm_residual_with_grad_port


class RMSNormResidualMXFP8(nn.Module):
    """RMSNorm of `branch` times `self.weight`, plus `residual`, quantized to MXFP8 in one pass.

    The module it replaces holds `weight` ((C,) bfloat16) and `variance_epsilon` (float), the names
    Hugging Face's RMSNorm modules use, and its forward takes (branch, residual), both (N, C)
    bfloat16 on the GPU.

    Returns (vals, scales, rrms, y_port) as `fused_rmsnorm_residual_with_grad_port`: vals (N, C)
    float8_e4m3fn, scales the blocked e8m0 layout a block-scaled GEMM reads, rrms (N,) float32, and
    y_port, the bf16 stand-in for y through which the consumer's d loss / d y reaches the fused
    backward (grad_branch, grad_residual, grad_weight).
    """

    can_torch_compile: bool = True
    has_backward: bool = True

    def forward(self, branch: torch.Tensor, residual: torch.Tensor):
        return fused_rmsnorm_residual_with_grad_port(branch, residual, self.weight, self.variance_epsilon)
