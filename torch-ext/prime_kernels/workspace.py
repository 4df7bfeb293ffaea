"""The workspace manifests: the top-level build.toml and each member's kernel-builder build.toml.

Member manifests are validated by kernel-builder's own parser (`kernels._rust.Build`, the Rust
`kernels-data` crate); the fields the shim and the local builder need are then read with tomllib.
Every error names the file and the field.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import tomllib

WORKSPACE_ENV = "PRIME_KERNELS_WORKSPACE"


class ManifestError(ValueError):
    """A build.toml that is missing, malformed or inconsistent."""


@dataclasses.dataclass(frozen=True)
class CudaKernel:
    """One `[kernel.<name>]` table of a member: CUDA sources built for a list of capabilities."""

    name: str
    sources: tuple[str, ...]
    include: tuple[str, ...]
    depends: tuple[str, ...]
    capabilities: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Everything the shim and the builder know about one member kernel."""

    name: str  # Python package name, e.g. "flash_moe"
    builder_name: str  # kernel-builder name, e.g. "flash-moe"
    directory: pathlib.Path
    version: int
    license: str
    repo_id: str
    hub_version: int | None  # what `load` asks the Hub for: exactly one of these two
    hub_revision: str | None
    torch_sources: tuple[str, ...]
    kernels: tuple[CudaKernel, ...]

    @property
    def manifest(self) -> pathlib.Path:
        return self.directory / "build.toml"

    @property
    def build_dir(self) -> pathlib.Path:
        return self.directory / "build"

    @property
    def python_dir(self) -> pathlib.Path:
        return self.directory / "torch-ext" / self.name

    @property
    def capabilities(self) -> tuple[str, ...]:
        """Every capability any of its CUDA kernels is compiled for, sorted, e.g. ("10.0a", "9.0a")."""
        from .capability import parse

        return tuple(sorted({c for k in self.kernels for c in k.capabilities}, key=parse))

    @property
    def hub_pin(self) -> str:
        return f"v{self.hub_version}" if self.hub_version is not None else f"revision {self.hub_revision}"


def workspace_root() -> pathlib.Path:
    """The checkout holding the top-level build.toml ($PRIME_KERNELS_WORKSPACE overrides)."""
    if env := os.environ.get(WORKSPACE_ENV):
        return pathlib.Path(env).resolve()
    # torch-ext/prime_kernels/workspace.py -> the checkout root
    return pathlib.Path(__file__).resolve().parents[2]


def _read_toml(path: pathlib.Path) -> dict:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ManifestError(f"{path}: file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(f"{path}: not valid TOML: {e}") from None


def _field(table: dict, key: str, kind: type, path: pathlib.Path, where: str):
    if key not in table:
        raise ManifestError(f"{path}: missing field `{where}{key}`")
    value = table[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        article = "an" if kind.__name__[0] in "aeiou" else "a"
        raise ManifestError(f"{path}: field `{where}{key}` must be {article} {kind.__name__}, got {value!r}")
    return value


def _str_list(table: dict, key: str, path: pathlib.Path, where: str, required: bool = True) -> tuple[str, ...]:
    if key not in table and not required:
        return ()
    value = _field(table, key, list, path, where)
    if not all(isinstance(v, str) for v in value):
        raise ManifestError(f"{path}: field `{where}{key}` must be a list of strings, got {value!r}")
    return tuple(value)


def _validate_with_kernel_builder(directory: pathlib.Path) -> None:
    try:
        from kernels._rust import Build
    except ImportError:  # kernels not installed: tomllib checks below still run
        return
    try:
        Build.open(str(directory))
    except ValueError as e:
        raise ManifestError(f"{directory / 'build.toml'}: rejected by kernel-builder's parser: {e}") from None


def read_member(directory: pathlib.Path, hub: dict | None = None, workspace_manifest: pathlib.Path | None = None) -> KernelSpec:
    """Parse and validate `<directory>/build.toml`; `hub` is the member's `[hub.<name>]` pin table."""
    path = directory / "build.toml"
    data = _read_toml(path)

    # Our field checks first (their errors name the field), then kernel-builder's full validation.
    general = _field(data, "general", dict, path, "")
    builder_name = _field(general, "name", str, path, "general.")
    version = _field(general, "version", int, path, "general.")
    license_ = _field(general, "license", str, path, "general.")
    backends = _str_list(general, "backends", path, "general.")
    if backends != ("cuda",):
        raise ManifestError(f"{path}: field `general.backends` must be [\"cuda\"], got {list(backends)!r}")
    hub_table = _field(general, "hub", dict, path, "general.")
    repo_id = _field(hub_table, "repo-id", str, path, "general.hub.")
    torch_sources = _str_list(_field(data, "torch", dict, path, ""), "src", path, "torch.")

    kernels = []
    for kname, table in _field(data, "kernel", dict, path, "").items():
        where = f"kernel.{kname}."
        backend = _field(table, "backend", str, path, where)
        if backend != "cuda":
            raise ManifestError(f"{path}: field `{where}backend` must be \"cuda\", got {backend!r}")
        kernels.append(
            CudaKernel(
                name=kname,
                sources=_str_list(table, "src", path, where),
                include=_str_list(table, "include", path, where, required=False),
                depends=_str_list(table, "depends", path, where),
                capabilities=_str_list(table, "cuda-capabilities", path, where),
            )
        )

    _validate_with_kernel_builder(directory)
    name = builder_name.replace("-", "_")
    if directory.name != name:
        raise ManifestError(f"{path}: field `general.name` ({builder_name!r}) must match the folder name {directory.name!r}")

    hub = hub or {}
    hub_where = f"hub.{name}."
    hub_path = workspace_manifest or path
    hub_version = hub.get("version")
    hub_revision = hub.get("revision")
    if (hub_version is None) == (hub_revision is None):
        raise ManifestError(f"{hub_path}: `[hub.{name}]` needs exactly one of `version` or `revision`")
    if hub_version is not None and (not isinstance(hub_version, int) or isinstance(hub_version, bool)):
        raise ManifestError(f"{hub_path}: field `{hub_where}version` must be an int, got {hub_version!r}")
    if hub_revision is not None and not isinstance(hub_revision, str):
        raise ManifestError(f"{hub_path}: field `{hub_where}revision` must be a string, got {hub_revision!r}")

    return KernelSpec(
        name=name,
        builder_name=builder_name,
        directory=directory,
        version=version,
        license=license_,
        repo_id=repo_id,
        hub_version=hub_version,
        hub_revision=hub_revision,
        torch_sources=torch_sources,
        kernels=tuple(kernels),
    )


def read_workspace(root: pathlib.Path | None = None) -> dict[str, KernelSpec]:
    """Every member of the workspace at `root`, by Python name, in manifest order."""
    root = root or workspace_root()
    path = root / "build.toml"
    data = _read_toml(path)
    workspace = _field(data, "workspace", dict, path, "")
    members = _str_list(workspace, "members", path, "workspace.")
    hub = data.get("hub", {})
    if not isinstance(hub, dict):
        raise ManifestError(f"{path}: field `hub` must be a table, got {hub!r}")
    for pinned in hub:
        if pinned not in members:
            raise ManifestError(f"{path}: field `hub.{pinned}` pins a kernel that is not in `workspace.members`")
    specs = {}
    for member in members:
        if member not in hub:
            raise ManifestError(f"{path}: missing field `hub.{member}` (the Hub version or revision it loads)")
        specs[member] = read_member(root / member, hub[member], path)
    return specs
