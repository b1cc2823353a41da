"""One JSON and one PNG (engine vs planner, per memory category) of the `amsp dryrun --out DIR`
folders under a results folder: python comparisons/dryrun_paper_table.py RUNS_DIR DEST_PREFIX.
Also prints the Markdown rows of the report's two tables. The planner's activations and
temporary buffers are those of the moment the engine's peak was at (dryrun_report.planner_at)."""
import glob
import json
import sys

from amsp_ext.tools.dryrun_report import CATS, KINDS, bytes_per_kind, planner_at

OUT, DEST = sys.argv[1], sys.argv[2]
runs = {d.split("/")[-2]: json.load(open(d)) for d in sorted(glob.glob(f"{OUT}/*/dryrun.json"))}
json.dump(runs, open(f"{DEST}.json", "w"), indent=1)


def G(n):
    return n / 2**30


rows, kinds = [], []
for name, r in runs.items():
    rk = r["ranks"][0]
    m, at = rk["memory"], planner_at(r, rk)
    cells = " | ".join(f"{G(m[c]):.2f} / {G(at[c]):.2f}" for c in CATS)
    moments = f"{rk.get('peak_moment')} / {r['planner'].get('peak_moment')}"
    ms = rk["model_state_bytes"]
    rows.append(f"| {name} | {r['plan']} | {G(rk['peak_bytes']):.2f} / {G(r['planner']['memory']['total']):.2f} | "
                f"{moments} | {cells} | "
                f"{G(ms['params']):.2f}+{G(ms['grads']):.2f}+{G(ms['master'] + ms['optim_states']):.2f} | "
                f"{'yes' if r['fits'] else 'NO'} | {rk['seconds']['total']:.0f} s |")
    got, want = bytes_per_kind(rk), r["planner"]["bytes"]
    kinds.append(f"| {name} | " + " | ".join(f"{got[k] / 2**20:.0f} / {want[k] / 2**20:.0f}" for k in KINDS) + " |")
print("\n".join(rows) + "\n\n" + "\n".join(kinds))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, axes = plt.subplots(1, len(runs), figsize=(3.2 * len(runs), 3.5), sharey=True, squeeze=False)
for ax, (name, r) in zip(axes[0], runs.items()):
    rk = r["ranks"][0]
    at = planner_at(r, rk)
    b1 = b2 = 0
    for c in CATS:
        e, p = G(rk["memory"][c]), G(at[c])
        ax.bar(0, e, bottom=b1, label=c)
        ax.bar(1, p, bottom=b2, color=ax.patches[-1].get_facecolor())
        b1 += e
        b2 += p
    ax.set_xticks([0, 1], ["engine", "planner"])
    ax.set_title(f"{name}\n{r['plan']}\n(peak: {rk.get('peak_moment')})", fontsize=7)
axes[0][0].set_ylabel("GiB per GPU (rank 0)")
axes[0][0].legend(fontsize=6)
fig.tight_layout()
fig.savefig(f"{DEST}.png", dpi=100)
