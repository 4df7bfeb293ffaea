"""SonicMoE (sonic-moe 0.1.2.post1, CuTe DSL + QuACK GEMMs) as a peer of our MoE forward and
backward, timed in one process beside our own rows on compare.py's BACKWARD_SHAPES.

Why: our backward's targets (flash_moe/DESIGN.md §8) are set against SonicMoE's backward,
≥ 1.3× / 1.25× / 1.15× at BACKWARD_SHAPES[0..2] (`TARGETS`), in the spaced timing
(compare.median_ms: a GPU spin before each call) and back to back (ClockMonitor.sustained: ~1.5 s
of calls, where the H200 runs at its power limit). Both must hold, so both are measured here,
ours first on each shape (docs/DESIGN.md §9), SonicMoE right after on the same inputs, and both
impls' back-to-back windows after both impls' spaced timings (`Timed`).

Per shape, for ours and for SonicMoE: the training forward (leaves that require grad, so each saves
what its backward needs; routing metadata included: our moe_align, SonicMoE's
general_routing_router_metadata), the backward alone, and forward+backward through autograd
(fresh leaves each call). The backward alone is, for ours, `functional.fused_backward` on the saved
pre-activations (compare.py's row; `autograd_ms` is the same backward through torch.autograd.grad
with retain_graph, to show the engine costs nothing on the GPU); for SonicMoE, torch.autograd.grad
with retain_graph on one forward's graph, i.e. its backward kernels alone, measured directly like
ours rather than as fwd+bwd minus fwd (a difference of two medians, and back to back the two
windows run at different clocks); fwd+bwd minus fwd is recorded beside it (`fwd_bwd_minus_fwd_ms`).

SonicMoE is called as `moe_general_routing_inputs(x, wt.view(-1), token_idx, expert_idx,
w.permute(1, 2, 0), None, w2.permute(1, 2, 0), None, E, stream, SWIGLU, concat_layout=True)`:
w = cat([w1, w3], 1) (E, 2I, K), gate rows first (its concat layout), a leaf of its own (its
layout; ours reads w1 and w3 as they are); slot j = t * top_k + k throughout,
so token_idx = t (int32, ascending, as it requires), expert_idx = ids.view(-1) (int32) and the fp32
scores wt.view(-1), whose gradient is ours: d out / d topk_weights (T, top_k), no softmax behind it.
Its outputs and gradients are checked against the fp32 truth (compare.backward_truth) and ours:
a mis-wired peer shows up as a large error, printed and recorded.

Its first call JIT-compiles and autotunes (QuACK GEMMs, Triton gather-sums). QuACK pre-compiles
the candidate configs in a pool of worker processes; on the H200 image that pool had not answered
after 300 s (the first shape's backward weight GEMM), so the script sets QUACK_COMPILE_WORKERS=1
unless it is set, which makes QuACK compile in-process as it benchmarks (the three shapes in one
process, compiles and autotuning included, took ~490 s on the H200 at 3332917). Run as a script,
it keeps QuACK's and Triton's caches in the checkout's .peer-cache/ (`peer_caches`), so the
shapes can be split over calls to a warm machine, the later calls reusing the first one's
compiles and autotune picks. `faulthandler` dumps every thread's stack if a shape's SonicMoE part
runs past --peer-timeout (the run goes on), an exception there costs only that shape's SonicMoE
rows, and the results file is rewritten after every step, so our rows survive a run cut short.

Writes <out>/h200_sonicmoe.json (compare.py's format: gpu, torch, commit, date, same-run ceilings,
rows; impl `sonicmoe` for the peer; each backward row with its per-kernel times, `kernels_ms`, to
show which of SonicMoE's kernels beat ours) and prints shape | ours bwd | SonicMoE bwd | ratios |
target.
Without an importable sonicmoe it prints why and exits 0.

usage: PYTHONPATH=<sonicmoe site>:<site>/nvidia_cutlass_dsl/python_packages \\
       python3 flash_moe/benchmarks/sonicmoe_peer.py [--out DIR] [--shapes 0,1,2] [--iters 20]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import pathlib
import sys
import tempfile
import time
import traceback

import torch

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # loaded by path (the CPU tests) rather than run as a script
    sys.path.append(str(HERE))
import kernel_package  # noqa: E402

compare = kernel_package.load_file("flash_moe_compare", HERE / "compare.py")

# The backward's targets, SonicMoE bwd ms / ours, by compare.BACKWARD_SHAPES index.
TARGETS = {0: 1.3, 1: 1.25, 2: 1.15}
FWD_NOTE = "training forward through autograd (inputs require grad: saves what the backward needs), routing included"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shapes", default="0,1,2",
                    help="compare.BACKWARD_SHAPES indices (3 and 4 have no target, and SonicMoE's first call "
                         "there ran past 3-4 minutes)")
    ap.add_argument("--commit", default=os.environ.get("PRIME_KERNELS_COMMIT", ""),
                    help="git sha to record (default: git rev-parse HEAD)")
    ap.add_argument("--sustained", action=argparse.BooleanOptionalAction, default=True,
                    help="also time every part back to back with clock and power sampling (default: on)")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="per-kernel device times of each backward (torch.profiler, 5 calls), printed and "
                         "recorded as kernels_ms in the backward rows (default: on)")
    ap.add_argument("--peer-timeout", type=float, default=300,
                    help="seconds of one shape's SonicMoE part after which every thread's stack is dumped")
    return ap.parse_args(argv)


def peer_caches(root):
    """Where QuACK keeps its compiled GEMMs and autotune picks and Triton its kernels: under `root`
    (the checkout's ignored .peer-cache/, which a warm GPU machine keeps from one call to the next),
    so a second call skips the first one's compiling and tuning. Variables already set win."""
    os.environ.setdefault("QUACK_CACHE_DIR", str(root / "quack"))
    os.environ.setdefault("QUACK_CACHE_AUTOTUNING", "1")
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))


