"""CPU tests of the side-by-side benchmark (benchmarks/compare.py): its peers compute what their
rows claim, so a peer's time is the time of that computation; its kernel labels and its
back-to-back rows' clock fields are what they say. And of benchmarks/sonicmoe_peer.py, the parts
that need no GPU: a missing SonicMoE never fails a run, its shapes, targets and routing inputs."""

import os
import pathlib
import sys
import types

import kernel_package
import pytest
import reference_kernel
import torch

MEMBER = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compare():
    return kernel_package.load_file("flash_moe_compare", MEMBER / "benchmarks" / "compare.py")


@pytest.fixture(scope="module")
def sonicmoe_peer():
    return kernel_package.load_file("flash_moe_sonicmoe_peer", MEMBER / "benchmarks" / "sonicmoe_peer.py")


class FakeTiming:
    """compare.median_ms and a ClockMonitor, faked: each spaced timing or back-to-back window runs its
    callable once and is logged in `events`; a window takes 2 ms at the SM clock nvidia-smi did not
    report, a spaced timing 1 ms at 1980 MHz."""

    def __init__(self):
        self.events = []

    def median_ms(self, fn, reps, **kwargs):
        fn(0)
        self.events.append("spaced")
        return 1.0

    def spaced(self, fn, reps):
        return self.median_ms(fn, reps), {"sm_mhz": 1980}

    def sustained(self, fn, flops, secs=1.5):
        fn(0)
        self.events.append("window")
        return {"ms": 2.0, "tflops": flops / 2e9}


def _problem(T=64, K=64, I=32, E=8, top_k=3):
    g = torch.Generator().manual_seed(T * 7 + E)
    x = torch.randn(T, K, generator=g).bfloat16()
    w = (torch.randn(E, 2 * I, K, generator=g) / K ** 0.5).bfloat16()
    w2 = (torch.randn(E, K, I, generator=g) / I ** 0.5).bfloat16()
    ids = torch.rand(T, E, generator=g).topk(top_k, dim=1).indices.to(torch.int32)
    wt = torch.softmax(torch.randn(T, top_k, generator=g), -1)
    return x, w, w2, ids, wt, E, I


def test_unfused_peer_is_the_moe(reference):
    """The `grouped_mm` row's peer (reference.grouped_mm_path) is the MoE, -1 ids dropped."""
    x, w, w2, ids, wt, E, I = _problem()
    ids[::5, 0] = -1
    out = reference.grouped_mm_path(x, w, w2, ids, wt)
    truth = reference.moe_fp32(x, w, w2, ids, wt)
    rel = ((out.float() - truth).norm() / truth.norm()).item()
    assert rel < 2e-2, rel  # bf16 GEMMs, SwiGLU and sum in bf16


