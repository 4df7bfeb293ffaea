"""Which Hub release a kernel loads: load argument > the consumer's kernels.lock > the workspace's
[hub.<name>] > the shipped release file. Real files in tmp dirs; the lock is kernels' own format."""

import pytest

from prime_kernels import workspace as ws
from toy_workspace import make_workspace, run_python, write_kernels_lock

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def toy(tmp_path):
    return ws.read_workspace(make_workspace(tmp_path / "ws"))["toy"]


def test_without_argument_or_lock_the_workspace_pin_is_used(toy, tmp_path):
    pin = ws.choose_pin(toy, start=tmp_path)
    assert (pin.version, pin.revision, pin.origin, pin.path) == (1, None, ws.ORIGIN_WORKSPACE, tmp_path / "ws" / "build.toml")
    assert pin.described == f"v1 from the workspace build.toml ({tmp_path / 'ws' / 'build.toml'})"


def test_a_consumer_lock_beats_the_workspace_and_an_argument_beats_both(toy, tmp_path):
    lock = write_kernels_lock(tmp_path / "project", {"prime-intellect/toy": (1, SHA)})
    deep = tmp_path / "project" / "src" / "pkg"
    deep.mkdir(parents=True)
    pin = ws.choose_pin(toy, start=deep)
    assert (pin.version, pin.revision, pin.origin, pin.path) == (None, SHA, ws.ORIGIN_LOCK, lock)
    assert str(pin) == f"revision {SHA}"
    assert ws.choose_pin(toy, version=3, start=deep) == ws.HubPin(3, None, ws.ORIGIN_ARGUMENT, None)
    assert ws.choose_pin(toy, revision="main", start=deep) == ws.HubPin(None, "main", ws.ORIGIN_ARGUMENT, None)


def test_a_lock_that_does_not_name_the_kernel_falls_through(toy, tmp_path):
    write_kernels_lock(tmp_path / "project", {"someone/else": (1, SHA)})
    assert ws.choose_pin(toy, start=tmp_path / "project").origin == ws.ORIGIN_WORKSPACE


def test_a_project_without_kernels_lock_yet_falls_through(toy, tmp_path):
    write_kernels_lock(tmp_path / "project", {"prime-intellect/toy": (1, SHA)}).unlink()
    assert ws.find_consumer_lock(tmp_path / "project") is None
    assert ws.choose_pin(toy, start=tmp_path / "project").origin == ws.ORIGIN_WORKSPACE


def test_a_pyproject_without_kernels_dependencies_is_passed_over(toy, tmp_path):
    lock = write_kernels_lock(tmp_path / "project", {"prime-intellect/toy": (1, SHA)})
    inner = tmp_path / "project" / "member"
    inner.mkdir()
    (inner / "pyproject.toml").write_text('[project]\nname = "member"\n')
    assert ws.find_consumer_lock(inner) == lock


def test_a_malformed_lock_names_the_file(toy, tmp_path):
    lock = write_kernels_lock(tmp_path / "project", {"prime-intellect/toy": (1, SHA)})
    lock.write_text('[{"dependency": {"repo-id": "prime-intellect/toy", "version": 1}, "lock": {"commit": "abc"}}]')
    with pytest.raises(ws.ManifestError) as e:
        ws.choose_pin(toy, start=tmp_path / "project")
    assert str(e.value).startswith(f"{lock}: not a kernels.lock that kernels can read (")


def test_the_release_file_pin_comes_last(tmp_path):
    spec = ws.read_release()["flash_moe"]
    pin = ws.choose_pin(spec, start=tmp_path)
    assert (pin.version, pin.origin, pin.path) == (1, ws.ORIGIN_RELEASE, ws.RELEASE_FILE)
    write_kernels_lock(tmp_path / "project", {"prime-intellect/flash_moe": (1, SHA)})
    assert ws.choose_pin(spec, start=tmp_path / "project").origin == ws.ORIGIN_LOCK


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(version=0), "version must be an integer >= 1 (release branches are v1, v2, ...), got 0"),
        (dict(version="1"), "version must be an integer >= 1 (release branches are v1, v2, ...), got '1'"),
        (dict(version=1, revision="main"), "pass version= or revision=, not both (got version=1, revision='main')"),
        (dict(revision=""), "revision must be a non-empty string (a branch, tag or commit), got ''"),
    ],
)
def test_bad_load_arguments_are_refused_by_name(toy, kwargs, message):
    with pytest.raises(ValueError) as e:
        ws.choose_pin(toy, **kwargs)
    assert str(e.value) == message


def test_the_public_api_takes_the_pin_keywords(tmp_path):
    root = make_workspace(tmp_path / "ws")
    empty = str(tmp_path / "empty")
    code = (
        "import prime_kernels\n"
        "print(prime_kernels.unavailable_reason('toy', version=4))\n"
        "print(prime_kernels.is_available('toy', revision='main'))\n"
        "try:\n    prime_kernels.load('toy', version=0)\nexcept ValueError as e:\n    print('refused:', e)\n"
    )
    result = run_python(code, root, HF_HUB_OFFLINE="1", HF_HUB_CACHE=empty, KERNELS_CACHE=empty)
    assert "HF_HUB_OFFLINE=1 and prime-intellect/toy v4 is not usable from the local cache" in result.stdout, result.stderr
    assert "False" in result.stdout
    assert "refused: version must be an integer >= 1" in result.stdout
