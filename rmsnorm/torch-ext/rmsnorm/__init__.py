"""rmsnorm: fused RMSNorm + residual add + MXFP8 quantization (docs/DESIGN.md §6, §7), and its backward.

Forward (one pass over the inputs)::

    vals, scales, rrms = rmsnorm.fused_rmsnorm_residual(branch, residual, weight, epsilon=1e-6)

    branch, residual : (N, C) bfloat16, contiguous, CUDA;  weight: (C,) bfloat16;  C % 32 == 0
    rrms   (N,) float32         = 1 / sqrt(mean(branch^2, -1) + epsilon)
    y      (N, C) fp32 (never stored) = branch * rrms * weight + residual
    vals   (N, C) float8_e4m3fn = e4m3_satfinite_rne(y * 2^(127 - scale byte))
    scales flat float8_e8m0fnu of roundup(N,128)*roundup(C/32,4) bytes: the RCEIL scale of each
           32-element block of y, in the blocked layout cuBLAS / torch._scaled_mm read
           (offset ((r//128)*ceil(S/4) + s//4)*512 + (r%32)*16 + ((r%128)//32)*4 + s%4), zero padded.

Backward (the quantization is passed straight through: d vals / d y := identity)::

    grad_branch, grad_weight = rmsnorm.fused_rmsnorm_residual_backward(grad_y, branch, weight, rrms)
    grad_residual = grad_y                       # y = ... + residual: no kernel needed

How gradients reach it, and why `vals` is not the gradient carrier
------------------------------------------------------------------
`vals` is float8_e4m3fn.  The autograd engine casts every incoming gradient to the dtype of the
output it belongs to, so a bf16 gradient for `vals` would arrive as unscaled e4m3 (3 mantissa
bits, |g| > 448 -> NaN, |g| < 2^-9 -> 0): a silent loss of the whole gradient signal.  So:

* Training: ask for a *gradient port*::

      vals, scales, rrms, y_port = rmsnorm.fused_rmsnorm_residual_with_grad_port(branch, residual, weight)
      out = my_mxfp8_linear(vals, scales, w_q, w_scales, y_port)   # consumer's autograd.Function

  `y_port` is a bf16 (N, C) tensor with no storage of its own (a broadcast zero); it stands for
  y.  The consumer (the MXFP8 GEMM's autograd Function) takes it as an input and returns its bf16
  gradient d loss / d y for it (e.g. grad_out @ W for a linear).  Its dtype is bf16, so autograd
  hands that gradient over unchanged, and the port's backward runs the fused backward kernel:
  grad_branch, grad_residual (= d loss / d y) and grad_weight flow on to branch, residual and
  weight through ordinary autograd.  Equivalently, a hand-written layer Function can save
  (branch, weight, rrms) and call `fused_rmsnorm_residual_backward` itself.
* Differentiating through `vals` directly (e.g. `vals.float().sum().backward()`) raises a
  RuntimeError that explains the above instead of training on an e4m3-quantized gradient.
  `scales` and `rrms` are not differentiable.

The GPU must be one the variant was compiled for (9.0a, 10.0a, 12.0a; tested on sm_90 only).
"""

from __future__ import annotations

import torch

from . import reference
from ._ops import add_op_namespace_prefix, ops
from .reference import MXFP8_SCALE_BLOCK

__all__ = [
    "MXFP8_SCALE_BLOCK",
    "MAX_HIDDEN",
    "fused_rmsnorm_residual",
    "fused_rmsnorm_residual_backward",
    "fused_rmsnorm_residual_with_grad_port",
    "scales_numel",
    "layers",
    "reference",
]

MAX_HIDDEN = 32768  # the binding's kMaxC


