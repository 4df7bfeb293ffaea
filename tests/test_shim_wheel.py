"""`pip install .` without -e: the wheel carries the shim and its release file, and works outside a
checkout (Hub pins from the shipped release file) and inside one (the workspace found from the cwd)."""

import os
import shutil
import subprocess
import sys

import pytest

from toy_workspace import REPO, make_workspace


def _pip(*args, cwd=None):
    result = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                            capture_output=True, text=True, cwd=cwd, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory):
    """The repo's wheel, built offline from a copy of what it packages, installed with --target."""
    tmp = tmp_path_factory.mktemp("wheel")
    # A copy: setuptools' build/ and egg-info stay out of the checkout, and stale files out of the wheel.
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(REPO / "torch-ext" / "prime_kernels", source / "torch-ext" / "prime_kernels",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), ".", cwd=source)
    (wheel,) = (tmp / "dist").glob("prime_kernels-*.whl")
    target = tmp / "site"
    _pip("install", "--no-deps", "--no-index", "--target", str(target), str(wheel))
    return target


def _run(args, target, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("PRIME_KERNELS_WORKSPACE", "LOCAL_KERNELS")}
    empty = str(cwd / ".empty-cache")
    env.update(PYTHONPATH=str(target), HF_HUB_OFFLINE="1", HF_HUB_CACHE=empty, KERNELS_CACHE=empty)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def test_the_wheel_ships_the_release_file(installed_wheel):
    assert (installed_wheel / "prime_kernels" / "release.toml").read_text() == (
        REPO / "torch-ext" / "prime_kernels" / "release.toml").read_text()


def test_installed_shim_works_outside_any_checkout(installed_wheel, tmp_path):
    code = (
        "import prime_kernels\n"
        "print('file:', prime_kernels.__file__)\n"
        "print('kernels:', prime_kernels.KERNELS)\n"
        "print('pin:', prime_kernels.status()['flash_moe'].pin.described)\n"
    )
    api = _run(["-c", code], installed_wheel, tmp_path)
    assert api.returncode == 0, api.stderr
    assert f"file: {installed_wheel / 'prime_kernels' / '__init__.py'}" in api.stdout  # not the editable checkout
    assert "kernels: ('rmsnorm', 'flash_moe')" in api.stdout
    assert f"pin: v1 from the shipped release file ({installed_wheel / 'prime_kernels' / 'release.toml'})" in api.stdout

    status = _run(["-m", "prime_kernels", "status"], installed_wheel, tmp_path)
    assert status.returncode == 0, status.stderr
    text = " ".join(status.stdout.split())
    assert "file not found" not in text + status.stderr
    assert "hub prime-intellect/flash_moe" in text and "v1 (release file)" in text
    # The reason is the device's or the Hub's (offline, empty cache), never a missing manifest.
    assert "no CUDA device" in text or "not usable from the local cache" in text or "built for" in text


def test_installed_shim_finds_the_workspace_it_is_run_in(installed_wheel, tmp_path):
    root = make_workspace(tmp_path / "ws")
    code = "import prime_kernels; print('kernels:', prime_kernels.KERNELS, prime_kernels.status()['toy'].pin.described)"
    result = _run(["-c", code], installed_wheel, root / "toy")
    assert f"kernels: ('toy',) v1 from the workspace build.toml ({root / 'build.toml'})" in result.stdout, result.stderr
