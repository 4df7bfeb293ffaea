"""`prime-kernels build [names]`, `status`, `sync-release` and `check-upload [names]`."""

from __future__ import annotations

import argparse
import pathlib
import sys
import textwrap

from .workspace import NO_WORKSPACE, ORIGIN_ARGUMENT, ORIGIN_LOCK, ORIGIN_RELEASE, ORIGIN_WORKSPACE

MAX_WIDTH = 120  # no line of the status table is wider (cells wrap)
_ORIGIN_LABEL = {ORIGIN_ARGUMENT: "argument", ORIGIN_LOCK: "kernels.lock", ORIGIN_WORKSPACE: "build.toml",
                 ORIGIN_RELEASE: "release file"}
_ORIGIN_NOTE = {ORIGIN_ARGUMENT: "passed to load()", ORIGIN_LOCK: "your project's lock",
                ORIGIN_WORKSPACE: "the workspace's pins", ORIGIN_RELEASE: f"shipped with prime_kernels; {NO_WORKSPACE}"}


def _column_widths(rows: list[list[str]], floors: list[int | None], max_width: int) -> list[int]:
    """Each column's natural width; while the table is wider than `max_width`, the widest column
    above its floor (None: never narrower than natural) gives up a character, the last column (the
    reason) only when no other can."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    floors = [w if f is None else max(f, len(h)) for f, w, h in zip(floors, widths, rows[0])]
    while sum(widths) + 2 * (len(widths) - 1) > max_width:
        shrinkable = [i for i, w in enumerate(widths) if w > floors[i]]
        if not shrinkable:
            break
        others = [i for i in shrinkable if i != len(widths) - 1]
        widest = max(others or shrinkable, key=lambda i: widths[i])
        widths[widest] -= 1
    return widths


def _table(rows: list[list[str]], floors: list[int | None], max_width: int = MAX_WIDTH) -> str:
    """Columns two spaces apart under a dashed rule; cells wrap to fit `max_width`."""
    widths = _column_widths(rows, floors, max_width)
    lines = []
    for n, row in enumerate(rows):
        cells = [textwrap.wrap(c, w, break_on_hyphens=False) or [""] for c, w in zip(row, widths)]
        for k in range(max(len(c) for c in cells)):
            parts = [(c[k] if k < len(c) else "").ljust(w) for c, w in zip(cells, widths)]
            lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _relative(path: str, base: pathlib.Path) -> str:
    """`path` relative to `base` when it lies inside, else as is."""
    try:
        return str(pathlib.Path(path).relative_to(base))
    except ValueError:
        return path


def _short_pin(pin) -> str:
    """"v1 (build.toml)", "0123456789ab (kernels.lock)": the pin and the file that chose it."""
    text = f"v{pin.version}" if pin.version is not None else pin.revision[:12]
    return f"{text} ({_ORIGIN_LABEL[pin.origin]})"


def _loads_from(spec, r) -> str:
    if r.source == "local build":  # always <member>/build/<variant>: the variant says it all
        return f"local build {pathlib.Path(r.location).name}"
    if r.source == "LOCAL_KERNELS":
        return f"LOCAL_KERNELS {_relative(r.location, pathlib.Path.cwd())}"
    return f"hub {spec.repo_id}"


def _pin_notes(resolutions) -> list[str]:
    """One line per file the pins came from."""
    origins = dict.fromkeys((r.pin.origin, r.pin.path) for r in resolutions)
    return [f"hub pins ({_ORIGIN_LABEL[origin]}): " + (f"{path}, " if path else "") + _ORIGIN_NOTE[origin]
            for origin, path in origins]


def status_table(device=None) -> str:
    """The device; per kernel: capabilities built for, Hub pin (and which file chose it), where it
    would load from, "available" or why not; then the files the pins came from."""
    from . import _specs, status
    from .capability import sm_name

    rows = [["kernel", "built for", "hub pin", "loads from", "status"]]
    resolutions = []
    for name, kernel_status in status(device).items():
        r, spec = kernel_status.resolution, _specs()[name]
        resolutions.append(r)
        rows.append([
            spec.name,
            ", ".join(sm_name(a) for a in r.archs),
            _short_pin(r.pin),
            _loads_from(spec, r),
            "available" if r.available else r.reason,
        ])
    device_line = f"this device: {resolutions[0].device}" if resolutions else "no kernels"
    notes = [textwrap.fill(n, MAX_WIDTH, subsequent_indent="    ", break_on_hyphens=False)
             for n in _pin_notes(resolutions)]
    # The reason keeps at least 40 characters: the other columns wrap first.
    return "\n".join([device_line, "", _table(rows, floors=[None, 15, None, 30, 40]), "", *notes])


def sync_release(check: bool = False, log=print) -> int:
    """Write (or with `check`, compare) the workspace's torch-ext/prime_kernels/release.toml."""
    from .workspace import ManifestError, read_workspace, release_text, workspace_root

    root = workspace_root()
    package = root / "torch-ext" / "prime_kernels"
    if not package.is_dir():
        raise ManifestError(f"{root}: no torch-ext/prime_kernels/ (the shim's sources) to write release.toml into")
    target = package / "release.toml"
    text = release_text(read_workspace(root))
    current = target.read_text() if target.is_file() else None
    if current == text:
        log(f"{target}: up to date")
        return 0
    if check:
        log(f"{target}: out of date with the manifests: run `prime-kernels sync-release`")
        return 1
    target.write_text(text)
    log(f"wrote {target}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prime-kernels", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build members into <member>/build/<variant>/ (default: all, or $PRIME_KERNELS)")
    b.add_argument("names", nargs="*", help="members to build")
    b.add_argument("-j", "--jobs", type=int, default=None, help="parallel compiles (ninja's default if unset)")
    sub.add_parser("status", help="per kernel: built for, Hub pin, where it loads from, available or why not")
    s = sub.add_parser("sync-release", help="regenerate torch-ext/prime_kernels/release.toml from the manifests")
    s.add_argument("--check", action="store_true", help="only compare: exit 1 when it is out of date")
    u = sub.add_parser("check-upload", help="exit non-zero unless each member's build/ may be uploaded to the Hub")
    u.add_argument("names", nargs="*", help="members to check (default: all)")
    args = parser.parse_args(argv)

    from . import ManifestError, _specs
    from .workspace import find_workspace

    try:
        if args.command in ("build", "check-upload"):
            if find_workspace() is None:
                raise ManifestError(f"nothing to {args.command.split('-')[-1]}: {NO_WORKSPACE}")
            from . import builder

            if args.command == "check-upload":
                return builder.check_upload(_specs(), args.names)
            return builder.build(_specs(), args.names, jobs=args.jobs)
        if args.command == "sync-release":
            return sync_release(check=args.check)
        print(status_table())
        return 0
    except (ManifestError, KeyError) as e:
        print(f"prime-kernels: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
