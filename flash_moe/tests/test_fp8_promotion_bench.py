"""The fp8-promotion microbenchmark (benchmarks/fp8_promotion_bench.cu, the measured alternative
of flash_moe/DESIGN.md) still compiles against sm90.cuh. It runs on an H200 only; compiling needs just nvcc."""

import pathlib
import subprocess

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "fp8_promotion_bench.cu"


def test_fp8_promotion_bench_compiles(tmp_path):
    from prime_kernels.builder import toolchain

    cuda_home = toolchain().cuda_home
    if cuda_home is None:
        pytest.skip("no CUDA toolkit (nvcc) on this machine")
    cmd = [str(cuda_home / "bin" / "nvcc"), "-std=c++17", "-O3", "-gencode", "arch=compute_90a,code=sm_90a",
           "-o", str(tmp_path / "fp8_promotion_bench"), str(BENCH)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
