"""`prime-kernels build [names]` and `prime-kernels status`."""

from __future__ import annotations

import argparse
import sys


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def status_table(device=None) -> str:
    """kernel, capabilities built for, this device, where it would load from, available or why not."""
    from . import _specs
    from .capability import sm_name
    from .registry import resolve

    rows = [["kernel", "built for", "this device", "loads from", "status"]]
    for spec in _specs().values():
        r = resolve(spec, device)
        rows.append([
            spec.name,
            ",".join(sm_name(a) for a in r.archs),
            r.device,
            f"{r.source}: {r.location}",
            "available" if r.available else r.reason,
        ])
    return _table(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prime-kernels", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build members into <member>/build/<variant>/ (default: all, or $PRIME_KERNELS)")
    b.add_argument("names", nargs="*", help="members to build")
    b.add_argument("-j", "--jobs", type=int, default=None, help="parallel compiles (ninja's default if unset)")
    sub.add_parser("status", help="per kernel: built for, this device, where it loads from, available or why not")
    args = parser.parse_args(argv)

    from . import ManifestError, _specs

    try:
        specs = _specs()
        if args.command == "build":
            from .builder import build

            return build(specs, args.names, jobs=args.jobs)
        print(status_table())
        return 0
    except (ManifestError, KeyError) as e:
        print(f"prime-kernels: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
