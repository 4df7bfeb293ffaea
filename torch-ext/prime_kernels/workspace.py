"""The manifests: where the kernels are declared, and which Hub release each one loads.

Two ways to know the kernels:

* a workspace (a checkout): the top-level build.toml with a `[workspace]` table, and each
  member's kernel-builder build.toml. Found through $PRIME_KERNELS_WORKSPACE, else from the
  current directory upwards. Member manifests are validated by kernel-builder's own parser
  (`kernels._rust.Build`, the Rust `kernels-data` crate); the fields the shim and the local
  builder need are then read with tomllib.
* no workspace (the shim pip-installed on its own): `release.toml` beside this file, generated
  from a workspace by `prime-kernels sync-release`: per kernel its names, repo-id, Hub pin and
  declared capabilities, as of the release the shim was tested with.

Which Hub release a kernel loads (its pin), first match wins: the `version=`/`revision=`
argument of `load`; the consumer's own `kernels.lock` (beside the nearest pyproject.toml, from
the current directory upwards, that has `[tool.kernels.dependencies]`; its locked commit becomes a
revision pin); the workspace's `[hub.<name>]`; the shipped release file.

Every error names the file and the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import tomllib

from . import capability

WORKSPACE_ENV = "PRIME_KERNELS_WORKSPACE"
RELEASE_FILE = pathlib.Path(__file__).resolve().with_name("release.toml")
SYNC_RELEASE_COMMAND = "prime-kernels sync-release"
NO_WORKSPACE = (
    "no workspace: run inside a checkout (a build.toml with a [workspace] table in the current "
    f"directory or above) or set {WORKSPACE_ENV} to a checkout's root"
)

# Where a pin came from, in order of precedence.
ORIGIN_ARGUMENT = "load argument"
ORIGIN_LOCK = "kernels.lock"
ORIGIN_WORKSPACE = "workspace build.toml"
ORIGIN_RELEASE = "shipped release file"


class ManifestError(ValueError):
    """A build.toml, release file or kernels.lock that is missing, malformed or inconsistent."""


@dataclasses.dataclass(frozen=True)
class CudaKernel:
    """One `[kernel.<name>]` table of a member: CUDA sources built for a list of capabilities."""

    name: str
    sources: tuple[str, ...]
    include: tuple[str, ...]
    depends: tuple[str, ...]
    capabilities: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class HubPin:
    """Which release of a kernel's Hub repo to load (exactly one of version, revision), and who chose it."""

    version: int | None
    revision: str | None
    origin: str  # one of the ORIGIN_* constants
    path: pathlib.Path | None  # the file the pin was read from (None for a load argument)

    def __str__(self) -> str:
        return f"v{self.version}" if self.version is not None else f"revision {self.revision}"

    @property
    def described(self) -> str:
        """E.g. "v1 from the workspace build.toml (/ws/build.toml)"."""
        where = f" ({self.path})" if self.path is not None else ""
        return f"{self} from the {self.origin}{where}"


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Everything the shim and the builder know about one kernel.

    From a workspace every field is set. From the shipped release file only the names, the Hub
    repo and pin and the declared capabilities are: `directory` is None (no sources, no local
    build)."""

    name: str  # Python package name, e.g. "flash_moe"
    builder_name: str  # kernel-builder name, e.g. "flash-moe"
    repo_id: str
    hub_version: int | None  # what `load` asks the Hub for by default: exactly one of these two
    hub_revision: str | None
    capabilities: tuple[str, ...]  # every capability any of its CUDA kernels is compiled for, sorted
    pin_origin: str  # ORIGIN_WORKSPACE or ORIGIN_RELEASE
    pin_file: pathlib.Path | None  # the file holding the default pin
    directory: pathlib.Path | None = None
    version: int | None = None
    license: str | None = None
    torch_sources: tuple[str, ...] = ()
    kernels: tuple[CudaKernel, ...] = ()

    @property
    def manifest(self) -> pathlib.Path:
        return self._source_dir / "build.toml"

    @property
    def build_dir(self) -> pathlib.Path:
        return self._source_dir / "build"

    @property
    def python_dir(self) -> pathlib.Path:
        return self._source_dir / "torch-ext" / self.name

    @property
    def _source_dir(self) -> pathlib.Path:
        if self.directory is None:
            raise ManifestError(f"{self.name}: {NO_WORKSPACE} (its pins come from {self.pin_file})")
        return self.directory

    @property
    def default_pin(self) -> HubPin:
        return HubPin(self.hub_version, self.hub_revision, self.pin_origin, self.pin_file)

    @property
    def hub_pin(self) -> str:
        return str(self.default_pin)


# ---------------------------------------------------------------------------------------------
# Reading TOML tables with errors that name file and field


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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_release_number(value) -> bool:
    """A version is a release branch v1, v2, ...: an integer >= 1."""
    return _is_int(value) and value >= 1


def _is_revision(value) -> bool:
    """A branch, tag or commit: a non-empty string."""
    return isinstance(value, str) and bool(value)


def _release_number(value, path: pathlib.Path, field: str) -> int:
    if not _is_int(value):
        raise ManifestError(f"{path}: field `{field}` must be an int, got {value!r}")
    if not _is_release_number(value):
        raise ManifestError(
            f"{path}: field `{field}` must be an integer >= 1 (release branches are v1, v2, ...), got {value!r}"
        )
    return value


def _capabilities(table: dict, path: pathlib.Path, where: str) -> tuple[str, ...]:
    """`cuda-capabilities` in kernel-builder's form ("9.0a"); anything else names the value and the form."""
    values = _str_list(table, "cuda-capabilities", path, where)
    for value in values:
        try:
            capability.parse(value)
        except ValueError:
            suggestion = capability.from_sm_name(value)
            fix = f'write "{suggestion}"' if suggestion else 'write it as major.minor, e.g. "10.0a"'
            raise ManifestError(
                f"{path}: field `{where}cuda-capabilities`: {value!r} is not a CUDA capability in "
                f"kernel-builder's form (major.minor plus an optional a/f suffix, e.g. \"10.0a\"): {fix}"
            ) from None
    return values


