"""Side-by-side benchmark of fused_moe_bf16 and fused_moe_mxfp8 (docs/DESIGN.md §9), all in one run.

Measures the ceilings (device-to-device copy, 8192^3 bf16 matmul), our op (moe_align INCLUDED
in the prime-kernels row; the op alone is printed too), the unfused path
(`reference.grouped_mm_path`: sort, gather, three torch._grouped_mm, SwiGLU, weight, index_add),
its three grouped GEMMs alone on inputs already sorted and gathered (`grouped_mm GEMMs only`:
torch._grouped_mm is CUTLASS's Hopper grouped GEMM, the library kernel our hand-written GEMMs are
measured against; no rel_err, it is not the whole op) and Liger's LigerFusedMoEFunction (autotune
off) on the docs/DESIGN.md §9 shapes. CUDA events, median of >= 20 timed calls after warm-up;
x/routing rotate over several copies (the expert weights alone exceed the 50 MB L2 in every shape).

MXFP8 (unless --no-mxfp8): the same shapes with x, w, w2 quantized from the bf16 originals, as
`fused_moe_mxfp8` (moe_align included), `dequant+grouped_mm` (plain torch dequantization to bf16,
then the unfused path) and `dequant+fused_bf16` (dequantize_mxfp8 of everything, then
fused_moe_bf16); every dequantization is inside the timed call. Their rel_err_vs_fp32 is against
the fp32 truth of the ORIGINAL inputs; quant_floor_rel_err is the error that quantizing alone
costs (fp32 MoE of the dequantized inputs). Then quantize_mxfp8 alone on bf16 (N, C) inputs,
row-major and blocked scales (GB/s counts 2 B read + 1 B + 1/32 B scale written per element).

The backward (unless --backward-shapes ''), on BACKWARD_SHAPES: ours
(`functional.fused_backward` on the pre-activations the training forward saved), prime-rl's
backward as restated in flash_moe/tests/prime_rl_peer.py, the four backward GEMMs alone
(`grouped_mm GEMMs only`, rows pre-gathered), and forward+backward through autograd with its peak
memory (`peak_GB`), also with the MXFP8 forward (`fused_moe_mxfp8_forward_backward`, unless
--no-mxfp8); FLOPs 12 (18 with the forward) * T * k * K * I; each gradient's error against
fp32 autograd through the reference (`grad_rel_err_vs_fp32`, the largest as rel_err_vs_fp32).
Our row runs the backward at the bpc `moe` takes, `preferred_bpc(shape, backward=True)` (recorded as
`bpc`), and also records it at bpc 1 and 2 (CTA pairs), each timed as `op_alone_ms_by_bpc` is:
`fused_moe_bf16_dgrad` (`dgrad_ms_by_bpc`), `fused_moe_bf16_wgrad` (`wgrad_ms_by_bpc`) and the
backward (`backward_ms_by_bpc`, `bits_equal_across_bpc`; back to back: `sustained_by_bpc`, two
windows per bpc in the order 1 2 2 1), and
the dgrad and wgrad ops back to back at `moe`'s bpc (`sustained_by_op`).

Writes <out>/h200.json (docs/DESIGN.md §9 schema), h200.png of the forward rows and h200_backward.png
of the backward rows, each where there are such rows (a run with --shapes= is the training rows alone;
where such a run is committed as results/h200_training.json, the card reads its training rows in
place of h200.json's).

Our ops run as a caller who passes no tuning argument calls them: `bpc=None`, which takes
`flash_moe.preferred_bpc(shape)` (CTA pairs where they measured faster; recorded as `bpc` in the
row); the op alone is timed with both bpc values, alternating twice, the faster of each pair of
timings kept (`op_alone_ms`, `op_alone_ms_by_bpc`).

Per-kernel device times of our ops (torch.profiler over 5 calls) are printed and recorded as
`kernels_ms` in their rows unless --no-profile.

Sustained rates (unless --no-sustained): the matmul ceiling and our ops also run back to back for
~1.5 s while nvidia-smi samples the SM clock, the board power and the sw_power_cap clock-event
reason every 20 ms; recorded as `sustained` in the ceilings and in our rows ({ms, tflops, sm_mhz,
power_w, power_capped: the fraction of samples in which nvidia-smi reports that reason active}).
Each shape's spaced timings all run before its back-to-back windows (`spaced_ms`), and our rows'
and prime-rl's spaced timing record the same medians over its own span (`spaced_clock`).
The docs/DESIGN.md §9 timing above leaves ~2 ms idle before each call, which lets a short kernel run much
of its time at boost clocks; back to back, as in a training step, the matmul and the large MoE
shapes run at the H200's 700 W power limit, well below boost (flash_moe/DESIGN.md §6).

usage: python3 flash_moe/benchmarks/compare.py [--out DIR] [--iters 20] [--shapes 0,1,2,3,4] [--no-liger]
       [--no-mxfp8] [--no-profile] [--no-sustained] [--backward-shapes 0,1,2,3,4]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")

import torch  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
MEMBER = HERE.parent
if str(HERE) not in sys.path:  # loaded by path (the CPU tests) rather than run as a script
    sys.path.append(str(HERE))
import kernel_package  # noqa: E402
from bench_timing import ceilings, median_ms  # noqa: E402

SHAPES = [(8192, 2048, 768, 64, 8), (16384, 2048, 768, 128, 8), (8192, 4096, 1536, 128, 8),
          (8192, 7168, 2048, 256, 8), (1024, 2048, 768, 128, 8)]
# The backward's shapes (docs/DESIGN.md §9; their results and targets are in flash_moe/DESIGN.md §8.2).
BACKWARD_SHAPES = [(8192, 2048, 768, 64, 8), (16384, 2048, 768, 128, 8), (32768, 4096, 1024, 64, 4),
                   (8192, 4096, 1536, 128, 8), (1024, 2048, 768, 128, 8)]
GRADS = ("x", "w1", "w2", "w3", "topk_weights")
LIGER_SHAPES = (0, 1, 4)  # SHAPES indices where the forward's targets name Liger's fused MoE as a peer
QUANT_SHAPES = [(65536, 4096), (16384, 7168)]  # (N, C) bf16 inputs of quantize_mxfp8


def load_kernel():
    sys.path.insert(0, str(MEMBER.parent / "torch-ext"))
    import prime_kernels

    return prime_kernels.load("flash_moe")


class ClockMonitor:
    """nvidia-smi sampling, every 20 ms, of the SM clock, the board power and whether the
    power-cap clock-event reason is active. `sustained` marks windows of back-to-back work; `stop`
    ends the sampling and fills each window's medians in. Inactive (no fields) where nvidia-smi
    is missing or does not know a field."""

    FIELDS = "timestamp,clocks.sm,power.draw,clocks_event_reasons.sw_power_cap"

    def __init__(self, path):
        self.path, self.windows, self.proc = path, [], None
        self.file = open(path, "w")
        try:
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits",
                                          "-lms", "20"], stdout=self.file, stderr=subprocess.STDOUT)
        except OSError as e:
            self.file.close()
            print(f"no clock sampling: {e}")

    def sustained(self, fn, flops, secs=1.5):
        """fn(i) back to back for ~secs after a warm-up call: a dict {ms, tflops} that stop() completes
        with the window's median SM clock, power and power-cap fraction."""
        fn(0)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0, n = time.time(), 0
        a.record()
        while time.time() - t0 < secs:
            for _ in range(4):
                fn(n)
                n += 1
            torch.cuda.synchronize()
        b.record()
        b.synchronize()
        ms = a.elapsed_time(b) / n
        r = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
        self.windows.append((t0 + 0.3, time.time(), r))  # the first 0.3 s: clocks still settling
        return r

    def spaced(self, fn, reps):
        """median_ms(fn, reps), and a dict that stop() fills with the SM clock, power and power-cap
        fraction over that timing (None when nvidia-smi is not sampling)."""
        t0 = time.time()
        ms = median_ms(fn, reps)
        if self.proc is None:
            return ms, None
        clock = {}
        self.windows.append((t0, time.time(), clock))
        return ms, clock

    def stop(self):
        if self.proc is None:
            return
        self.proc.terminate()
        self.proc.wait()
        self.file.close()
        with open(self.path) as f:
            samples = parse_clock_samples(f)
        for t0, t1, r in self.windows:
            r.update(window_stats(samples, t0, t1))


