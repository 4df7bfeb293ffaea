"""The fused backward on one of compare.py's BACKWARD_SHAPES, for a profiler: the training forward
once (it saves the pre-activations), then `functional.fused_backward` `--calls` times, the last
inside an NVTX range named `backward`, so ncu profiles that call's kernels alone:

    ncu --nvtx --nvtx-include "backward/" --clock-control none --set full -o $OUT/bwd \\
        python3 flash_moe/benchmarks/profile_backward.py --shape 3 --bpc 2

--shape indexes BACKWARD_SHAPES (0-4, flash_moe/DESIGN.md §8.2's shapes 1-5); --bpc defaults to
what `moe` runs there (`preferred_bpc(..., backward=True)`). The inputs are compare.py's
(`backward_inputs`), so the kernels see the routing its timings saw."""

from __future__ import annotations

import argparse

import torch

import compare  # this folder is on sys.path when run as a script


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, default=3, help="index into compare.BACKWARD_SHAPES")
    ap.add_argument("--bpc", type=int, default=None, help="1 or 2; default: what moe runs at the shape")
    ap.add_argument("--calls", type=int, default=2, help="backward calls; the last one is in the NVTX range")
    args = ap.parse_args(argv)
    if not 0 <= args.shape < len(compare.BACKWARD_SHAPES):
        ap.error(f"--shape must be in [0, {len(compare.BACKWARD_SHAPES)}), got {args.shape}")
    if args.calls < 1:
        ap.error(f"--calls must be >= 1, got {args.calls}")
    kernel = compare.load_kernel()
    F = kernel.functional
    T, K, I, E, top_k = shape = compare.BACKWARD_SHAPES[args.shape]
    _, inputs, ids, go = compare.backward_inputs(shape)
    routing, preact, _ = compare.training_forward(kernel, shape, inputs, ids)
    x, w1, w2, w3, wt = inputs
    bpc = args.bpc if args.bpc is not None else kernel.preferred_bpc(T, K, I, E, top_k, backward=True)
    for call in range(args.calls):
        if call == args.calls - 1:
            torch.cuda.nvtx.range_push("backward")
        F.fused_backward(go, x, w1, w2, w3, wt, routing, preact, bpc=bpc)
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print(f"fused_backward at shape {shape}, bpc {bpc}: {args.calls} calls, the last in NVTX range 'backward'")


if __name__ == "__main__":
    main()
