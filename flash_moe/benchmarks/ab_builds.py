"""Two builds of flash_moe timed against each other in one process: a kernel change against the
tree it changes, on one machine and in one power state. The backward's ops on compare.py's
BACKWARD_SHAPES -- `fused_moe_bf16_dgrad`, `fused_moe_bf16_wgrad` and `functional.fused_backward`
-- and, with `--ops forward`, the bf16 forward on the same routing, each timed as compare.py times
an op alone (the builds in the order A B B A, the faster of each build's two medians), every output
compared bit for bit between the builds:

    python3 flash_moe/benchmarks/ab_builds.py --b .ab/flash_moe/build [--a flash_moe/build]
        [--shapes 0,1,2,3,4] [--ops dgrad,wgrad,backward,forward] [--bpc 1] [--iters 20] [--out ab.json]
        [--no-sustained]

--a / --b: a member's build/ folder (kernels.get_local_kernel takes the variant of this torch;
default --a: this checkout's). The two extensions load side by side, their ops in namespaces named
by their build ids, so the two trees' sources must differ. Both builds read the same inputs: A's
moe_align, training forward and dgrad outputs. --bpc: both builds' bpc (default: each op's own
default, `preferred_bpc`). Unless --no-sustained, each op also runs back to back (compare.py's
ClockMonitor.sustained, ~1.5 s a window) in the order A B B A, after every spaced timing of its
shape (compare.spaced_ms says why): the targets hold back to back too, where the power limit sets
the clock, so a change can gain spaced and lose there. Ends with a table: shape, op, A ms, B ms, B
against A, bits equal, and back to back the mean of each build's two windows and their clocks."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile

import torch

import compare  # this folder is on sys.path when run as a script

OPS = ("dgrad", "wgrad", "backward", "forward")
DEFAULT_OPS = "dgrad,wgrad,backward"
HERE = pathlib.Path(__file__).resolve().parent


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default=str(HERE.parent / "build"), help="build A: a flash_moe build/ folder")
    ap.add_argument("--b", required=True, help="build B: a flash_moe build/ folder")
    ap.add_argument("--shapes", default="0,1,2,3,4", help="BACKWARD_SHAPES indices")
    ap.add_argument("--ops", default=DEFAULT_OPS, help=f"a comma-separated subset of {', '.join(OPS)}")
    ap.add_argument("--bpc", type=int, default=None, help="1 or 2 for both builds; default: each op's default")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--sustained", action=argparse.BooleanOptionalAction, default=True,
                    help="also time each op back to back, A B B A (default: on)")
    args = ap.parse_args(argv)
    args.shapes = compare.indices(args.shapes)
    bad = [i for i in args.shapes if not 0 <= i < len(compare.BACKWARD_SHAPES)]
    if bad:
        ap.error(f"--shapes must be in [0, {len(compare.BACKWARD_SHAPES)}), got {bad}")
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if not args.ops or any(o not in OPS for o in args.ops):
        ap.error(f"--ops must be a comma-separated subset of {', '.join(OPS)}, got {args.ops}")
    if args.bpc not in (None, 1, 2):
        ap.error(f"--bpc must be 1 or 2, got {args.bpc}")
    for name in ("a", "b"):
        if not pathlib.Path(getattr(args, name)).is_dir():
            ap.error(f"--{name} must be a build/ folder, got {getattr(args, name)}")
    return args


def load_build(path):
    import kernels

    return kernels.get_local_kernel(pathlib.Path(path))


def same_bits(xs, ys):
    return all(torch.equal(x, y) for x, y in zip(xs, ys))


def shape_rows(builds, shape, args, monitor=None):
    """The rows of one shape: for each op, {shape, op, ms: {A, B}, bits_equal} and, with a monitor,
    sustained: {A: [window, window], B: [...]} (ClockMonitor.sustained's dicts)."""
    _, inputs, ids, go = compare.backward_inputs(shape)
    routing, preact, _ = compare.training_forward(builds["A"], shape, inputs, ids)
    used = int(routing[2])  # ntpp: dab's and sh's rows past it are never written
    _, dab, sh, _ = compare.backward_op(builds["A"], "dgrad", args.bpc, go, inputs, routing, preact)(0)

    def defined(op, out):  # the outputs every call writes whole
        if op == "dgrad":
            dx, d_ab, s_h, dscore = out
            return dx, d_ab[:used], s_h[:used], dscore
        return (out,) if op == "forward" else out

    rows, callables = [], []
    for op in (o for o in OPS if o in args.ops):
        def fn_for(k, op=op):
            if op == "forward":  # its last step, reduce_kernel, is the dgrad's too
                x, w1, w2, w3, wt = inputs
                return lambda i: builds[k].functional._forward(x, w1, w2, w3, wt, routing, False)
            return compare.backward_op(builds[k], op, args.bpc, go, inputs, routing, preact, (dab, sh))

        bits = same_bits(defined(op, fn_for("A")(0)), defined(op, fn_for("B")(0)))
        ms = compare.op_alone_by(fn_for, args.iters, keys=("A", "B"))
        rows.append({"shape": list(shape), "op": op, "ms": ms, "bits_equal": bits})
        callables.append(fn_for)
        print(f"{shape} {op}: A {ms['A']:.3f} ms, B {ms['B']:.3f} ms ({ms['B'] / ms['A'] - 1:+.1%}); "
              f"bits equal: {bits}", flush=True)
    T, K, I, E, top_k = shape
    for row, fn_for in zip(rows, callables):
        if monitor:  # after every spaced timing of the shape
            flops = (12 if row["op"] == "backward" else 6) * T * top_k * K * I
            row["sustained"] = compare.sustained_by(monitor, fn_for, flops, keys=("A", "B"))
    return rows


def back_to_back(windows):
    """(mean ms, mean SM MHz) of a build's windows; MHz nan where nvidia-smi gave none."""
    mhz = [w["sm_mhz"] for w in windows if "sm_mhz" in w]
    return (sum(w["ms"] for w in windows) / len(windows), sum(mhz) / len(mhz) if mhz else float("nan"))


def print_table(rows):
    print(f"\n{'shape':26} {'op':9} {'A ms':>8} {'B ms':>8} {'B vs A':>7}  {'bits':6} "
          f"{'b2b A ms':>8} {'B ms':>8} {'B vs A':>7} {'A MHz':>6} {'B MHz':>6}")
    for r in rows:
        line = (f"{','.join(map(str, r['shape'])):26} {r['op']:9} {r['ms']['A']:8.3f} {r['ms']['B']:8.3f} "
                f"{r['ms']['B'] / r['ms']['A'] - 1:+7.1%}  {'equal' if r['bits_equal'] else 'DIFFER':6}")
        if "sustained" in r:
            (a_ms, a_mhz), (b_ms, b_mhz) = (back_to_back(r["sustained"][k]) for k in ("A", "B"))
            line += f" {a_ms:8.3f} {b_ms:8.3f} {b_ms / a_ms - 1:+7.1%} {a_mhz:6.0f} {b_mhz:6.0f}"
        print(line)


def main(argv=None):
    args = parse_args(argv)
    builds = {"A": load_build(args.a), "B": load_build(args.b)}
    print(f"A: {args.a} ({builds['A'].__name__}); B: {args.b} ({builds['B'].__name__}); "
          f"{torch.cuda.get_device_name()}", flush=True)
    monitor = compare.ClockMonitor(os.path.join(tempfile.mkdtemp(), "clocks.csv")) if args.sustained else None
    rows = []
    for si in args.shapes:
        rows += shape_rows(builds, compare.BACKWARD_SHAPES[si], args, monitor)
        torch.cuda.empty_cache()  # the shape's inputs and outputs are gone with shape_rows' frame
    if monitor:
        monitor.stop()  # fills in each window's clock and power
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"a": args.a, "b": args.b, "bpc": args.bpc, "rows": rows},
                                                     indent=1) + "\n")
    print_table(rows)


if __name__ == "__main__":
    main()
