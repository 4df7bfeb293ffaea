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

for results in sorted(out.glob("*/h200.json")):
    data = json.loads(results.read_text())
    ceil = data["ceilings"]
    print(f"\n{results.parent.name}: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    print(f"{'op':34} {'impl':21} {'shape':34} {'ms':>8} {'rate':>12} {'of ceiling':>10}")
    for row in data["rows"]:
        shape = ",".join(str(v) for v in row["shape"].values())
        if "GBps" in row:
            rate, frac = f"{row['GBps']:.0f} GB/s", row["GBps"] / ceil["copy_GBps"]
        else:
            rate, frac = f"{row['tflops']:.0f} TF/s", row["tflops"] / ceil["bf16_matmul_TFLOPs"]
        print(f"{row['op']:34} {row['impl']:21} {shape:34} {row['ms']:8.3f} {rate:>12} {frac:10.0%}")
