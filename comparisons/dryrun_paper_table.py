"""One JSON and one PNG (engine vs planner, per memory category) of the `amsp dryrun --out DIR`
folders under a results folder: python comparisons/dryrun_paper_table.py RUNS_DIR DEST_PREFIX.
Also prints the Markdown rows of the report's two tables."""
import glob
import json
import sys
from collections import Counter

OUT, DEST = sys.argv[1], sys.argv[2]
runs = {}
for d in sorted(glob.glob(f"{OUT}/*/dryrun.json")):
    name = d.split("/")[-2]; runs[name] = json.load(open(d))
json.dump(runs, open(f"{DEST}.json", "w"), indent=1)
G = lambda n: n / 2**30
paper = {}  # Fig. 13 figures are written into the report by hand (section 5 of the paper review)
rows = []
for name, r in runs.items():
    rk = r["ranks"][0]; m = rk["memory"]; pm = r["planner"]["memory"]
    cells = " | ".join(f"{G(m[c]):.2f} / {G(pm[c]):.2f}" for c in ("params", "grads", "optimizer", "activations", "temporary"))
    ms = rk["model_state_bytes"]
    rows.append(f"| {name} | {r['plan']} | {G(rk['peak_bytes']):.2f} / {G(pm['total']):.2f} | {cells} | "
                f"{G(ms['params']):.2f}+{G(ms['grads']):.2f}+{G(ms['master']+ms['optim_states']):.2f} | "
                f"{paper.get(name, '')} | {'yes' if r['fits'] else 'NO'} | {rk['seconds']['total']:.0f} s |")
kinds = []
for name, r in runs.items():
    rk = r["ranks"][0]; pb = r["planner"]["bytes"]
    got = Counter()
    for c in rk["collectives"]:
        if c["kind"] == "all_reduce" and c["group"] not in ("param_replica", "grad"): continue
        if c["kind"] == "broadcast" and c["group"] != "optim_bcast": continue
        got[c["kind"]] += c["bytes"]
    kinds.append(f"| {name} | " + " | ".join(f"{got[k]/2**20:.0f} / {pb[k]/2**20:.0f}" for k in ("all_gather", "reduce_scatter", "all_reduce", "broadcast")) + " |")
print("\n".join(rows) + "\n\n" + "\n".join(kinds))
import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
cats = ("params", "grads", "optimizer", "activations", "temporary")
fig, axes = plt.subplots(1, len(runs), figsize=(3.2 * len(runs), 3.5), sharey=True)
for ax, (name, r) in zip(axes, runs.items()):
    rk = r["ranks"][0]; b1 = 0; b2 = 0
    for c in cats:
        e, p = G(rk["memory"][c]), G(r["planner"]["memory"][c])
        ax.bar(0, e, bottom=b1, label=c); ax.bar(1, p, bottom=b2, color=ax.patches[-1].get_facecolor()); b1 += e; b2 += p
    ax.set_xticks([0, 1], ["engine", "planner"]); ax.set_title(f"{name}\n{r['plan']}", fontsize=7)
axes[0].set_ylabel("GiB per GPU (rank 0)"); axes[0].legend(fontsize=6)
fig.tight_layout(); fig.savefig(f"{DEST}.png", dpi=100)