def _hub_pin(table: dict, path: pathlib.Path, where: str) -> tuple[int | None, str | None]:
    """`version = N` or `revision = "<ref>"` (exactly one) of a `[hub.<name>]`-like table."""
    version, revision = table.get("version"), table.get("revision")
    if (version is None) == (revision is None):
        raise ManifestError(f"{path}: `[{where.rstrip('.')}]` needs exactly one of `version` or `revision`")
    if version is not None:
        _release_number(version, path, f"{where}version")
    if revision is not None and not _is_revision(revision):
        raise ManifestError(f"{path}: field `{where}revision` must be a non-empty string, got {revision!r}")
    return version, revision


# ---------------------------------------------------------------------------------------------
# The workspace


def _has_workspace_table(manifest: pathlib.Path) -> bool:
    return manifest.is_file() and isinstance(_read_toml(manifest).get("workspace"), dict)


def find_workspace(start: pathlib.Path | None = None) -> pathlib.Path | None:
    """The workspace root: $PRIME_KERNELS_WORKSPACE if set (it must hold a build.toml with a
    `[workspace]` table), else the nearest directory from `start` (default: the current
    directory) upwards holding one; None when there is none."""
    if env := os.environ.get(WORKSPACE_ENV):
        root = pathlib.Path(env).resolve()
        manifest = root / "build.toml"
        if not _has_workspace_table(manifest):
            problem = "has no [workspace] table" if manifest.is_file() else "does not exist"
            raise ManifestError(
                f"{WORKSPACE_ENV}={env}: {manifest} {problem}: point it at a checkout's root "
                f"(the folder whose build.toml has a [workspace] table), or unset it"
            )
        return root
    start = (start or pathlib.Path.cwd()).resolve()
    # A member's own build.toml has no [workspace] table: keep going up to the checkout's.
    return next((d for d in (start, *start.parents) if _has_workspace_table(d / "build.toml")), None)


def workspace_root() -> pathlib.Path:
    """The workspace root; ManifestError saying how to give one when there is none."""
    root = find_workspace()
    if root is None:
        raise ManifestError(NO_WORKSPACE)
    return root