def load_sonicmoe():
    """(moe_general_routing_inputs, ActivationType.SWIGLU), or None with the reason printed."""
    os.environ.setdefault("QUACK_COMPILE_WORKERS", "1")  # no pre-compile worker pool: see the module docstring
    try:
        from sonicmoe import moe_general_routing_inputs
        from sonicmoe.enums import ActivationType
    except Exception as e:  # noqa: BLE001  (a missing or broken peer never fails the run)
        print(f"SonicMoE peer skipped: import sonicmoe failed ({type(e).__name__}: {e}). Install it with "
              "shared/tools/sonicmoe-wheels.sh and put its site and site/nvidia_cutlass_dsl/python_packages "
              "on PYTHONPATH.", flush=True)
        return None
    return moe_general_routing_inputs, ActivationType.SWIGLU


def sonic_routing(ids):
    """SonicMoE's general-routing indices for our (T, top_k) ids, slot j = t * top_k + k:
    (token index per slot, ascending as it requires; expert per slot), both int32."""
    T, top_k = ids.shape
    token = torch.arange(T, device=ids.device, dtype=torch.int32).repeat_interleave(top_k)
    return token, ids.reshape(-1).to(torch.int32).contiguous()


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).norm() / b.norm()).item()


PARTS = (("fwd", 6), ("bwd", 12), ("both", 18))  # each part's FLOPs: factor * T * top_k * K * I


class Timed:
    """One impl's timings on one shape: `fns` {part: fn(i)} of fwd, bwd and both; `t` {part:
    (spaced median ms, back-to-back dict or None)}; `rows` {part: its recorded row}. Both impls'
    spaced timings run before either's windows (`windows`; compare.spaced_ms says why)."""

    def __init__(self, name, shape, fwd, bwd, both, args):
        self.name, self.shape = name, shape
        self.fns = {"fwd": fwd, "bwd": bwd, "both": both}
        self.t = {part: (compare.median_ms(fn, args.iters), None) for part, fn in self.fns.items()}
        self.rows = {}
        for part, (ms, _) in self.t.items():
            print(f"{shape} {name} {part}: {ms:.3f} ms", flush=True)

    def windows(self, monitor):
        """The three parts back to back, recorded in `t` and in the rows."""
        T, K, I, E, top_k = self.shape
        for part, factor in PARTS:
            sus = monitor.sustained(self.fns[part], factor * T * top_k * K * I)
            self.t[part] = (self.t[part][0], sus)
            self.rows[part]["sustained"] = sus
            print(f"{self.shape} {self.name} {part}: back to back {sus['ms']:.3f} ms", flush=True)
        self.rows["bwd"]["sustained_fwd_bwd_minus_fwd_ms"] = round(
            self.t["both"][1]["ms"] - self.t["fwd"][1]["ms"], 6)

    def record(self, rows, out_err, grad_errs, peak, bwd_note, out_vs_ours=None, **extra):
        """The three rows of the impl on the shape; `extra` goes on the backward row."""
        t, impl, shape = self.t, self.name, self.shape
        self.rows["fwd"] = compare.moe_row(rows, "fused_moe_bf16", impl, shape, t["fwd"][0], out_err, 6,
                                           note=FWD_NOTE, rel_err_vs_ours=out_vs_ours)
        self.rows["bwd"] = compare.moe_row(rows, "fused_moe_bf16_backward", impl, shape, t["bwd"][0],
                                           max(grad_errs.values()), 12, grad_rel_err_vs_fp32=grad_errs, note=bwd_note,
                                           fwd_bwd_minus_fwd_ms=t["both"][0] - t["fwd"][0], **extra)
        self.rows["both"] = compare.moe_row(rows, "fused_moe_bf16_forward_backward", impl, shape, t["both"][0], None,
                                            18, peak_GB=peak)


