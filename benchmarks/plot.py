"""Plot the kfac_ref / hand-NumPy time ratios of a benchmark JSON file.

    python -m benchmarks.plot benchmark-results/bench-numpy.json docs/_static/benchmarks-ratios.png

One horizontal bar per timed row (log scale), float32 and float64 side by side, with the
issue's goals marked (1.1 for updates and inverses, 1.5 for cached products).
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(result, path):
    rows = [r for r in result["rows"]
            if r["op"] in ("update", "inverses", "cached_product", "chunking")]
    labels = []
    for r in rows:
        label = f"{r['workload'].upper()} {r['row']}"
        if label not in labels:
            labels.append(label)
    dtypes = sorted({r["dtype"] for r in rows})
    fig, ax = plt.subplots(figsize=(7.5, 0.32 * len(labels) * len(dtypes) + 1.2))
    height = 0.8 / len(dtypes)
    for j, dt in enumerate(dtypes):
        ys, xs, lo, hi = [], [], [], []
        for r in rows:
            if r["dtype"] != dt:
                continue
            i = labels.index(f"{r['workload'].upper()} {r['row']}")
            k, h = r["kfac_ref"], r["hand"]
            ratio = k["median_s"] / h["median_s"]
            ys.append(i + (j - (len(dtypes) - 1) / 2) * height)
            xs.append(ratio)
            # spread: the ratio of the quartiles, kfac_ref's against the hand's
            lo.append(ratio - k["q1_s"] / h["q3_s"])
            hi.append(k["q3_s"] / h["q1_s"] - ratio)
        # bars grow from 1 (equal time) to the ratio, left for faster, right for slower
        err = [[max(v, 0) for v in lo], [max(v, 0) for v in hi]]
        ax.barh(ys, [x - 1.0 for x in xs], left=1.0, height=height, xerr=err, label=dt,
                capsize=2, error_kw={"lw": 0.8})
    ax.axvline(1.0, color="k", lw=0.8)
    ax.axvline(1.1, color="tab:green", lw=0.8, ls="--", label="goal 1.1×")
    ax.axvline(1.5, color="tab:olive", lw=0.8, ls=":", label="goal 1.5× (cached)")
    if any(r["op"] == "chunking" for r in rows):
        ax.axvline(1.3, color="tab:purple", lw=0.8, ls="-.",
                   label="goal 1.3× (chunked / one shot)")
    ax.set_xscale("log")
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("kfac_ref time / hand-written NumPy time (median; bars: quartile ratios)")
    m = result["meta"]
    ax.set_title(f"kfac_ref {m['kfac_ref_version']} vs hand NumPy, {m['backend']}, "
                 f"{m['cpu_count']} CPUs, {m['repeats']} repeats", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("png")
    args = parser.parse_args(argv)
    with open(args.json, encoding="utf-8") as fh:
        plot(json.load(fh), args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
