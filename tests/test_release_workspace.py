"""One member list: build.toml's `workspace.members`. The top-level flake reads it (checked by
evaluating the flake's outputs with stub inputs, no network), and pytest's testpaths, which
cannot read TOML, must match it."""

import json
import os
import pathlib
import shutil
import subprocess
import tomllib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
MEMBERS = tomllib.loads((REPO / "build.toml").read_text())["workspace"]["members"]

# The top-level flake's outputs, with a stub nixpkgs that provides what the flake calls.
STUB_OUT = "/nix/store/stub-prime-kernels-build"
TOP_FLAKE_OUTPUTS = """
let
  flake = import ./flake.nix;
  stubPkgs = {
    writeShellApplication = args: args // { outPath = "%s"; };
    lib.concatStringsSep = builtins.concatStringsSep;
  };
  outputs = flake.outputs { self = ./.; nixpkgs.legacyPackages.x86_64-linux = stubPkgs; };
  apps = outputs.apps.x86_64-linux;
in
{
  apps = builtins.attrNames apps;
  types = builtins.mapAttrs (name: app: app.type) apps;
  programs = builtins.mapAttrs (name: app: app.program) apps;
  members = outputs.lib.members;
  script = outputs.packages.x86_64-linux.default.text;
}
""" % STUB_OUT

# A member's flake, with kernel-builder's genKernelFlakeOutputs stubbed to return its arguments.
MEMBER_FLAKE_OUTPUTS = """
let
  flake = import ./%s/flake.nix;
  outputs = flake.outputs { self = "self"; kernel-builder.lib.genKernelFlakeOutputs = args: args; };
in
{ kernelBuilder = flake.inputs.kernel-builder.url; self = outputs.self; path = toString outputs.path; }
"""


def test_pytest_testpaths_follow_the_member_list():
    testpaths = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"]
    expected = ["tests", *(f"{m}/tests" for m in MEMBERS)]
    assert testpaths == expected, (
        f"pyproject.toml's [tool.pytest.ini_options] testpaths is {json.dumps(testpaths)}; for build.toml's "
        f"members it must be: testpaths = {json.dumps(expected)}")


def _nix_instantiate() -> str:
    """nix-instantiate (Debian's nix-bin, which .ci/run installs): skips without it, fails in CI."""
    nix = shutil.which("nix-instantiate")
    if nix is None:
        if os.environ.get("CI"):
            pytest.fail("nix-instantiate is missing in CI (.ci/run installs Debian's nix-bin)")
        pytest.skip("nix-instantiate not installed (Debian's nix-bin; .ci/run installs it)")
    return nix


def _evaluate(expression: str) -> dict:
    result = subprocess.run([_nix_instantiate(), "--eval", "--strict", "--json", "-E", expression],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_top_flake_builds_every_member_of_build_toml():
    outputs = _evaluate(TOP_FLAKE_OUTPUTS)
    print(json.dumps(outputs, indent=1))
    assert outputs["apps"] == ["build"] and outputs["types"] == {"build": "app"}
    assert outputs["programs"]["build"] == f"{STUB_OUT}/bin/prime-kernels-build"
    assert outputs["members"] == MEMBERS
    assert f"for member in {' '.join(MEMBERS)}; do" in outputs["script"]
    for member in outputs["members"]:
        assert (REPO / member / "flake.nix").is_file(), f"build.toml names {member}, which has no {member}/flake.nix"


@pytest.mark.parametrize("member", MEMBERS)
def test_member_flake_is_kernel_builders(member):
    outputs = _evaluate(MEMBER_FLAKE_OUTPUTS % member)
    assert outputs == {"kernelBuilder": "github:huggingface/kernels", "self": "self", "path": str(REPO / member)}


def test_ci_installs_the_nix_tool_these_tests_use():
    run = (REPO / ".ci" / "run").read_text()
    assert "command -v nix-instantiate" in run and "apt-get install -y -qq nix-bin" in run
    nix, dpkg = shutil.which("nix-instantiate"), shutil.which("dpkg")
    if nix is None or dpkg is None:
        pytest.skip("needs nix-instantiate installed by dpkg (Debian's nix-bin) to check which package provides it")
    owner = subprocess.run([dpkg, "-S", os.path.realpath(nix)], capture_output=True, text=True)
    if owner.returncode != 0:
        pytest.skip(f"{nix} is not from a Debian package")
    assert owner.stdout.startswith("nix-bin:"), owner.stdout
