"""The manifests: every build.toml through kernel-builder's parser, errors that name file and field."""

import os
import pathlib
import shutil
import subprocess

import pytest

import prime_kernels
from prime_kernels.workspace import ManifestError, read_member, read_workspace

REPO = pathlib.Path(__file__).resolve().parents[1]
MEMBERS = ["rmsnorm", "flash_moe"]


@pytest.mark.parametrize("member", [*MEMBERS, "tests/toy"])
def test_member_manifest_passes_kernel_builders_parser(member):
    from kernels._rust import Backend, Build

    build = Build.open(str(REPO / member))
    assert build.general.backends == [Backend.CUDA]


def test_workspace_lists_members_with_repo_ids_and_pins():
    specs = read_workspace(REPO)
    assert list(specs) == MEMBERS
    assert prime_kernels.KERNELS == tuple(MEMBERS)
    assert specs["flash_moe"].builder_name == "flash-moe"
    assert specs["flash_moe"].repo_id == "prime-intellect/flash_moe"
    assert specs["rmsnorm"].repo_id == "prime-intellect/rmsnorm"
    assert specs["flash_moe"].capabilities == ("9.0a",)
    assert specs["rmsnorm"].capabilities == ("9.0a", "10.0a", "12.0a")
    for spec in specs.values():
        assert spec.version == 1 and spec.hub_version == 1 and spec.hub_revision is None
        assert spec.kernels[0].depends == ("torch",)


def test_unknown_kernel_is_a_key_error_listing_the_known_ones():
    with pytest.raises(KeyError, match="unknown kernel 'nope'; known kernels: rmsnorm, flash_moe"):
        prime_kernels.spec("nope")
    with pytest.raises(KeyError, match="known kernels"):
        prime_kernels.unavailable_reason("nope")


def _toy_copy(tmp_path):
    dest = tmp_path / "toy"
    shutil.copytree(REPO / "tests" / "toy", dest, ignore=shutil.ignore_patterns("build"))
    return dest


@pytest.mark.parametrize(
    "old, new, message",
    [
        ('license = "Apache-2.0"\n', "", "field `general.license`"),
        ('name = "toy"', 'name = "Toy_Kernel"', "rejected by kernel-builder's parser"),
        ('depends = ["torch"]', 'depends = ["torch", "cutlass_9_9"]', "rejected by kernel-builder's parser"),
        ("version = 1\n", 'version = "one"\n', "field `general.version` must be an int"),
        ('[general.hub]\nrepo-id = "prime-intellect/toy"\n', "", "missing field `general.hub`"),
        ("[torch]", "[torch", "not valid TOML"),
        ("version = 1\n", "version = 0\n", "field `general.version` must be an integer >= 1 (release branches are v1, v2, ...), got 0"),
        ('cuda-capabilities = ["9.0a"]', 'cuda-capabilities = ["sm_100a"]',
         "field `kernel.toy.cuda-capabilities`: 'sm_100a' is not a CUDA capability in kernel-builder's form "
         '(major.minor plus an optional a/f suffix, e.g. "10.0a"): write "10.0a"'),
        ('cuda-capabilities = ["9.0a"]', 'cuda-capabilities = ["9.0a", "hopper"]',
         "'hopper' is not a CUDA capability in kernel-builder's form"),
    ],
)
def test_malformed_member_manifest_names_file_and_field(tmp_path, old, new, message):
    member = _toy_copy(tmp_path)
    manifest = member / "build.toml"
    text = manifest.read_text()
    assert old in text
    manifest.write_text(text.replace(old, new))
    with pytest.raises(ManifestError) as e:
        read_member(member, {"version": 1})
    assert str(manifest) in str(e.value) and message in str(e.value)


@pytest.mark.parametrize(
    "hub, message",
    [
        ("", "missing field `hub.toy`"),
        ("[hub.toy]\nversion = 1\nrevision = \"main\"\n", "exactly one of `version` or `revision`"),
        ("[hub.toy]\nversion = \"1\"\n", "field `hub.toy.version` must be an int"),
        ("[hub.toy]\nversion = 0\n", "field `hub.toy.version` must be an integer >= 1 (release branches are v1, v2, ...), got 0"),
        ("[hub.toy]\nrevision = \"\"\n", "field `hub.toy.revision` must be a non-empty string"),
        ("[hub]\ntoy = 1\n", "field `hub.toy` must be a table"),
        ("[hub.toy]\nversion = 1\n[hub.other]\nversion = 1\n", "`hub.other` pins a kernel that is not in"),
    ],
)
def test_malformed_workspace_manifest_names_file_and_field(tmp_path, hub, message):
    _toy_copy(tmp_path)
    (tmp_path / "build.toml").write_text('[workspace]\nmembers = ["toy"]\n' + hub)
    with pytest.raises(ManifestError) as e:
        read_workspace(tmp_path)
    assert str(tmp_path / "build.toml") in str(e.value) and message in str(e.value)


def test_member_folder_must_carry_the_python_name(tmp_path):
    member = _toy_copy(tmp_path)
    folder = member.rename(tmp_path / "my-op")
    manifest = folder / "build.toml"
    manifest.write_text(manifest.read_text().replace('name = "toy"', 'name = "my-op"'))
    with pytest.raises(ManifestError) as e:
        read_member(folder, {"version": 1})
    assert str(e.value) == (
        f"{manifest}: field `general.name` ('my-op') gives the Python package `my_op`, which must also be "
        "the member's folder name; the folder is 'my-op': rename it to 'my_op' (and list 'my_op' in "
        "`workspace.members`)"
    )


def test_revision_pin_is_read(tmp_path):
    _toy_copy(tmp_path)
    (tmp_path / "build.toml").write_text('[workspace]\nmembers = ["toy"]\n[hub.toy]\nrevision = "0123abc"\n')
    spec = read_workspace(tmp_path)["toy"]
    assert (spec.hub_version, spec.hub_revision, spec.hub_pin) == (None, "0123abc", "revision 0123abc")


@pytest.mark.parametrize("flake", ["flake.nix", *(f"{m}/flake.nix" for m in MEMBERS)])
def test_flake_parses_with_nix(flake):
    nix = shutil.which("nix-instantiate")
    if nix is None:
        if os.environ.get("CI"):
            pytest.fail("nix-instantiate is missing in CI (.ci/run installs Debian's nix-bin)")
        pytest.skip("nix-instantiate not installed (Debian's nix-bin; .ci/run installs it)")
    result = subprocess.run([nix, "--parse", str(REPO / flake)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    text = (REPO / flake).read_text()
    if flake == "flake.nix":
        # The member list is build.toml's (tests/test_release_workspace.py evaluates the outputs).
        assert "builtins.fromTOML (builtins.readFile ./build.toml)" in text
    else:
        assert "kernel-builder.lib.genKernelFlakeOutputs" in text and "path = ./.;" in text
