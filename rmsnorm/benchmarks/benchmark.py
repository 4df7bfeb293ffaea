"""`kernels benchmark` workloads for rmsnorm (see kernels.benchmark.Benchmark).

Each workload times one op and nothing else; `verify_*` returns what the runner compares with
`self.out` (allclose, atol 1e-2): the forward's e4m3 values, as bytes (a free view), must equal
those of the pure-PyTorch reference fed the kernel's rrms, bit for bit; the backward's bf16
grad_branch must match the fp32 reference rounded to bf16 within atol. The runner takes every
Benchmark subclass defined here and fails on one without a benchmark_* method, so the shared part
is a mixin (`_Inputs`).
"""

import pathlib
import sys

import torch

from kernels.benchmark import Benchmark

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # the runner loads this file by path
    sys.path.append(str(_HERE))
import kernel_package  # noqa: E402

reference = kernel_package.load_reference(_HERE.parent)


class _Inputs:
    seed: int = 42
    SHAPES = {"n65536_c4096": (65536, 4096), "n16384_c7168": (16384, 7168)}  # workload: (N, C)

    def _make(self, workload):
        N, C = self.SHAPES[workload]
        self.branch = torch.randn(N, C, device=self.device).bfloat16()
        self.residual = torch.randn(N, C, device=self.device).bfloat16()
        self.weight = (1 + 0.1 * torch.randn(C, device=self.device)).bfloat16()
        self.grad_y = torch.randn(N, C, device=self.device).bfloat16()


class FusedRMSNormResidualForward(_Inputs, Benchmark):
    """Forward, (65536, 4096) and (16384, 7168)."""

    def setup_n65536_c4096(self):
        self._make("n65536_c4096")

    def setup_n16384_c7168(self):
        self._make("n16384_c7168")

    def benchmark_n65536_c4096(self):
        self.vals, self.scales, self.rrms = self.kernel.fused_rmsnorm_residual(
            self.branch, self.residual, self.weight, 1e-6)
        self.out = self.vals.view(torch.uint8)

    def verify_n65536_c4096(self) -> torch.Tensor:
        vals, _, _ = reference.fused_rmsnorm_residual(
            self.branch, self.residual, self.weight, 1e-6, rrms=self.rrms)
        return vals.view(torch.uint8)

    benchmark_n16384_c7168 = benchmark_n65536_c4096
    verify_n16384_c7168 = verify_n65536_c4096


class FusedRMSNormResidualBackward(_Inputs, Benchmark):
    """Backward, (65536, 4096)."""

    def setup(self):
        self._make("n65536_c4096")
        _, _, self.rrms = self.kernel.fused_rmsnorm_residual(self.branch, self.residual, self.weight)

    def benchmark_n65536_c4096(self):
        self.out, self.grad_weight = self.kernel.fused_rmsnorm_residual_backward(
            self.grad_y, self.branch, self.weight, self.rrms)

    def verify_n65536_c4096(self) -> torch.Tensor:
        gb, _ = reference.fused_rmsnorm_residual_backward(
            self.grad_y, self.branch, self.weight, self.rrms)
        return gb.to(torch.bfloat16)
