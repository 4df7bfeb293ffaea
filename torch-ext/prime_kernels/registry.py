"""Where a kernel would load from, and whether it can run on this device.

Resolution order (docs/DESIGN.md §3): `LOCAL_KERNELS` (the `kernels` convention, `repo_id=path:...`),
then the member's local build (`<member>/build/<variant>/`, only in a workspace), then the Hub
through `kernels.get_kernel(repo_id, version=|revision=)` with the pin `workspace.choose_pin`
picks (from the local cache alone when `HF_HUB_OFFLINE=1`). The variant's `metadata.json` is read
and its `backend.archs` compared exactly with the device's capability *before* any native code is
imported.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

from . import capability
from .workspace import HubPin, KernelSpec, choose_pin

# Written by `prime-kernels build` into <member>/build/ when it skips the member.
SKIP_MARKER = "SKIPPED"
LOCAL_KERNELS_FORM = "`org/name=/path[:org/name=/path...]`"


def variant_dirs(build_dir: pathlib.Path) -> list[pathlib.Path]:
    """The variant folders of a member's build/ (the local builder's hidden .obj/ is not one)."""
    if not build_dir.is_dir():
        return []
    return sorted(p for p in build_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


@dataclasses.dataclass(frozen=True)
class Resolution:
    """One kernel's answer: where it loads from, what it was built for, and why not (if not)."""

    kernel: str
    source: str  # "LOCAL_KERNELS", "local build" or "hub"
    location: str  # the variant directory, or "<repo_id> <pin>" when not found locally
    archs: tuple[str, ...]  # from the variant's metadata.json, else as declared in build.toml
    device: str  # e.g. "sm_90 (NVIDIA H200)", or what is missing
    reason: str | None  # None: available
    pin: HubPin  # the Hub release asked for, and which file chose it (used when source is "hub")

    @property
    def available(self) -> bool:
        return self.reason is None


class KernelStatus(str):
    """"available" or the reason a kernel cannot run here (a plain str to compare and print),
    carrying where it would load from and which Hub pin was used, and from where."""

    resolution: Resolution

    def __new__(cls, resolution: Resolution) -> "KernelStatus":
        self = super().__new__(cls, resolution.reason or "available")
        self.resolution = resolution
        return self

    @property
    def source(self) -> str:
        return self.resolution.source

    @property
    def location(self) -> str:
        return self.resolution.location

    @property
    def pin(self) -> HubPin:
        return self.resolution.pin


@dataclasses.dataclass(frozen=True)
class _Device:
    description: str
    capability: tuple[int, int] | None
    problem: str | None


@dataclasses.dataclass(frozen=True)
class _Found:
    """What one step of the resolution order found (problem None: a usable variant)."""

    source: str
    location: str
    archs: tuple[str, ...]
    problem: str | None = None


def _device(spec: KernelSpec, device) -> _Device:
    import torch

    wanted = ", ".join(capability.sm_name(a) for a in spec.capabilities)
    if torch.version.cuda is None:
        return _Device(
            f"none (torch {torch.__version__} has no CUDA)",
            None,
            f"torch {torch.__version__} is built without CUDA: install a CUDA build of torch "
            f"to run {spec.name} (built for {wanted})",
        )
    if not torch.cuda.is_available():
        return _Device(
            "no CUDA device",
            None,
            f"no CUDA device is visible (torch.cuda.is_available() is False; check the driver and "
            f"CUDA_VISIBLE_DEVICES): {spec.name} needs a GPU of {wanted}",
        )
    index = torch.cuda.current_device() if device is None else torch.device("cuda", device).index
    cap = torch.cuda.get_device_capability(index)
    return _Device(f"{capability.device_sm(cap)} ({torch.cuda.get_device_name(index)})", cap, None)


def _kernel_dependency(repo_id: str, pin: HubPin):
    from kernels._rust import KernelDependency, KernelVersion

    version = KernelVersion.Version(pin.version) if pin.version is not None else KernelVersion.Revision(pin.revision)
    return KernelDependency(repo_id=repo_id, version=version)


def hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _archs(metadata) -> tuple[str, ...]:
    return tuple(metadata.backend.archs or ())


def _one_line(error: Exception) -> str:
    """kernels' messages span lines (a trace per variant): fold them into one."""
    return " ".join(str(error).split())


def _fact(text: str) -> str:
    """The statement a reason opens with, before its first ": " (what follows is the fix)."""
    return text.split(": ", 1)[0]


# ---------------------------------------------------------------------------------------------
# The steps of the resolution order


def _from_local_kernels(spec: KernelSpec) -> _Found | None:
    """1. `LOCAL_KERNELS`, parsed by kernels' own parser; None when it does not name this repo."""
    from kernels.load import _parse_local_kernel_overrides
    from kernels.resolver import resolve_local_kernel

    value = os.environ.get("LOCAL_KERNELS")
    if not value:
        return None
    try:
        overrides = _parse_local_kernel_overrides(value)
    except ValueError:
        # kernels refuses every load while it is malformed, not just this repo's.
        return _Found("LOCAL_KERNELS", value, spec.capabilities,
                      f"LOCAL_KERNELS is malformed: {value!r} (expected {LOCAL_KERNELS_FORM})")
    path = overrides.get(spec.repo_id)
    if path is None:
        return None
    try:
        found = resolve_local_kernel(path, backend=None)
    except (FileNotFoundError, ValueError, OSError) as e:
        return _Found("LOCAL_KERNELS", str(path), spec.capabilities,
                      f"LOCAL_KERNELS points {spec.repo_id} at {path}, which holds no usable build ({_one_line(e)})")
    return _Found("LOCAL_KERNELS", str(found.variant_path), _archs(found.metadata))


