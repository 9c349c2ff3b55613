"""Plot the kfac_ref / hand-NumPy time ratios of a benchmark JSON file.

    python -m benchmarks.plot RESULT.json [PEERS.json ...] OUT.png

One horizontal bar per timed row (log scale), float32 and float64 side by side, with the
targets marked (:data:`TARGETS`: on a CPU every row within 1.2× of the hand-written maths; on
a GPU updates within 2×, inverses 1.5×, cached products 1.3×); the full-update rows
against peers (kfac_ref / peer), when the file has them, in a second panel.  Several result
files (the main run and a ``--peers-only`` run per peer environment) are merged.
"""

from __future__ import annotations

import argparse
import json
import math

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .common import on_gpu  # noqa: E402


def _bars(ax, rows, label_of, other):
    """One bar per row from 1 to the ratio ``kfac_ref / rows[other]`` (log scale), dtypes
    side by side; the whiskers are the ratios of the quartiles."""
    labels = []
    for r in rows:
        if label_of(r) not in labels:
            labels.append(label_of(r))
    dtypes = sorted({r["dtype"] for r in rows})
    height = 0.8 / len(dtypes)
    for j, dt in enumerate(dtypes):
        ys, xs, lo, hi = [], [], [], []
        for r in rows:
            if r["dtype"] != dt:
                continue
            k, h = r["kfac_ref"], r[other]
            ratio = k["median_s"] / h["median_s"]
            ys.append(labels.index(label_of(r)) + (j - (len(dtypes) - 1) / 2) * height)
            xs.append(ratio)
            lo.append(ratio - k["q1_s"] / h["q3_s"])
            hi.append(k["q3_s"] / h["q1_s"] - ratio)
        err = [[max(v, 0) for v in lo], [max(v, 0) for v in hi]]
        ax.barh(ys, [x - 1.0 for x in xs], left=1.0, height=height, xerr=err, label=dt,
                capsize=2, error_kw={"lw": 0.8})
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    return labels, dtypes


def ratio_ticks(lo: float, hi: float, least: int = 4) -> list[float]:
    """Tick positions for a log axis of ratios from ``lo`` to ``hi``: the 1-2-5 sequence
    (…, 0.2, 0.5, 1, 2, 5, …) inside the range, and — when that gives fewer than ``least``
    ticks, as for ratios between 0.7 and 1.5 — the finer 1-1.25-1.5-2-3-5-7.5 steps of each
    decade, so that every axis is labelled at several plain ratios, 1 among them."""
    if not (0 < lo < hi):
        raise ValueError(f"ratio_ticks: need 0 < lo < hi; got lo={lo!r}, hi={hi!r}")
    decades = range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
    ticks = []
    for steps in ((1, 2, 5), (1, 1.25, 1.5, 2, 3, 5, 7.5), (1, 1.1, 1.25, 1.5, 1.75, 2, 2.5, 3,
                                                            4, 5, 6, 7.5, 9)):
        ticks = [round(m * 10.0 ** e, 12) for e in decades for m in steps]
        ticks = [t for t in ticks if lo <= t <= hi]
        if len(ticks) >= least:
            break
    return ticks


def _ratio_axis(ax, values):
    """Label the log x axis of ``ax`` at plain ratios (0.5×, 1×, 2×, …) that cover
    ``values`` (bar ends, whiskers, goal lines) with a margin."""
    lo, hi = min(min(values), 1.0) / 1.15, max(max(values), 1.0) * 1.15
    ax.set_xlim(lo, hi)
    ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(ratio_ticks(lo, hi)))
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}×"))


def _extent(rows, other):
    """Every ratio the bars and whiskers of ``rows`` reach."""
    out = []
    for r in rows:
        k, h = r["kfac_ref"], r[other]
        out += [k["median_s"] / h["median_s"], k["q1_s"] / h["q3_s"], k["q3_s"] / h["q1_s"]]
    return [v for v in out if v > 0]