def scales_numel(N: int, C: int) -> int:
    """Bytes of the blocked scale buffer for an (N, C) input."""
    return reference.scales_numel(N, C // MXFP8_SCALE_BLOCK)


def _check_2d_bf16(op: str, name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        raise RuntimeError(f"{op}: {name} must be bfloat16, got {t.dtype}")
    if t.dim() != 2:
        raise RuntimeError(f"{op}: {name} must have rank 2 (N, C), got shape {tuple(t.shape)}")


def fused_rmsnorm_residual(
    branch: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm(branch) * weight + residual, quantized to MXFP8 in one pass.

    Args:
        branch, residual: (N, C) bfloat16, contiguous, same CUDA device; C a multiple of 32, <= 32768.
        weight: (C,) bfloat16.
        epsilon: added to mean(branch^2) before the square root.
    Returns:
        vals (N, C) float8_e4m3fn; scales (scales_numel(N, C),) float8_e8m0fnu, blocked layout;
        rrms (N,) float32.  N == 0 gives empty tensors.
    """
    op = "fused_rmsnorm_residual"
    _check_2d_bf16(op, "branch", branch)
    _check_2d_bf16(op, "residual", residual)
    return ops.fused_rmsnorm_residual(branch, residual, weight, float(epsilon))


def fused_rmsnorm_residual_backward(
    grad_y: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor, rrms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of y = branch * rrms * weight + residual (quantization passed straight through).

    Args:
        grad_y: (N, C) bfloat16, d loss / d y.  branch: (N, C) bfloat16.  weight: (C,) bfloat16.
        rrms: (N,) float32 from the forward.
    Returns:
        grad_branch (N, C) bfloat16, grad_weight (C,) bfloat16 (deterministic: fp32 partials per
        row slot, reduced in a fixed order).  grad_residual is grad_y itself.
    """
    op = "fused_rmsnorm_residual_backward"
    _check_2d_bf16(op, "grad_y", grad_y)
    _check_2d_bf16(op, "branch", branch)
    return ops.fused_rmsnorm_residual_backward(grad_y, branch, weight, rrms)


def fused_rmsnorm_residual_with_grad_port(
    branch: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fused_rmsnorm_residual` plus `y_port`, a storage-free bf16 (N, C) stand-in for y whose
    autograd gradient (bf16, uncast) is d loss / d y; see the module docstring."""
    vals, scales, rrms = fused_rmsnorm_residual(branch, residual, weight, epsilon)
    y_port = ops.fused_rmsnorm_residual_grad_port(branch, residual, weight, rrms.detach())
    return vals, scales, rrms, y_port


# ---- fake kernels (shapes/dtypes for torch.compile / meta tensors) ----


@torch.library.register_fake(add_op_namespace_prefix("fused_rmsnorm_residual"))
def _fused_rmsnorm_residual_fake(branch, residual, weight, epsilon=1e-6):
    N, C = branch.shape
    vals = branch.new_empty((N, C), dtype=torch.float8_e4m3fn)
    scales = branch.new_empty((scales_numel(N, C),), dtype=torch.float8_e8m0fnu)
    rrms = branch.new_empty((N,), dtype=torch.float32)
    return vals, scales, rrms


@torch.library.register_fake(add_op_namespace_prefix("fused_rmsnorm_residual_backward"))
def _fused_rmsnorm_residual_backward_fake(grad_y, branch, weight, rrms):
    return torch.empty_like(branch), torch.empty_like(weight)


@torch.library.register_fake(add_op_namespace_prefix("fused_rmsnorm_residual_grad_port"))
def _fused_rmsnorm_residual_grad_port_fake(branch, residual, weight, rrms):
    N, C = branch.shape
    return branch.new_zeros(()).expand(N, C)


# ---- autograd ----


def _fwd_setup_context(ctx, inputs, output):
    vals, scales, rrms = output
    ctx.mark_non_differentiable(scales, rrms)


def _fwd_backward(ctx, grad_vals, grad_scales, grad_rrms):
    raise RuntimeError(
        "fused_rmsnorm_residual: a gradient reached `vals` (float8_e4m3fn). Autograd casts a "
        "gradient to its output's dtype, so it has already been quantized to unscaled e4m3 "
        f"(got {grad_vals.dtype if grad_vals is not None else None}); refusing to train on it. "
        "Use fused_rmsnorm_residual_with_grad_port(...) and give the bf16 d loss / d y to "
        "`y_port`, or call fused_rmsnorm_residual_backward(grad_y, branch, weight, rrms) yourself."
    )


torch.library.register_autograd(
    add_op_namespace_prefix("fused_rmsnorm_residual"), _fwd_backward, setup_context=_fwd_setup_context
)


def _port_setup_context(ctx, inputs, output):
    branch, residual, weight, rrms = inputs
    ctx.save_for_backward(branch, weight, rrms)


def _port_backward(ctx, grad_y):
    branch, weight, rrms = ctx.saved_tensors
    if grad_y.dtype != torch.bfloat16:  # cannot happen through the engine; be safe for direct calls
        grad_y = grad_y.to(torch.bfloat16)
    grad_y = grad_y.contiguous()
    grad_branch, grad_weight = None, None
    if ctx.needs_input_grad[0] or ctx.needs_input_grad[2]:
        grad_branch, grad_weight = ops.fused_rmsnorm_residual_backward(grad_y, branch, weight, rrms)
    grad_residual = grad_y if ctx.needs_input_grad[1] else None
    return grad_branch, grad_residual, grad_weight, None


torch.library.register_autograd(
    add_op_namespace_prefix("fused_rmsnorm_residual_grad_port"),
    _port_backward,
    setup_context=_port_setup_context,
)


# Last: the layers call the functions above.
from . import layers  # noqa: E402
