"""Finding the kernels: $PRIME_KERNELS_WORKSPACE, else a workspace from the cwd upwards, else the
release file shipped in the package (the pins of the release the shim was tested with)."""

import pytest

from prime_kernels import workspace as ws
from toy_workspace import REPO, make_workspace, run_python

def _offline(tmp_path) -> dict[str, str]:
    """Offline with an empty cache: no network, and the Hub step answers at once."""
    empty = str(tmp_path / "empty-cache")
    return {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": empty, "KERNELS_CACHE": empty}


def test_committed_release_file_matches_the_manifests():
    expected = ws.release_text(ws.read_workspace(REPO))
    assert ws.RELEASE_FILE.read_text() == expected, (
        f"{ws.RELEASE_FILE} disagrees with build.toml and the members' build.toml: "
        f"regenerate it with `{ws.SYNC_RELEASE_COMMAND}` (in the checkout) and commit it"
    )


def test_release_file_round_trips_the_workspace_specs():
    workspace = ws.read_workspace(REPO)
    released = ws.read_release()
    assert list(released) == list(workspace)
    for name, spec in released.items():
        ours = workspace[name]
        assert (spec.builder_name, spec.repo_id, spec.hub_version, spec.hub_revision, spec.capabilities) == (
            ours.builder_name, ours.repo_id, ours.hub_version, ours.hub_revision, ours.capabilities)
        assert spec.directory is None and spec.default_pin.origin == ws.ORIGIN_RELEASE
        assert spec.default_pin.path == ws.RELEASE_FILE


@pytest.mark.parametrize(
    "old, new, message",
    [
        ('hub = { version = 1 }', 'hub = { version = 0 }', "field `kernel[0].hub.version` must be an integer >= 1"),
        ('cuda-capabilities = ["9.0a", "10.0a", "12.0a"]', 'cuda-capabilities = ["sm_90a"]',
         "field `kernel[0].cuda-capabilities`: 'sm_90a' is not a CUDA capability"),
        ('repo-id = "prime-intellect/rmsnorm"\n', "", "missing field `kernel[0].repo-id`"),
    ],
)
def test_malformed_release_file_names_file_and_field(tmp_path, old, new, message):
    path = tmp_path / "release.toml"
    text = ws.RELEASE_FILE.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(ws.ManifestError) as e:
        ws.read_release(path)
    assert str(path) in str(e.value) and message in str(e.value)


def test_sync_release_writes_and_checks_the_workspaces_release_file(tmp_path):
    root = make_workspace(tmp_path)
    (root / "torch-ext" / "prime_kernels").mkdir(parents=True)
    code = "import sys; from prime_kernels.cli import main; sys.exit(main(sys.argv[1:]))"
    sync = "import sys; sys.argv[1:] = {argv!r}; " + code
    wrote = run_python(sync.format(argv=["sync-release"]), root)
    release = root / "torch-ext" / "prime_kernels" / "release.toml"
    assert wrote.returncode == 0 and f"wrote {release}" in wrote.stdout, wrote.stderr
    assert ws.read_release(release)["toy"].repo_id == "prime-intellect/toy"
    assert run_python(sync.format(argv=["sync-release", "--check"]), root).returncode == 0
    (root / "build.toml").write_text((root / "build.toml").read_text().replace("version = 1", "version = 2"))
    stale = run_python(sync.format(argv=["sync-release", "--check"]), root)
    assert stale.returncode == 1
    assert f"{release}: out of date with the manifests: run `prime-kernels sync-release`" in stale.stdout


def test_workspace_is_found_from_the_cwd_upwards(tmp_path):
    root = make_workspace(tmp_path / "ws")
    # From inside a member: its own build.toml has no [workspace] table, the checkout's has.
    assert ws.find_workspace(root / "toy" / "toy_cuda") == root
    assert ws.find_workspace(root) == root
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    assert ws.find_workspace(outside) is None


def test_workspace_variable_wins_and_must_point_at_a_workspace(tmp_path, monkeypatch):
    root = make_workspace(tmp_path / "ws")
    other = make_workspace(tmp_path / "other")
    monkeypatch.setenv(ws.WORKSPACE_ENV, str(other))
    assert ws.find_workspace(root / "toy") == other
    for bad, problem in [(tmp_path / "nothing", "does not exist"), (root / "toy", "has no [workspace] table")]:
        bad.mkdir(exist_ok=True)
        monkeypatch.setenv(ws.WORKSPACE_ENV, str(bad))
        with pytest.raises(ws.ManifestError) as e:
            ws.find_workspace()
        assert str(e.value) == (
            f"PRIME_KERNELS_WORKSPACE={bad}: {bad / 'build.toml'} {problem}: point it at a checkout's root "
            "(the folder whose build.toml has a [workspace] table), or unset it"
        )


def test_a_bad_workspace_variable_is_one_cli_line(tmp_path):
    result = run_python("from prime_kernels.cli import main; raise SystemExit(main(['status']))",
                        tmp_path, cwd=tmp_path, **_offline(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr == (
        f"prime-kernels: PRIME_KERNELS_WORKSPACE={tmp_path}: {tmp_path / 'build.toml'} does not exist: point it at a "
        "checkout's root (the folder whose build.toml has a [workspace] table), or unset it\n"
    )


def test_cwd_inside_a_workspace_selects_it(tmp_path):
    root = make_workspace(tmp_path / "ws")
    code = "import prime_kernels; print(prime_kernels.KERNELS, prime_kernels.spec('toy').default_pin.described)"
    result = run_python(code, None, cwd=root / "toy", **_offline(tmp_path))
    assert f"('toy',) v1 from the workspace build.toml ({root / 'build.toml'})" in result.stdout, result.stderr


def test_outside_a_workspace_the_shipped_release_pins_are_used(tmp_path):
    code = (
        "import prime_kernels\n"
        "print('kernels:', prime_kernels.KERNELS)\n"
        "for name, st in prime_kernels.status().items():\n"
        "    print(name, '|', st.source, '|', st.pin.described)\n"
    )
    result = run_python(code, None, cwd=tmp_path, **_offline(tmp_path))
    assert "kernels: ('rmsnorm', 'flash_moe')" in result.stdout, result.stderr
    assert f"flash_moe | hub | v1 from the shipped release file ({ws.RELEASE_FILE})" in result.stdout

    table = run_python("from prime_kernels.cli import main; raise SystemExit(main(['status']))",
                       None, cwd=tmp_path, **_offline(tmp_path))
    assert table.returncode == 0, table.stderr
    text = " ".join(table.stdout.split())
    assert "v1 (release file)" in text and f"hub pins (release file): {ws.RELEASE_FILE}, shipped with prime_kernels" in text
    assert "file not found" not in text


def test_build_without_a_workspace_says_how_to_give_one(tmp_path):
    result = run_python("from prime_kernels.cli import main; raise SystemExit(main(['build']))",
                        None, cwd=tmp_path, **_offline(tmp_path))
    assert result.returncode == 2
    assert result.stderr == (
        "prime-kernels: nothing to build: no workspace: run inside a checkout (a build.toml with a [workspace] "
        "table in the current directory or above) or set PRIME_KERNELS_WORKSPACE to a checkout's root\n"
    )


def test_resolving_never_imports_native_code_without_a_workspace(tmp_path):
    code = (
        "import sys, prime_kernels\n"
        "prime_kernels.status()\n"
        "print('native:', sorted(m for m in sys.modules if m.startswith(('_rmsnorm_cuda', '_flash_moe_cuda'))))\n"
    )
    result = run_python(code, None, cwd=tmp_path, **_offline(tmp_path))
    assert "native: []" in result.stdout, result.stderr
