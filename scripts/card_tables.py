"""Render each member's H200 results table into its CARD.md, from the committed results JSON.

    python scripts/card_tables.py          # rewrite the tables in place
    python scripts/card_tables.py --check  # exit 1 if a CARD.md is out of date (a CPU test runs this)

The table sits between `<!-- results:begin -->` and `<!-- results:end -->` in
`<member>/CARD.md`; everything else in the card is hand-written.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _rows(results: dict, op: str, impl: str) -> dict[tuple, dict]:
    return {tuple(r["shape"].values()): r for r in results["rows"] if r["op"] == op and r["impl"] == impl}


def _ms(row: dict | None, rate: str, unit: str) -> str:
    return "—" if row is None else f"{row['ms']:.3f} ({row[rate]:.0f} {unit})"


def _provenance(results: dict) -> str:
    c = results["ceilings"]
    return (f"{results['gpu']}, torch {results['torch']}, commit `{results['commit'][:7]}`, {results['date'][:10]}; "
            f"same-run ceilings: copy {c['copy_GBps']:.0f} GB/s, bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s.")


def _spaced_b2b(row: dict | None) -> str:
    if row is None:
        return "—"
    sustained = row.get("sustained")
    return f"{row['ms']:.3f} / {sustained['ms']:.3f}" if sustained else f"{row['ms']:.3f} / —"


def _ratio(peer: dict | None, ours: dict) -> str:
    """peer's ms over ours, spaced / back to back."""
    if peer is None:
        return "—"
    b2b = "—"
    if peer.get("sustained") and ours.get("sustained"):
        b2b = f"{peer['sustained']['ms'] / ours['sustained']['ms']:.2f}"
    return f"{peer['ms'] / ours['ms']:.2f} / {b2b}"


def _sonicmoe_lines(peer_run: dict) -> list[str]:
    """SonicMoE beside ours, both timed in sonicmoe_peer.py's one run (its own results file)."""
    intro = ("Against SonicMoE, timed in one run of `benchmarks/sonicmoe_peer.py` (ours re-timed there; "
             "its backward through `torch.autograd.grad`, ours the op's), spaced / back to back:")
    header = ("| shape | backward ms, ours | SonicMoE | SonicMoE ÷ ours, spaced / back to back | "
              "forward+backward ms, ours | SonicMoE |")
    lines = ["", intro, "", header, "|---|---|---|---|---|---|"]
    ours = _rows(peer_run, "fused_moe_bf16_backward", "prime-kernels")
    peer = _rows(peer_run, "fused_moe_bf16_backward", "sonicmoe")
    both = _rows(peer_run, "fused_moe_bf16_forward_backward", "prime-kernels")
    both_peer = _rows(peer_run, "fused_moe_bf16_forward_backward", "sonicmoe")
    for shape, r in ours.items():
        p = peer.get(shape)
        lines.append(f"| {', '.join(map(str, shape))} | {_spaced_b2b(r)} | {_spaced_b2b(p)} | {_ratio(p, r)} | "
                     f"{_spaced_b2b(both.get(shape))} | {_spaced_b2b(both_peer.get(shape))} |")
    return lines + ["", _provenance(peer_run)]


def _training_lines(run: dict) -> list[str]:
    """The backward and forward+backward rows of a compare.py run, spaced / back to back."""
    bwd = _rows(run, "fused_moe_bf16_backward", "prime-kernels")
    peer = _rows(run, "fused_moe_bf16_backward", "prime-rl backward")
    both = _rows(run, "fused_moe_bf16_forward_backward", "prime-kernels")
    both_peer = _rows(run, "fused_moe_bf16_forward_backward", "prime-rl backward")
    lines = ["", "Training: the backward (`moe(...)`'s, 12·M·K·I FLOPs) and forward+backward with its peak memory; "
             "ms spaced / back to back.", "",
             "| shape | backward ms | TFLOP/s, spaced | prime-rl's backward | prime-rl's ÷ ours | forward+backward | "
             "peak GB, ours / prime-rl's |", "|---|---|---|---|---|---|---|"]
    for shape, r in bwd.items():
        p, b, bp = peer.get(shape), both.get(shape), both_peer.get(shape)
        peak = f"{b['peak_GB']:.2f} / {bp['peak_GB']:.2f}" if b and bp else "—"
        lines.append(f"| {', '.join(map(str, shape))} | {_spaced_b2b(r)} | {r['tflops']:.0f} | {_spaced_b2b(p)} | "
                     f"{_ratio(p, r)} | {_spaced_b2b(b)} | {peak} |")
    return lines + ["", _provenance(run)]


