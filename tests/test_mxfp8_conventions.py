"""docs/DESIGN.md §6 is shared by both kernels: their pure-PyTorch references must agree bit for
bit on the scale bytes and the e4m3 values. (The rules themselves, the blocked packing included,
are one file, common/mxfp8_rules.py, copied into both; quantize_mxfp8 is flash_moe's own.)"""

import pathlib
import sys

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "common"))
import kernel_package  # noqa: E402


@pytest.fixture(scope="module")
def refs():
    return kernel_package.load_reference(REPO / "flash_moe"), kernel_package.load_reference(REPO / "rmsnorm")


def _hard_blocks(R: int, K: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(R, K, generator=g)
    # Rows spanning the fp32 range, so scale bytes from near 0 to near 254 occur.
    y *= torch.exp2(torch.randint(-120, 120, (R, 1), generator=g).float())
    y[0, :32] = 0.0  # amax 0 -> byte 0
    y[1, :32] = 448.0  # t == 1.0 exactly -> byte 127, values exactly 448
    y[1, 32:64] = torch.nextafter(torch.tensor(448.0), torch.tensor(1e9))  # just above: byte 128
    y[2, 3] = float("nan")  # non-finite blocks: byte 255
    y[2, 40] = float("inf")
    y[3, :32] = 1e-40  # subnormal amax
    y[4, :32] = torch.linspace(-3.0, 3.0, 32) * 2.0**-130
    return y


@pytest.mark.parametrize("R, K, seed", [(1, 32, 0), (130, 160, 1), (257, 96, 2)])
def test_both_kernels_quantize_identically(refs, R, K, seed):
    flash_moe, rmsnorm = refs
    y = _hard_blocks(R, K, seed) if R >= 5 else torch.randn(R, K)
    vals, scales = flash_moe.quantize_mxfp8(y)

    amax = y.view(R, K // 32, 32).abs().amax(-1)  # NaN propagates
    byte = rmsnorm.rceil_scale_bytes(amax)
    q = rmsnorm.e4m3_satfinite(y.view(R, K // 32, 32) * rmsnorm.scale_multiplier(byte)[..., None]).view(R, K)

    assert torch.equal(scales.view(torch.uint8), byte)
    assert torch.equal(vals.view(torch.uint8), q.view(torch.uint8))
    if R >= 5:
        assert byte[0, 0] == 0 and byte[1, 0] == 127 and byte[1, 1] == 128 and byte[2, 0] == 255 and byte[2, 1] == 255
        assert (vals[1, :32].float() == 448.0).all()
