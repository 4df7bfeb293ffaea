"""`nn.Module` layers in the kernels-community convention, for `kernels.kernelize`.

A layer has no constructor and no state of its own: `kernelize` swaps its forward in for that of
a module in the user's model (a class decorated with
`kernels.use_kernel_forward_from_hub("MoEExperts")`), and the forward then reads that module's
attributes.
"""

from __future__ import annotations

import torch
from torch import nn

from .functional import moe


class MoEExperts(nn.Module):
    """Routed experts: `moe(x, self.w1, self.w2, self.w3, topk_ids, topk_weights)`, differentiable.

    The module it replaces holds the expert weights as prime-rl's GroupedExperts does: `w1` (gate)
    and `w3` (up) of shape (E, I, K), `w2` (down) of shape (E, K, I), any float dtype; and
    optionally `mxfp8` (bool) to run the forward in MXFP8. Its forward takes x (M, K),
    topk_ids (M, top_k) and topk_weights (M, top_k) and returns (M, K) in x's dtype.
    """

    # No test runs `moe` (an autograd.Function around the custom ops) under torch.compile yet,
    # so kernelize does not offer this layer to a model it compiles.
    can_torch_compile: bool = False
    has_backward: bool = True

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return moe(x, self.w1, self.w2, self.w3, topk_ids, topk_weights, mxfp8=getattr(self, "mxfp8", False))