def flash_moe_table(results: dict, peer_run: dict | None = None, training_run: dict | None = None) -> str:
    """The forward rows of h200.json; the training rows of training_run (a run of those rows alone)
    where there is one, else of h200.json; SonicMoE's run of its own beside them."""
    ours = _rows(results, "fused_moe_bf16", "prime-kernels")
    mx = _rows(results, "fused_moe_mxfp8", "prime-kernels")
    grouped = _rows(results, "fused_moe_bf16", "grouped_mm")
    liger = _rows(results, "fused_moe_bf16", "liger")
    lines = [
        "| shape (tokens, dim, hidden, experts, top_k) | `fused_moe_bf16` ms (TFLOP/s) | back to back | "
        "`fused_moe_mxfp8` ms (TFLOP/s) | unfused `grouped_mm` | Liger |",
        "|---|---|---|---|---|---|",
    ]
    for shape, r in ours.items():
        sustained = r.get("sustained")
        b2b = f"{sustained['tflops']:.0f} TFLOP/s" if sustained else "—"
        lines.append(f"| {', '.join(map(str, shape))} | {_ms(r, 'tflops', 'TF/s')} | {b2b} | "
                     f"{_ms(mx.get(shape), 'tflops', 'TF/s')} | {_ms(grouped.get(shape), 'tflops', 'TF/s')} | "
                     f"{_ms(liger.get(shape), 'tflops', 'TF/s')} |")
    lines += ["", _provenance(results)]
    training = training_run if training_run is not None else results
    if _rows(training, "fused_moe_bf16_backward", "prime-kernels"):
        lines += _training_lines(training)
    if peer_run is not None:
        lines += _sonicmoe_lines(peer_run)
    return "\n".join(lines)


def rmsnorm_table(results: dict) -> str:
    copy = results["ceilings"]["copy_GBps"]
    cells = {(op, impl): _rows(results, op, impl)
             for op in ("fused_rmsnorm_residual", "fused_rmsnorm_residual_backward")
             for impl in ("prime-kernels", "liger", "torch.compile")}
    lines = [
        "| (N, C) | forward ms (GB/s) | % of copy | Liger | torch.compile | backward ms (GB/s) | Liger | torch.compile |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shape, fwd in cells[("fused_rmsnorm_residual", "prime-kernels")].items():
        bwd = cells[("fused_rmsnorm_residual_backward", "prime-kernels")].get(shape)

        def cell(op, impl):
            return _ms(cells[(op, impl)].get(shape), "GBps", "GB/s")

        lines.append(f"| {', '.join(map(str, shape))} | {_ms(fwd, 'GBps', 'GB/s')} | {fwd['GBps'] / copy:.0%} | "
                     f"{cell('fused_rmsnorm_residual', 'liger')} | {cell('fused_rmsnorm_residual', 'torch.compile')} | "
                     f"{_ms(bwd, 'GBps', 'GB/s')} | {cell('fused_rmsnorm_residual_backward', 'liger')} | "
                     f"{cell('fused_rmsnorm_residual_backward', 'torch.compile')} |")
    return "\n".join(lines + ["", _provenance(results)])


TABLES = {"flash_moe": flash_moe_table, "rmsnorm": rmsnorm_table}
# Runs of their own beside h200.json, passed to the member's table by keyword (None where the file
# is missing): a peer timed alone (SonicMoE), the training rows timed alone (compare.py --shapes=).
EXTRA_RUNS = {"flash_moe": {"peer_run": "h200_sonicmoe.json", "training_run": "h200_training.json"}}


def rendered(member: str) -> tuple[pathlib.Path, str, str]:
    """(card path, its current text, its text with the table rendered from the results JSON)."""
    card = ROOT / member / "CARD.md"
    text = card.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"{card}: needs exactly one {BEGIN} ... {END} block")
    results_dir = ROOT / member / "benchmarks" / "results"
    results = json.loads((results_dir / "h200.json").read_text())
    extra = {}
    for key, name in EXTRA_RUNS.get(member, {}).items():
        path = results_dir / name
        extra[key] = json.loads(path.read_text()) if path.exists() else None
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return card, text, f"{head}{BEGIN}\n{TABLES[member](results, **extra)}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if a card's table is out of date")
    args = parser.parse_args(argv)
    stale = []
    for member in TABLES:
        card, old, new = rendered(member)
        if old != new:
            stale.append(str(card.relative_to(ROOT)))
            if not args.check:
                card.write_text(new)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}: run `python scripts/card_tables.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
