"""The upload guard (`builder.check_upload`, `prime-kernels check-upload`): a member's build/ may be
uploaded only when it holds kernel-builder's variants alone, each matching its digest and passing
kernel-abi-check. A local development build is refused, alone or mixed with nix-built variants."""

import json
import os
import pathlib

import pytest

from toy_workspace import make_workspace
from prime_kernels import builder
from prime_kernels.workspace import read_workspace

LOCAL = "torch214-cxx11-cu130-x86_64-linux"
NIX = ("torch211-cxx11-cu130-x86_64-linux", "torch212-cxx11-cu130-x86_64-linux")


@pytest.fixture(autouse=True)
def kernel_abi_check():
    try:
        import kernel_abi_check  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("kernel-abi-check is not installed in CI (the test extra)")
        pytest.skip("kernel-abi-check is not installed: pip install -e '.[test]'")


def _variant(build_dir: pathlib.Path, name: str, *, development=False, ops_header="# kernel-builder\n",
             extension: bytes | None = None) -> pathlib.Path:
    """A variant folder as a builder leaves it: package files, optionally an extension, and a
    metadata.json whose digest covers them."""
    from kernels_data import Digest, DigestAlgorithm

    variant = build_dir / name
    variant.mkdir(parents=True)
    (variant / "__init__.py").write_text("from ._ops import ops\n")
    (variant / "_ops.py").write_text(ops_header + "import torch\nops = torch.ops._toy_cuda_abcdefg\n")
    if extension is not None:
        (variant / "_toy_cuda_abcdefg.abi3.so").write_bytes(extension)
    digest = Digest.hash_variant(DigestAlgorithm.SHA256, variant)
    metadata = {
        "id": "_toy_cuda_abcdefg", "name": "toy", "version": 1, "license": "Apache-2.0", "python-depends": [],
        "backend": {"type": "cuda", "archs": ["9.0a"]},
        "digest": {"algorithm": "sha256", "files": dict(digest.files)},
    }
    if development:
        metadata[builder.DEVELOPMENT_KEY] = builder.development_mark()
    (variant / "metadata.json").write_text(json.dumps(metadata, indent=2))
    return variant


@pytest.fixture
def toy(tmp_path):
    """The toy member's spec, in a workspace of its own with an empty build/."""
    spec = read_workspace(make_workspace(tmp_path))["toy"]
    spec.build_dir.mkdir()
    return spec


def _check(spec) -> tuple[int, str]:
    lines = []
    code = builder.check_upload({spec.name: spec}, [], log=lines.append)
    return code, "\n".join(lines)


def test_kernel_builder_variants_alone_may_be_uploaded(toy):
    for name in NIX:
        _variant(toy.build_dir, name)
    assert builder.upload_problems(toy.build_dir) == []
    code, out = _check(toy)
    assert code == 0 and f"toy: ready to upload: kernel-builder upload --repo-id prime-intellect/toy {toy.build_dir}" in out


def test_a_local_build_is_refused(built_toy):
    specs = read_workspace(built_toy)
    lines = []
    assert builder.check_upload(specs, [], log=lines.append) == 1
    out = "\n".join(lines)
    print(out)
    build_dir = specs["toy"].build_dir
    assert f"refusing to upload {build_dir}:" in out
    assert f"it holds local development builds ({builder.toolchain().variant()}): {builder.LOCAL_BUILD_WHY}" in out
    assert "it holds the local builder's files (.obj)" in out
    assert f"rm -rf {build_dir}, run `nix run .#build` from the workspace root" in out


def test_a_mix_of_local_and_kernel_builder_variants_is_refused(toy):
    _variant(toy.build_dir, NIX[0])
    _variant(toy.build_dir, LOCAL, development=True)
    code, out = _check(toy)
    assert code == 1
    assert f"it mixes kernel-builder variants ({NIX[0]}) with local development builds ({LOCAL})" in out


def test_a_local_variant_is_known_by_its_ops_header_without_the_mark(toy):
    _variant(toy.build_dir, LOCAL, ops_header=builder._OPS_PY.splitlines()[0] + "\n")
    assert builder.upload_problems(toy.build_dir) == [f"it holds local development builds ({LOCAL}): {builder.LOCAL_BUILD_WHY}"]


def test_the_local_builders_files_are_refused(toy):
    _variant(toy.build_dir, NIX[0])
    (toy.build_dir / ".obj").mkdir()
    (toy.build_dir / "SKIPPED").write_text("no CUDA toolkit\n")
    assert builder.upload_problems(toy.build_dir) == ["it holds the local builder's files (.obj, SKIPPED)"]


def test_files_that_differ_from_the_digest_are_refused(toy):
    variant = _variant(toy.build_dir, NIX[0])
    stale = variant / "_toy_cuda_stale.abi3.so"
    stale.write_bytes(b"left over from another build")
    digest, abi = builder.upload_problems(toy.build_dir)
    assert digest == f"{variant}: files differ from metadata.json's digest: Unknown file: _toy_cuda_stale.abi3.so"
    assert abi.startswith(f"{stale}: fails every ABI check: Cannot parse object file")


def test_an_abi_failure_is_refused_naming_file_check_and_symbol(toy, monkeypatch):
    variant = _variant(toy.build_dir, NIX[0], extension=b"\x7fELF")
    failing = {builder.ABI3_CHECK: [], builder.MANYLINUX: ["__libc_single_threaded@GLIBC_2.32"]}
    monkeypatch.setattr(builder, "abi_violations", lambda so: failing)
    assert builder.upload_problems(toy.build_dir) == [
        f"{variant / '_toy_cuda_abcdefg.abi3.so'}: fails manylinux_2_28: __libc_single_threaded@GLIBC_2.32"]


def test_an_empty_build_folder_is_refused(toy):
    code, out = _check(toy)
    assert code == 1 and f"{toy.build_dir} holds no variants" in out