def test_gemms_only_row_times_the_unfused_paths_gemms(compare, reference):
    """The `grouped_mm GEMMs only` row's inputs and GEMMs are exactly the unfused path's: weighting
    and summing its down-GEMM output reproduces the unfused output bit for bit."""
    x, w, w2, ids, wt, E, I = _problem()
    wg, wu, w2t = w[:, :I].transpose(1, 2), w[:, I:].transpose(1, 2), w2.transpose(1, 2)
    xs, h, offs = compare.sorted_gemm_inputs(reference, x, ids, wg, wu, E)
    g, u, y = compare.grouped_gemms(xs, h, offs, wg, wu, w2t)
    assert torch.equal(torch.nn.functional.silu(g) * u, h)
    top_k = ids.shape[1]
    order = torch.argsort(ids.reshape(-1), stable=True)
    y = y * wt.reshape(-1)[order].to(y.dtype)[:, None]
    out = torch.zeros_like(x)
    out.index_add_(0, order // top_k, y)
    assert torch.equal(out, reference.grouped_mm_path(x, w, w2, ids, wt))


def test_kernel_labels_name_the_gemm_roles(compare):
    mangled = ("void flash_moe::gemm::moe_gemm_kernel<(flash_moe::gemm::Weights){w}, (flash_moe::gemm::Kind){k}, 4>"
               "(CUtensorMap_st, CUtensorMap_st, CUtensorMap_st, flash_moe::gemm::GemmParams)")
    assert compare.kernel_label(mangled.format(w=0, k=0)) == "gemm bf16 gate/up"
    assert compare.kernel_label(mangled.format(w=1, k=1)) == "gemm mxfp8 down"
    wgrad = "void flash_moe::wgrad::moe_wgrad_kernel<(flash_moe::wgrad::Kind){k}, 4>(flash_moe::wgrad::Maps, ...)"
    assert compare.kernel_label(wgrad.format(k=1)) == "gemm bf16 gate/up wgrad"
    assert compare.kernel_label(mangled.format(w=2, k=0)) == "gemm mxfp8-f16 gate/up"
    assert compare.kernel_label(mangled.format(w=0, k=2)) == "gemm bf16 down dgrad"
    assert compare.kernel_label(mangled.format(w=0, k=3)) == "gemm bf16 gate/up dgrad"
    assert compare.kernel_label(mangled.format(w=7, k=0)) == "gemm weights7 gate/up"  # a new one: no crash
    assert compare.kernel_label("void flash_moe::(anonymous namespace)::reduce_kernel(int const*)") == "reduce_kernel"


def test_per_kernel_times_keep_repeated_names_apart_by_launch_order(compare):
    # Two calls of: gemm A (10 µs), gemm A again (30 µs), a reduce (4 µs); our GEMM labels stay whole.
    ours = "void flash_moe::gemm::moe_gemm_kernel<(flash_moe::gemm::Weights)0, (flash_moe::gemm::Kind)2, (int)4, (bool)0>"
    launches = [("kernel_cutlass_kernel", 10.0), ("kernel_cutlass_kernel", 30.0), ("reduce_kernel", 4.0),
                (ours, 8.0)] * 2
    per = compare.per_kernel_ms(launches, calls=2)
    assert per == {"kernel_cutlass_kernel #2": 0.03, "kernel_cutlass_kernel #1": 0.01, "gemm bf16 down dgrad": 0.008,
                   "reduce_kernel": 0.004}
    assert list(per) == ["kernel_cutlass_kernel #2", "kernel_cutlass_kernel #1", "gemm bf16 down dgrad", "reduce_kernel"]


def test_clock_samples_give_each_window_its_medians(compare):
    """The back-to-back rows' clock, power and power-cap fields: nvidia-smi's csv lines parsed
    (an error line and a line cut at the stop skipped), and only the samples inside a window
    counted."""
    lines = ["2026/11/30 03:40:01.000, 1500, 690.5, Active",
             "2026/11/30 03:40:01.020, 1300, 700.0, Active",
             "2026/11/30 03:40:01.040, 1400, 680.0, Not Active",
             "Field \"clocks_event_reasons.sw_power_cap\" is not a valid field to query.",
             "2026/11/30 03:40:05.000, 1980, 80.0, Not Active",
             "2026/11/30 03:40:05.0"]
    samples = compare.parse_clock_samples(lines)
    assert [s[1] for s in samples] == [1500, 1300, 1400, 1980]
    t0 = samples[0][0]
    stats = compare.window_stats(samples, t0, t0 + 0.05)
    assert stats == {"sm_mhz": 1400, "power_w": 690.5, "power_capped": 0.67}
    assert compare.window_stats(samples, t0 + 1, t0 + 2) == {}


def test_backward_gemms_row_computes_the_four_gemms(compare):
    """`backward_gemms` on rows grouped by expert (offsets multiples of 128, as moe_align's) is,
    per expert, g W2, dA|dB W, dA|dBᵀ x and gᵀ h."""
    g = torch.Generator().manual_seed(5)
    E, K, I, rows = 3, 64, 32, (128, 0, 256)
    offs = torch.tensor(rows).cumsum(0).to(torch.int32)
    L = sum(rows)
    xs, gs = (torch.randn(L, K, generator=g).bfloat16() for _ in range(2))
    h, dab = torch.randn(L, I, generator=g).bfloat16(), torch.randn(L, 2 * I, generator=g).bfloat16()
    w, w2 = torch.randn(E, 2 * I, K, generator=g).bfloat16(), torch.randn(E, K, I, generator=g).bfloat16()
    dh, dx, dw, dw2 = compare.backward_gemms(xs, gs, h, dab, offs, w, w2)
    start = 0
    for e, n in enumerate(rows):
        r = slice(start, start + n)
        start += n
        for got, want in ((dh[r], gs[r].float() @ w2[e].float()), (dx[r], dab[r].float() @ w[e].float()),
                          (dw[e], dab[r].float().t() @ xs[r].float()), (dw2[e], gs[r].float().t() @ h[r].float())):
            scale = want.abs().max().item() if want.numel() else 1.0  # an empty expert: its wgrads are 0
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * max(1.0, scale))