def ours_part(kernel, args, shape, inputs, ids, go, out_truth, truth, rows):
    """Our rows on one shape, spaced timings only; (out, grads in GRADS order, Timed)."""
    T, K, I, E, top_k = shape
    F = kernel.functional
    x, w1, w2, w3, wt = inputs
    routing, preact, out = compare.training_forward(kernel, shape, inputs, ids)

    def leaves():
        return [t.detach().requires_grad_() for t in inputs]

    def fwd(i, lv=None):
        x_, w1_, w2_, w3_, wt_ = leaves() if lv is None else lv
        return kernel.moe(x_, w1_, w2_, w3_, ids, wt_)

    bpc = kernel.preferred_bpc(T, K, I, E, top_k, backward=True)  # what `moe` runs (bpc=None), recorded

    def bwd(i):
        return F.fused_backward(go, x, w1, w2, w3, wt, routing, preact)

    def both(i):
        fwd(i).backward(go)

    lv = leaves()
    graph = fwd(0, lv)

    def bwd_autograd(i):
        return torch.autograd.grad(graph, lv, go, retain_graph=True)

    grads = bwd(0)
    timed = Timed("prime-kernels", shape, fwd, bwd, both, args)
    autograd_ms = compare.median_ms(bwd_autograd, args.iters)
    print(f"{shape} prime-kernels bwd through autograd.grad(retain_graph): {autograd_ms:.3f} ms", flush=True)
    timed.record(rows, rel(out, out_truth), compare.grad_errors(grads, truth), compare.peak_gb(both),
                 "functional.fused_backward on the saved pre-activations (compare.py's row)",
                 bpc=bpc, autograd_ms=autograd_ms, kernels_ms=compare.profile_kernels(bwd) if args.profile else None)
    return out, grads, timed


def sonic_part(sonic, args, shape, inputs, ids, go, out_truth, truth, ours_out, ours_grads, rows):
    """SonicMoE's rows on one shape, spaced timings only; its Timed."""
    moe_general_routing_inputs, swiglu = sonic
    T, K, I, E, top_k = shape
    x, w1, w2, w3, wt = inputs
    token, expert = sonic_routing(ids)
    stream = torch.cuda.current_stream().cuda_stream
    peer_inputs = (x, torch.cat([w1, w3], 1), w2, wt)

    def leaves():
        return [t.detach().requires_grad_() for t in peer_inputs]

    def fwd(i, lv=None):
        x_, w_, w2_, wt_ = leaves() if lv is None else lv
        out, _ = moe_general_routing_inputs(x_, wt_.view(-1), token, expert, w_.permute(1, 2, 0), None,
                                            w2_.permute(1, 2, 0), None, E, stream, swiglu,
                                            is_inference_mode_enabled=False, concat_layout=True)
        return out

    def both(i):
        fwd(i).backward(go)

    t0 = time.time()
    print(f"{shape} SonicMoE first forward+backward (JIT compiles, QuACK and Triton autotune) ...", flush=True)
    both(0)
    torch.cuda.synchronize()
    print(f"{shape} SonicMoE first call done in {time.time() - t0:.0f} s", flush=True)

    lv = leaves()
    graph = fwd(0, lv)

    def bwd(i):
        return torch.autograd.grad(graph, lv, go, retain_graph=True)

    gx, gw, gw2, gwt = bwd(0)
    grads = (gx, gw[:, :I], gw2, gw[:, I:], gwt)  # GRADS order: x, w1, w2, w3, topk_weights (T, top_k)
    errs = compare.grad_errors(grads, truth)
    vs_ours = compare.grad_errors(grads, [g.float() for g in ours_grads])
    out_err, out_vs_ours = rel(graph, out_truth), rel(graph, ours_out)
    print(f"{shape} SonicMoE sanity: out rel_err vs fp32 {out_err:.2e}, vs ours {out_vs_ours:.2e}; "
          f"grads vs fp32 {errs}; vs ours {vs_ours}", flush=True)
    if max(out_err, *errs.values()) > 2e-2:
        print(f"{shape} WARNING: SonicMoE is far from the fp32 truth: check how it is called", flush=True)

    timed = Timed("sonicmoe", shape, fwd, bwd, both, args)
    timed.record(rows, out_err, errs, compare.peak_gb(both),
                 "torch.autograd.grad(retain_graph=True) on one forward's graph: its backward kernels alone",
                 out_vs_ours=out_vs_ours, grad_rel_err_vs_ours=vs_ours,
                 kernels_ms=compare.profile_kernels(bwd) if args.profile else None)
    return timed