def _validate_with_kernel_builder(directory: pathlib.Path) -> None:
    try:
        from kernels._rust import Build
    except ImportError:  # kernels not installed: tomllib checks below still run
        return
    try:
        Build.open(str(directory))
    except ValueError as e:
        raise ManifestError(f"{directory / 'build.toml'}: rejected by kernel-builder's parser: {e}") from None


def _check_folder_name(path: pathlib.Path, builder_name: str, directory: pathlib.Path) -> str:
    """The Python package name `general.name` gives; the member's folder must carry it."""
    name = builder_name.replace("-", "_")
    if directory.name != name:
        raise ManifestError(
            f"{path}: field `general.name` ({builder_name!r}) gives the Python package `{name}`, "
            f"which must also be the member's folder name; the folder is {directory.name!r}: "
            f"rename it to {name!r} (and list {name!r} in `workspace.members`)"
        )
    return name


def read_member(directory: pathlib.Path, hub: dict | None = None, workspace_manifest: pathlib.Path | None = None) -> KernelSpec:
    """Parse and validate `<directory>/build.toml`; `hub` is the member's `[hub.<name>]` pin table."""
    path = directory / "build.toml"
    data = _read_toml(path)

    # Our field checks first (their errors name the field), then kernel-builder's full validation.
    general = _field(data, "general", dict, path, "")
    builder_name = _field(general, "name", str, path, "general.")
    version = _release_number(_field(general, "version", int, path, "general."), path, "general.version")
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
                capabilities=_capabilities(table, path, where),
            )
        )

    _validate_with_kernel_builder(directory)
    name = _check_folder_name(path, builder_name, directory)
    hub_path = workspace_manifest or path
    if hub is not None and not isinstance(hub, dict):
        raise ManifestError(f"{hub_path}: field `hub.{name}` must be a table (`version = N` or `revision = \"<ref>\"`), got {hub!r}")
    hub_version, hub_revision = _hub_pin(hub or {}, hub_path, f"hub.{name}.")

    return KernelSpec(
        name=name,
        builder_name=builder_name,
        repo_id=repo_id,
        hub_version=hub_version,
        hub_revision=hub_revision,
        capabilities=tuple(sorted({c for k in kernels for c in k.capabilities}, key=capability.parse)),
        pin_origin=ORIGIN_WORKSPACE,
        pin_file=hub_path,
        directory=directory,
        version=version,
        license=license_,
        torch_sources=torch_sources,
        kernels=tuple(kernels),
    )


def read_workspace(root: pathlib.Path | None = None) -> dict[str, KernelSpec]:
    """Every member of the workspace at `root` (default: `workspace_root()`), by Python name, in manifest order."""
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


# ---------------------------------------------------------------------------------------------
# The shipped release file


def release_text(specs: dict[str, KernelSpec]) -> str:
    """The release file for a workspace's kernels: what `prime-kernels sync-release` writes."""
    q = json.dumps  # a JSON string is a valid TOML basic string
    lines = [
        f"# Generated by `{SYNC_RELEASE_COMMAND}` from build.toml and the members' build.toml: do not edit.",
        "# The Hub pins of the release this shim was tested with; `prime_kernels` uses them outside a checkout.",
    ]
    for spec in specs.values():
        pin = f"version = {spec.hub_version}" if spec.hub_version is not None else f"revision = {q(spec.hub_revision)}"
        lines += [
            "",
            "[[kernel]]",
            f"name = {q(spec.name)}",
            f"builder-name = {q(spec.builder_name)}",
            f"repo-id = {q(spec.repo_id)}",
            f"hub = {{ {pin} }}",
            f"cuda-capabilities = [{', '.join(q(c) for c in spec.capabilities)}]",
        ]
    return "\n".join(lines) + "\n"