def test_shape_indices_allow_none(compare):
    """--shapes '' runs no forward rows (a backward-only run), as --backward-shapes '' runs no backward."""
    assert compare.indices("0,1, 4") == [0, 1, 4]
    assert compare.indices("") == []


def test_sonicmoe_peer_without_sonicmoe_exits_cleanly(sonicmoe_peer, monkeypatch, tmp_path, capsys):
    """No importable sonicmoe: main says why and returns 0 before touching the GPU or writing."""
    monkeypatch.setitem(sys.modules, "sonicmoe", None)  # `import sonicmoe` raises ImportError
    assert sonicmoe_peer.main(["--out", str(tmp_path / "out")]) == 0
    assert "SonicMoE peer skipped" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_sonicmoe_peer_shapes_targets_and_routing(sonicmoe_peer, compare):
    """By default the three backward shapes with a SonicMoE target, each with its target; SonicMoE's routing
    inputs name, for slot t * top_k + k (how our (T, top_k) topk_weights flatten), token t
    (ascending, as it requires) and expert ids[t, k], both int32."""
    shapes = [int(s) for s in sonicmoe_peer.parse_args([]).shapes.split(",")]
    assert [compare.BACKWARD_SHAPES[i] for i in shapes] == [
        (8192, 2048, 768, 64, 8), (16384, 2048, 768, 128, 8), (32768, 4096, 1024, 64, 4)]
    assert sonicmoe_peer.TARGETS == {0: 1.3, 1: 1.25, 2: 1.15}
    T, top_k = 6, 3
    ids = torch.rand(T, 16, generator=torch.Generator().manual_seed(1)).topk(top_k, dim=1).indices.to(torch.int32)
    token, expert = sonicmoe_peer.sonic_routing(ids)
    assert token.dtype == expert.dtype == torch.int32
    assert token.tolist() == [j // top_k for j in range(T * top_k)]
    assert expert.tolist() == [ids[j // top_k, j % top_k].item() for j in range(T * top_k)]


def test_sonicmoe_peer_table_needs_both_ratios(sonicmoe_peer, capsys):
    """A target is met only when SonicMoE / ours meets it spaced and back to back; a missing peer
    or back-to-back timing prints "-", not a verdict."""
    def timings(bwd_ms, b2b_ms):
        return {"bwd": (bwd_ms, {"ms": b2b_ms} if b2b_ms else None)}

    shape = (8192, 2048, 768, 64, 8)
    sonicmoe_peer.print_table([(shape, 1.3, timings(2.0, 2.5), timings(2.8, 3.3)),   # 1.40, 1.32
                               (shape, 1.3, timings(2.0, 2.5), timings(2.8, 3.0)),   # 1.40, 1.20
                               (shape, 1.3, timings(2.0, 2.5), None),
                               (shape, 1.3, timings(2.0, None), timings(2.8, None))])
    verdicts = [line.split()[-1] for line in capsys.readouterr().out.strip().splitlines()[1:]]
    assert verdicts == ["yes", "no", "-", "-"]


def test_sonicmoe_peer_records_spaced_rows_then_adds_their_windows(sonicmoe_peer, monkeypatch):
    """sonicmoe_peer.Timed: the three spaced timings at construction, the rows recorded from them,
    and `windows` (run after both impls' spaced timings) adds each part's back-to-back timing to its
    row and the backward row's back-to-back fwd+bwd minus fwd."""
    compare = sonicmoe_peer.compare
    calls = []
    monkeypatch.setattr(compare, "median_ms", lambda fn, reps: calls.append(("spaced", fn(0))) or 3.0)

    class Monitor:
        def sustained(self, fn, flops):
            calls.append(("window", fn(0)))
            return {"ms": {"fwd": 1.0, "bwd": 2.0, "both": 3.5}[fn(0)], "tflops": 1.0}

    shape = (8, 64, 64, 4, 2)
    timed = sonicmoe_peer.Timed("sonicmoe", shape, lambda i: "fwd", lambda i: "bwd", lambda i: "both",
                                types.SimpleNamespace(iters=2))
    rows = []
    timed.record(rows, 1e-3, {"x": 2e-3}, 0.5, "note")
    assert [r["op"] for r in rows] == ["fused_moe_bf16", "fused_moe_bf16_backward", "fused_moe_bf16_forward_backward"]
    assert calls == [("spaced", "fwd"), ("spaced", "bwd"), ("spaced", "both")] and "sustained" not in rows[1]
    timed.windows(Monitor())
    assert calls[3:] == [("window", "fwd"), ("window", "bwd"), ("window", "both")]
    assert [r["sustained"]["ms"] for r in rows] == [1.0, 2.0, 3.5] and timed.t["bwd"] == (3.0, rows[1]["sustained"])
    assert rows[1]["fwd_bwd_minus_fwd_ms"] == 0.0 and rows[1]["sustained_fwd_bwd_minus_fwd_ms"] == 2.5


def test_sonicmoe_peer_caches_under_the_given_root_unless_set(sonicmoe_peer, monkeypatch, tmp_path):
    monkeypatch.delenv("QUACK_CACHE_DIR", raising=False)
    monkeypatch.delenv("QUACK_CACHE_AUTOTUNING", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    sonicmoe_peer.peer_caches(tmp_path)
    assert os.environ["QUACK_CACHE_DIR"] == str(tmp_path / "quack")
    assert os.environ["QUACK_CACHE_AUTOTUNING"] == "1"
    assert os.environ["TRITON_CACHE_DIR"] == "/elsewhere"


def test_profile_backward_refuses_bad_arguments(compare, capsys):
    """benchmarks/profile_backward.py (for ncu) checks its arguments before it loads the kernel."""
    prof = kernel_package.load_file("flash_moe_profile_backward", MEMBER / "benchmarks" / "profile_backward.py")
    bad = ((["--shape", "5"], "--shape must be in [0, 5), got 5"), (["--calls", "0"], "--calls must be >= 1"))
    for argv, rule in bad:
        with pytest.raises(SystemExit):
            prof.main(argv)
        assert rule in capsys.readouterr().err


def test_backward_op_calls_each_op_with_its_arguments_in_order(compare, reference):
    """compare.backward_op (the backward rows' and ab_builds.py's op calls), the references standing
    in for the kernels: the dgrad then the wgrad it builds give the very gradients of the
    `fused_backward` it builds (w1 and w3 apart, as a swap would show), and it refuses an unknown op."""
    T, K, I, E, top_k = 40, 64, 64, 8, 2
    g = torch.Generator().manual_seed(11)
    x, go = (torch.randn(T, K, generator=g).bfloat16() for _ in range(2))
    w1, w3 = ((torch.randn(E, I, K, generator=g) / K ** 0.5).bfloat16() for _ in range(2))
    w2 = (torch.randn(E, K, I, generator=g) / I ** 0.5).bfloat16()
    wt, ids = torch.softmax(torch.randn(T, E, generator=g), -1).topk(top_k, -1)
    routing = (*reference.moe_align(ids.to(torch.int32), E), top_k)
    preact = torch.empty(2 * routing[0].numel() * I, dtype=torch.bfloat16)
    reference.fused_moe_bf16(x, torch.cat([w1, w3], 1), w2, *routing[:3], wt, torch.empty_like(x), top_k,
                             preact=preact)
    kernel = reference_kernel.load()
    inputs = (x, w1, w2, w3, wt)
    grads = compare.backward_op(kernel, "backward", 1, go, inputs, routing, preact)(0)
    gx, dab, sh, score = compare.backward_op(kernel, "dgrad", 1, go, inputs, routing, preact)(0)
    gw1, gw3, gw2 = compare.backward_op(kernel, "wgrad", 1, go, inputs, routing, preact, (dab, sh))(0)
    assert not torch.equal(gw1, gw3)
    assert all(torch.equal(a, b) for a, b in zip((gx, gw1, gw2, gw3, score), grads))
    with pytest.raises(ValueError, match="op must be dgrad, wgrad or backward, got 'fwd'"):
        compare.backward_op(kernel, "fwd", 1, go, inputs, routing, preact)


def test_backward_rows_time_every_spaced_row_before_any_back_to_back_window(compare, reference,
                                                                           monkeypatch):
    """compare.backward_rows on the CPU, the references standing in for the kernels and the timing
    faked (each timing runs its callable once): it records its five rows with their fields, and
    every spaced timing of the shape comes before its first back-to-back window, which leaves the
    GPU at its power limit for a while after."""
    timing = FakeTiming()
    events = timing.events
    monkeypatch.setattr(compare, "median_ms", timing.median_ms)
    monkeypatch.setattr(compare, "peak_gb", lambda fn: fn(0) or 0.5)
    on_gpu = compare.backward_inputs
    monkeypatch.setattr(compare, "backward_inputs", lambda shape: on_gpu(shape, device="cpu"))
    kernel = types.SimpleNamespace(**vars(reference_kernel.load()) | {"preferred_bpc": lambda *shape, backward: 2})
    args = types.SimpleNamespace(iters=2, profile=False, mxfp8=False)
    rows = []
    compare.backward_rows(kernel, reference, compare.load_prime_rl_peer(), args, (48, 64, 64, 8, 2), rows, timing)

    assert events.count("window") == 8  # dgrad, wgrad, the backward 1 2 2 1, prime-rl's, forward+backward
    assert "spaced" not in events[events.index("window"):]
    assert [(r["op"], r["impl"]) for r in rows] == [
        ("fused_moe_bf16_backward", "prime-kernels"), ("fused_moe_bf16_backward", "prime-rl backward"),
        ("fused_moe_bf16_backward", "grouped_mm GEMMs only"), ("fused_moe_bf16_forward_backward", "prime-kernels"),
        ("fused_moe_bf16_forward_backward", "prime-rl backward")]
    ours, prime_rl = rows[0], rows[1]
    assert ours["bpc"] == 2 and ours["bits_equal_across_bpc"] and ours["spaced_clock"] == {"sm_mhz": 1980}
    assert ours["sustained"] is ours["sustained_by_bpc"][2][0] and set(ours["sustained_by_op"]) == {"dgrad", "wgrad"}
    assert max(ours["grad_rel_err_vs_fp32"].values()) < 2e-2 and max(prime_rl["grad_rel_err_vs_fp32"].values()) < 2e-2
    assert "sustained" in prime_rl and "sustained" in rows[3] and "sustained" not in rows[4]
    assert rows[3]["peak_GB"] == rows[4]["peak_GB"] == 0.5


def test_ab_builds_times_both_builds_spaced_then_back_to_back(monkeypatch, capsys):
    """ab_builds.shape_rows on the CPU (the references as both builds, timing faked): per op, A and B
    spaced (A B B A) with their bits compared, then, after every spaced timing of the shape, each
    op's windows A B B A; the table prints both."""
    ab = kernel_package.load_file("flash_moe_ab_builds", MEMBER / "benchmarks" / "ab_builds.py")
    timing = FakeTiming()
    monkeypatch.setattr(ab.compare, "median_ms", timing.median_ms)
    on_gpu = ab.compare.backward_inputs
    monkeypatch.setattr(ab.compare, "backward_inputs", lambda shape: on_gpu(shape, device="cpu"))
    build = reference_kernel.load()
    args = types.SimpleNamespace(iters=2, bpc=None, ops=["dgrad", "wgrad", "backward"])
    rows = ab.shape_rows({"A": build, "B": build}, (48, 64, 64, 8, 2), args, timing)
    assert [r["op"] for r in rows] == ["dgrad", "wgrad", "backward"] and all(r["bits_equal"] for r in rows)
    assert timing.events == ["spaced"] * 12 + ["window"] * 12
    assert [len(r["sustained"]["A"]) for r in rows] == [2, 2, 2]
    assert rows[2]["sustained"]["B"][0]["tflops"] == 2 * rows[0]["sustained"]["B"][0]["tflops"]  # 12 vs 6 FLOPs
    ab.print_table(rows)
    assert capsys.readouterr().out.strip().splitlines()[-1].split()[-5:] == ["2.000", "2.000", "+0.0%", "nan", "nan"]


def test_ab_builds_refuses_bad_arguments(compare, capsys, tmp_path):
    """benchmarks/ab_builds.py (two builds against each other) checks its arguments before it loads
    either build."""
    ab = kernel_package.load_file("flash_moe_ab_builds", MEMBER / "benchmarks" / "ab_builds.py")
    b = ["--b", str(tmp_path)]
    bad = ((b + ["--shapes", "0,5"], "--shapes must be in [0, 5), got [5]"),
           (b + ["--ops", "wgrad,fwd"], "--ops must be a comma-separated subset of dgrad, wgrad, backward"),
           (b + ["--bpc", "3"], "--bpc must be 1 or 2, got 3"),
           (["--b", str(tmp_path / "none")], "--b must be a build/ folder"),
           ([], "the following arguments are required: --b"))
    for argv, rule in bad:
        with pytest.raises(SystemExit):
            ab.parse_args(argv)
        assert rule in capsys.readouterr().err, argv
    args = ab.parse_args(b + ["--a", str(tmp_path), "--shapes", "1,3", "--ops", "wgrad"])
    assert (args.shapes, args.ops, args.bpc, args.sustained) == ([1, 3], ["wgrad"], None, True)
    assert not ab.parse_args(b + ["--no-sustained"]).sustained
