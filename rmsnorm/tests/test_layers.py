"""rmsnorm's `layers.py`: a layer `kernels.kernelize` accepts (stateless, no constructor, the
forward signature of the module it replaces), and on the GPU a kernelized model runs the op."""

import pathlib

import kernel_package
import pytest
import torch
from torch import nn

MEMBER_DIR = pathlib.Path(__file__).resolve().parents[1]
LAYER = "RMSNormResidualMXFP8"


def _user_module_class(reference):
    """The module a user's model holds: HF RMSNorm attribute names, forward(branch, residual),
    the reference computation, marked for `kernelize`."""
    from kernels import use_kernel_forward_from_hub

    @use_kernel_forward_from_hub(LAYER)
    class RMSNormResidual(nn.Module):
        def __init__(self, hidden, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16))
            self.variance_epsilon = eps

        def forward(self, branch, residual):
            vals, scales, rrms = reference.fused_rmsnorm_residual(branch, residual, self.weight, self.variance_epsilon)
            return vals, scales, rrms, reference.y_reference(branch, residual, self.weight, self.variance_epsilon)

    return RMSNormResidual


def _layers_without_native_code():
    """layers.py loaded under a stand-in parent package (its native ops need a GPU build)."""
    return kernel_package.load_submodule("rmsnorm_layers_parent", MEMBER_DIR / "torch-ext" / "rmsnorm", "layers",
                                         fused_rmsnorm_residual_with_grad_port=lambda *a: a)


def test_layer_passes_kernelize_validation(reference):
    from kernels.layer.layer import _validate_layer, _validate_layer_has_mode
    from kernels import Mode

    layer = getattr(_layers_without_native_code(), LAYER)
    _validate_layer(check_cls=_user_module_class(reference), cls=layer, repo="rmsnorm")
    _validate_layer_has_mode(layer_name=LAYER, module=layer, repo="rmsnorm",
                             repo_mode=Mode.TRAINING | Mode.TORCH_COMPILE)

    class WithState(layer):
        scale = 2.0

    with pytest.raises(TypeError, match="additional members"):  # the validation can fail
        _validate_layer(check_cls=_user_module_class(reference), cls=WithState, repo="rmsnorm")


@pytest.mark.gpu
def test_kernelized_model_runs_the_op(kernel, reference):
    import prime_kernels
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    N, C = 256, 1024
    g = torch.Generator(device="cuda").manual_seed(5)
    model = nn.Sequential(_user_module_class(reference)(C)).cuda()
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(C, generator=g, device="cuda").bfloat16())
    branch = torch.randn(N, C, generator=g, device="cuda").bfloat16().requires_grad_()
    residual = torch.randn(N, C, generator=g, device="cuda").bfloat16()
    repo = LocalLayerRepository(repo_path=prime_kernels.spec("rmsnorm").build_dir, layer_name=LAYER)
    with use_kernel_mapping({LAYER: {"cuda": repo}}):
        kernelize(model, mode=Mode.TRAINING, device="cuda")
    vals, scales, rrms, y_port = model[0](branch, residual)
    want = kernel.fused_rmsnorm_residual(branch.detach(), residual, model[0].weight.detach())
    for got, ref in zip((vals, scales, rrms), want):
        assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                           ref.view(torch.uint8) if ref.element_size() == 1 else ref)
    grad_y = torch.randn(N, C, generator=g, device="cuda").bfloat16()
    (y_port.float() * grad_y.float()).sum().backward()
    gb, gw = kernel.fused_rmsnorm_residual_backward(grad_y, branch.detach(), model[0].weight.detach(), rrms)
    assert torch.equal(branch.grad, gb) and torch.equal(model[0].weight.grad, gw)
