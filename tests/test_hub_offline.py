"""The Hub path, offline and for real: a cache laid out as huggingface_hub lays one out, filled from
a local build, then `prime_kernels` -> `kernels.get_kernel(..., version=1)` with HF_HUB_OFFLINE=1.
No mock of kernels or huggingface_hub."""

import pytest

from toy_workspace import make_workspace, run_python


@pytest.fixture(scope="module")
def offline_hub(toy_hub_cache, tmp_path_factory):
    """A workspace with no local build of toy, and a Hub cache holding its v1."""
    _, snapshot, env = toy_hub_cache
    workspace = make_workspace(tmp_path_factory.mktemp("consumer"))
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


# -- pins: which release the Hub step asks for, and who chose it -------------------------------------

_RESOLVE = (
    "import prime_kernels, prime_kernels.registry as r\n"
    "res = r.resolve(prime_kernels.spec('toy'){args})\n"
    "print('source:', res.source)\nprint('location:', res.location)\n"
    "print('pin:', res.pin, '|', res.pin.origin, '|', res.pin.path)\nprint('reason:', res.reason)\n"
)


def test_load_argument_overrides_the_workspace_pin(offline_hub):
    workspace, snapshot, env = offline_hub
    by_commit = run_python(_RESOLVE.format(args=f", revision={snapshot.name!r}"), workspace, **env)
    assert f"location: {snapshot}/build/" in by_commit.stdout, by_commit.stderr
    assert f"pin: revision {snapshot.name} | load argument | None" in by_commit.stdout
    missing = run_python("import prime_kernels; print(prime_kernels.unavailable_reason('toy', version=2))", workspace, **env)
    assert "HF_HUB_OFFLINE=1 and prime-intellect/toy v2 is not usable from the local cache" in missing.stdout, missing.stderr


def test_a_consumer_kernels_lock_is_honoured(offline_hub, tmp_path):
    from toy_workspace import write_kernels_lock

    workspace, snapshot, env = offline_hub
    lock = write_kernels_lock(tmp_path / "project", {"prime-intellect/toy": (1, snapshot.name)})
    inside = tmp_path / "project" / "src"
    inside.mkdir()
    locked = run_python(_RESOLVE.format(args=""), workspace, cwd=inside, **env)
    assert f"location: {snapshot}/build/" in locked.stdout, locked.stderr
    assert f"pin: revision {snapshot.name} | kernels.lock | {lock}" in locked.stdout
    # An explicit argument beats the lock.
    argument = run_python(_RESOLVE.format(args=", version=1"), workspace, cwd=inside, **env)
    assert "pin: v1 | load argument | None" in argument.stdout, argument.stderr
    # A locked commit that is not cached: the reason names the locked revision, the table the lock.
    write_kernels_lock(tmp_path / "project", {"prime-intellect/toy": (1, "f" * 40)})
    stale = run_python("from prime_kernels.cli import main; main(['status'])", workspace, cwd=inside, **env)
    table = " ".join(stale.stdout.split())  # cells and notes wrap
    assert f"prime-intellect/toy revision {'f' * 40} is not usable from the local cache" in table, stale.stderr
    assert f"hub pins (kernels.lock): {lock}, your project's lock" in table


def test_without_a_workspace_the_shipped_release_pins_load_from_the_hub_cache(offline_hub, tmp_path):
    """A shim whose release.toml names toy (as `prime-kernels sync-release` writes it), used from
    a directory outside any workspace."""
    import shutil

    from prime_kernels.workspace import read_workspace, release_text
    from toy_workspace import SHIM

    workspace, snapshot, env = offline_hub
    shim = tmp_path / "site"
    shutil.copytree(SHIM / "prime_kernels", shim / "prime_kernels", ignore=shutil.ignore_patterns("__pycache__"))
    (shim / "prime_kernels" / "release.toml").write_text(release_text(read_workspace(workspace)))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = "import prime_kernels\nprint('kernels:', prime_kernels.KERNELS)\n" + _RESOLVE.format(args="")
    result = run_python(code, None, cwd=elsewhere, shim=shim, **env)
    assert "kernels: ('toy',)" in result.stdout, result.stderr
    assert f"location: {snapshot}/build/" in result.stdout
    assert f"pin: v1 | shipped release file | {shim / 'prime_kernels' / 'release.toml'}" in result.stdout
