"""Helpers for the workspace tests: a throwaway workspace holding the toy member, a way to build
it, and a way to run Python in a fresh process (huggingface_hub reads HF_HUB_OFFLINE and the
cache location at import)."""

from __future__ import annotations

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


def run_python(code: str, workspace: pathlib.Path, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PRIME_KERNELS_WORKSPACE": str(workspace), **env}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SHIM), full_env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=600)


def build_toy(workspace: pathlib.Path) -> subprocess.CompletedProcess:
    return run_python("from prime_kernels.cli import main; raise SystemExit(main(['build']))", workspace)


def gpu_capability() -> tuple[int, int] | None:
    import torch

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None
