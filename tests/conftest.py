"""Fixtures for the workspace tests: the toolchain's verdict and a toy member built once per session."""

import pathlib

import pytest

from toy_workspace import TOY, build_toy, fill_hub_cache, gpu_capability, make_workspace


@pytest.fixture(scope="session")
def toolchain_reason():
    """None when this machine can build members (nvcc + a CUDA torch of the same major), else why not."""
    from prime_kernels.builder import skip_reason, toolchain
    from prime_kernels.workspace import read_member

    return skip_reason(read_member(TOY, {"version": 1}), toolchain())


@pytest.fixture(scope="session")
def built_toy(tmp_path_factory, toolchain_reason) -> pathlib.Path:
    """A workspace whose toy member is built (once per session); skips with the toolchain's reason."""
    if toolchain_reason is not None:
        pytest.skip(f"cannot build here: {toolchain_reason}")
    root = make_workspace(tmp_path_factory.mktemp("built"))
    result = build_toy(root)
    assert result.returncode == 0, result.stdout + result.stderr
    return root


@pytest.fixture
def sm90_gpu():
    """Skips unless an sm_90 GPU is present (the toy member is built for 9.0a only)."""
    if gpu_capability() != (9, 0):
        pytest.skip("the toy member is built for sm_90a; this needs an sm_90 GPU")


@pytest.fixture(scope="session")
def toy_hub_cache(built_toy, tmp_path_factory):
    """A Hub cache holding prime-intellect/toy v1 (the toy build), its snapshot, and the env that
    makes huggingface_hub and kernels use that cache alone."""
    (variant,) = [p for p in (built_toy / "toy" / "build").iterdir() if p.name.startswith("torch")]
    cache = tmp_path_factory.mktemp("hub-cache")
    snapshot = fill_hub_cache(cache, "prime-intellect/toy", 1, variant)
    env = {"HF_HUB_OFFLINE": "1", "KERNELS_CACHE": str(cache), "HF_HUB_CACHE": str(cache)}
    return cache, snapshot, env