def read_release(path: pathlib.Path = RELEASE_FILE) -> dict[str, KernelSpec]:
    """The kernels of the shipped release file, by Python name, in file order."""
    if not path.is_file():
        raise ManifestError(f"{path}: file not found: this copy of prime_kernels ships no release pins, and {NO_WORKSPACE}")
    entries = _field(_read_toml(path), "kernel", list, path, "")
    specs = {}
    for i, entry in enumerate(entries):
        where = f"kernel[{i}]."
        if not isinstance(entry, dict):
            raise ManifestError(f"{path}: field `kernel[{i}]` must be a table, got {entry!r}")
        name = _field(entry, "name", str, path, where)
        hub_version, hub_revision = _hub_pin(_field(entry, "hub", dict, path, where), path, f"{where}hub.")
        capabilities = _capabilities(entry, path, where)
        specs[name] = KernelSpec(
            name=name,
            builder_name=_field(entry, "builder-name", str, path, where),
            repo_id=_field(entry, "repo-id", str, path, where),
            hub_version=hub_version,
            hub_revision=hub_revision,
            capabilities=tuple(sorted(capabilities, key=capability.parse)),
            pin_origin=ORIGIN_RELEASE,
            pin_file=path,
        )
    return specs


def read_kernels(root: pathlib.Path | None = None) -> dict[str, KernelSpec]:
    """The workspace's kernels when there is a workspace (`root`, else `find_workspace()`), else the release file's."""
    root = root or find_workspace()
    return read_workspace(root) if root is not None else read_release()


# ---------------------------------------------------------------------------------------------
# The pin a load uses


def find_consumer_lock(start: pathlib.Path | None = None) -> pathlib.Path | None:
    """The kernels.lock of the consumer's project: beside the nearest pyproject.toml, from `start`
    (default: the current directory) upwards, that declares `[tool.kernels.dependencies]`; None
    when there is no such project or it has no kernels.lock yet."""
    start = (start or pathlib.Path.cwd()).resolve()
    for directory in (start, *start.parents):
        pyproject = directory / "pyproject.toml"
        if not pyproject.is_file():
            continue
        try:
            data = tomllib.loads(pyproject.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError):
            continue  # not a project kernels could read a lock for either
        tool = data.get("tool", {})
        kernels = tool.get("kernels", {}) if isinstance(tool, dict) else {}
        if isinstance(kernels, dict) and isinstance(kernels.get("dependencies"), dict):
            lock = directory / "kernels.lock"
            return lock if lock.is_file() else None
    return None


def locked_commit(lock: pathlib.Path, repo_id: str) -> str | None:
    """The commit `lock` (kernels' own format, read by kernels' own parser) records for `repo_id`; None if absent."""
    from kernels._rust import KernelLocks

    try:
        locks = KernelLocks.from_json(lock.read_text())
    except ValueError as e:
        raise ManifestError(f"{lock}: not a kernels.lock that kernels can read ({e}): regenerate it") from None
    # Locks are keyed by (repo, version); a project locks one version per repo, as kernels assumes.
    # str(): kernels >= 0.18 returns the commit as an Oid, which KernelVersion.Revision refuses.
    commit = next((locks[dep].commit for dep in locks.keys() if dep.repo_id == repo_id), None)
    return None if commit is None else str(commit)


def argument_pin(version: int | None, revision: str | None) -> HubPin | None:
    """The pin given to `load(..., version=|revision=)`, validated; None when neither is given."""
    if version is None and revision is None:
        return None
    if version is not None and revision is not None:
        raise ValueError(f"pass version= or revision=, not both (got version={version!r}, revision={revision!r})")
    if version is not None and not _is_release_number(version):
        raise ValueError(f"version must be an integer >= 1 (release branches are v1, v2, ...), got {version!r}")
    if revision is not None and not _is_revision(revision):
        raise ValueError(f"revision must be a non-empty string (a branch, tag or commit), got {revision!r}")
    return HubPin(version, revision, ORIGIN_ARGUMENT, None)


def choose_pin(spec: KernelSpec, version: int | None = None, revision: str | None = None,
               start: pathlib.Path | None = None) -> HubPin:
    """The pin for `spec`: the argument, else the consumer's kernels.lock (found from `start`
    upwards), else the spec's own (workspace build.toml or shipped release file)."""
    if (pin := argument_pin(version, revision)) is not None:
        return pin
    lock = find_consumer_lock(start)
    if lock is not None and (commit := locked_commit(lock, spec.repo_id)) is not None:
        return HubPin(None, commit, ORIGIN_LOCK, lock)
    return spec.default_pin
