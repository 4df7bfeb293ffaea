"""Each rule or helper both members need has one source in common/; the members carry copies
(kernel-builder builds a member folder alone) that scripts/sync_common.py writes. A copy that
differs from its canonical file fails here, with the file and the command that fixes it."""

import pathlib
import subprocess
import sys

from toy_workspace import REPO

SYNC = REPO / "scripts" / "sync_common.py"


def test_every_copy_matches_its_canonical_file():
    result = subprocess.run([sys.executable, str(SYNC), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_changed_copy_is_named_with_the_command(tmp_path):
    """The check itself, on a scratch tree (common/ and the script): it writes every copy under its
    header, then names an edited copy and the command that restores it."""
    root = tmp_path / "ws"
    (root / "scripts").mkdir(parents=True)
    script = root / "scripts" / "sync_common.py"
    script.write_text(SYNC.read_text())
    (root / "common").mkdir()
    for canonical in (REPO / "common").iterdir():
        if canonical.is_file():
            (root / "common" / canonical.name).write_text(canonical.read_text())
    subprocess.run([sys.executable, str(script)], check=True, capture_output=True)
    copy = root / "rmsnorm" / "tests" / "conftest.py"
    assert copy.read_text() == ("# generated from common/conftest.py: edit there and run scripts/sync_common.py\n"
                                + (REPO / "common" / "conftest.py").read_text())
    assert subprocess.run([sys.executable, str(script), "--check"]).returncode == 0
    copy.write_text(copy.read_text() + "# edited in the member\n")
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr == ("rmsnorm/tests/conftest.py differs from common/conftest.py: edit common/conftest.py, "
                             "then run `python scripts/sync_common.py`\n")


def test_each_member_uses_its_copies():
    """The copies are what the members include and import, not files lying beside the code."""
    for m in ("flash_moe", "rmsnorm"):
        member = REPO / m
        build = (member / "build.toml").read_text()
        assert f'"{m}_cuda/mxfp8_rules.cuh"' in build and '"torch-ext/torch_check.h"' in build, m
        assert '#include "torch_check.h"' in (member / "torch-ext" / "torch_binding.cpp").read_text()
        assert "from .mxfp8_rules import" in (member / "torch-ext" / m / "reference.py").read_text()
    assert '#include "mxfp8_rules.cuh"' in (REPO / "flash_moe" / "flash_moe_cuda" / "mxfp8.cuh").read_text()
    assert '#include "mxfp8_rules.cuh"' in (REPO / "rmsnorm" / "rmsnorm_cuda" / "rmsnorm_forward.cu").read_text()
    for bench in ("flash_moe/benchmarks/compare.py", "rmsnorm/benchmarks/compare.py"):
        assert "bench_timing" in (REPO / bench).read_text(), bench
    assert pathlib.Path(SYNC).is_file()
