# generated from common/bench_timing.py: edit there and run scripts/sync_common.py
"""Timing of the side-by-side benchmarks (docs/DESIGN.md §9): the median device time of a call
over rotated inputs, and the ceilings (device-to-device copy, an 8192^3 bf16 matmul) that every
run measures beside its rows."""

from __future__ import annotations

import torch


def median_ms(fn, reps: int, *, warmup: int = 3) -> float:
    """Median device time in ms of fn(i) over `reps` timed calls, i = warmup, ..., warmup + reps - 1,
    after the warm-up calls i = 0, ..., warmup - 1 (fn picks its inputs by i, rotating over sets
    larger than L2 together, so L2 does not serve them). CUDA events; each timed call follows a
    ~1 ms GPU spin (torch.cuda._sleep), so the host has enqueued it before the start event fires:
    the events time the GPU work, not Python's dispatch gap."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(warmup, warmup + reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)
        a.record()
        fn(i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def ceilings(reps: int = 20, monitor=None):
    """(copy GB/s counting read + write, 8192^3 bf16 matmul TFLOP/s, the matmul back to back):
    1 GiB copies and the matmuls each rotate over two input sets. The third item is
    monitor.sustained(matmul, flops) (a back-to-back timing, flash_moe's ClockMonitor), None
    without a monitor."""
    n = 1 << 30
    src = [torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda") for _ in range(2)]
    dst = [torch.empty_like(s) for s in src]
    copy = 2 * n / median_ms(lambda i: dst[i % 2].copy_(src[i % 2]), reps) / 1e6
    del src, dst
    m = 8192
    a = [torch.randn(m, m, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    b = [torch.randn(m, m, device="cuda", dtype=torch.bfloat16) for _ in range(2)]

    def matmul(i):
        return a[i % 2] @ b[i % 2]

    mm = 2 * m**3 / median_ms(matmul, reps) / 1e9
    sustained = monitor.sustained(matmul, 2 * m**3) if monitor else None
    return copy, mm, sustained
