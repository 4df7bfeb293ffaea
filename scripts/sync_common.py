"""Copy the canonical files in common/ into the members, each copy under a one-line header.

    python scripts/sync_common.py          # write every copy
    python scripts/sync_common.py --check  # exit 1, naming them, if copies differ (a CPU test runs this)

A rule or helper both kernels need lives once, in common/; kernel-builder copies one member
folder and builds it alone, so each member carries a copy, never edited there.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMON = ROOT / "common"
MEMBERS = ("flash_moe", "rmsnorm")  # the members that share every file below

# canonical file in common/ -> where its copies go in each member ({m}: the member folder)
COPIES = {
    "mxfp8_rules.cuh": ["{m}/{m}_cuda/mxfp8_rules.cuh"],
    "mxfp8_rules.py": ["{m}/torch-ext/{m}/mxfp8_rules.py"],
    "torch_check.h": ["{m}/torch-ext/torch_check.h"],
    "conftest.py": ["{m}/tests/conftest.py"],
    "kernel_package.py": ["{m}/tests/kernel_package.py", "{m}/benchmarks/kernel_package.py"],
    "bench_timing.py": ["{m}/benchmarks/bench_timing.py"],
}


def header(name: str) -> str:
    comment = "#" if name.endswith(".py") else "//"
    return f"{comment} generated from common/{name}: edit there and run scripts/sync_common.py\n"


def expected() -> dict[pathlib.Path, tuple[str, str]]:
    """Every copy's path -> (its canonical file's name in common/, the text the copy must have)."""
    out = {}
    for name, patterns in COPIES.items():
        text = header(name) + (COMMON / name).read_text()
        for pattern in patterns:
            for m in MEMBERS:
                out[ROOT / pattern.format(m=m)] = (name, text)
    return out


def stale() -> list[tuple[pathlib.Path, str]]:
    """(copy, canonical name) of every copy that is missing or differs from header + canonical file."""
    return [(p, name) for p, (name, text) in expected().items() if not p.is_file() or p.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if a copy differs from its canonical file")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale()
        for path, name in bad:
            print(f"{path.relative_to(ROOT)} differs from common/{name}: edit common/{name}, then run "
                  "`python scripts/sync_common.py`", file=sys.stderr)
        return 1 if bad else 0
    texts = expected()
    for path, _ in stale():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(texts[path][1])
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
