"""The local builder: toolchain skip rules, member selection, and a real build of the toy member."""

import dataclasses
import json
import pathlib

import pytest

from toy_workspace import REPO, TOY, build_toy, gpu_capability, make_workspace, run_python
from prime_kernels import builder
from prime_kernels.registry import SKIP_MARKER
from prime_kernels.workspace import read_member, read_workspace

GOOD = builder.Toolchain(cuda_home=pathlib.Path("/usr/local/cuda"), nvcc_version=(13, 0),
                         torch_version="2.11.0+cu130", torch_cuda="13.0", cxx11_abi=True)


def test_variant_name_is_kernel_builders():
    assert GOOD.variant().startswith("torch211-cxx11-cu130-")
    assert GOOD.variant().endswith("-linux")


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(cuda_home=None, nvcc_version=None), "no CUDA toolkit"),
        (dict(torch_version="2.13.0+cpu", torch_cuda=None), "torch 2.13.0+cpu is built without CUDA"),
        (dict(nvcc_version=(12, 8)), "nvcc 12.8 and torch's CUDA 13.0 differ in major version"),
        (dict(nvcc_version=(13, 0), torch_cuda="12.8"), "nvcc 13.0 and torch's CUDA 12.8 differ in major version"),
    ],
)
def test_unsuitable_toolchain_is_a_reason(change, reason):
    spec = read_member(TOY, {"version": 1})
    assert builder.skip_reason(spec, GOOD) is None
    assert reason in builder.skip_reason(spec, dataclasses.replace(GOOD, **change))


def test_nvcc_too_old_for_a_capability(tmp_path):
    spec = read_workspace(make_workspace(tmp_path, '"9.0a", "10.0a"'))["toy"]
    old = dataclasses.replace(GOOD, nvcc_version=(12, 4), torch_cuda="12.4")
    assert builder.skip_reason(spec, old) == "nvcc 12.4 cannot compile 10.0a (needs CUDA 12.8 or newer)"


def test_missing_sources_are_named(tmp_path):
    root = make_workspace(tmp_path)
    (root / "toy" / "toy_cuda" / "scale.cu").unlink()
    spec = read_workspace(root)["toy"]
    assert builder.skip_reason(spec, GOOD) == "missing sources listed in build.toml: toy_cuda/scale.cu"


@pytest.mark.parametrize("dependency", ["metal-cpp", "sycl_tla"])
def test_a_dependency_the_builder_cannot_provide_is_named(tmp_path, dependency):
    root = make_workspace(tmp_path)
    manifest = root / "toy" / "build.toml"
    manifest.write_text(manifest.read_text().replace('depends = ["torch"]', f'depends = ["torch", "{dependency}"]'))
    spec = read_workspace(root)["toy"]
    assert builder.skip_reason(spec, GOOD) == (
        f"depends on {dependency}, which the local builder cannot provide (it provides only torch): "
        "build it with kernel-builder, `nix run .#build`")


def test_members_select_by_argument_then_env(monkeypatch):
    specs = read_workspace(REPO)
    monkeypatch.delenv("PRIME_KERNELS", raising=False)
    assert [s.name for s in builder.selected(specs, [])] == ["rmsnorm", "flash_moe"]
    monkeypatch.setenv("PRIME_KERNELS", "flash_moe")
    assert [s.name for s in builder.selected(specs, [])] == ["flash_moe"]
    assert [s.name for s in builder.selected(specs, ["rmsnorm"])] == ["rmsnorm"]
    monkeypatch.setenv("PRIME_KERNELS", "rmsnorm,bogus")
    with pytest.raises(KeyError, match="unknown kernel 'bogus'; known kernels: rmsnorm, flash_moe"):
        builder.selected(specs, [])


@pytest.mark.parametrize("require, code", [("", 0), ("1", 1)])
def test_skip_is_one_line_and_require_makes_it_fail(tmp_path, monkeypatch, require, code):
    specs = read_workspace(make_workspace(tmp_path))
    monkeypatch.setattr(builder, "toolchain", lambda: dataclasses.replace(GOOD, cuda_home=None, nvcc_version=None))
    monkeypatch.setenv("PRIME_KERNELS_REQUIRE", require)
    lines = []
    assert builder.build(specs, [], log=lines.append) == code
    assert lines[0].startswith("skipping toy: no CUDA toolkit")
    assert len(lines) == (2 if require else 1)
    assert (specs["toy"].build_dir / SKIP_MARKER).read_text().startswith("no CUDA toolkit")


