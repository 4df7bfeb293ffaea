"""Side-by-side benchmark of rmsnorm (docs/DESIGN.md §9), all measured in ONE run:

ceilings (device-to-device copy GB/s counting read + write; 8192^3 bf16 matmul TFLOP/s), our
forward and backward, torch.compile of the pure-PyTorch reference and Liger's fused add+RMSNorm
(which does not quantize).  CUDA events, median of 30 after warm-up, inputs rotated over sets
larger than L2.  Writes <out>/h200.json (docs/DESIGN.md §9 schema) and <out>/h200.png.

    PYTHONPATH=torch-ext python3 rmsnorm/benchmarks/compare.py [--out DIR]
        [--shapes 16384x7168,65536x4096] [--ours-only]

--shapes / --ours-only make a quick check of our kernels at some shapes (no torch.compile, no
Liger); the full run (no flags) is the one rmsnorm/DESIGN.md reports.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import math
import pathlib
import subprocess
import sys
import traceback

import torch

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # loaded by path rather than run as a script
    sys.path.append(str(HERE))
import bench_timing  # noqa: E402
import kernel_package  # noqa: E402

SHAPES = [(65536, 2048), (65536, 4096), (65536, 8192), (16384, 7168), (8192, 8192)]
EPS = 1e-6


def median_ms(fn, nsets, warm=5, reps=30):
    """bench_timing.median_ms of fn(set index), rotating over `nsets` input sets."""
    return bench_timing.median_ms(lambda i: fn(i % nsets), reps, warmup=warm)


def git_commit():
    if os.environ.get("PRIME_KERNELS_COMMIT"):  # set by .ci/gpu-run where the copy has no .git
        return os.environ["PRIME_KERNELS_COMMIT"]
    try:
        p = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], capture_output=True,
                           text=True, cwd=HERE)
        sha = p.stdout.strip()
        return sha if p.returncode == 0 and len(sha) == 40 else "uncommitted"
    except Exception:  # noqa: BLE001
        return "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--shapes", default="", help="comma-separated NxC (default: the five of docs/DESIGN.md §9)")
    ap.add_argument("--ours-only", action="store_true", help="skip torch.compile and Liger")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s] or SHAPES
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import prime_kernels

    k = prime_kernels.load("rmsnorm")
    ref = kernel_package.load_reference(HERE.parent)  # in sys.modules: torch.compile looks modules up by name
    l2 = torch.cuda.get_device_properties(0).L2_cache_size

    copy_gbps, mm_tflops, _ = bench_timing.ceilings(reps=30)
    print(f"ceilings: copy {copy_gbps:.0f} GB/s, bf16 matmul {mm_tflops:.0f} TFLOP/s", flush=True)

    # peers
    def ref_fwd(b, r, w):
        return ref.fused_rmsnorm_residual(b, r, w, EPS)

    def ref_bwd(g, b, w, rr):
        gb, gw = ref.fused_rmsnorm_residual_backward(g, b, w, rr)
        return gb.to(torch.bfloat16), gw.to(torch.bfloat16)

    compiled_fwd = torch.compile(ref_fwd, dynamic=True)
    compiled_bwd = torch.compile(ref_bwd, dynamic=True)
    Liger = None
    if not args.ours_only:
        try:
            from liger_kernel.ops import LigerFusedAddRMSNormFunction as Liger
        except Exception as e:  # noqa: BLE001
            print("liger unavailable:", e)

    rows = []

    def add(op, impl, N, C, ms, nbytes):
        gbps = nbytes / ms / 1e6
        rows.append({"op": op, "impl": impl, "shape": {"N": N, "C": C}, "ms": round(ms, 5),
                     "GBps": round(gbps, 1)})
        print(f"{op:32s} {impl:14s} {N:6d}x{C:<6d} {ms:8.4f} ms {gbps:8.1f} GB/s "
              f"{100 * gbps / copy_gbps:6.1f}% of copy", flush=True)

    def inputs(N, C):
        set_bytes = 3 * 2 * N * C
        nsets = max(2, math.ceil(4 * l2 / set_bytes))
        B = [torch.randn(N, C, device="cuda").bfloat16() for _ in range(nsets)]
        R = [torch.randn(N, C, device="cuda").bfloat16() for _ in range(nsets)]
        G = [torch.randn(N, C, device="cuda").bfloat16() for _ in range(nsets)]
        W = (1 + 0.1 * torch.randn(C, device="cuda")).bfloat16()
        RR = [k.fused_rmsnorm_residual(B[i], R[i], W)[2] for i in range(nsets)]
        return nsets, B, R, G, W, RR

    def nbytes(N, C):
        sb = ref.scales_numel(N, C // ref.MXFP8_SCALE_BLOCK)
        fwd = 2 * 2 * N * C + 2 * C + N * C + sb + 4 * N  # branch, residual, weight; vals, scales, rrms
        bwd = 2 * 2 * N * C + 2 * C + 4 * N + 2 * N * C + 2 * C  # grad_y, branch, weight, rrms; grad_branch, grad_weight
        return fwd, bwd

    # Our kernels at every shape first, then the peers: run after the peers, our forward measured
    # several % of copy slower than alone, an effect of the process state the peers leave, not of
    # the kernel (rmsnorm/DESIGN.md).
    for N, C in shapes:
        nsets, B, R, G, W, RR = inputs(N, C)
        fwd_bytes, bwd_bytes = nbytes(N, C)
        add("fused_rmsnorm_residual", "prime-kernels", N, C,
            median_ms(lambda i: k.fused_rmsnorm_residual(B[i], R[i], W), nsets, reps=args.reps), fwd_bytes)
        add("fused_rmsnorm_residual_backward", "prime-kernels", N, C,
            median_ms(lambda i: k.fused_rmsnorm_residual_backward(G[i], B[i], W, RR[i]), nsets, reps=args.reps),
            bwd_bytes)
        del B, R, G, RR
        torch.cuda.empty_cache()

    for N, C in shapes if not args.ours_only else []:
        nsets, B, R, G, W, RR = inputs(N, C)
        fwd_bytes, bwd_bytes = nbytes(N, C)
        try:
            # the compiled reference must agree with the kernel before it is timed
            v0, s0, _ = compiled_fwd(B[0], R[0], W)
            v1, s1, _ = k.fused_rmsnorm_residual(B[0], R[0], W)
            same = torch.equal(s0.view(torch.uint8), s1.view(torch.uint8))
            print(f"  torch.compile reference: scales identical to the kernel's: {same}")
            add("fused_rmsnorm_residual", "torch.compile", N, C,
                median_ms(lambda i: compiled_fwd(B[i], R[i], W), nsets, reps=args.reps), fwd_bytes)
            add("fused_rmsnorm_residual_backward", "torch.compile", N, C,
                median_ms(lambda i: compiled_bwd(G[i], B[i], W, RR[i]), nsets, reps=args.reps), bwd_bytes)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        if Liger is not None:
            try:
                # Liger: S = X + R; Y = rmsnorm(S) * W (bf16 Y and S out, no quantization)
                liger_fwd_bytes = 2 * 2 * N * C + 2 * C + 2 * 2 * N * C + 4 * N
                add("fused_rmsnorm_residual", "liger", N, C,
                    median_ms(lambda i: Liger.apply(B[i], R[i], W, EPS, 0.0, "llama", False), nsets,
                              reps=args.reps), liger_fwd_bytes)
                Bg = [b.clone().requires_grad_() for b in B[:2]]
                Rg = [r.clone().requires_grad_() for r in R[:2]]
                Wg = W.clone().requires_grad_()
                outs = [Liger.apply(Bg[i], Rg[i], Wg, EPS, 0.0, "llama", False) for i in range(2)]
                # backward reads dY, S, W, rstd and writes dX (= dR) and dW
                liger_bwd_bytes = 2 * 2 * N * C + 2 * C + 4 * N + 2 * N * C + 2 * C
                add("fused_rmsnorm_residual_backward", "liger", N, C,
                    median_ms(lambda i: torch.autograd.grad(outs[i][0], (Bg[i], Rg[i], Wg), G[i],
                                                            retain_graph=True), 2, reps=args.reps),
                    liger_bwd_bytes)
                del outs, Bg, Rg
            except Exception:  # noqa: BLE001
                traceback.print_exc()
        del B, R, G, RR
        torch.cuda.empty_cache()

    result = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ceilings": {"copy_GBps": round(copy_gbps, 1), "bf16_matmul_TFLOPs": round(mm_tflops, 1)},
        "rows": rows,
    }
    (out / "h200.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "h200.png", shapes)
    print("\nsummary (GB/s, % of copy):")
    for r in rows:
        if r["impl"] == "prime-kernels":
            print(f"  {r['op']:32s} {r['shape']['N']:6d}x{r['shape']['C']:<6d} {r['GBps']:8.1f} "
                  f"{100 * r['GBps'] / copy_gbps:6.1f}%")


def plot(result, path, shapes=SHAPES):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print("no matplotlib:", e)
        return
    copy = result["ceilings"]["copy_GBps"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    impls = ["prime-kernels", "torch.compile", "liger"]
    for ax, op in zip(axes, ["fused_rmsnorm_residual", "fused_rmsnorm_residual_backward"]):
        for j, impl in enumerate(impls):
            ys = []
            for N, C in shapes:
                m = [r["GBps"] for r in result["rows"]
                     if r["op"] == op and r["impl"] == impl and r["shape"] == {"N": N, "C": C}]
                ys.append(m[0] if m else 0)
            ax.bar([i + (j - 1) * 0.27 for i in range(len(shapes))], ys, 0.27, label=impl)
        ax.axhline(copy, color="k", lw=1, label=f"D2D copy {copy:.0f} GB/s")
        ax.axhline((0.9 if op == "fused_rmsnorm_residual" else 0.85) * copy, color="k", ls="--", lw=0.8,
                   label="target")
        ax.set_xticks(range(len(shapes)), [f"{N}x{C}" for N, C in shapes], rotation=15)
        ax.set_title(op)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("GB/s (each input read once, each output written once)")
    fig.suptitle(f"{result['gpu']}, torch {result['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    sys.exit(main())