def _b2b_bwd_ms(t):
    return t["bwd"][1]["ms"] if t and t["bwd"][1] else None


def _fmt(v, fmt):
    return "-" if v is None else format(v, fmt)


def print_table(summary):
    """Per shape: our and SonicMoE's backward back to back (ms), SonicMoE / ours spaced and back to
    back, the target, and whether both ratios meet it ("-": a timing is missing)."""
    print(f"\n{'shape':28s} {'ours bwd b2b':>12s} {'Sonic bwd b2b':>13s} {'ratio spaced':>12s} "
          f"{'ratio b2b':>9s} {'target':>6s}  met")
    for shape, target, ours, sonic in summary:
        ours_b2b, sonic_b2b = _b2b_bwd_ms(ours), _b2b_bwd_ms(sonic)
        spaced = sonic["bwd"][0] / ours["bwd"][0] if sonic else None
        back = sonic_b2b / ours_b2b if sonic_b2b and ours_b2b else None
        met = "-" if None in (spaced, back, target) else "yes" if min(spaced, back) >= target else "no"
        print(f"{str(shape):28s} {_fmt(ours_b2b, '12.3f'):>12s} {_fmt(sonic_b2b, '13.3f'):>13s} "
              f"{_fmt(spaced, '12.2f'):>12s} {_fmt(back, '9.2f'):>9s} {_fmt(target, '6.2f'):>6s}  {met}")


def main(argv=None):
    peer_caches(HERE.parents[1] / ".peer-cache")
    args = parse_args(argv)
    sonic = load_sonicmoe()
    if sonic is None:
        return 0
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "h200_sonicmoe.json"
    kernel = compare.load_kernel()
    ref = kernel_package.load_reference(compare.MEMBER)
    commit = compare.resolve_commit(args.commit)

    monitor = compare.ClockMonitor(os.path.join(tempfile.mkdtemp(), "clocks.csv")) if args.sustained else None
    copy, mm, mm_sustained = compare.ceilings(args.iters, monitor)
    ceil = {"copy_GBps": round(copy, 1), "bf16_matmul_TFLOPs": round(mm, 1)}
    if monitor:
        ceil["bf16_matmul_sustained"] = mm_sustained
    print(f"ceilings: copy {copy:.0f} GB/s, bf16 matmul {mm:.0f} TFLOP/s"
          + (f" ({mm_sustained['tflops']:.0f} back to back)" if mm_sustained else ""), flush=True)
    rows, summary = [], []

    def save():
        path.write_text(json.dumps(compare.results_record(commit, ceil, rows), indent=1))

    for si in compare.indices(args.shapes):
        shape = compare.BACKWARD_SHAPES[si]
        _, inputs, ids, go = compare.backward_inputs(shape)
        out_truth, truth = compare.backward_truth(ref, inputs, ids, go)
        ours_out, ours_grads, ours = ours_part(kernel, args, shape, inputs, ids, go, out_truth, truth, rows)
        save()
        sonic_timed = None
        faulthandler.dump_traceback_later(args.peer_timeout, exit=False)
        try:
            sonic_timed = sonic_part(sonic, args, shape, inputs, ids, go, out_truth, truth, ours_out, ours_grads,
                                     rows)
            save()
            if monitor:  # both impls' windows after both impls' spaced timings
                ours.windows(monitor)
                sonic_timed.windows(monitor)
        except Exception as e:  # noqa: BLE001  (our rows are kept; the next shape still runs)
            print(f"{shape} SonicMoE failed: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        finally:
            faulthandler.cancel_dump_traceback_later()
        if monitor and ours.t["fwd"][1] is None:  # SonicMoE failed before the windows: ours still get theirs
            ours.windows(monitor)
        summary.append((shape, TARGETS.get(si), ours.t, sonic_timed.t if sonic_timed else None))
        save()
        del inputs, ids, go, out_truth, truth, ours_out, ours_grads
        torch.cuda.empty_cache()

    if monitor:
        monitor.stop()  # fills in each back-to-back window's clock and power
        compare.print_sustained(mm_sustained, rows)
    save()
    compare.print_table(rows)
    print_table(summary)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