def spaced_ms(monitor, fn, reps):
    """(median_ms(fn, reps), the power state it ran in: ClockMonitor.spaced's clock, or None).

    A shape's spaced timings all come before its back-to-back windows: a window leaves the GPU at
    its power limit for a while after, and a spaced row timed after one ran slower than the same op
    timed before it (flash_moe/DESIGN.md §8.2); the clock recorded beside it (`spaced_clock`) shows
    the state it ran in."""
    return monitor.spaced(fn, reps) if monitor else (median_ms(fn, reps), None)


def parse_clock_samples(lines):
    """(time, SM MHz, watts, power cap reported) per line of ClockMonitor.FIELDS in nvidia-smi's
    `csv,noheader,nounits` form; lines that are not samples (errors, a cut last line) are skipped."""
    samples = []
    for line in lines:
        f = [c.strip() for c in line.split(",")]
        try:
            ts = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((ts, float(f[1]), float(f[2]), f[3].lower() == "active"))
        except (ValueError, IndexError):
            continue
    return samples


def window_stats(samples, t0, t1):
    """Median SM clock and power, and the fraction of samples reporting the power cap, over the
    samples in [t0, t1]; {} when there are none."""
    sel = [smp for smp in samples if t0 <= smp[0] <= t1]
    if not sel:
        return {}
    return {"sm_mhz": sorted(smp[1] for smp in sel)[len(sel) // 2],
            "power_w": round(sorted(smp[2] for smp in sel)[len(sel) // 2], 1),
            "power_capped": round(sum(smp[3] for smp in sel) / len(sel), 2)}


def sorted_gemm_inputs(ref, x, ids, wg, wu, E):
    """The inputs of the unfused path's GEMMs (`reference.grouped_mm_path`, in its slot order
    `reference.grouped_mm_layout`), pre-gathered: the rows of x sorted by expert, the SwiGLU
    output h and the group offsets."""
    _, _, tok, offs = ref.grouped_mm_layout(ids, E)
    xs = x[tok]
    h = torch.nn.functional.silu(torch._grouped_mm(xs, wg, offs=offs)) * torch._grouped_mm(xs, wu, offs=offs)
    return xs, h, offs


def grouped_gemms(xs, h, offs, wg, wu, w2t):
    """The unfused path's three grouped GEMMs, nothing else."""
    return (torch._grouped_mm(xs, wg, offs=offs), torch._grouped_mm(xs, wu, offs=offs),
            torch._grouped_mm(h, w2t, offs=offs))


def torch_dequant(q, scales):
    """MXFP8 -> bf16 with plain torch ops (the unfused baseline's dequantization): q * 2^(byte-127).

    The scale is built from its fp32 bit pattern (byte << 23); byte 0 gives 0 instead of 2^-127,
    which only a quantizer's all-zero blocks carry, and byte 255 gives inf (so NaN products).
    """
    K = q.shape[-1]
    scale = (scales.view(torch.uint8).to(torch.int32) << 23).view(torch.float32).to(torch.bfloat16)
    return (q.to(torch.bfloat16).view(*q.shape[:-1], K // 32, 32) * scale[..., None]).view(q.shape)


# gemm::Weights in moe_gemm.cuh, in order: kBf16, kMxfp8, kMxfp8Window (the f16 scale-window gate/up).
GEMM_WEIGHTS = ("bf16", "mxfp8", "mxfp8-f16")
# gemm::Kind, in order: the forward's two GEMMs, then the backward's (fused_moe_bf16_dgrad).
GEMM_KINDS = ("gate/up", "down", "down dgrad", "gate/up dgrad")
# wgrad::Kind (moe_wgrad.cuh, fused_moe_bf16_wgrad), in order.
WGRAD_KINDS = ("down wgrad", "gate/up wgrad")


def kernel_label(name):
    """A short name for a profiled kernel: `gemm bf16 gate/up` for moe_gemm_kernel<Weights 0, Kind 0,
    stages>, `gemm bf16 down wgrad` for moe_wgrad_kernel<Kind 0, stages>, else the `*_kernel` name
    (or the event's first 60 characters)."""
    m = re.search(r"moe_gemm_kernel<\(flash_moe::gemm::Weights\)(\d), \(flash_moe::gemm::Kind\)(\d)", name)
    if m:
        w = int(m.group(1))
        weights = GEMM_WEIGHTS[w] if w < len(GEMM_WEIGHTS) else f"weights{w}"
        return f"gemm {weights} {GEMM_KINDS[int(m.group(2))]}"
    m = re.search(r"moe_wgrad_kernel<\(flash_moe::wgrad::Kind\)(\d)", name)
    if m:
        return f"gemm bf16 {WGRAD_KINDS[int(m.group(1))]}"
    m = re.search(r"(\w+_kernel(<[^>]*>)?)", name)
    return m.group(1) if m else name[:60]


def per_kernel_ms(launches, calls):
    """Mean ms per kernel from `launches`, (name, device µs) in launch order over `calls` identical
    calls, keyed by kernel_label, slowest first. A label launched more than once per call is kept
    apart by launch order (`kernel_cutlass_kernel #2`): SonicMoE's GEMMs all share one name."""
    labels = [kernel_label(name) for name, _ in launches]
    per_call = {label: labels.count(label) // calls for label in set(labels)}
    seen, per = {}, {}
    for label, (_, us) in zip(labels, launches):
        i = seen.get(label, 0)
        seen[label] = i + 1
        key = f"{label} #{i % per_call[label] + 1}" if per_call[label] > 1 else label
        per[key] = per.get(key, 0.0) + us / calls / 1000
    return {key: round(t, 4) for key, t in sorted(per.items(), key=lambda kv: -kv[1])}


def profile_kernels(fn, calls=5):
    """Mean device time per kernel over `calls` calls of fn(i), in ms (per_kernel_ms); printed.
    None (with the reason printed) where the profiler fails: the timings do not depend on it."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(calls):
                fn(i)
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        print(f"    no per-kernel profile: {e}")
        return None
    events = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda ev: ev.time_range.start)
    per = per_kernel_ms([(ev.name, ev.device_time) for ev in events], calls)
    for name, t in per.items():
        print(f"    kernel {t:8.4f} ms  {name}")
    return per


def op_alone_by(op_for, iters, keys=(1, 2)):
    """{key: ms} of the op alone for each variant key (default: bpc 1 and 2), timed in order and
    then in reverse, the faster of each key's two timings kept (fresh H200s drift by several % at
    the large shapes within seconds)."""
    times = {k: [] for k in keys}
    for k in (*keys, *reversed(keys)):
        times[k].append(median_ms(op_for(k), iters))
    return {k: round(min(v), 4) for k, v in times.items()}


def sustained_by(monitor, op_for, flops, keys=(1, 2)):
    """{key: [window, window]}: monitor.sustained of each variant's op back to back, in order and
    then in reverse (1 2 2 1), as op_alone_by times them spaced: each window starts in the power
    state the last left."""
    windows = {k: [] for k in keys}
    for k in (*keys, *reversed(keys)):
        windows[k].append(monitor.sustained(op_for(k), flops))
    return windows


def indices(text):
    """The shape indices of a comma-separated --shapes / --backward-shapes ('' for none)."""
    return [int(s) for s in text.split(",") if s.strip()]


def moe_row(rows, op, impl, shape, ms, err, flop_factor=6, **extra):
    """Record and print one MoE row (docs/DESIGN.md §9 schema) of `shape` (T, K, I, E, top_k); its
    FLOPs are flop_factor * T * top_k * K * I (forward 6, backward 12, both 18); err None: a row that
    does not compute the whole op (no rel_err_vs_fp32). Extra fields that are None are left out.
    Returns the row (a back-to-back window timed later goes in as its `sustained`)."""
    T, K, I, E, top_k = shape
    flops = flop_factor * T * top_k * K * I
    r = {"op": op, "impl": impl, "shape": {"tokens": T, "dim": K, "hidden": I, "experts": E, "top_k": top_k},
         "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
    if err is not None:
        r["rel_err_vs_fp32"] = round(err, 6)
    r.update({k: (round(v, 6) if isinstance(v, float) else v) for k, v in extra.items() if v is not None})
    rows.append(r)
    floor = f" (quantization floor {extra['quant_floor_rel_err']:.2e})" if "quant_floor_rel_err" in extra else ""
    err_text = f" rel_err {err:.2e}" if err is not None else ""
    print(f"{shape} {op} {impl} {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s){err_text}{floor}", flush=True)
    return r


def mxfp8_moe_rows(kernel, ref, args, si, w, w2, sets, outs, rel, rows, monitor=None):
    """fused_moe_mxfp8 and its two dequantize-first peers on one shape (inputs quantized from the bf16
    originals `w`, `w2`, `sets`; `rel` measures against the fp32 truth of those originals)."""
    T, K, I, E, top_k = SHAPES[si]
    flops = 6 * T * top_k * K * I
    wq, ws = kernel.quantize_mxfp8(w, blocked=True)
    w2q, w2s = kernel.quantize_mxfp8(w2, blocked=True)
    # row-major copies of the weight scales for the dequantize paths (the fused op reads the blocked ones)
    ws_rm = ref.unpack_scales_blocked(ws, E, 2 * I, K // 32)
    w2s_rm = ref.unpack_scales_blocked(w2s, E, K, I // 32)
    qsets = [(kernel.quantize_mxfp8(x), ids, wt) for (x, ids, wt) in sets]
    n_sets = len(qsets)

    # what quantizing alone costs: the fp32 MoE of the dequantized inputs (exact in bf16 for a
    # quantizer's output; torch_dequant rather than the fp32 reference to stay within memory at E=256)
    (xq0, xs0), ids0, wt0 = qsets[0]
    xd, wd, w2d = torch_dequant(xq0, xs0), torch_dequant(wq, ws_rm), torch_dequant(w2q, w2s_rm)
    floor = rel(ref.moe_fp32(xd, wd, w2d, ids0, wt0))
    del xd, wd, w2d
    torch.cuda.empty_cache()

    def row(impl, ms, err, **extra):
        return moe_row(rows, "fused_moe_mxfp8", impl, SHAPES[si], ms, err, quant_floor_rel_err=floor, **extra)

    bpc = kernel.preferred_bpc(T, K, I, E, top_k, mxfp8=True)
    bf16_bpc = kernel.preferred_bpc(T, K, I, E, top_k)  # for the dequant+fused_bf16 row

    def ours(i):
        (xq, xs), ids, wt = qsets[i % n_sets]
        s, e, n = kernel.moe_align(ids, E)
        kernel.fused_moe_mxfp8(xq, xs, wq, ws, w2q, w2s, s, e, n, wt, outs[i % n_sets], top_k)

    aligned = [kernel.moe_align(ids, E) for (_, ids, _) in qsets]

    def ours_op(b):
        def call(i):
            (xq, xs), ids, wt = qsets[i % n_sets]
            s, e, n = aligned[i % n_sets]
            kernel.fused_moe_mxfp8(xq, xs, wq, ws, w2q, w2s, s, e, n, wt, outs[i % n_sets], top_k, bpc=b)
        return call

    outs[0].fill_(float("nan"))  # poisoned: an unwritten row shows up in the error
    ours(0)
    err = rel(outs[0])
    ms, clock = spaced_ms(monitor, ours, args.iters)
    ms_by_bpc = op_alone_by(ours_op, args.iters)
    print(f"{SHAPES[si]} mxfp8 op alone: bpc=1 {ms_by_bpc[1]:.3f} ms, bpc=2 {ms_by_bpc[2]:.3f} ms "
          f"({flops / ms_by_bpc[bpc] / 1e9:.0f} TFLOP/s at bpc={bpc})", flush=True)
    ours_row = row("prime-kernels", ms, err, bpc=bpc, op_alone_ms=ms_by_bpc[bpc], op_alone_ms_by_bpc=ms_by_bpc,
                   kernels_ms=profile_kernels(ours) if args.profile else None, spaced_clock=clock)

    try:
        def deq_unfused(i):
            (xq, xs), ids, wt = qsets[i % n_sets]
            xd, wd, w2d = torch_dequant(xq, xs), torch_dequant(wq, ws_rm), torch_dequant(w2q, w2s_rm)
            return ref.grouped_mm_path(xd, wd, w2d, ids, wt)

        err_u = rel(deq_unfused(0))
        row("dequant+grouped_mm", median_ms(deq_unfused, args.iters), err_u)
    except Exception as e:  # noqa: BLE001
        print(f"dequant+grouped_mm failed on {SHAPES[si]}: {e}")
    torch.cuda.empty_cache()

    try:
        def deq_fused(i):
            (xq, xs), ids, wt = qsets[i % n_sets]
            xd = kernel.dequantize_mxfp8(xq, xs)
            wd = kernel.dequantize_mxfp8(wq, ws_rm)
            w2d = kernel.dequantize_mxfp8(w2q, w2s_rm)
            s, e, n = kernel.moe_align(ids, E)
            kernel.fused_moe_bf16(xd, wd, w2d, s, e, n, wt, outs[i % n_sets], top_k, bpc=bf16_bpc)

        outs[0].fill_(float("nan"))
        deq_fused(0)
        err_d = rel(outs[0])
        row("dequant+fused_bf16", median_ms(deq_fused, args.iters), err_d,
            note="alternative: dequantize everything, then the bf16 op")
    except Exception as e:  # noqa: BLE001
        print(f"dequant+fused_bf16 failed on {SHAPES[si]}: {e}")
    if monitor:  # after every spaced timing (spaced_ms)
        ours_row["sustained"] = monitor.sustained(ours, flops)
    del wq, w2q, ws, w2s, ws_rm, w2s_rm, qsets, aligned
    torch.cuda.empty_cache()


def quantize_rows(kernel, ref, args, copy, rows):
    """quantize_mxfp8 alone on bf16 (N, C) inputs, row-major and blocked scales."""
    for N, C in QUANT_SHAPES:
        g = torch.Generator(device="cuda").manual_seed(N + C)
        xs = [torch.randn(N, C, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(args.rotate)]
        for blocked in (False, True):
            # spot check against the reference on the first rows (a slice is its own (R, C/32) matrix)
            v, sc = kernel.quantize_mxfp8(xs[0][:1024], blocked=blocked)
            rv, rs = ref.quantize_mxfp8(xs[0][:1024].cpu(), blocked=blocked)
            exact = bool(torch.equal(v.view(torch.uint8).cpu(), rv.view(torch.uint8)) and
                         torch.equal(sc.view(torch.uint8).cpu().reshape(-1), rs.view(torch.uint8).reshape(-1)))
            ms = median_ms(lambda i, b=blocked: kernel.quantize_mxfp8(xs[i % len(xs)], blocked=b), args.iters)
            gbps = N * C * (2 + 1 + 1 / 32) / ms / 1e6
            rows.append({"op": "quantize_mxfp8", "impl": "prime-kernels",
                         "shape": {"N": N, "C": C, "blocked": blocked}, "ms": round(ms, 4), "GBps": round(gbps, 1),
                         "pct_copy": round(100 * gbps / copy, 1), "bit_exact_vs_reference": exact})
            print(f"quantize_mxfp8 ({N}, {C}) {'blocked' if blocked else 'row-major'} {ms:.3f} ms "
                  f"{gbps:.0f} GB/s ({100 * gbps / copy:.0f}% of copy) bit-exact {exact}", flush=True)
        del xs
        torch.cuda.empty_cache()


def backward_gemms(xs, gs, h, dab, offs, w, w2):
    """The backward's four grouped GEMMs on rows already gathered by position (moe_align's padded
    layout): dh = g W2, dx = dA|dB W, dW = dA|dBᵀ x, dW2 = gᵀ h."""
    return (torch._grouped_mm(gs, w2, offs=offs), torch._grouped_mm(dab, w, offs=offs),
            torch._grouped_mm(dab.t(), xs, offs=offs), torch._grouped_mm(gs.t(), h, offs=offs))


def load_prime_rl_peer():
    """prime-rl's backward and its `_FusedMoE`, restated (tests/prime_rl_peer.py, the GPU tests' peer)."""
    return kernel_package.load_file("flash_moe_prime_rl_peer", MEMBER / "tests" / "prime_rl_peer.py")


def peak_gb(fn):
    """Memory fn(0) allocates at its peak beyond what was allocated before, in GB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(0)
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 1e9, 3)


def backward_inputs(shape, device="cuda"):
    """The backward rows' inputs on `shape` (T, K, I, E, top_k), seeded by the shape: (g, (x, w1,
    w2, w3, wt), ids, go) with bf16 x (T, K), w1 and w3 (E, I, K), w2 (E, K, I) and grad_out go
    (T, K), int32 ids (T, top_k) of a random top-k and fp32 softmax weights wt (T, top_k); g is
    the generator, which backward_rows draws on from."""
    T, K, I, E, top_k = shape
    g = torch.Generator(device=device).manual_seed(100 + sum(shape))
    x = torch.randn(T, K, generator=g, device=device).bfloat16()
    w1, w3 = ((torch.randn(E, I, K, generator=g, device=device) / K ** 0.5).bfloat16() for _ in range(2))
    w2 = (torch.randn(E, K, I, generator=g, device=device) / I ** 0.5).bfloat16()
    ids = torch.rand(T, E, generator=g, device=device).topk(top_k, dim=1).indices.to(torch.int32)
    wt = torch.softmax(torch.randn(T, top_k, generator=g, device=device), -1)
    go = torch.randn(T, K, generator=g, device=device).bfloat16()
    return g, (x, w1, w2, w3, wt), ids, go


def training_forward(kernel, shape, inputs, ids):
    """The training forward a backward timing starts from, on `shape`'s inputs: (routing, preact,
    out) with routing = moe_align's buffers and top_k, preact the pre-activations it saved."""
    T, K, I, E, top_k = shape
    x, w1, w2, w3, wt = inputs
    routing = (*kernel.moe_align(ids, E), top_k)
    preact = torch.empty(kernel.preact_numel(routing[0].numel(), I), dtype=torch.bfloat16, device=x.device)
    out = kernel.functional._forward(x, w1, w2, w3, wt, routing, False, preact)
    return routing, preact, out


def backward_op(kernel, op, bpc, go, inputs, routing, preact, dab_sh=None):
    """A callable i -> the outputs of one of the backward's ops on `kernel` (a flash_moe module) at
    `bpc`: "dgrad" (`fused_moe_bf16_dgrad`: dx, dab, sh, score partials), "wgrad"
    (`fused_moe_bf16_wgrad` on dab_sh = the dgrad's (dab, sh)) or "backward"
    (`functional.fused_backward`), on a shape's inputs (x, w1, w2, w3, wt), grad_out go, and the
    routing and pre-activations of its training forward (`training_forward`)."""
    x, w1, w2, w3, wt = inputs
    sorted_ids, expert_ids, ntpp, top_k = routing
    if op == "dgrad":
        return lambda i: kernel.fused_moe_bf16_dgrad(go, w1, w3, w2, preact, sorted_ids, expert_ids, ntpp, wt, top_k,
                                                      bpc=bpc)
    if op == "wgrad":
        dab, sh = dab_sh
        return lambda i: kernel.fused_moe_bf16_wgrad(x, go, dab, sh, sorted_ids, expert_ids, ntpp, w1.shape[0], top_k,
                                                      bpc=bpc)
    if op == "backward":
        return lambda i: kernel.functional.fused_backward(go, x, w1, w2, w3, wt, routing, preact, bpc=bpc)
    raise ValueError(f"op must be dgrad, wgrad or backward, got {op!r}")


def backward_truth(ref, inputs, ids, go):
    """fp32 autograd through the reference on inputs (x, w1, w2, w3, wt): (out, the gradients in
    GRADS order). The leaves are detached copies (.float() of the fp32 wt would be wt itself)."""
    leaves = [t.detach().float().requires_grad_() for t in inputs]
    out = ref.moe_fp32(leaves[0], torch.cat([leaves[1], leaves[3]], 1), leaves[2], ids, leaves[4])
    out.backward(go.float())
    return out.detach(), [t.grad for t in leaves]


def grad_errors(grads, truth):
    """{name: |grad - truth| / |truth|} over GRADS."""
    return {n: round(((a.float() - t).norm() / t.norm()).item(), 6) for n, a, t in zip(GRADS, grads, truth)}


def backward_rows(kernel, ref, peer, args, shape, rows, monitor=None):
    """The backward on one shape: ours (`functional.fused_backward` on the pre-activations the
    training forward saved), prime-rl's restated backward, the four backward GEMMs alone
    (`backward_gemms`), and forward+backward through autograd (ours: `moe`; prime-rl's: our
    forward with its backward), with each gradient's error against fp32 autograd through the
    reference and the peak memory of forward+backward. One input set (the weights, read once per
    call, exceed L2 at every shape). Every spaced timing comes before the shape's back-to-back
    windows (see `spaced_ms`)."""
    T, K, I, E, top_k = shape
    F = kernel.functional
    g, inputs, ids, go = backward_inputs(shape)
    x, w1, w2, w3, wt = inputs
    _, truth = backward_truth(ref, inputs, ids, go)

    def errors(grads):
        return grad_errors(grads, truth)

    routing, preact, _ = training_forward(kernel, shape, inputs, ids)
    sorted_ids, expert_ids, ntpp, _ = routing

    def backward_at(b):
        return backward_op(kernel, "backward", b, go, inputs, routing, preact)

    bpc = kernel.preferred_bpc(T, K, I, E, top_k, backward=True)  # what `moe` runs (bpc=None), recorded
    ours = backward_at(bpc)

    def leaves_of(i):
        return [t.detach().requires_grad_() for t in inputs]

    def ours_both(i):
        lv = leaves_of(i)
        kernel.moe(lv[0], lv[1], lv[2], lv[3], ids, lv[4]).backward(go)

    peer.PrimeRlFusedMoE.kernel = kernel

    def prime_rl(i):
        return peer.prime_rl_backward(go, x, w1, w2, w3, ids, wt, E)

    def prime_rl_both(i):
        lv = leaves_of(i)
        peer.PrimeRlFusedMoE.apply(lv[0], lv[1], lv[2], lv[3], ids, lv[4], E, False).backward(go)

    def ours_mxfp8_both(i):  # a trainer's moe(mxfp8=True): its backward is the bf16 one
        lv = leaves_of(i)
        kernel.moe(lv[0], lv[1], lv[2], lv[3], ids, lv[4], mxfp8=True).backward(go)

    # dgrad, wgrad and the backward at bpc 1 and 2 (the same bits)
    def dgrad_at(b):
        return backward_op(kernel, "dgrad", b, go, inputs, routing, preact)

    _, dab, sh, _ = dgrad_at(1)(0)

    def wgrad_at(b):
        return backward_op(kernel, "wgrad", b, go, inputs, routing, preact, (dab, sh))

    # Spaced timings.
    dgrad_ms = op_alone_by(dgrad_at, args.iters)
    wgrad_ms = op_alone_by(wgrad_at, args.iters)
    backward_ms = op_alone_by(backward_at, args.iters)
    print(f"{shape} backward: bpc=1 {backward_ms[1]:.3f} ms, bpc=2 {backward_ms[2]:.3f} ms (moe takes bpc={bpc}); "
          f"dgrad {dgrad_ms[1]:.3f} / {dgrad_ms[2]:.3f}; wgrad {wgrad_ms[1]:.3f} / {wgrad_ms[2]:.3f} ms", flush=True)
    same_bits = all(torch.equal(a, b) for a, b in zip(backward_at(1)(0), backward_at(2)(0)))
    if not same_bits:
        print(f"{shape} WARNING: the backward's gradients differ between bpc 1 and 2", flush=True)
    errs = errors(ours(0))
    kernels = profile_kernels(ours) if args.profile else None
    ours_ms, ours_clock = spaced_ms(monitor, ours, args.iters)
    errs_p = errors(prime_rl(0))
    prime_rl_ms, prime_rl_clock = spaced_ms(monitor, prime_rl, args.iters)

    live = F._live(sorted_ids, ntpp, T * top_k)[1]
    row = torch.where(live, sorted_ids.long() // top_k, T)
    xs, gs = (torch.cat([t, t.new_zeros(1, K)])[row] for t in (x, go))
    h_rand = torch.randn(sorted_ids.numel(), I, generator=g, device=x.device).bfloat16()
    dab_rand = torch.randn(sorted_ids.numel(), 2 * I, generator=g, device=x.device).bfloat16()
    w = torch.cat([w1, w3], 1)
    offs = F._group_ends(expert_ids, E, sorted_ids.numel())
    gemms_ms = median_ms(lambda i: backward_gemms(xs, gs, h_rand, dab_rand, offs, w, w2), args.iters)
    del xs, gs, h_rand, dab_rand, w

    both = [("fused_moe_bf16_forward_backward", "prime-kernels", ours_both),
            ("fused_moe_bf16_forward_backward", "prime-rl backward", prime_rl_both)]
    if args.mxfp8 and kernel.unsupported_shape_reason(K, I, mxfp8=True) is None:
        both.append(("fused_moe_mxfp8_forward_backward", "prime-kernels", ours_mxfp8_both))
    both_ms = [(median_ms(fn, args.iters), peak_gb(fn)) for _, _, fn in both]

    # Back-to-back windows: the backward at both bpc (the power limit may rank them otherwise than
    # spaced timing), two windows each in the order 1 2 2 1, as each window starts in the power
    # state the last left; each op at moe's bpc (6 * T * k * K * I FLOPs each), whose rate per MHz
    # tells a kernel's own cost from the power limit's (flash_moe/DESIGN.md §8.5 (e)).
    sus = sus_by_bpc = op_sus = prime_rl_sus = both_sus = None
    if monitor:
        op_sus = {name: monitor.sustained(at(bpc), 6 * T * top_k * K * I)
                  for name, at in (("dgrad", dgrad_at), ("wgrad", wgrad_at))}
        sus_by_bpc = sustained_by(monitor, backward_at, 12 * T * top_k * K * I)
        sus = sus_by_bpc[bpc][0]
        prime_rl_sus = monitor.sustained(prime_rl, 12 * T * top_k * K * I)
        both_sus = monitor.sustained(ours_both, 18 * T * top_k * K * I)
    del dab, sh

    moe_row(rows, "fused_moe_bf16_backward", "prime-kernels", shape, ours_ms, max(errs.values()), 12, bpc=bpc,
            grad_rel_err_vs_fp32=errs, kernels_ms=kernels, spaced_clock=ours_clock, sustained=sus,
            backward_ms_by_bpc=backward_ms, dgrad_ms_by_bpc=dgrad_ms, wgrad_ms_by_bpc=wgrad_ms,
            bits_equal_across_bpc=same_bits, sustained_by_bpc=sus_by_bpc, sustained_by_op=op_sus)
    moe_row(rows, "fused_moe_bf16_backward", "prime-rl backward", shape, prime_rl_ms, max(errs_p.values()), 12,
            grad_rel_err_vs_fp32=errs_p, spaced_clock=prime_rl_clock, sustained=prime_rl_sus)
    moe_row(rows, "fused_moe_bf16_backward", "grouped_mm GEMMs only", shape, gemms_ms, None, 12,
            note="the four backward GEMMs alone (torch._grouped_mm), rows pre-gathered by position")
    for (op, impl, fn), (ms, peak) in zip(both, both_ms):
        moe_row(rows, op, impl, shape, ms, None, 18, peak_GB=peak, sustained=both_sus if fn is ours_both else None)
    del preact, truth
    torch.cuda.empty_cache()


def _shape_text(r):
    sh = r["shape"]
    if r["op"] == "quantize_mxfp8":
        return f"({sh['N']}, {sh['C']}) {'blocked' if sh['blocked'] else 'row-major'}"
    return str(tuple(sh.values()))


def _moe_label(r):
    sh = r["shape"]
    return f"{sh['tokens']},{sh['dim']},{sh['hidden']},{sh['experts']}"


def plot(rows, copy, mm, path, gpu="", mm_sustained=None):
    """Bars of every MoE row's TFLOP/s (and quantize_mxfp8's GB/s) against the ceilings; where a row
    has a `sustained` rate, a black tick marks it on its bar, with the back-to-back matmul as a
    dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moe = [r for r in rows if r["op"] in ("fused_moe_bf16", "fused_moe_mxfp8")]
    quant = [r for r in rows if r["op"] == "quantize_mxfp8"]
    labels = sorted({_moe_label(r) for r in moe}, key=lambda s: [int(v) for v in s.split(",")])
    series = [(op, impl) for op, impl in [("fused_moe_bf16", "prime-kernels"), ("fused_moe_bf16", "grouped_mm"),
                                          ("fused_moe_bf16", "grouped_mm GEMMs only"), ("fused_moe_bf16", "liger"), ("fused_moe_mxfp8", "prime-kernels"),
                                          ("fused_moe_mxfp8", "dequant+grouped_mm"),
                                          ("fused_moe_mxfp8", "dequant+fused_bf16")]
              if any(r["op"] == op and r["impl"] == impl for r in moe)]
    if quant:
        fig, (ax, axq) = plt.subplots(1, 2, figsize=(15, 4.8), gridspec_kw={"width_ratios": [3, 1]})
    else:
        fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.8 / max(len(series), 1)
    for j, (op, impl) in enumerate(series):
        vals = []
        for lab in labels:
            v = [r["tflops"] for r in moe if r["op"] == op and r["impl"] == impl and _moe_label(r) == lab]
            vals.append(v[0] if v else 0)
        xs = [i + width * j for i in range(len(labels))]
        ax.bar(xs, vals, width=width,
               label=f"{'mxfp8' if op.endswith('mxfp8') else 'bf16'} {impl}", hatch="//" if "mxfp8" in op else None)
        for x, lab in zip(xs, labels):
            sus = [r["sustained"]["tflops"] for r in moe
                   if r["op"] == op and r["impl"] == impl and _moe_label(r) == lab and "sustained" in r]
            if sus:
                ax.plot([x - width / 2, x + width / 2], [sus[0], sus[0]], color="k", lw=2)
    ax.axhline(mm, color="k", ls="--", lw=1, label=f"8192^3 bf16 matmul {mm:.0f}")
    if mm_sustained:
        ax.axhline(mm_sustained["tflops"], color="k", ls=":", lw=1,
                   label=f"matmul back to back {mm_sustained['tflops']:.0f} (black ticks: ours back to back)")
    ax.set_ylim(0, mm * 1.35)  # room for the legend above the ceiling line
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, fontsize=8)
    ax.set_ylabel("TFLOP/s (6*T*k*K*I)")
    ax.set_title(f"fused MoE forward, bf16 and MXFP8 inputs, {gpu}")
    ax.legend(fontsize=7, ncol=2)
    if quant:
        axq.bar(range(len(quant)), [r["GBps"] for r in quant], color="tab:purple")
        axq.axhline(copy, color="k", ls="--", lw=1, label=f"copy {copy:.0f}")
        axq.set_xticks(range(len(quant)), [_shape_text(r).replace(") ", ")\n") for r in quant], fontsize=7)
        axq.set_ylabel("GB/s (2 + 1 + 1/32 B per element)")
        axq.set_title("quantize_mxfp8, bf16 input")
        axq.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_backward(rows, mm, path, gpu=""):
    """Bars of the backward rows' TFLOP/s per shape (12*T*k*K*I; forward+backward 18*...) against
    the matmul ceiling, with back-to-back rates as black ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [("fused_moe_bf16_backward", "prime-kernels"), ("fused_moe_bf16_backward", "prime-rl backward"),
              ("fused_moe_bf16_backward", "grouped_mm GEMMs only"), ("fused_moe_bf16_forward_backward", "prime-kernels"),
              ("fused_moe_bf16_forward_backward", "prime-rl backward"),
              ("fused_moe_mxfp8_forward_backward", "prime-kernels")]
    series = [s for s in series if any((r["op"], r["impl"]) == s for r in rows)]
    labels = list(dict.fromkeys(_shape_text(r) for r in rows if r["op"] == "fused_moe_bf16_backward"))
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.8 / max(len(series), 1)
    for j, (op, impl) in enumerate(series):
        for i, lab in enumerate(labels):
            r = [r for r in rows if (r["op"], r["impl"]) == (op, impl) and _shape_text(r) == lab]
            if not r:
                continue
            x = i + width * j
            step = ("mxfp8 fwd+bwd" if "mxfp8" in op else "fwd+bwd") if "forward" in op else "bwd"
            ax.bar(x, r[0]["tflops"], width=width, color=f"C{j}", hatch="//" if "forward" in op else None,
                   label=f"{step} {impl}" if i == 0 else None)
            if "sustained" in r[0]:
                ax.plot([x - width / 2, x + width / 2], [r[0]["sustained"]["tflops"]] * 2, color="k", lw=2)
    ax.axhline(mm, color="k", ls="--", lw=1, label=f"8192^3 bf16 matmul {mm:.0f}")
    ax.set_ylim(0, mm * 1.3)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, fontsize=8)
    ax.set_ylabel("TFLOP/s (bwd 12*T*k*K*I, fwd+bwd 18*...)")
    ax.set_title(f"MoE backward, bf16, {gpu}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(rows):
    print(f"\n{'op':33s} {'shape':30s} {'impl':21s} {'ms':>8s} {'TFLOP/s':>8s} {'GB/s':>6s} {'rel_err':>8s} "
          f"{'q_floor':>8s}")
    for r in rows:
        tf = f"{r['tflops']:8.1f}" if "tflops" in r else " " * 8
        gb = f"{r['GBps']:6.0f}" if "GBps" in r else " " * 6
        err = f"{r['rel_err_vs_fp32']:8.2e}" if "rel_err_vs_fp32" in r else " " * 8
        fl = f"{r['quant_floor_rel_err']:8.2e}" if "quant_floor_rel_err" in r else " " * 8
        print(f"{r['op']:33s} {_shape_text(r):30s} {r['impl']:21s} {r['ms']:8.3f} {tf} {gb} {err} {fl}")


def print_sustained(mm_sustained, rows):
    print(f"\n{'back to back (sustained)':58s} {'ms':>8s} {'TFLOP/s':>8s} {'SM MHz':>7s} {'W':>6s} {'capped':>6s}")
    items = [("8192^3 bf16 matmul", mm_sustained)] + [
        (f"{r['op'][10:]} {r['impl']} {_moe_label(r)}", r["sustained"]) for r in rows if "sustained" in r]
    for name, v in items:
        print(f"{name:58s} {v['ms']:8.3f} {v['tflops']:8.1f} {v.get('sm_mhz', float('nan')):7.0f} "
              f"{v.get('power_w', float('nan')):6.0f} {v.get('power_capped', float('nan')):6.2f}")


def resolve_commit(commit=""):
    """`commit`, else the sha of HEAD (git rev-parse), else "unknown"."""
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=MEMBER, capture_output=True,
                                    text=True).stdout.strip()
        except Exception:  # noqa: BLE001
            commit = ""
        if not re.fullmatch(r"[0-9a-f]{40}", commit or ""):
            commit = ""
    return commit or "unknown"


def results_record(commit, ceil, rows):
    """The results file's top level (docs/DESIGN.md §9 schema)."""
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "ceilings": ceil, "rows": rows}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shapes", default="0,1,2,3,4", help="SHAPES indices to run the forward rows on ('' for none)")
    ap.add_argument("--no-liger", action="store_true")
    ap.add_argument("--rotate", type=int, default=3)
    ap.add_argument("--commit", default=os.environ.get("PRIME_KERNELS_COMMIT", ""), help="git sha to record (default: git rev-parse HEAD)")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="per-kernel device times of our ops (torch.profiler, 5 calls), printed and recorded "
                         "as kernels_ms in their rows (default: on)")
    ap.add_argument("--mxfp8", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the fused_moe_mxfp8 and quantize_mxfp8 rows (default: on)")
    ap.add_argument("--backward-shapes", default="0,1,2,3,4",
                    help="BACKWARD_SHAPES indices to run the backward rows on ('' for none)")
    ap.add_argument("--sustained", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the matmul ceiling and our ops back to back with clock and power "
                         "sampling, recorded as `sustained` (default: on)")
    args = ap.parse_args()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    kernel = load_kernel()
    ref = kernel_package.load_reference(MEMBER)
    liger = None
    if not args.no_liger:
        try:
            from liger_kernel.ops.fused_moe import LigerFusedMoEFunction as liger
        except Exception as e:  # noqa: BLE001
            print(f"liger unavailable: {e}")

    mx_skip = None if args.mxfp8 else "--no-mxfp8"
    if mx_skip:
        print(f"mxfp8 rows skipped: {mx_skip}")

    monitor = ClockMonitor(os.path.join(tempfile.mkdtemp(), "clocks.csv")) if args.sustained else None
    copy, mm, mm_sustained = ceilings(args.iters, monitor)
    print(f"ceilings: copy {copy:.0f} GB/s, bf16 matmul {mm:.0f} TFLOP/s"
          + (f" ({mm_sustained['tflops']:.0f} back to back)" if mm_sustained else ""))
    rows = []
    for si in indices(args.shapes):
        T, K, I, E, top_k = SHAPES[si]
        flops = 6 * T * top_k * K * I
        g = torch.Generator(device="cuda").manual_seed(si)
        w = (torch.randn(E, 2 * I, K, generator=g, device="cuda", dtype=torch.bfloat16) / K ** 0.5)
        w2 = (torch.randn(E, K, I, generator=g, device="cuda", dtype=torch.bfloat16) / I ** 0.5)
        sets = []
        for r in range(args.rotate):
            x = torch.randn(T, K, generator=g, device="cuda", dtype=torch.bfloat16)
            ids = torch.rand(T, E, generator=g, device="cuda").topk(top_k, dim=1).indices.to(torch.int32)
            wt = torch.softmax(torch.randn(T, top_k, generator=g, device="cuda"), -1)
            sets.append((x, ids.contiguous(), wt.contiguous()))
        outs = [torch.empty(T, K, device="cuda", dtype=torch.bfloat16) for _ in sets]

        # accuracy on set 0 vs fp32 truth (chunked per expert)
        x0, ids0, wt0 = sets[0]
        truth = ref.moe_fp32(x0, w, w2, ids0, wt0)
        tn = truth.norm().item()

        def rel(o):
            return ((o.float() - truth).norm() / tn).item()

        bpc = kernel.preferred_bpc(T, K, I, E, top_k)

        def ours(i):
            x, ids, wt = sets[i % len(sets)]
            s, e, n = kernel.moe_align(ids, E)
            kernel.fused_moe_bf16(x, w, w2, s, e, n, wt, outs[i % len(sets)], top_k)

        aligned = [kernel.moe_align(ids, E) for (_, ids, _) in sets]

        def ours_op(b):
            def call(i):
                x, ids, wt = sets[i % len(sets)]
                s, e, n = aligned[i % len(sets)]
                kernel.fused_moe_bf16(x, w, w2, s, e, n, wt, outs[i % len(sets)], top_k, bpc=b)
            return call

        outs[0].fill_(float("nan"))  # poisoned: an unwritten row shows up in the error
        ours(0)
        err = rel(outs[0])
        ms, clock = spaced_ms(monitor, ours, args.iters)
        ms_by_bpc = op_alone_by(ours_op, args.iters)
        kernels = profile_kernels(ours) if args.profile else None
        print(f"{SHAPES[si]} op alone: bpc=1 {ms_by_bpc[1]:.3f} ms, bpc=2 {ms_by_bpc[2]:.3f} ms "
              f"({flops / ms_by_bpc[bpc] / 1e9:.0f} TFLOP/s at bpc={bpc})", flush=True)
        ours_row = moe_row(rows, "fused_moe_bf16", "prime-kernels", SHAPES[si], ms, err, bpc=bpc,
                           op_alone_ms=ms_by_bpc[bpc], op_alone_ms_by_bpc=ms_by_bpc, kernels_ms=kernels,
                           spaced_clock=clock)

        try:
            wg = w[:, :I].transpose(1, 2)
            wu = w[:, I:].transpose(1, 2)
            w2t = w2.transpose(1, 2)

            def peer(i):
                x, ids, wt = sets[i % len(sets)]
                return ref.grouped_mm_path(x, w, w2, ids, wt)

            err_u = rel(peer(0))
            moe_row(rows, "fused_moe_bf16", "grouped_mm", SHAPES[si], median_ms(peer, args.iters), err_u)

            gemm_inputs = [sorted_gemm_inputs(ref, x, ids, wg, wu, E) for (x, ids, _) in sets]

            def gemms_only(i):
                return grouped_gemms(*gemm_inputs[i % len(gemm_inputs)], wg, wu, w2t)

            moe_row(rows, "fused_moe_bf16", "grouped_mm GEMMs only", SHAPES[si], median_ms(gemms_only, args.iters), None,
                    note="the three CUTLASS grouped GEMMs of the unfused path alone, inputs pre-gathered")
            del gemm_inputs
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            print(f"grouped_mm failed on {SHAPES[si]}: {e}")

        if liger is not None and si in LIGER_SHAPES:
            try:
                def lig(i):
                    x, ids, wt = sets[i % len(sets)]
                    with torch.no_grad():
                        return liger.apply(x, w, w2, ids, wt.to(torch.bfloat16))

                err_l = rel(lig(0))
                moe_row(rows, "fused_moe_bf16", "liger", SHAPES[si], median_ms(lig, args.iters), err_l)
            except Exception as e:  # noqa: BLE001
                print(f"liger failed on {SHAPES[si]}: {e}")
        del aligned
        if mx_skip is None:  # its spaced timings, then its back-to-back window
            mxfp8_moe_rows(kernel, ref, args, si, w, w2, sets, outs, rel, rows, monitor)
        if monitor:  # after every spaced timing of the shape (spaced_ms)
            ours_row["sustained"] = monitor.sustained(ours, flops)
        del w, w2, sets, outs, truth
        torch.cuda.empty_cache()

    if args.backward_shapes:
        peer = load_prime_rl_peer()
        for bi in indices(args.backward_shapes):
            backward_rows(kernel, ref, peer, args, BACKWARD_SHAPES[bi], rows, monitor)

    if mx_skip is None:
        if hasattr(getattr(kernel, "ops", None), "quantize_mxfp8"):
            quantize_rows(kernel, ref, args, copy, rows)
        else:
            print("quantize_mxfp8 rows skipped: the loaded flash_moe has no native quantize_mxfp8 op")

    ceil = {"copy_GBps": round(copy, 1), "bf16_matmul_TFLOPs": round(mm, 1)}
    if monitor:
        monitor.stop()
        ceil["bf16_matmul_sustained"] = mm_sustained
        print_sustained(mm_sustained, rows)
    result = results_record(resolve_commit(args.commit), ceil, rows)
    (out_dir / "h200.json").write_text(json.dumps(result, indent=1))
    try:
        if any(r["op"] == "fused_moe_bf16" for r in rows):  # a backward-only run (--shapes=) has no forward plot
            plot(rows, copy, mm, out_dir / "h200.png", result["gpu"], ceil.get("bf16_matmul_sustained"))
        if any(r["op"] == "fused_moe_bf16_backward" for r in rows):
            plot_backward(rows, mm, out_dir / "h200_backward.png", result["gpu"])
    except Exception as e:  # noqa: BLE001
        print(f"no plot: {e}")
    print_table(rows)


if __name__ == "__main__":
    main()