def test_registry_reports_the_skip_reason(tmp_path):
    root = make_workspace(tmp_path)
    (root / "toy" / "build").mkdir()
    (root / "toy" / "build" / SKIP_MARKER).write_text("no CUDA toolkit: ...\n")
    result = run_python("import prime_kernels; print(prime_kernels.unavailable_reason('toy'))", root)
    assert "`prime-kernels build toy` skipped it: no CUDA toolkit" in result.stdout, result.stderr


def test_registry_lists_only_variants_as_variants(tmp_path):
    """A build/ holding the builder's hidden .obj/ and another torch's variant: the reason names
    the variant, not .obj."""
    from prime_kernels.registry import _from_local_build

    root = make_workspace(tmp_path)
    for folder in (".obj", "torch199-cxx11-cu990-x86_64-linux"):
        (root / "toy" / "build" / folder).mkdir(parents=True)
    found, problem, skipped = _from_local_build(read_workspace(root)["toy"], None)
    assert found is None and not skipped and "variants there: torch199-cxx11-cu990-x86_64-linux)" in problem, problem
    assert ".obj" not in problem


# -- a real build (needs nvcc and a CUDA build of torch; no GPU) ------------------------------------


def _variant(root: pathlib.Path) -> pathlib.Path:
    (variant,) = [p for p in (root / "toy" / "build").iterdir() if p.is_dir() and p.name.startswith("torch")]
    return variant


def test_build_lays_out_a_kernel_builder_variant(built_toy):
    from kernels import _rust as kernels_rust
    from kernels_data import Digest, DigestAlgorithm, Metadata

    variant = _variant(built_toy)
    assert variant.name == builder.toolchain().variant()
    (so,) = variant.glob("_toy_cuda_*.abi3.so")
    ext = so.name.removesuffix(".abi3.so")
    assert sorted(p.name for p in variant.iterdir()) == sorted(["__init__.py", "_ops.py", "metadata.json", so.name])
    assert f"torch.ops.{ext}" in (variant / "_ops.py").read_text()
    metadata = json.loads((variant / "metadata.json").read_text())
    assert metadata["id"] == ext and metadata["name"] == "toy" and metadata["version"] == 1
    assert metadata["backend"] == {"type": "cuda", "archs": ["9.0a"]}
    parsed = Metadata.read_from_file(str(variant / "metadata.json"))
    parsed.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, str(variant)))
    # A development build, marked so in metadata.json; the loader's own parser still accepts it.
    assert metadata[builder.DEVELOPMENT_KEY]["build"] == "development"
    assert builder.is_development_build(variant)
    kernels_rust.Metadata.read_from_file(str(variant / "metadata.json"))
    # The generated registration.h stays in the build tree, never beside the sources.
    assert (built_toy / "toy" / "build" / ".obj" / variant.name / "registration.h").is_file()
    assert not (built_toy / "toy" / "torch-ext" / "registration.h").exists()


def test_rebuild_is_incremental(built_toy):
    result = build_toy(built_toy)
    assert result.returncode == 0 and "no work to do" in result.stdout, result.stdout + result.stderr


