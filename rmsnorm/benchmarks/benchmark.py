"""`kernels benchmark` workloads for rmsnorm (see kernels.benchmark.Benchmark).

Each workload times one op; `verify_*` returns what the runner compares with `self.out`:
the forward's e4m3 values (as fp32) must equal the pure-PyTorch reference fed the kernel's rrms;
the backward's grad_branch must match the fp32 reference within bf16 rounding (atol 1e-2).
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


class _Base(Benchmark):
    seed: int = 42
    N = 65536
    C = 4096

    def _make(self):
        N, C = self.N, self.C
        self.branch = torch.randn(N, C, device=self.device).bfloat16()
        self.residual = torch.randn(N, C, device=self.device).bfloat16()
        self.weight = (1 + 0.1 * torch.randn(C, device=self.device)).bfloat16()
        self.grad_y = torch.randn(N, C, device=self.device).bfloat16()


class FusedRMSNormResidualForward(_Base):
    """Forward, (65536, 4096) and (16384, 7168)."""

    def setup(self):
        self._make()

    def benchmark_n65536_c4096(self):
        self.vals, self.scales, self.rrms = self.kernel.fused_rmsnorm_residual(
            self.branch, self.residual, self.weight, 1e-6)
        self.out = self.vals.float()

    def verify_n65536_c4096(self) -> torch.Tensor:
        vals, _, _ = reference.fused_rmsnorm_residual(
            self.branch, self.residual, self.weight, 1e-6, rrms=self.rrms)
        return vals.float()

    def setup_n16384_c7168(self):
        self.N, self.C = 16384, 7168
        self._make()

    def benchmark_n16384_c7168(self):
        self.benchmark_n65536_c4096()

    def verify_n16384_c7168(self) -> torch.Tensor:
        return self.verify_n65536_c4096()


class FusedRMSNormResidualBackward(_Base):
    """Backward, (65536, 4096)."""

    def setup(self):
        self._make()
        _, _, self.rrms = self.kernel.fused_rmsnorm_residual(self.branch, self.residual, self.weight)

    def benchmark_n65536_c4096(self):
        self.grad_branch, self.grad_weight = self.kernel.fused_rmsnorm_residual_backward(
            self.grad_y, self.branch, self.weight, self.rrms)
        self.out = self.grad_branch.float()

    def verify_n65536_c4096(self) -> torch.Tensor:
        gb, _ = reference.fused_rmsnorm_residual_backward(
            self.grad_y, self.branch, self.weight, self.rrms)
        return gb.to(torch.bfloat16).float()
