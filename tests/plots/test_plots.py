"""fedproto.plots: `fedproto plot` and the figures."""




import json

import numpy as np
import pytest
from conftest import assert_png, run_cli


@pytest.mark.usefixtures("one_thread")
def test_tsne_leaves_out_nonfinite_embeddings(tmp_path, caplog):
    """`fedproto plot` of a run with a blown-up client leaves out its non-finite embeddings instead of
    calling its files damaged."""
    from fedproto.plots import plot_tsne_arrays

    rng = np.random.default_rng(0)
    h = rng.normal(size=(40, 5)).astype(np.float32)
    h[[3, 7]] = np.nan
    client = np.repeat(np.arange(4), 10)
    with caplog.at_level("WARNING"):
        path = plot_tsne_arrays(h, rng.integers(0, 3, 40), client, tmp_path / "t.png", max_per_client=None)
    assert path.is_file() and "leaves out 2 test embedding(s)" in caplog.text and "clients [0]" in caplog.text


def test_run_then_plot_writes_pngs(capsys, monkeypatch, tmp_path):
    code, text = run_cli(["run", "--dataset", "digits", "--clients", "4", "--ways", "2", "--shots", "20",
                          "--stdev", "1", "--test-shots", "8", "--rounds", "2", "--out-dir", str(tmp_path),
                          "--name", "r", "-q"], capsys, monkeypatch)
    assert code == 0, text
    run = tmp_path / "r"
    import numpy as np

    e = np.load(run / "embeddings.npz")
    assert e["h"].shape[0] == len(e["y"]) == len(e["client"]) > 0
    assert set(e["client"].tolist()) == {0, 1, 2, 3}
    code, text = run_cli(["plot", str(run)], capsys, monkeypatch)
    assert code == 0, text
    assert str(run / "curves.png") in text and str(run / "tsne.png") in text
    # the t-SNE takes a while: the user is told before it starts, after curves.png is named
    assert text.index(str(run / "curves.png")) < text.index("t-SNE of the test embeddings (at most 200 per client)")
    assert_png(run / "curves.png")
    assert_png(run / "tsne.png")


def test_plot_missing_run_dir_exits_2(capsys, monkeypatch, tmp_path):
    code, text = run_cli(["plot", str(tmp_path / "nope")], capsys, monkeypatch)
    assert code == 2 and "does not exist" in text and "Traceback" not in text


def test_plot_sweep_direct(tmp_path):
    from fedproto.plots import plot_sweep

    rows = [{"value": k, "method": m, "acc_mean": a, "acc_std": 0.02}
            for m, base in (("fedproto", 0.9), ("fedavg", 0.85))
            for k, a in ((10, base - 0.1), (50, base), (100, base + 0.02))]
    assert_png(plot_sweep(rows, "value", tmp_path / "fig3.png", xlabel="k"))
    # text values (a sweep over aggregation rules) are drawn at positions, not dropped as NaN
    import matplotlib.pyplot as plt

    seen = []
    monkey = plt.Axes.plot

    def spy(self, *a, **k):
        seen.append(list(a[0]))
        return monkey(self, *a, **k)

    plt.Axes.plot = spy
    try:
        text = [{"value": v, "method": "fedproto", "acc_mean": a, "acc_std": 0.0}
                for v, a in (("mean", .9), ("median", .8))]
        assert_png(plot_sweep(text, "value", tmp_path / "agg.png"))
    finally:
        plt.Axes.plot = monkey
    assert seen == [[0.0, 1.0]]


def _capture_figures(monkeypatch):
    """Keep every figure the plot functions save (and still write the PNG): they all save through
    :func:`fedproto.plots.canvas.save_figure`."""
    from fedproto.plots import canvas

    figs, save = [], canvas.save_figure

    def keep(fig, path):
        figs.append(fig)
        return save(fig, path)

    monkeypatch.setattr(canvas, "save_figure", keep)
    return figs


def test_curves_of_a_one_round_run_show_the_whole_error_bar(monkeypatch, tmp_path):
    """Reported: in curves.png of a short run the lower error bar was cut by the axis."""
    from fedproto.plots import plot_curves

    (tmp_path / "metrics.jsonl").write_text(json.dumps(
        {"round": 1, "loss_ce": 2.3, "loss_proto": 0.0, "acc_mean": 0.3125, "acc_std": 0.2083,
         "acc_proto_mean": 0.5125, "acc_proto_std": 0.055}) + "\n")
    figs = _capture_figures(monkeypatch)
    assert_png(plot_curves(tmp_path))
    ax = figs[0].axes[0]
    lo, hi = ax.get_ylim()
    # classifier bar 31.25 ± 20.83 -> [10.42, 52.08]; prototype bar [45.75, 56.75]; margin 8% (>= 2 points)
    assert lo == pytest.approx(10.42 - max(2.0, 0.08 * (56.75 - 10.42)))
    assert hi == pytest.approx(56.75 + max(2.0, 0.08 * (56.75 - 10.42)))
    legend = ax.get_legend()
    fig_box = legend.get_window_extent(figs[0].canvas.get_renderer())
    assert fig_box.y1 <= ax.get_window_extent().y0  # the legend sits below the panel, on no bar


def test_curves_clip_the_band_at_0_and_100_percent(monkeypatch, tmp_path):
    from fedproto.plots import accuracy_limits, plot_curves

    rows = [{"round": r, "loss_ce": 1.0, "acc_mean": 0.95, "acc_std": 0.10} for r in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figs = _capture_figures(monkeypatch)
    plot_curves(tmp_path)
    assert accuracy_limits(85.0, 100.0) == pytest.approx((83.0, 102.0))  # 95 ± 10 % clipped at 100, 2-point margin
    assert figs[0].axes[0].get_ylim() == pytest.approx((83.0, 102.0))


def test_sweep_legend_covers_no_point(monkeypatch, tmp_path):
    """Reported: in sweep_lambda.png (fig. 4, two y-axes) the legend covered a point."""
    from fedproto.plots import plot_sweep

    rows = [{"value": lam, "method": "fedproto", "acc_mean": a, "acc_std": 0.09, "proto_mse": d}
            for lam, a, d in ((0, 0.861, 3.5), (0.5, 0.893, 0.4), (1, 0.899, 0.2), (2, 0.897, 0.1), (4, 0.895, 0.06))]
    figs = _capture_figures(monkeypatch)
    plot_sweep(rows, "value", tmp_path / "sweep_lambda.png", y2="proto_mse", y2label="prototype distance")
    fig = figs[0]
    box = fig.legends[0] if fig.legends else fig.axes[0].get_legend()
    box = box.get_window_extent(fig.canvas.get_renderer())
    points = [ax.transData.transform(line.get_xydata()) for ax in fig.axes for line in ax.get_lines()]
    assert sum(len(p) for p in points) == 10
    assert not any(box.contains(x, y) for p in points for x, y in p)


def test_tsne_says_marker_shapes_are_clients(monkeypatch, tmp_path):
    from fedproto.plots import MARKERS, plot_tsne_arrays

    rng = np.random.default_rng(0)
    n = 20 * 4
    figs = _capture_figures(monkeypatch)
    plot_tsne_arrays(rng.normal(size=(n, 5)), rng.integers(0, 10, n), np.repeat(np.arange(20), 4),
                     tmp_path / "tsne.png", proto_classes=np.arange(3), protos=rng.normal(size=(3, 5)))
    caption = figs[0].axes[0].get_xlabel()
    assert caption == (f"colour: class · marker shape: client (20 clients; shapes repeat after {len(MARKERS)})\n"
                       "star: global prototype of the class")
