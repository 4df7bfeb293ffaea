"""`kernels benchmark` convention: Benchmark subclasses for flash_moe (docs/DESIGN.md §9 shapes).

Run with `kernels benchmark prime-intellect/flash_moe` (or a local path). Each benchmark_*
method times one fused_moe_bf16 or fused_moe_mxfp8 forward (moe_align included, bpc from
`preferred_bpc`); verify_*
returns the fp32 reference the runner compares self.out against (for MXFP8: the fp32 MoE of the
dequantized inputs, i.e. the op's definition; the quantization error itself is measured by
compare.py).
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


class _MoEBench(Benchmark):
    seed = 0
    shape = (8192, 2048, 768, 64, 8)  # tokens, dim, hidden, experts, top_k

    def setup(self):
        T, K, I, E, k = self.shape
        self.x = torch.randn(T, K, device=self.device, dtype=torch.bfloat16)
        self.w = torch.randn(E, 2 * I, K, device=self.device, dtype=torch.bfloat16) / K ** 0.5
        self.w2 = torch.randn(E, K, I, device=self.device, dtype=torch.bfloat16) / I ** 0.5
        self.ids = torch.rand(T, E, device=self.device).topk(k, dim=1).indices.to(torch.int32).contiguous()
        self.wt = torch.softmax(torch.randn(T, k, device=self.device), -1).contiguous()
        self.out = torch.empty(T, K, device=self.device, dtype=torch.bfloat16)

    def _forward(self):
        E, k = self.shape[3], self.shape[4]
        s, e, n = self.kernel.moe_align(self.ids, E)
        self.kernel.fused_moe_bf16(self.x, self.w, self.w2, s, e, n, self.wt, self.out, k,
                                   bpc=self.kernel.preferred_bpc(*self.shape))

    def _verify(self):
        return _reference().moe_fp32(self.x, self.w, self.w2, self.ids, self.wt).to(torch.bfloat16)


class MoE8k2048x768E64(_MoEBench):
    shape = (8192, 2048, 768, 64, 8)

    def benchmark_fused_moe_bf16(self):
        self._forward()

    def verify_fused_moe_bf16(self):
        return self._verify()


class MoE16k2048x768E128(_MoEBench):
    shape = (16384, 2048, 768, 128, 8)

    def benchmark_fused_moe_bf16(self):
        self._forward()

    def verify_fused_moe_bf16(self):
        return self._verify()


class MoE8k4096x1536E128(_MoEBench):
    shape = (8192, 4096, 1536, 128, 8)

    def benchmark_fused_moe_bf16(self):
        self._forward()

    def verify_fused_moe_bf16(self):
        return self._verify()


class MoE8k7168x2048E256(_MoEBench):
    shape = (8192, 7168, 2048, 256, 8)

    def benchmark_fused_moe_bf16(self):
        self._forward()

    def verify_fused_moe_bf16(self):
        return self._verify()


class MoE1k2048x768E128(_MoEBench):
    shape = (1024, 2048, 768, 128, 8)

    def benchmark_fused_moe_bf16(self):
        self._forward()

    def verify_fused_moe_bf16(self):
        return self._verify()


class _MoEMxfp8Bench(_MoEBench):
    """fused_moe_mxfp8 on x, w, w2 quantized (on the GPU) from the bf16 inputs of _MoEBench."""

    def setup(self):
        super().setup()
        # The runner checks allclose(out, verify, atol=1e-2): with |out| up to ~2 (the bf16 classes'
        # data) one bf16 ulp is 0.016, so an order-of-summation rounding flip would fail it. A 4x smaller
        # w2 keeps |out| < 1 (GEMM speed does not depend on the values).
        self.w2 = self.w2 / 4
        q = self.kernel.quantize_mxfp8
        self.xq, self.xs = q(self.x)
        self.wq, self.ws = q(self.w, blocked=True)
        self.w2q, self.w2s = q(self.w2, blocked=True)
        # row-major weight scales, only for verify's dequantization
        self.ws_rm, self.w2s_rm = q(self.w)[1], q(self.w2)[1]
        del self.x, self.w, self.w2  # the bf16 originals are not needed any more (GBs at E=256)

    def _forward(self):
        E, k = self.shape[3], self.shape[4]
        s, e, n = self.kernel.moe_align(self.ids, E)
        self.kernel.fused_moe_mxfp8(self.xq, self.xs, self.wq, self.ws, self.w2q, self.w2s, s, e, n, self.wt,
                                    self.out, k, bpc=self.kernel.preferred_bpc(*self.shape, mxfp8=True))

    def _verify(self):
        dq = self.kernel.dequantize_mxfp8  # bf16, exact for a quantizer's output
        return _reference().moe_fp32(dq(self.xq, self.xs), dq(self.wq, self.ws_rm), dq(self.w2q, self.w2s_rm),
                                     self.ids, self.wt).to(torch.bfloat16)


class MoEMxfp8_8k2048x768E64(_MoEMxfp8Bench):
    shape = (8192, 2048, 768, 64, 8)

    def benchmark_fused_moe_mxfp8(self):
        self._forward()

    def verify_fused_moe_mxfp8(self):
        return self._verify()


class MoEMxfp8_16k2048x768E128(_MoEMxfp8Bench):
    shape = (16384, 2048, 768, 128, 8)

    def benchmark_fused_moe_mxfp8(self):
        self._forward()

    def verify_fused_moe_mxfp8(self):
        return self._verify()


class MoEMxfp8_8k4096x1536E128(_MoEMxfp8Bench):
    shape = (8192, 4096, 1536, 128, 8)

    def benchmark_fused_moe_mxfp8(self):
        self._forward()

    def verify_fused_moe_mxfp8(self):
        return self._verify()


class MoEMxfp8_8k7168x2048E256(_MoEMxfp8Bench):
    shape = (8192, 7168, 2048, 256, 8)

    def benchmark_fused_moe_mxfp8(self):
        self._forward()

    def verify_fused_moe_mxfp8(self):
        return self._verify()


class MoEMxfp8_1k2048x768E128(_MoEMxfp8Bench):
    shape = (1024, 2048, 768, 128, 8)

    def benchmark_fused_moe_mxfp8(self):
        self._forward()

    def verify_fused_moe_mxfp8(self):
        return self._verify()
