"""The short table .ci/gpu-run ends with: test counts, then every benchmark row against its ceiling."""

import json
import pathlib
import sys
import xml.etree.ElementTree as ET

out = pathlib.Path(sys.argv[1])
junit = out / "pytest.xml"
if junit.is_file():
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failures, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    print(f"\ntests: {total - failures - errors - skipped} passed, {failures + errors} failed, {skipped} skipped")


def back_to_back(s):
    """A `sustained` entry (flash_moe's compare.py): the back-to-back rate at the SM clock it held."""
    return f"{s['tflops']:.0f} TF/s @ {s.get('sm_mhz', float('nan')):.0f} MHz" if s else ""


for results in sorted(out.glob("*/h200.json")):
    data = json.loads(results.read_text())
    ceil = data["ceilings"]
    mm_b2b = ceil.get("bf16_matmul_sustained")
    print(f"\n{results.parent.name}: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s"
          + (f" (back to back: {back_to_back(mm_b2b)})" if mm_b2b else ""))
    print(f"{'op':34} {'impl':21} {'shape':34} {'ms':>8} {'rate':>12} {'of ceiling':>10}  back to back")
    for row in data["rows"]:
        shape = ",".join(str(v) for v in row["shape"].values())
        if "GBps" in row:
            rate, frac = f"{row['GBps']:.0f} GB/s", row["GBps"] / ceil["copy_GBps"]
        else:
            rate, frac = f"{row['tflops']:.0f} TF/s", row["tflops"] / ceil["bf16_matmul_TFLOPs"]
        spaced = row.get("spaced_clock") or {}
        at = f" (spaced @ {spaced['sm_mhz']:.0f} MHz)" if "sm_mhz" in spaced else ""
        print(f"{row['op']:34} {row['impl']:21} {shape:34} {row['ms']:8.3f} {rate:>12} {frac:10.0%}  "
              f"{back_to_back(row.get('sustained'))}{at}")
    for row in data["rows"]:  # the backward at bpc 1 and 2 (flash_moe compare.py)
        by_bpc = row.get("backward_ms_by_bpc")
        if by_bpc:
            shape = ",".join(str(v) for v in row["shape"].values())
            one, two = by_bpc["1"], by_bpc["2"]
            b2b, sus = "", row.get("sustained_by_bpc")
            if sus:  # two windows per bpc: their mean
                ms = {b: sum(w["ms"] for w in sus[b]) / len(sus[b]) for b in ("1", "2")}
                b2b = f"; back to back {ms['1']:.3f} / {ms['2']:.3f} ms ({ms['2'] / ms['1'] - 1:+.1%})"
            ops = row.get("sustained_by_op") or {}
            per_op = "".join(f"; {name} back to back {back_to_back(s)}" for name, s in ops.items())
            print(f"backward {shape}: bpc=1 {one:.3f} ms, bpc=2 {two:.3f} ms ({two / one - 1:+.1%}){b2b}; "
                  f"moe takes bpc={row.get('bpc')}; bits equal: {row.get('bits_equal_across_bpc')}{per_op}")
