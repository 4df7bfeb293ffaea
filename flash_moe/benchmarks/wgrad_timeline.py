"""Per-tile clock timeline of the backward's weight-gradient GEMMs (flash_moe/DESIGN.md §8.5 (e)).

A timeline build is main's flash_moe with `wgrad_timeline.patch` applied (this folder): one thread of
each consumer warpgroup and producer thread 0 keep `clock64` stamps of every tile in registers and
write them once a tile into a device array, which `fused_moe_bf16_wgrad` clears before its two GEMMs
and, when $FLASH_MOE_TIMELINE_FILE names a file, writes there after them (a stream sync: never a
release build). The patch was made against e9b53d4's kernels; regenerate it when it no longer
applies. Defining FLASH_MOE_TIMELINE_NO_GATHER or FLASH_MOE_TIMELINE_NO_TMA at the top of
moe_wgrad.cuh skips B's gather or A's TMA loads: timing only, the results are then wrong.

    git worktree add exp/timeline HEAD
    (cd exp/timeline && git apply flash_moe/benchmarks/wgrad_timeline.patch && scripts/gpu-prebuild.sh)
    # on the GPU machine, carrying exp/timeline/flash_moe/build/<variant> and .gpu-wheels:
    source scripts/env.sh; set +e
    $PY flash_moe/benchmarks/wgrad_timeline.py --build exp/timeline/flash_moe/build --shapes 3,2,0 --out $OUT

For each compare.BACKWARD_SHAPES index: the backward 3 times (warm-up), 10 times back to back
(untraced, timed), then once traced. Prints, per GEMM, the mean cycles a tile of each phase over every
tile but each CTA's first, and writes timeline.json (the same, plus tiles per CTA) and raw_<shape>.npy
(every stamp of CTAs 0-3) to --out. Phases, in the consumer's order: wait_first (the previous
epilogue's end to this tile's first full stage), kb0_issue, release_held (the previous tile's held
stage), mainloop_rest (k-blocks 1.. issued; data_wait_in_loop of it in full-stage waits), drain
(wgmma wait 0), epilogue (the four output boxes: box<i>_put / _fence / _bar, epi_tail); the
producer's producer_empty_wait. FLOP cycles count 4,096 bf16 FLOPs a clock per SM."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import compare  # noqa: E402

# The patch's device array: [GEMM (0 down, 1 gate/up)][CTA][tile][stamp].
CTAS, TILES, STAMPS = 132, 512, 32
GEMMS = ("down", "gate_up")
SHOWN = ("period", "wait_first", "kb0_issue", "release_held", "mainloop_rest", "data_wait_in_loop", "drain",
         "epilogue", "producer_empty_wait")


def phases(stamps: np.ndarray) -> dict:
    """Mean / median / p90 cycles a tile of each phase, from one GEMM's (CTAS, TILES, STAMPS) stamps."""
    per_cta = [stamps[c, :int((stamps[c, :, 1] != 0).sum())].astype(np.int64) for c in range(CTAS)]
    per_cta = [r for r in per_cta if len(r) >= 3]
    R = np.concatenate([r[1:] for r in per_cta])  # each CTA's first tile starts the kernel
    ph = {
        "period": R[:, 7] - R[:, 0],
        "wait_first": R[:, 1] - R[:, 0],
        "kb0_issue": R[:, 2] - R[:, 1],
        "release_held": R[:, 3] - R[:, 2],
        "mainloop_rest": R[:, 5] - R[:, 3],
        "data_wait_in_loop": R[:, 4],
        "drain": R[:, 6] - R[:, 5],
        "epilogue": R[:, 7] - R[:, 6],
        "wg1_epilogue_end_minus_wg0": R[:, 12] - R[:, 7],
        "producer_empty_wait": R[:, 9],
    }
    box_start = [R[:, 6]] + [R[:, 16 + 3 * i + 2] for i in range(3)]
    for i in range(4):
        ph[f"box{i}_put"] = R[:, 16 + 3 * i] - box_start[i]
        ph[f"box{i}_fence"] = R[:, 16 + 3 * i + 1] - R[:, 16 + 3 * i]
        ph[f"box{i}_bar"] = R[:, 16 + 3 * i + 2] - R[:, 16 + 3 * i + 1]
    ph["epi_tail"] = R[:, 7] - R[:, 27]
    k_blocks = R[:, 8] >> 32
    mhz = []
    for r in per_cta:  # clock64 cycles over %globaltimer ns, first to last traced tile
        ns = r[-1, 11] - r[1, 11]
        if ns > 0:
            mhz.append((r[-1, 1] - r[1, 1]) / (ns / 1e3))
    out = {"tiles": int(len(R)), "mean_k_blocks": float(k_blocks.mean()), "mhz": float(np.median(mhz)),
           "flop_cycles": float((2 * 256 * 128 * 64 * k_blocks / 4096.0).mean()),
           "tiles_per_cta": [int((stamps[c, :, 1] != 0).sum()) for c in range(CTAS)]}
    for name, v in ph.items():
        out[name] = {"mean": float(v.mean()), "p50": float(np.median(v)), "p90": float(np.percentile(v, 90))}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", required=True, help="a timeline build's flash_moe/build folder")
    ap.add_argument("--shapes", default="3,2,0", help="compare.BACKWARD_SHAPES indices")
    ap.add_argument("--bpc", type=int, default=None, help="1 or 2; default: what moe runs at the shape")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    import kernels

    kernel = kernels.get_local_kernel(pathlib.Path(args.build))
    F = kernel.functional
    results = {}
    for index in (int(s) for s in args.shapes.split(",")):
        shape = compare.BACKWARD_SHAPES[index]
        T, K, I, E, top_k = shape
        _, inputs, ids, go = compare.backward_inputs(shape)
        routing, preact, _ = compare.training_forward(kernel, shape, inputs, ids)
        x, w1, w2, w3, wt = inputs
        bpc = args.bpc if args.bpc is not None else kernel.preferred_bpc(T, K, I, E, top_k, backward=True)

        def backward():
            F.fused_backward(go, x, w1, w2, w3, wt, routing, preact, bpc=bpc)

        for _ in range(3):
            backward()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            backward()
        end.record()
        torch.cuda.synchronize()
        path = os.path.join(args.out, f"stamps_{index}.bin")
        os.environ["FLASH_MOE_TIMELINE_FILE"] = path
        backward()
        torch.cuda.synchronize()
        del os.environ["FLASH_MOE_TIMELINE_FILE"]
        stamps = np.fromfile(path, dtype=np.uint64).reshape(2, CTAS, TILES, STAMPS)
        os.remove(path)
        np.save(os.path.join(args.out, f"raw_{index}.npy"), stamps[:, :4])
        results[index] = {"shape": shape, "bpc": bpc, "backward_ms_back_to_back": start.elapsed_time(end) / 10,
                          "gemms": {name: phases(stamps[g]) for g, name in enumerate(GEMMS)}}
    with open(os.path.join(args.out, "timeline.json"), "w") as f:
        json.dump(results, f, indent=1)
    for index, r in results.items():
        print(f"shape {index + 1} {r['shape']} bpc {r['bpc']}: backward {r['backward_ms_back_to_back']:.3f} ms "
              "(10 back to back, untraced)")
        for name, g in r["gemms"].items():
            print(f"  {name}: {g['tiles']} tiles, {g['mean_k_blocks']:.2f} k-blocks, {g['mhz']:.0f} MHz, "
                  f"FLOP cycles {g['flop_cycles']:.0f}; cycles a tile (mean / median):")
            print("    " + "  ".join(f"{p}={g[p]['mean']:.0f}/{g[p]['p50']:.0f}" for p in SHOWN))
            print("    epilogue boxes put/fence/bar: " + "  ".join(
                "/".join(f"{g[f'box{i}_{x}']['mean']:.0f}" for x in ("put", "fence", "bar")) for i in range(4))
                  + f"  tail {g['epi_tail']['mean']:.0f}")


if __name__ == "__main__":
    main()
