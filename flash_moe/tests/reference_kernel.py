"""flash_moe with its pure-PyTorch reference standing in for the kernels: the package's ops
(moe_align, fused_moe_bf16, the dgrad and wgrad, ...) taken from reference.py (same layouts) and its
`functional` module loaded over them, so `moe`, both backwards and the benchmarks' op calls run on
the CPU. The one stand-in for the CPU tests of code written against the loaded kernel
(test_functional.py, test_benchmark_peers.py, tests/test_kernels_benchmark.py)."""

import functools
import pathlib
import types

import kernel_package
import torch

MEMBER = pathlib.Path(__file__).resolve().parents[1]


@functools.cache  # one functional module per process: tests share it, as they would the loaded kernel
def load() -> types.SimpleNamespace:
    """The stand-in, named like the loaded kernel's attributes. preferred_bpc says 1 at every shape
    (the references have no CTA pairs): a test that needs another rule replaces it on a copy."""
    ref = kernel_package.load_reference(MEMBER)
    ops = dict(moe_align=ref.moe_align, fused_moe_bf16=ref.fused_moe_bf16, fused_moe_mxfp8=ref.fused_moe_mxfp8,
               quantize_mxfp8=ref.quantize_mxfp8, fused_moe_bf16_dgrad=ref.fused_moe_bf16_dgrad,
               fused_moe_bf16_wgrad=ref.fused_moe_bf16_wgrad, preact_numel=lambda L, I: 2 * L * I)
    functional = kernel_package.load_submodule("flash_moe_reference_kernel", MEMBER / "torch-ext" / "flash_moe",
                                               "functional", **ops)
    return types.SimpleNamespace(__name__="flash_moe_reference_kernel", functional=functional, moe=functional.moe,
                                 preferred_bpc=lambda *shape, **kwargs: 1,
                                 dequantize_mxfp8=lambda v, s: ref.dequantize_mxfp8(v, s, torch.bfloat16), **ops)
