"""Side-by-side benchmark of fused_moe_bf16 (DESIGN §9), all in one run.

Measures the ceilings (device-to-device copy, 8192^3 bf16 matmul), our op (moe_align INCLUDED
in the prime-kernels row; the op alone is printed too), the unfused path (sort, gather, three
torch._grouped_mm, SwiGLU, weight, index_add) and Liger's LigerFusedMoEFunction (autotune off)
on the DESIGN §9 shapes. CUDA events, median of >= 20 timed calls after warm-up; x/routing
rotate over several copies (the expert weights alone exceed the 50 MB L2 in every shape).
Writes <out>/h200.json (DESIGN §9 schema) and a PNG beside it.

usage: python3 flash_moe/benchmarks/compare.py [--out DIR] [--iters 20] [--shapes 0,1,2,3,4] [--no-liger]
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

os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")

import torch  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
MEMBER = HERE.parent
SHAPES = [(8192, 2048, 768, 64, 8), (16384, 2048, 768, 128, 8), (8192, 4096, 1536, 128, 8),
          (8192, 7168, 2048, 256, 8), (1024, 2048, 768, 128, 8)]


def load_kernel():
    sys.path.insert(0, str(MEMBER.parent / "torch-ext"))
    import prime_kernels

    return prime_kernels.load("flash_moe")


def load_reference():
    import importlib.util

    spec = importlib.util.spec_from_file_location("flash_moe_reference", MEMBER / "torch-ext/flash_moe/reference.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def time_ms(fn, iters, warmup=3):
    for _ in range(warmup):
        fn(0)
    torch.cuda.synchronize()
    ts = []
    for i in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i + 1)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def ceilings(iters):
    n = 1 << 30  # 1 GiB
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda i: dst.copy_(src), iters)
    copy = 2 * n / ms / 1e6
    del src, dst
    a = torch.randn(8192, 8192, device="cuda").bfloat16()
    b = torch.randn(8192, 8192, device="cuda").bfloat16()
    ms = time_ms(lambda i: a @ b, iters)
    mm = 2 * 8192 ** 3 / ms / 1e9
    return copy, mm


def unfused(x, wg, wu, w2t, ids, wt, E):
    """sort, gather, three grouped GEMMs, SwiGLU, weight, index_add (all bf16, no host sync)."""
    M, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // top_k
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[tok]
    g = torch._grouped_mm(xs, wg, offs=offs)
    u = torch._grouped_mm(xs, wu, offs=offs)
    h = torch.nn.functional.silu(g) * u
    y = torch._grouped_mm(h, w2t, offs=offs)
    y = y * wt.reshape(-1)[order].to(y.dtype)[:, None]
    out = torch.zeros_like(x)
    out.index_add_(0, tok, y)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shapes", default="0,1,2,3,4")
    ap.add_argument("--no-liger", action="store_true")
    ap.add_argument("--rotate", type=int, default=3)
    ap.add_argument("--commit", default=os.environ.get("PRIME_KERNELS_COMMIT", ""), help="git sha to record (default: git rev-parse HEAD)")
    ap.add_argument("--profile", action="store_true", help="print per-kernel device times of our op")
    args = ap.parse_args()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    kernel = load_kernel()
    ref = load_reference()
    liger = None
    if not args.no_liger:
        try:
            from liger_kernel.ops.fused_moe import LigerFusedMoEFunction as liger
        except Exception as e:  # noqa: BLE001
            print(f"liger unavailable: {e}")

    copy, mm = ceilings(args.iters)
    print(f"ceilings: copy {copy:.0f} GB/s, bf16 matmul {mm:.0f} TFLOP/s")
    rows = []
    table = []
    for si in [int(s) for s in args.shapes.split(",")]:
        T, K, I, E, top_k = SHAPES[si]
        shape = {"tokens": T, "dim": K, "hidden": I, "experts": E, "top_k": top_k}
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

        def ours(i):
            x, ids, wt = sets[i % len(sets)]
            s, e, n = kernel.moe_align(ids, E)
            kernel.fused_moe_bf16(x, w, w2, s, e, n, wt, outs[i % len(sets)], top_k)

        aligned = [kernel.moe_align(ids, E) for (_, ids, _) in sets]

        def ours_op(i):
            x, ids, wt = sets[i % len(sets)]
            s, e, n = aligned[i % len(sets)]
            kernel.fused_moe_bf16(x, w, w2, s, e, n, wt, outs[i % len(sets)], top_k)

        def ours_op3(i):
            x, ids, wt = sets[i % len(sets)]
            s, e, n = aligned[i % len(sets)]
            kernel.fused_moe_bf16(x, w, w2, s, e, n, wt, outs[i % len(sets)], top_k, stages=3)

        ours(0)
        err = rel(outs[0])
        ms = time_ms(ours, args.iters)
        ms_op = time_ms(ours_op, args.iters)
        ms_op3 = time_ms(ours_op3, args.iters)
        print(f"{SHAPES[si]} op alone with stages=3: {ms_op3:.3f} ms", flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(5):
                    ours(i)
                torch.cuda.synchronize()
            per = {}
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    m = re.search(r"(\w+_kernel(<[^>]*>)?)", ev.name)
                    name = m.group(1) if m else ev.name[:60]
                    per[name] = per.get(name, 0.0) + ev.device_time / 5 / 1000
            for name, t in sorted(per.items(), key=lambda kv: -kv[1]):
                print(f"    kernel {t:8.4f} ms  {name}")
        rows.append({"op": "fused_moe_bf16", "impl": "prime-kernels", "shape": shape, "ms": round(ms, 4),
                     "tflops": round(flops / ms / 1e9, 1), "rel_err_vs_fp32": round(err, 6)})
        table.append((shape, "prime-kernels", ms, flops / ms / 1e9, err))
        print(f"{SHAPES[si]} prime-kernels {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s; op alone {ms_op:.3f} ms "
              f"{flops / ms_op / 1e9:.0f} TFLOP/s) rel_err {err:.2e}", flush=True)

        try:
            wg = w[:, :I].transpose(1, 2)
            wu = w[:, I:].transpose(1, 2)
            w2t = w2.transpose(1, 2)

            def peer(i):
                x, ids, wt = sets[i % len(sets)]
                return unfused(x, wg, wu, w2t, ids, wt, E)

            err_u = rel(peer(0))
            ms_u = time_ms(peer, args.iters)
            rows.append({"op": "fused_moe_bf16", "impl": "grouped_mm", "shape": shape, "ms": round(ms_u, 4),
                         "tflops": round(flops / ms_u / 1e9, 1), "rel_err_vs_fp32": round(err_u, 6)})
            table.append((shape, "grouped_mm", ms_u, flops / ms_u / 1e9, err_u))
            print(f"{SHAPES[si]} grouped_mm {ms_u:.3f} ms ({flops / ms_u / 1e9:.0f} TFLOP/s) rel_err {err_u:.2e}",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"grouped_mm failed on {SHAPES[si]}: {e}")

        if liger is not None and si in (0, 1, 4):  # the rows the issue lists Liger for
            try:
                def lig(i):
                    x, ids, wt = sets[i % len(sets)]
                    with torch.no_grad():
                        return liger.apply(x, w, w2, ids, wt.to(torch.bfloat16))

                err_l = rel(lig(0))
                ms_l = time_ms(lig, args.iters)
                rows.append({"op": "fused_moe_bf16", "impl": "liger", "shape": shape, "ms": round(ms_l, 4),
                             "tflops": round(flops / ms_l / 1e9, 1), "rel_err_vs_fp32": round(err_l, 6)})
                table.append((shape, "liger", ms_l, flops / ms_l / 1e9, err_l))
                print(f"{SHAPES[si]} liger {ms_l:.3f} ms ({flops / ms_l / 1e9:.0f} TFLOP/s) rel_err {err_l:.2e}",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"liger failed on {SHAPES[si]}: {e}")
        del w, w2, sets, outs, truth, aligned
        torch.cuda.empty_cache()

    commit = args.commit
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=MEMBER, capture_output=True,
                                    text=True).stdout.strip()
        except Exception:  # noqa: BLE001
            commit = ""
        if not re.fullmatch(r"[0-9a-f]{40}", commit or ""):
            commit = ""
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit or "unknown",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "ceilings": {"copy_GBps": round(copy, 1), "bf16_matmul_TFLOPs": round(mm, 1)}, "rows": rows}
    (out_dir / "h200.json").write_text(json.dumps(result, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = sorted({f"{r['shape']['tokens']},{r['shape']['dim']},{r['shape']['hidden']},{r['shape']['experts']}"
                         for r in rows}, key=lambda s: [int(v) for v in s.split(",")])
        impls = ["prime-kernels", "grouped_mm", "liger"]
        fig, ax = plt.subplots(figsize=(10, 4.5))
        for j, impl in enumerate(impls):
            vals = []
            for lab in labels:
                v = [r["tflops"] for r in rows if r["impl"] == impl and
                     f"{r['shape']['tokens']},{r['shape']['dim']},{r['shape']['hidden']},{r['shape']['experts']}" == lab]
                vals.append(v[0] if v else 0)
            ax.bar([i + 0.27 * j for i in range(len(labels))], vals, width=0.27, label=impl)
        ax.axhline(mm, color="k", ls="--", lw=1, label=f"8192^3 bf16 matmul {mm:.0f}")
        ax.set_xticks([i + 0.27 for i in range(len(labels))], labels, fontsize=8)
        ax.set_ylabel("TFLOP/s (6*T*k*K*I)")
        ax.set_title(f"fused_moe_bf16 forward, {torch.cuda.get_device_name()}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "h200.png", dpi=110)
    except Exception as e:  # noqa: BLE001
        print(f"no plot: {e}")
    print("\nshape                          impl            ms      TFLOP/s  rel_err")
    for shape, impl, ms, tf, err in table:
        print(f"{str(tuple(shape.values())):30s} {impl:14s} {ms:7.3f} {tf:8.1f}  {err:.2e}")


if __name__ == "__main__":
    main()