def _carried_copy(built_toy: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """A fresh workspace holding the toy's built variant folder alone, as a copy carried to
    another machine has it (no .obj/)."""
    import shutil

    root = make_workspace(dest)
    variant = _variant(built_toy)
    shutil.copytree(variant, root / "toy" / "build" / variant.name)
    return root


KEEP = {builder.KEEP_CARRIED_ENV: "1"}


def test_a_carried_build_of_the_same_sources_is_kept(built_toy, tmp_path):
    root = _carried_copy(built_toy, tmp_path / "kept")
    result = build_toy(root, **KEEP)
    assert result.returncode == 0 and "kept toy:" in result.stdout, result.stdout + result.stderr
    assert not (root / "toy" / "build" / ".obj").exists()  # nothing compiled
    # Run again: still kept (keeping writes no build state that would turn it into a local build).
    assert "kept toy:" in build_toy(root, **KEEP).stdout


@pytest.mark.parametrize("change", ["not asked", "tampered", "sources", "builder inputs"])
def test_a_carried_build_that_differs_is_rebuilt(built_toy, tmp_path, change):
    root = _carried_copy(built_toy, tmp_path / change.replace(" ", "-"))
    env = {} if change == "not asked" else KEEP  # a local build never keeps one unasked
    if change == "tampered":  # a file that differs from metadata.json's digest
        (_variant(root) / "__init__.py").write_text("# not what was built\n")
    elif change == "sources":  # an edited source: the extension id changes
        binding = root / "toy" / "torch-ext" / "torch_binding.cpp"
        binding.write_text(binding.read_text() + "\n// edited\n")
    elif change == "builder inputs":  # made by another builder, torch or nvcc (outside the digest)
        meta = _variant(root) / "metadata.json"
        data = json.loads(meta.read_text())
        data[builder.DEVELOPMENT_KEY]["inputs"] = "0" * 16
        meta.write_text(json.dumps(data))
    result = build_toy(root, **env)
    assert result.returncode == 0 and "built toy:" in result.stdout and "kept" not in result.stdout, \
        result.stdout + result.stderr


def test_build_loads_with_kernels_get_local_kernel_and_local_kernels(built_toy):
    code = (
        "import kernels, pathlib, prime_kernels.registry as r, prime_kernels as p\n"
        "m = kernels.get_local_kernel(pathlib.Path(%r))\n"
        "print('ops', hasattr(m.ops, 'scale'), m.__name__)\n"
        "print('source', r.resolve(p.spec('toy')).source)\n"
    ) % str(built_toy / "toy" / "build")
    plain = run_python(code, built_toy)
    assert "ops True _toy_cuda_" in plain.stdout and "source local build" in plain.stdout, plain.stderr
    via_env = run_python(code, built_toy, LOCAL_KERNELS=f"prime-intellect/toy={built_toy / 'toy' / 'build'}")
    assert "source LOCAL_KERNELS" in via_env.stdout, via_env.stderr


@pytest.fixture(scope="module")
def built_for_blackwell_only(tmp_path_factory, toolchain_reason):
    if toolchain_reason is not None:
        pytest.skip(f"cannot build here: {toolchain_reason}")
    root = make_workspace(tmp_path_factory.mktemp("sm100"), capabilities='"10.0a"')
    result = build_toy(root)
    assert result.returncode == 0, result.stdout + result.stderr
    return root


def test_variant_records_what_it_was_built_for(built_for_blackwell_only):
    metadata = json.loads((_variant(built_for_blackwell_only) / "metadata.json").read_text())
    assert metadata["backend"]["archs"] == ["10.0a"]


@pytest.mark.gpu
def test_variant_for_another_capability_is_refused_before_import(built_for_blackwell_only):
    cap = gpu_capability()
    if cap is None or cap == (10, 0):
        pytest.skip("needs a CUDA GPU that is not sm_100")
    code = (
        "import sys, prime_kernels\n"
        "reason = prime_kernels.unavailable_reason('toy')\n"
        "print('reason:', reason)\n"
        "try:\n    prime_kernels.load('toy')\nexcept RuntimeError as e:\n    print('refused:', e)\n"
        "print('native loaded:', any(n.startswith('_toy_cuda_') for n in sys.modules))\n"
    )
    result = run_python(code, built_for_blackwell_only)
    print(result.stdout)
    expected = f"built for sm_100a, this device is sm_{cap[0]}{cap[1]}"
    assert f"reason: {expected}" in result.stdout and "refused: prime_kernels: cannot load toy" in result.stdout
    assert "native loaded: False" in result.stdout, result.stderr


@pytest.mark.gpu
def test_local_build_loads_and_runs_on_the_gpu(built_toy, sm90_gpu):
    code = (
        "import torch, prime_kernels\n"
        "toy = prime_kernels.load('toy')\n"
        "x = torch.randn(1000, device='cuda')\n"
        "print('ok', torch.equal(toy.scale(x, 3.0), x * 3.0))\n"
    )
    result = run_python(code, built_toy)
    assert "ok True" in result.stdout, result.stdout + result.stderr


@pytest.mark.gpu
def test_bad_input_raises_a_clear_error_not_a_crash(built_toy, sm90_gpu):
    code = (
        "import torch, prime_kernels\n"
        "toy = prime_kernels.load('toy')\n"
        "try:\n    toy.scale(torch.randn(4, 4, device='cuda'), 2.0)\n"
        "except RuntimeError as e:\n    print('raised:', str(e).splitlines()[0])\n"
    )
    result = run_python(code, built_toy)
    assert result.returncode == 0, f"rc={result.returncode}: {result.stderr[-2000:]}"
    assert "raised: scale: x must be 1-D, got 2 dimensions" in result.stdout
