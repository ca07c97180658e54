"""Renders docs/spread.json (from `stoker-lab bench spread --json-out docs/spread.json`) as
docs/spread.png: samples/s per run, and MB/s sent on each node's link against the cap."""

import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

REPO = pathlib.Path(__file__).resolve().parents[1]
src = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "docs/spread.json"
out = pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else REPO / "docs/spread.png"
r = json.loads(src.read_text())
runs = r["runs"]
names = [f'{x["placement"]}\n{x["scale"]}\n{x["path"]}' for x in runs]
fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
bars = a.bar(range(len(runs)), [x["samples_per_s"] for x in runs],
             color=["#c44" if x["placement"] == "pack" else "#48c" for x in runs])
for rect, x in zip(bars, runs):
    a.annotate(f'wait {x["wait_ratio"]:.2f}', (rect.get_x() + rect.get_width() / 2, rect.get_height()),
               ha="center", va="bottom", fontsize=8)
a.set_xticks(range(len(runs)), names, fontsize=7)
a.set_ylabel("samples/s consumed by the trainer")
a.set_title(f'{r["workers"]} workers, {r["ranks"]} ranks, {r["nodes"]} nodes')
cap = r["link_mbit"] / 8
width = 0.8 / r["nodes"]
for n in range(r["nodes"]):
    b.bar([i + n * width for i in range(len(runs))], [x["node_mb_per_s"][n] for x in runs],
          width=width, label=f"node {n}")
b.axhline(cap, color="k", linestyle="--", linewidth=1, label=f'link cap {r["link_mbit"]} Mbit/s')
b.set_xticks([i + 0.4 - width / 2 for i in range(len(runs))], names, fontsize=7)
b.set_ylabel("MB/s sent on the node's link")
b.set_title("bytes per node link")
b.legend(fontsize=7)
fig.suptitle("Pack vs spread with capped node links (network namespaces + tbf), and the relay hop")
fig.tight_layout()
fig.savefig(out, dpi=90)
print(f"wrote {out}")
