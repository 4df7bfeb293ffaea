"""README, "Pinning a release in your project": its code runs as written, offline, against a Hub
cache holding a release (the toy member's, standing in for prime-intellect/flash_moe), with the
README's own kernels.lock. And what it says about `kernels` 0.17.2 holds for the installed one."""

import json
import os
import re
import subprocess
import sys

from toy_workspace import REPO

SECTION = "### Pinning a release in your project (without this repo)"
FLASH_MOE, TOY = "prime-intellect/flash_moe", "prime-intellect/toy"


def _section() -> str:
    """The section's text, up to the next heading of level 1-3 outside a code block."""
    lines = (REPO / "README.md").read_text().splitlines(keepends=True)
    start = lines.index(SECTION + "\n")
    fenced = False
    for end in range(start + 1, len(lines)):
        fenced ^= lines[end].startswith("```")
        if not fenced and re.match(r"#{1,3} ", lines[end]):
            break
    else:
        end = len(lines)
    return "".join(lines[start:end])


def _blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", section, re.MULTILINE | re.DOTALL)


def _readme_lock(section: str, commits: dict[str, str]) -> str:
    """The README's kernels.lock, each `<commit of branch v1 of REPO>` placeholder filled in."""
    (lock,) = _blocks(section, "json")
    return re.sub(r"<commit of branch v1 of ([^>]+)>", lambda m: commits[m.group(1)], lock)


def test_readme_lock_recipe_loads_the_cached_release_offline(toy_hub_cache, tmp_path):
    from kernels._rust import KernelDependency, KernelLock, KernelLocks, KernelVersion

    _, snapshot, env = toy_hub_cache
    section = _section()
    project = tmp_path / "project"
    project.mkdir()
    (pyproject,) = _blocks(section, "toml")
    (project / "pyproject.toml").write_text(pyproject.replace(FLASH_MOE, TOY))

    commits = {FLASH_MOE: snapshot.name, "prime-intellect/rmsnorm": "0" * 40}
    lock = _readme_lock(section, commits).replace(FLASH_MOE, TOY)
    # The README's lock is the format `kernels lock` writes: kernels' own serializer agrees.
    written_by_kernels = KernelLocks({
        KernelDependency(TOY, KernelVersion.Version(1)): KernelLock(snapshot.name),
        KernelDependency("prime-intellect/rmsnorm", KernelVersion.Version(1)): KernelLock("0" * 40),
    }).to_json()
    assert json.loads(KernelLocks.from_json(lock).to_json()) == json.loads(written_by_kernels)
    (project / "kernels.lock").write_text(lock)

    python = _blocks(section, "python")
    assert python and all(FLASH_MOE in block for block in python)
    code = "\n".join(block.replace(FLASH_MOE, TOY) for block in python)
    check = "\nprint('loaded:', flash_moe.__name__, hasattr(flash_moe.ops, 'scale'))\n"
    full_env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_KERNELS", "PRIME_KERNELS_WORKSPACE")}
    result = subprocess.run([sys.executable, "-c", code + check], capture_output=True, text=True,
                            cwd=project, env={**full_env, **env}, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "loaded: _toy_cuda_" in result.stdout and result.stdout.rstrip().endswith("True")


def _locked_calls(code: str) -> dict[str, list]:
    """{function: its keyword names} for each call of get_locked_kernel / load_kernel in `code`."""
    import ast

    return {node.func.id: [k.arg for k in node.keywords] for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("get_locked_kernel", "load_kernel")}


def test_what_the_readme_says_about_kernels_holds(tmp_path):
    import inspect
    import pathlib

    import kernels

    section = _section()
    # get_locked_kernel takes trust_remote_code, and the README passes it; load_kernel has none.
    assert "trust_remote_code" in inspect.signature(kernels.get_locked_kernel).parameters
    assert "trust_remote_code" not in inspect.signature(kernels.load_kernel).parameters
    calls = _locked_calls("\n".join(_blocks(section, "python")))
    assert calls == {"get_locked_kernel": ["lockfile", "trust_remote_code"], "load_kernel": ["lockfile"]}
    assert "applies its own capability check" not in section
    # `kernels lock` has no option to trust a repo by name, and refuses one it cannot vouch for
    # (offline it cannot ask the Hub about the publisher at all).
    kernels_cli = pathlib.Path(sys.executable).parent / "kernels"
    help_text = subprocess.run([str(kernels_cli), "lock", "--help"], capture_output=True, text=True)
    assert help_text.returncode == 0 and "trust" not in help_text.stdout, help_text.stdout + help_text.stderr
    (tmp_path / "pyproject.toml").write_text(_blocks(section, "toml")[0])
    refused = subprocess.run([str(kernels_cli), "lock", str(tmp_path)], capture_output=True, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert refused.returncode != 0 and "trust_remote_code" in refused.stderr, refused.stderr
    assert not (tmp_path / "kernels.lock").exists()