def _labels(ax, labels):
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()


#: the time-ratio targets marked on the first panel, by where the run was made: the array
#: library's device ("gpu" for CuPy and CUDA tensors, else "cpu") -> [(ratio, label)]
TARGETS = {
    "cpu": [(1.2, "target 1.2× (every CPU row)")],
    "gpu": [(1.3, "target 1.3× (cached products)"), (1.5, "target 1.5× (inverses)"),
            (2.0, "target 2× (updates)")],
}
_TARGET_STYLES = (("tab:green", "--"), ("tab:olive", ":"), ("tab:red", (0, (5, 1, 1, 1))))


def _device(meta):
    """``"gpu"`` for a run whose kfac_ref arrays were on a GPU, else ``"cpu"``."""
    return "gpu" if on_gpu(meta.get("backend", "numpy")) else "cpu"


def _on(row):
    """Where a peer row ran: `` (torch-cuda)`` for the peer (rows that record it), then
    `` [torch-cpu]`` when kfac_ref's side did not run on NumPy."""
    peer_on = f" ({row['peer_on']})" if "peer_on" in row else ""
    backend = row.get("backend", "numpy")
    return peer_on + ("" if backend == "numpy" else f" [{backend}]")


def plot(result, path):
    rows = [r for r in result["rows"]
            if r["op"] in ("update", "inverses", "cached_product", "chunking")]
    peer_rows = [r for r in result["rows"] if r["op"] == "peer" and "peer_time" in r]
    sizes = [n for n in (len({(r["workload"], r["row"], r["dtype"]) for r in rows}),
                         len({(r["workload"], r["row"], r["dtype"]) for r in peer_rows})) if n]
    fig, axes = plt.subplots(len(sizes), 1, figsize=(9.5, 0.32 * sum(sizes) + 1.6 * len(sizes)),
                             gridspec_kw={"height_ratios": sizes}, squeeze=False)
    axes = list(axes[:, 0])
    m = result["meta"]
    if rows:
        ax = axes.pop(0)
        labels, _ = _bars(ax, rows, lambda r: f"{r['workload'].upper()} {r['row']}", "hand")
        _labels(ax, labels)
        goals = []
        for (ratio, label), (color, style) in zip(TARGETS[_device(m)], _TARGET_STYLES,
                                                      strict=False):
            goals.append(ratio)
            ax.axvline(ratio, color=color, lw=0.8, ls=style, label=label)
        _ratio_axis(ax, _extent(rows, "hand") + goals)
        hand_lib = {"numpy": "NumPy", "cupy": "CuPy"}.get(m.get("hand", "numpy"), m.get("hand"))
        ax.set_xlabel(f"kfac_ref time / hand-written {hand_lib} time (median; bars: quartile "
                      "ratios)")
        ax.set_title(f"kfac_ref {m['kfac_ref_version']} vs hand {hand_lib}, {m['backend']}, "
                     f"{m['cpu_count']} CPUs, {m['repeats']} repeats", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    if peer_rows:
        ax = axes.pop(0)
        labels, _ = _bars(ax, peer_rows, lambda r: f"{r['workload'].upper()} full update "
                          f"{r['mode']} vs {r['peer']}{_on(r)}", "peer_time")
        _labels(ax, labels)
        _ratio_axis(ax, _extent(peer_rows, "peer_time"))
        ax.set_xlabel("kfac_ref / peer full update (below 1: kfac_ref faster)\n(…): where the "
                      "peer ran; […]: kfac_ref's array library when not NumPy", fontsize=8)
        ax.set_title("Full update (factors, damped inverses, one product) against peers",
                     fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", help="result files; the first one's meta is used")
    parser.add_argument("png")
    args = parser.parse_args(argv)
    results = []
    for path in args.json:
        with open(path, encoding="utf-8") as fh:
            results.append(json.load(fh))
    merged = {"meta": results[0]["meta"], "rows": [r for res in results for r in res["rows"]]}
    plot(merged, args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
