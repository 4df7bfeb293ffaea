"""One ninja for every build: switching between a shell whose PATH has another ninja (the system's,
or an activated venv's) and one without must not make the next build start over."""

import os
import stat
import sys

import pytest

from prime_kernels import builder
from toy_workspace import SHIM, build_toy


def _fake_ninja(directory):
    """A `ninja` on PATH that fails loudly: used, it breaks the build."""
    directory.mkdir(exist_ok=True)
    exe = directory / "ninja"
    exe.write_text("#!/bin/sh\necho 'the ninja on PATH was used' >&2\nexit 3\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return directory


def test_the_ninja_module_of_this_python_wins_over_path(tmp_path, monkeypatch):
    pytest.importorskip("ninja", reason="the `ninja` package (the build extra) is not installed")
    monkeypatch.setenv("PATH", f"{_fake_ninja(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}")
    assert builder._ninja() == [sys.executable, "-m", "ninja"]


def test_without_the_ninja_module_the_one_on_path_is_used(tmp_path):
    import subprocess

    bin_dir = _fake_ninja(tmp_path / "bin")
    # -S: no site-packages, so no `ninja` module; the shim itself needs nothing from there to plan.
    code = f"import sys; sys.path.insert(0, {str(SHIM)!r}); from prime_kernels import builder; print(builder._ninja())"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env)
    assert result.stdout.strip() == str([str(bin_dir / "ninja")]), result.stderr


def test_no_ninja_at_all_names_the_fix(tmp_path):
    import subprocess

    code = (f"import sys; sys.path.insert(0, {str(SHIM)!r}); from prime_kernels import builder\n"
            "try:\n    builder._ninja()\nexcept builder.BuildError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PATH": str(tmp_path)})
    assert result.stdout.strip() == "ninja not found: pip install ninja (the `build` extra installs it)", result.stderr


def test_rebuild_with_another_ninja_on_path_does_no_work(built_toy, tmp_path):
    pytest.importorskip("ninja", reason="the `ninja` package (the build extra) is not installed")
    path = f"{_fake_ninja(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}"
    result = build_toy(built_toy, PATH=path)
    assert result.returncode == 0 and "no work to do" in result.stdout, result.stdout + result.stderr
