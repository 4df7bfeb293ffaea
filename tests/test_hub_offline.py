"""The Hub path, offline and for real: a cache laid out as huggingface_hub lays one out, filled from
a local build, then `prime_kernels` -> `kernels.get_kernel(..., version=1)` with HF_HUB_OFFLINE=1.
No mock of kernels or huggingface_hub."""

import hashlib
import shutil

import pytest

from toy_workspace import make_workspace, run_python


def fill_hub_cache(cache, repo_id, version, variant_dir):
    """kernels--<org>--<name>/refs/v<version> -> <sha>, snapshots/<sha>/build/<variant>/..."""
    folder = cache / ("kernels--" + repo_id.replace("/", "--"))
    sha = hashlib.sha1(repo_id.encode() + bytes(version)).hexdigest()
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / f"v{version}").write_text(sha)
    shutil.copytree(variant_dir, folder / "snapshots" / sha / "build" / variant_dir.name,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return folder / "snapshots" / sha


@pytest.fixture(scope="module")
def offline_hub(built_toy, tmp_path_factory):
    """A workspace with no local build of toy, and a Hub cache holding its v1."""
    (variant,) = [p for p in (built_toy / "toy" / "build").iterdir() if p.name.startswith("torch")]
    cache = tmp_path_factory.mktemp("hub-cache")
    snapshot = fill_hub_cache(cache, "prime-intellect/toy", 1, variant)
    workspace = make_workspace(tmp_path_factory.mktemp("consumer"))
    env = {"HF_HUB_OFFLINE": "1", "KERNELS_CACHE": str(cache), "HF_HUB_CACHE": str(cache)}
    return workspace, snapshot, env


def test_offline_resolution_finds_the_cached_release(offline_hub):
    workspace, snapshot, env = offline_hub
    code = (
        "import kernels, prime_kernels, prime_kernels.registry as r\n"
        "res = r.resolve(prime_kernels.spec('toy'))\n"
        "print('source:', res.source)\nprint('location:', res.location)\nprint('archs:', res.archs)\n"
        "m = kernels.get_kernel('prime-intellect/toy', version=1)\n"
        "print('module:', m.__name__, hasattr(m.ops, 'scale'))\n"
    )
    result = run_python(code, workspace, **env)
    assert result.returncode == 0, result.stderr
    assert "source: hub" in result.stdout
    assert f"location: {snapshot}/build/" in result.stdout
    assert "archs: ('9.0a',)" in result.stdout
    assert "module: _toy_cuda_" in result.stdout and " True" in result.stdout


def test_offline_and_not_cached_names_the_fix(tmp_path):
    workspace = make_workspace(tmp_path / "ws")
    env = {"HF_HUB_OFFLINE": "1", "KERNELS_CACHE": str(tmp_path / "empty"), "HF_HUB_CACHE": str(tmp_path / "empty")}
    result = run_python("import prime_kernels; print(prime_kernels.unavailable_reason('toy'))", workspace, **env)
    assert "HF_HUB_OFFLINE=1 and prime-intellect/toy v1 is not usable from the local cache" in result.stdout, result.stderr
    assert "download it once online, or no local build" in result.stdout


@pytest.mark.gpu
def test_load_through_the_offline_hub_runs_on_the_gpu(offline_hub, sm90_gpu):
    workspace, _, env = offline_hub
    code = (
        "import torch, prime_kernels, prime_kernels.registry as r\n"
        "print('source:', r.resolve(prime_kernels.spec('toy')).source)\n"
        "toy = prime_kernels.load('toy')\n"
        "x = torch.randn(4096, device='cuda')\n"
        "print('ok', torch.equal(toy.scale(x, -2.5), x * -2.5))\n"
    )
    result = run_python(code, workspace, **env)
    assert "source: hub" in result.stdout and "ok True" in result.stdout, result.stdout + result.stderr
