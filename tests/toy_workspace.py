"""Helpers for the workspace tests: a throwaway workspace holding the toy member, a way to build
it, a Hub cache filled as huggingface_hub fills one, a consumer's kernels.lock in kernels' own
format, and a way to run Python in a fresh process (huggingface_hub reads HF_HUB_OFFLINE and the
cache location at import; the shim finds its workspace from the environment and the cwd)."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
TOY = pathlib.Path(__file__).resolve().parent / "toy"
SHIM = REPO / "torch-ext"


def make_workspace(root: pathlib.Path, capabilities: str = '"9.0a"', pin: str = "version = 1") -> pathlib.Path:
    """A workspace at `root` whose only member is a copy of tests/toy (its capabilities replaced)."""
    shutil.copytree(TOY, root / "toy", ignore=shutil.ignore_patterns("build", "__pycache__"))
    manifest = root / "toy" / "build.toml"
    manifest.write_text(manifest.read_text().replace('cuda-capabilities = ["9.0a"]', f"cuda-capabilities = [{capabilities}]"))
    (root / "build.toml").write_text(f'[workspace]\nmembers = ["toy"]\n\n[hub.toy]\n{pin}\n')
    return root


def run_python(code: str, workspace: pathlib.Path | None, *, cwd: pathlib.Path | None = None,
               shim: pathlib.Path = SHIM, **env: str) -> subprocess.CompletedProcess:
    """`python -c code` with `shim` first on the path and PRIME_KERNELS_WORKSPACE=`workspace`
    (unset when None, so the shim looks for a workspace from `cwd` upwards)."""
    full_env = {**os.environ, **env}
    full_env.pop("PRIME_KERNELS_WORKSPACE", None)
    if workspace is not None:
        full_env["PRIME_KERNELS_WORKSPACE"] = str(workspace)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), full_env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
                          cwd=cwd, timeout=600)


def build_toy(workspace: pathlib.Path, **env: str) -> subprocess.CompletedProcess:
    return run_python("from prime_kernels.cli import main; raise SystemExit(main(['build']))", workspace, **env)


def gpu_capability() -> tuple[int, int] | None:
    import torch

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def fill_hub_cache(cache: pathlib.Path, repo_id: str, version: int, variant_dir: pathlib.Path) -> pathlib.Path:
    """kernels--<org>--<name>/refs/v<version> -> <sha>, snapshots/<sha>/build/<variant>/...; returns the snapshot."""
    folder = cache / ("kernels--" + repo_id.replace("/", "--"))
    sha = hashlib.sha1(repo_id.encode() + bytes(version)).hexdigest()
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / f"v{version}").write_text(sha)
    shutil.copytree(variant_dir, folder / "snapshots" / sha / "build" / variant_dir.name,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return folder / "snapshots" / sha


def write_kernels_lock(project: pathlib.Path, locks: dict[str, tuple[int, str]]) -> pathlib.Path:
    """A consumer project: pyproject.toml with [tool.kernels.dependencies] and the kernels.lock
    `kernels lock` would write for it (kernels' own serializer), {repo_id: (version, commit)}."""
    from kernels._rust import KernelDependency, KernelLock, KernelLocks, KernelVersion

    project.mkdir(parents=True, exist_ok=True)
    deps = "".join(f'"{repo}" = {version}\n' for repo, (version, _) in locks.items())
    (project / "pyproject.toml").write_text(f'[project]\nname = "consumer"\nversion = "0"\n\n[tool.kernels.dependencies]\n{deps}')
    lock = KernelLocks({KernelDependency(repo, KernelVersion.Version(version)): KernelLock(commit)
                        for repo, (version, commit) in locks.items()})
    (project / "kernels.lock").write_text(lock.to_json())
    return project / "kernels.lock"
