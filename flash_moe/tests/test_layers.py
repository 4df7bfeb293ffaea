"""flash_moe's `layers.py`: a layer `kernels.kernelize` accepts (stateless, no constructor, the
forward signature of the module it replaces). On the GPU, test_moe_backward_gpu.py kernelizes a
model with it."""

import pathlib

import kernel_package
import pytest
import torch
from torch import nn

MEMBER_DIR = pathlib.Path(__file__).resolve().parents[1]
LAYER = "MoEExperts"


def _user_module_class():
    """The module a user's model holds: prime-rl's GroupedExperts weights, forward(x, ids, weights)."""
    from kernels import use_kernel_forward_from_hub

    @use_kernel_forward_from_hub(LAYER)
    class Experts(nn.Module):
        def __init__(self, E, K, I):
            super().__init__()
            self.w1 = nn.Parameter(torch.empty(E, I, K))
            self.w2 = nn.Parameter(torch.empty(E, K, I))
            self.w3 = nn.Parameter(torch.empty(E, I, K))

        def forward(self, x, topk_ids, topk_weights):
            raise NotImplementedError

    return Experts


def test_layer_passes_kernelize_validation():
    from kernels import Mode
    from kernels.layer.layer import _validate_layer, _validate_layer_has_mode

    stand_ins = {name: (lambda *a, **k: None) for name in
                 ("fused_moe_bf16", "fused_moe_bf16_dgrad", "fused_moe_bf16_wgrad", "fused_moe_mxfp8", "moe_align",
                  "preact_numel", "quantize_mxfp8")}
    layers = kernel_package.load_submodule("flash_moe_layers_parent", MEMBER_DIR / "torch-ext" / "flash_moe",
                                           "layers", **stand_ins)
    layer = getattr(layers, LAYER)
    _validate_layer(check_cls=_user_module_class(), cls=layer, repo="flash_moe")
    _validate_layer_has_mode(layer_name=LAYER, module=layer, repo="flash_moe", repo_mode=Mode.TRAINING)
    with pytest.raises(ValueError, match="torch.compile"):  # the mode check can fail
        _validate_layer_has_mode(layer_name=LAYER, module=layer, repo="flash_moe", repo_mode=Mode.TORCH_COMPILE)
