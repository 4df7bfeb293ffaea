"""Plot bench.cu's CSV: best variant and dispatch-rule choice per shape vs the copy ceiling."""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

rows = list(csv.DictReader(open(sys.argv[1])))
out = sys.argv[2]
shapes = []
for r in rows:
    s = (int(r["N"]), int(r["C"]))
    if s not in shapes:
        shapes.append(s)
fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
for ax, op in zip(axes, ["fwd", "bwd"]):
    for i, s in enumerate(shapes):
        vs = [r for r in rows if r["op"] == op and (int(r["N"]), int(r["C"])) == s]
        for j, r in enumerate(vs):
            color = "tab:red" if r["variant"].endswith("*") else "tab:blue"
            ax.scatter(i + (j - len(vs) / 2) * 0.04, float(r["pct_copy"]), s=14, color=color)
    ax.axhline(100, color="k", lw=0.8)
    ax.axhline(90 if op == "fwd" else 85, color="tab:green", ls="--", lw=0.8, label="target")
    ax.set_xticks(range(len(shapes)), [f"{n}x{c}" for n, c in shapes], rotation=20)
    ax.set_title(f"{op}: every variant (red = dispatch rule), % of copy kernel")
    ax.legend()
axes[0].set_ylabel("% of D2D copy GB/s (same bytes)")
fig.tight_layout()
fig.savefig(out, dpi=120)
print("wrote", out)
