"""`kernels benchmark` convention: Benchmark subclasses for flash_moe (docs/DESIGN.md §9 shapes).

Run with `kernels benchmark prime-intellect/flash_moe` (or a local path). Workloads:
- `fused_moe_bf16` / `fused_moe_mxfp8`: one forward, moe_align included, bpc from
  `preferred_bpc`; verify returns the fp32 reference (for MXFP8: the fp32 MoE of the dequantized
  inputs, i.e. the op's definition; the quantization error itself is measured by compare.py).
- `fused_moe_bf16_backward` (compare.py's backward shapes): the backward alone, as `moe`'s backward
  runs it (`functional.fused_backward` at `preferred_bpc(..., backward=True)`) on the
  pre-activations a training forward saved; self.out is grad_x, verified against fp32 autograd
  through the reference (the weight and router-weight gradients are held to fp64 truth by the GPU
  tests, test_moe_backward_gpu.py).
The runner checks allclose(self.out, verify, atol=1e-2). It takes every Benchmark subclass defined
here and fails on one without a benchmark_* method, so the shared parts are mixins (`_MoECase`
...), and each class below is a mixin, Benchmark and a shape.
"""

import pathlib
import sys

import torch
from kernels.benchmark import Benchmark

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # the runner loads this file by path
    sys.path.append(str(_HERE))
import kernel_package  # noqa: E402


def _reference():
    return kernel_package.load_reference(_HERE.parent)


class _MoECase:
    """One shape's bf16 inputs and the bf16 forward workload."""

    seed = 0
    shape = (8192, 2048, 768, 64, 8)  # tokens, dim, hidden, experts, top_k

    def setup(self):
        T, K, I, E, k = self.shape
        self.x = torch.randn(T, K, device=self.device, dtype=torch.bfloat16)
        self.w = torch.randn(E, 2 * I, K, device=self.device, dtype=torch.bfloat16) / K ** 0.5
        # The runner checks allclose(out, verify, atol=1e-2): with w2 ~ N(0, 1/I), |out| reaches ~2,
        # where one bf16 ulp is 0.016 and a rounding flip against the fp32 reference fails it (on the
        # CPU with the reference standing in, it did). A 4x smaller w2 keeps |out| < 1 (the GEMMs'
        # speed does not depend on the values).
        self.w2 = torch.randn(E, K, I, device=self.device, dtype=torch.bfloat16) / (4 * I ** 0.5)
        self.ids = torch.rand(T, E, device=self.device).topk(k, dim=1).indices.to(torch.int32).contiguous()
        self.wt = torch.softmax(torch.randn(T, k, device=self.device), -1).contiguous()
        self.out = torch.empty(T, K, device=self.device, dtype=torch.bfloat16)

    def benchmark_fused_moe_bf16(self):
        E, k = self.shape[3], self.shape[4]
        s, e, n = self.kernel.moe_align(self.ids, E)
        self.kernel.fused_moe_bf16(self.x, self.w, self.w2, s, e, n, self.wt, self.out, k,
                                   bpc=self.kernel.preferred_bpc(*self.shape))

    def verify_fused_moe_bf16(self):
        return _reference().moe_fp32(self.x, self.w, self.w2, self.ids, self.wt).to(torch.bfloat16)


class _Mxfp8Case(_MoECase):
    """fused_moe_mxfp8 on x, w, w2 quantized (on the GPU) from the bf16 inputs of _MoECase."""

    benchmark_fused_moe_bf16 = verify_fused_moe_bf16 = None  # not a workload of these classes

    def setup(self):
        super().setup()
        q = self.kernel.quantize_mxfp8
        self.xq, self.xs = q(self.x)
        self.wq, self.ws = q(self.w, blocked=True)
        self.w2q, self.w2s = q(self.w2, blocked=True)
        # row-major weight scales, only for verify's dequantization
        self.ws_rm, self.w2s_rm = q(self.w)[1], q(self.w2)[1]
        del self.x, self.w, self.w2  # the bf16 originals are not needed any more (GBs at E=256)

    def benchmark_fused_moe_mxfp8(self):
        E, k = self.shape[3], self.shape[4]
        s, e, n = self.kernel.moe_align(self.ids, E)
        self.kernel.fused_moe_mxfp8(self.xq, self.xs, self.wq, self.ws, self.w2q, self.w2s, s, e, n, self.wt,
                                    self.out, k, bpc=self.kernel.preferred_bpc(*self.shape, mxfp8=True))

    def verify_fused_moe_mxfp8(self):
        dq = self.kernel.dequantize_mxfp8  # bf16, exact for a quantizer's output
        return _reference().moe_fp32(dq(self.xq, self.xs), dq(self.wq, self.ws_rm), dq(self.w2q, self.w2s_rm),
                                     self.ids, self.wt).to(torch.bfloat16)


