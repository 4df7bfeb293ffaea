"""Capability strings and the exact-match rule."""

import pytest

from prime_kernels import capability


@pytest.mark.parametrize("arch, cap, sm", [("9.0a", (9, 0), "sm_90a"), ("10.0a", (10, 0), "sm_100a"),
                                           ("12.0", (12, 0), "sm_120"), ("8.9+PTX", (8, 9), "sm_89")])
def test_parse_and_names(arch, cap, sm):
    assert capability.parse(arch) == cap
    assert capability.sm_name(arch) == sm


@pytest.mark.parametrize("bad", ["90a", "sm_90a", "9", "9.0b", ""])
def test_bad_capability_is_rejected_by_name(bad):
    with pytest.raises(ValueError, match="not a CUDA capability"):
        capability.parse(bad)


def test_gencode_is_architecture_specific():
    assert capability.gencode("9.0a") == "-gencode=arch=compute_90a,code=sm_90a"


def test_exact_match_only():
    assert capability.mismatch_reason(["9.0a"], (9, 0)) is None
    assert capability.mismatch_reason(["9.0a", "10.0a", "12.0a"], (12, 0)) is None
    # No forward compatibility: sm_90a code does not run on sm_100, nor 10.0a on sm_103.
    assert capability.mismatch_reason(["9.0a"], (10, 0)) == "built for sm_90a, this device is sm_100"
    assert capability.mismatch_reason(["10.0a"], (9, 0)) == "built for sm_100a, this device is sm_90"
    assert capability.mismatch_reason(["10.0a"], (10, 3)) == "built for sm_100a, this device is sm_103"


@pytest.mark.parametrize("text, arch", [("sm_100a", "10.0a"), ("sm_90a", "9.0a"), ("compute_120f", "12.0f"),
                                        ("90", "9.0"), ("9.0a", None), ("hopper", None)])
def test_sm_names_translate_to_kernel_builders_form(text, arch):
    assert capability.from_sm_name(text) == arch