def _skip_text(spec: KernelSpec) -> str | None:
    marker = spec.build_dir / SKIP_MARKER
    return marker.read_text().strip() if marker.is_file() else None


def _from_local_build(spec: KernelSpec, device_problem: str | None) -> tuple[_Found | None, str | None, bool]:
    """2. the member's build/ (workspace only): (the variant, None, False) or (None, why not and the
    fix, whether `prime-kernels build` left a SKIPPED marker)."""
    from kernels.resolver import resolve_local_kernel

    if spec.directory is None:
        return None, (
            f"build it in a checkout (`prime-kernels build {spec.name}`) and point LOCAL_KERNELS at "
            f"that build (`{spec.repo_id}=/path/to/{spec.name}/build`)"
        ), False
    trace = None
    if spec.build_dir.is_dir():
        try:
            found = resolve_local_kernel(spec.build_dir, backend=None)
        except FileNotFoundError as e:
            trace = str(e).strip().splitlines()[-1].strip()
        except (ValueError, OSError) as e:  # a variant whose metadata.json kernels cannot read
            trace = f"unreadable variant: {_one_line(e)}"
        else:
            return _Found("local build", str(found.variant_path), _archs(found.metadata)), None, False
    skipped = _skip_text(spec)
    if skipped is not None:
        if device_problem is not None and _fact(skipped) in device_problem:
            return None, f"not built: `prime-kernels build {spec.name}` skipped it for the same reason", True
        return None, f"not built: `prime-kernels build {spec.name}` skipped it: {skipped}", True
    variants = [p.name for p in variant_dirs(spec.build_dir)]
    have = f"variants there: {', '.join(variants)}" if variants else "no variants there"
    detail = f" ({trace})" if trace else ""
    return None, (
        f"no local build for this torch/CUDA in {spec.build_dir} ({have}){detail}: "
        f"run `prime-kernels build {spec.name}`"
    ), False


def _only_says_not_cached(error: Exception) -> bool:
    """kernels' offline "not in the cache" errors, which the shim's own reason already states."""
    text = str(error)
    return ("is not available in the local cache" in text
            or isinstance(error, FileNotFoundError) and text.startswith("Cannot find a local snapshot"))


def _from_hub(spec: KernelSpec, pin: HubPin, dev: _Device, local_problem: str, local_skipped: bool) -> _Found:
    """3. the Hub (or, with HF_HUB_OFFLINE=1, its local cache) at `pin`. local_skipped: the local
    build was skipped (its reason, `local_problem`, is then the one to give)."""
    from kernels.hf_hub import _get_hf_api
    from kernels.resolver import HubCacheResolver, HubResolver

    location = f"{spec.repo_id} {pin}"
    offline = hub_offline()
    if dev.problem is not None and not offline:
        # Not asked over the network when the device already rules the kernel out.
        return _Found("hub", location, spec.capabilities, local_problem if local_skipped else None)
    # The shim's own repos are trusted by name, so kernels' publisher check never refuses them.
    resolver = (HubCacheResolver if offline else HubResolver)(trust_remote_code=[spec.repo_id])
    try:
        found = resolver.resolve(api=_get_hf_api(), backend=None, kernel=_kernel_dependency(spec.repo_id, pin))
    except Exception as e:  # what huggingface_hub / kernels raise varies: report it with the fix
        if offline:
            detail = "" if _only_says_not_cached(e) else f" ({_one_line(e)})"
            problem = (f"HF_HUB_OFFLINE=1 and {location} is not usable from the local cache{detail}; "
                       f"download it once online, or {local_problem}")
        else:
            problem = f"{location} could not be resolved on the Hub ({type(e).__name__}: {_one_line(e)}); or {local_problem}"
        return _Found("hub", location, spec.capabilities, problem)
    variant = str(getattr(found, "variant_path", f"{location} ({found.variant_str})"))
    return _Found("hub", variant, _archs(found.metadata))


def resolve(spec: KernelSpec, device=None, *, version: int | None = None, revision: str | None = None) -> Resolution:
    """Find the variant `load` would import, and the reason it cannot run here (None if it can).

    `version`/`revision` override the pin (see `workspace.choose_pin`); no native code is imported."""
    pin = choose_pin(spec, version, revision)
    dev = _device(spec, device)
    found = _from_local_kernels(spec)
    if found is None:
        found, local_problem, local_skipped = _from_local_build(spec, dev.problem)
        if found is None:
            found = _from_hub(spec, pin, dev, local_problem, local_skipped)

    reason = "; ".join(filter(None, [dev.problem, found.problem])) or None
    if reason is None and dev.capability is not None:
        reason = capability.mismatch_reason(found.archs, dev.capability)
        if reason is not None:
            reason += f": rebuild {spec.name} with {dev.capability[0]}.{dev.capability[1]}a in its cuda-capabilities"
    return Resolution(spec.name, found.source, found.location, tuple(found.archs), dev.description, reason, pin)


def import_kernel(spec: KernelSpec, resolution: Resolution):
    """Import the resolved variant through `kernels` (only after `resolution.available`)."""
    import kernels

    if resolution.source == "local build":
        return kernels.get_local_kernel(spec.build_dir)
    return kernels.get_kernel(
        spec.repo_id,
        version=resolution.pin.version,
        revision=resolution.pin.revision,
        trust_remote_code=[spec.repo_id],
    )