class _BackwardCase(_MoECase):
    """The backward alone on the pre-activations of one training forward. grad_out is N(0, 1) / 2:
    with N(0, 1) and w2 ~ N(0, 1/I), |grad_x| reaches ~3.5 and its error against fp32 ~0.018 (the
    references' bf16 rounding points, counted on the CPU at the dims of these shapes with 256-512
    tokens), beyond the runner's atol; _MoECase's w2 / 4 and grad_out / 2, powers of two, divide
    both by 8 and change no rounding."""

    benchmark_fused_moe_bf16 = verify_fused_moe_bf16 = None  # not a workload of these classes

    def setup(self):
        super().setup()
        T, K, I, E, k = self.shape
        # w1 and w3 apart and contiguous, as `moe` holds them (a view of w would be copied per call)
        self.w1, self.w3 = self.w[:, :I].contiguous(), self.w[:, I:].contiguous()
        self.grad_out = torch.randn(T, K, device=self.device, dtype=torch.bfloat16) / 2
        self.routing = (*self.kernel.moe_align(self.ids, E), k)
        self.preact = torch.empty(self.kernel.preact_numel(self.routing[0].numel(), I), device=self.device,
                                  dtype=torch.bfloat16)
        self.kernel.fused_moe_bf16(self.x, self.w, self.w2, *self.routing[:3], self.wt, self.out, k,
                                   preact=self.preact)

    def benchmark_fused_moe_bf16_backward(self):
        self.out = self.kernel.functional.fused_backward(self.grad_out, self.x, self.w1, self.w2, self.w3, self.wt,
                                                         self.routing, self.preact)[0]

    def verify_fused_moe_bf16_backward(self):
        x = self.x.float().requires_grad_()
        out = _reference().moe_fp32(x, self.w.float(), self.w2.float(), self.ids, self.wt)
        out.backward(self.grad_out.float())
        return x.grad.to(torch.bfloat16)


class MoE8k2048x768E64(_MoECase, Benchmark):
    shape = (8192, 2048, 768, 64, 8)


class MoE16k2048x768E128(_MoECase, Benchmark):
    shape = (16384, 2048, 768, 128, 8)


class MoE8k4096x1536E128(_MoECase, Benchmark):
    shape = (8192, 4096, 1536, 128, 8)


class MoE8k7168x2048E256(_MoECase, Benchmark):
    shape = (8192, 7168, 2048, 256, 8)


class MoE1k2048x768E128(_MoECase, Benchmark):
    shape = (1024, 2048, 768, 128, 8)


class MoEMxfp8_8k2048x768E64(_Mxfp8Case, Benchmark):
    shape = (8192, 2048, 768, 64, 8)


class MoEMxfp8_16k2048x768E128(_Mxfp8Case, Benchmark):
    shape = (16384, 2048, 768, 128, 8)


class MoEMxfp8_8k4096x1536E128(_Mxfp8Case, Benchmark):
    shape = (8192, 4096, 1536, 128, 8)


class MoEMxfp8_8k7168x2048E256(_Mxfp8Case, Benchmark):
    shape = (8192, 7168, 2048, 256, 8)


class MoEMxfp8_1k2048x768E128(_Mxfp8Case, Benchmark):
    shape = (1024, 2048, 768, 128, 8)


class MoEBackward8k2048x768E64(_BackwardCase, Benchmark):
    shape = (8192, 2048, 768, 64, 8)


class MoEBackward16k2048x768E128(_BackwardCase, Benchmark):
    shape = (16384, 2048, 768, 128, 8)


class MoEBackward32k4096x1024E64(_BackwardCase, Benchmark):
    shape = (32768, 4096, 1024, 64, 4)


class MoEBackward8k4096x1536E128(_BackwardCase, Benchmark):
    shape = (8192, 4096, 1536, 128, 8)


class MoEBackward1k2048x768E128(_BackwardCase, Benchmark):
    shape = (1024, 2048, 768, 128, 8)
