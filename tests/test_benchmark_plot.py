"""The benchmark ratio plot (benchmarks/plot.py) labels its log axes at several plain ratios
(0.5×, 1×, 2×, … and finer steps when the ratios are close to 1).  Nothing is timed here."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from benchmarks.plot import plot, ratio_ticks  # noqa: E402


@pytest.mark.parametrize(("lo", "hi", "expected"), [
    (0.05, 5.0, [0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]),
    (0.6, 1.8, [0.75, 1.0, 1.25, 1.5]),
    (0.3, 3.0, [0.3, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0]),
])
def test_ratio_ticks(lo, hi, expected):
    assert ratio_ticks(lo, hi) == expected


def test_ratio_ticks_rejects_an_empty_range():
    with pytest.raises(ValueError, match=r"ratio_ticks: need 0 < lo < hi; got lo=2, hi=1"):
        ratio_ticks(2, 1)


def _timing(median):
    return {"median_s": median, "q1_s": 0.95 * median, "q3_s": 1.05 * median}


def _result():
    rows = []
    for i, ratio in enumerate((0.7, 0.9, 1.05, 1.2, 1.4)):
        for dt in ("float32", "float64"):
            rows.append({"op": "update", "workload": "mlp", "row": f"mode{i}", "dtype": dt,
                         "kfac_ref": _timing(ratio * 1e-3), "hand": _timing(1e-3)})
    rows.append({"op": "peer", "workload": "cnn", "mode": "ggn_exact", "peer": "p",
                 "row": "full", "dtype": "float64", "kfac_ref": _timing(0.02e-3),
                 "peer_time": _timing(1e-3)})
    meta = {"kfac_ref_version": "0", "backend": "numpy", "cpu_count": 2, "repeats": 3}
    return {"meta": meta, "rows": rows}


def test_every_panel_has_several_ratio_labels_including_1(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read its axes
    plot(_result(), tmp_path / "ratios.png")
    assert (tmp_path / "ratios.png").stat().st_size > 1000
    (fig,) = figures
    for ax in fig.axes:
        labels = [t.get_text() for t in ax.get_xticklabels()]
        lo, hi = ax.get_xlim()
        shown = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert len(shown) >= 3, labels
        assert "1×" in labels
        assert all(label.endswith("×") for label in labels)


@pytest.mark.parametrize(("backend", "expected"), [
    ("numpy", [1.2]), ("torch-cpu", [1.2]), ("cupy", [1.3, 1.5, 2.0]),
    ("torch-cuda", [1.3, 1.5, 2.0])])
def test_the_target_lines_follow_the_device_of_the_run(tmp_path, monkeypatch, backend,
                                                       expected):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    result = _result()
    result["meta"]["backend"] = backend
    plot(result, tmp_path / "ratios.png")
    ratio_panel = figures[0].axes[0]
    # the vertical lines: x constant over the line; the first is the 1× reference
    xs = [line.get_xdata()[0] for line in ratio_panel.get_lines()
          if line.get_xdata()[0] == line.get_xdata()[-1]]
    assert xs[0] == 1.0
    assert sorted(xs[1:]) == expected
    labels = ratio_panel.get_legend_handles_labels()[1]
    assert len([label for label in labels if label.startswith("target")]) == len(expected)
