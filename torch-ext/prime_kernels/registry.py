"""Where a kernel would load from, and whether it can run on this device.

Resolution order (DESIGN §3): `LOCAL_KERNELS` (the `kernels` convention, `repo_id=path:...`),
then the member's local build (`<member>/build/<variant>/`), then the Hub through
`kernels.get_kernel(repo_id, version=|revision=)` with the pin from the top-level build.toml
(from the local cache alone when `HF_HUB_OFFLINE=1`). The variant's `metadata.json` is read and
its `backend.archs` compared exactly with the device's capability *before* any native code is
imported.
"""

from __future__ import annotations

import dataclasses
import os

from . import capability
from .workspace import KernelSpec

# Written by `prime-kernels build` into <member>/build/ when it skips the member.
SKIP_MARKER = "SKIPPED"


@dataclasses.dataclass(frozen=True)
class Resolution:
    """One kernel's answer: where it loads from, what it was built for, and why not (if not)."""

    kernel: str
    source: str  # "LOCAL_KERNELS", "local build" or "hub"
    location: str  # the variant directory, or "<repo_id> <pin>" when not found locally
    archs: tuple[str, ...]  # from the variant's metadata.json, else as declared in build.toml
    device: str  # e.g. "sm_90 (NVIDIA H200)", or what is missing
    reason: str | None  # None: available

    @property
    def available(self) -> bool:
        return self.reason is None


@dataclasses.dataclass(frozen=True)
class _Device:
    description: str
    capability: tuple[int, int] | None
    problem: str | None


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


def _kernel_dependency(spec: KernelSpec):
    from kernels._rust import KernelDependency, KernelVersion

    version = (
        KernelVersion.Version(spec.hub_version)
        if spec.hub_version is not None
        else KernelVersion.Revision(spec.hub_revision)
    )
    return KernelDependency(repo_id=spec.repo_id, version=version)


def hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _archs(metadata) -> tuple[str, ...]:
    return tuple(metadata.backend.archs or ())


def _local_build_problem(spec: KernelSpec, trace: str | None) -> str:
    marker = spec.build_dir / SKIP_MARKER
    if marker.is_file():
        return f"not built: `prime-kernels build {spec.name}` skipped it: {marker.read_text().strip()}"
    variants = sorted(p.name for p in spec.build_dir.iterdir() if p.is_dir()) if spec.build_dir.is_dir() else []
    have = f"variants there: {', '.join(variants)}" if variants else "no variants there"
    detail = f" ({trace})" if trace else ""
    return (
        f"no local build for this torch/CUDA in {spec.build_dir} ({have}){detail}: "
        f"run `prime-kernels build {spec.name}`"
    )


def resolve(spec: KernelSpec, device=None) -> Resolution:
    """Find the variant `load` would import, and the reason it cannot run here (None if it can)."""
    from kernels.hf_hub import _get_hf_api
    from kernels.load import _get_local_kernel_overrides
    from kernels.resolver import HubCacheResolver, HubResolver, resolve_local_kernel

    dev = _device(spec, device)
    api = _get_hf_api()
    dependency = _kernel_dependency(spec)
    hub_location = f"{spec.repo_id} {spec.hub_pin}"

    def answer(source, location, archs, problem=None):
        reason = "; ".join(filter(None, [dev.problem, problem])) or None
        if reason is None and dev.capability is not None:
            reason = capability.mismatch_reason(archs, dev.capability)
            if reason is not None:
                reason += f": rebuild {spec.name} with {dev.capability[0]}.{dev.capability[1]}a in its cuda-capabilities"
        return Resolution(spec.name, source, location, tuple(archs), dev.description, reason)

    # 1. LOCAL_KERNELS
    if os.environ.get("LOCAL_KERNELS"):
        try:
            found = _get_local_kernel_overrides().resolve(api=api, backend=None, kernel=dependency)
        except (FileNotFoundError, ValueError) as e:
            return answer("LOCAL_KERNELS", os.environ["LOCAL_KERNELS"], spec.capabilities,
                          f"LOCAL_KERNELS names {spec.repo_id} but holds no usable build: {e}")
        if found is not None:
            return answer("LOCAL_KERNELS", str(found.variant_path), _archs(found.metadata))

    # 2. the member's local build
    local_trace = None
    if spec.build_dir.is_dir():
        try:
            found = resolve_local_kernel(spec.build_dir, backend=None)
        except FileNotFoundError as e:
            local_trace = str(e).strip().splitlines()[-1].strip()
        else:
            return answer("local build", str(found.variant_path), _archs(found.metadata))
    local_problem = _local_build_problem(spec, local_trace)

    # 3. the Hub: not asked over the network when the device already rules the kernel out.
    offline = hub_offline()
    if dev.problem is not None and not offline:
        skipped = (spec.build_dir / SKIP_MARKER).is_file()
        return answer("hub", hub_location, spec.capabilities, local_problem if skipped else None)
    # The workspace's own repos are trusted by name, so kernels' publisher check never refuses them.
    resolver = (HubCacheResolver if offline else HubResolver)(trust_remote_code=[spec.repo_id])
    try:
        found = resolver.resolve(api=api, backend=None, kernel=dependency)
    except Exception as e:  # what huggingface_hub / kernels raise varies: report it with the fix
        if offline:
            problem = (
                f"HF_HUB_OFFLINE=1 and {hub_location} is not usable from the local cache ({e}); "
                f"download it once online, or {local_problem}"
            )
        else:
            problem = f"{hub_location} could not be resolved on the Hub ({type(e).__name__}: {e}); or {local_problem}"
        return answer("hub", hub_location, spec.capabilities, problem)
    location = str(getattr(found, "variant_path", f"{hub_location} ({found.variant_str})"))
    return answer("hub", location, _archs(found.metadata))


def import_kernel(spec: KernelSpec, resolution: Resolution):
    """Import the resolved variant through `kernels` (only after `resolution.available`)."""
    import kernels

    if resolution.source == "local build":
        return kernels.get_local_kernel(spec.build_dir)
    return kernels.get_kernel(
        spec.repo_id,
        version=spec.hub_version,
        revision=spec.hub_revision,
        trust_remote_code=[spec.repo_id],
    )
