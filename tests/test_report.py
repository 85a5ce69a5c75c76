"""sim.report: summaries (unambiguous names, round 1 timed apart), atomic figures, partition report."""

import json
import os

import numpy as np
import pytest

from fedkernels.sim import report
from fedkernels.sim.config import RunConfig


def _metrics(accs, t_local=None, t_agg=None, start=1):
    out = []
    for i, a in enumerate(accs):
        r = start + i
        m = {
            "round": r,
            "t_local": (t_local or {}).get(r, 1.0),
            "t_agg": (t_agg or {}).get(r, 0.01),
            "t_eval": 0.5,
            "excluded": [],
        }
        if a is not None:
            m.update(accuracy=a, test_loss=1.0 - a, train_loss_mean=2.0 - a)
        out.append(m)
    return out


def test_summary_metric_names_and_windows():
    accs = [0.1 * (i % 10) + 0.001 * i for i in range(1, 31)]  # 30 rounds
    s = report.summarize(_metrics(accs), rounds=30)
    assert s["final_accuracy"] == accs[-1] and s["final_round"] == 30
    assert s["mean_last_10pct_rounds"] == pytest.approx(np.mean(accs[-3:]))  # rounds 28-30
    assert s["mean_last_10_rounds"] == pytest.approx(np.mean(accs[-10:]))  # rounds 21-30
    assert s["best_accuracy"] == max(accs) and "mean_last_10pct" not in s and "mean_last_10" not in s


def test_summary_windows_count_rounds_not_evaluations():
    # evaluated every 5 rounds of 50: the last 10 rounds (41-50) hold the evaluations of rounds 45
    # and 50, the last 10% (46-50) only that of round 50
    accs = [0.5 + 0.01 * r if r % 5 == 0 else None for r in range(1, 51)]
    s = report.summarize(_metrics(accs), rounds=50)
    assert s["mean_last_10_rounds"] == pytest.approx((0.95 + 1.0) / 2)
    assert s["mean_last_10pct_rounds"] == pytest.approx(1.0)
    # a run stopped at round 30 of 50: the windows end at its last round
    s = report.summarize(_metrics(accs[:30]), rounds=50)
    assert s["mean_last_10_rounds"] == pytest.approx((0.75 + 0.8) / 2)
    assert s["mean_last_10pct_rounds"] == pytest.approx(0.8)


def test_round_one_is_timed_apart():
    t_local = {1: 10.0, 2: 1.0, 3: 2.0, 4: 1.5}
    t_agg = {1: 5.0, 2: 0.1, 3: 0.1, 4: 0.1}
    s = report.summarize(_metrics([0.1, 0.2, 0.3, 0.4], t_local, t_agg), rounds=4)
    assert s["t_round1_s"] == pytest.approx(15.0)
    assert s["t_round_median_s"] == pytest.approx(1.6)
    assert s["t_local_median_s"] == pytest.approx(1.5) and s["t_agg_median_s"] == pytest.approx(0.1)
    assert s["agg_share"] == pytest.approx(0.3 / 4.8)  # rounds 2-4 only
    assert s["agg_share_incl_round1"] == pytest.approx(5.3 / 19.8)
    assert s["t_local_total"] == pytest.approx(14.5) and s["t_eval_total"] == pytest.approx(2.0)
    # a resumed tail without round 1, and a run of one round
    assert report.summarize(_metrics([0.5], start=5), rounds=5)["t_round1_s"] is None
    one = report.summarize(_metrics([0.5], {1: 2.0}, {1: 0.5}), rounds=1)
    assert one["t_round_median_s"] is None and one["agg_share"] == pytest.approx(0.2)


def _seed_runs(n_seeds, rounds=6, explore=0, with_round0=False):
    rng = np.random.default_rng(0)
    runs = []
    for _ in range(n_seeds):
        ms = []
        for r in range(0 if with_round0 else 1, rounds + 1):
            m = {
                "round": r,
                "accuracy": 0.1 * r + 0.01 * rng.random(),
                "test_loss": 2.0 / (r + 1),
                "global_loss": 1.0 / (r + 1),
                "client_loss_var": 0.1 / (r + 1),
            }
            if r >= 1:
                m["agg"] = {"phase": "explore" if r <= explore else "aware"}
            ms.append(m)
        runs.append(ms)
    return runs


def test_plot_curves_writes_png_pdf_svg_atomically(tmp_path):
    pytest.importorskip("matplotlib")
    p = str(tmp_path / "c.png")
    got = report.plot_curves(
        {"fedavg": _seed_runs(3), "fedaware": _seed_runs(3, explore=2, with_round0=True)},
        p,
        title="digits, iid, 4 clients, mlp, 6 rounds, seeds 0,1,2",
    )
    assert got == p
    assert sorted(os.listdir(tmp_path)) == ["c.pdf", "c.png", "c.svg"]
    from PIL import Image

    with Image.open(p) as im:
        dpi = im.info.get("dpi")
    assert dpi is not None and round(dpi[0]) == 200
    svg = (tmp_path / "c.svg").read_text()
    # the caption says what the band is and that the warm-up rounds are FedAvg by design
    assert "sample standard deviation" in svg and "FedAvg steps by design" in svg
    assert "global objective" in svg and "variance of client losses" in svg
    report.plot_curves({"a": _seed_runs(2)}, str(tmp_path / "ci.png"), band="ci", formats=("png", "svg"))
    assert "95% Student-t confidence interval" in (tmp_path / "ci.svg").read_text()
    with pytest.raises(ValueError, match="band"):
        report.plot_curves({"a": _seed_runs(2)}, str(tmp_path / "x.png"), band="minmax")


def test_plot_interrupted_leaves_no_file(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    real = Figure.savefig
    calls = []

    def flaky(self, fname, *a, **k):
        calls.append(fname)
        if len(calls) == 2:  # the PNG is rendered, the PDF is interrupted
            raise KeyboardInterrupt
        return real(self, fname, *a, **k)

    monkeypatch.setattr(Figure, "savefig", flaky)
    old = tmp_path / "c.png"
    old.write_bytes(b"previous figure")
    with pytest.raises(KeyboardInterrupt):
        report.plot_curves({"a": _seed_runs(2)}, str(old))
    # the previous PNG is intact, no PDF/SVG and no temporary file is left
    assert sorted(os.listdir(tmp_path)) == ["c.png"] and old.read_bytes() == b"previous figure"


def test_atomic_path_and_json(tmp_path):
    p = tmp_path / "a.json"
    report.write_json_atomic(str(p), {"x": float("nan"), "y": [1, 2]})
    assert json.loads(p.read_text()) == {"x": None, "y": [1, 2]}
    with pytest.raises(RuntimeError):
        with report.atomic_path(str(p)) as tmp:
            open(tmp, "w").write("partial")
            raise RuntimeError("boom")
    assert json.loads(p.read_text())["y"] == [1, 2] and os.listdir(tmp_path) == ["a.json"]


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_partition_report_json_text_and_plot(tmp_path):
    labels = np.array([0, 0, 1, 1, 2, 2, 2, 0, 1, 2])
    parts = [np.array([0, 1, 2]), np.array([3, 4, 5, 6]), np.array([7, 8, 9])]
    info = report.write_partition_report(str(tmp_path), labels, parts, num_classes=4, plot=_has_matplotlib())
    j = json.loads((tmp_path / "partition.json").read_text())
    assert j["sizes"] == [3, 4, 3] and j["num_classes"] == 4
    assert j["label_histogram"] == [[2, 1, 0, 0], [0, 1, 3, 0], [1, 1, 1, 0]]
    assert j["stats"]["num_samples"] == 10 and j["stats"]["classes_per_client_max"] == 3
    assert "3 clients, 10 samples" in (tmp_path / "partition.txt").read_text()
    if _has_matplotlib():
        assert (tmp_path / "partition.png").exists() and (tmp_path / "partition.pdf").exists()
        assert info["plot"] == str(tmp_path / "partition.png")


def test_run_writer_titles_name_the_setup(tmp_path):
    pytest.importorskip("matplotlib")
    cfg = RunConfig.from_dict(
        {
            "rounds": 3,
            "num_clients": 4,
            "data": {"name": "digits"},
            "partition": {"scheme": "dirichlet", "options": {"alpha": 0.1}},
            "model": {"name": "mlp"},
            "algorithm": {"name": "fedaware"},
        }
    )
    w = report.RunWriter(str(tmp_path))
    w.write_config(cfg)
    w.plot(_seed_runs(1, rounds=3)[0])
    svg = (tmp_path / "curves.svg").read_text()
    assert "digits, dirichlet(alpha=0.1), 4 clients, mlp, 3 rounds" in svg
    assert (
        report.describe_setup(cfg, [0, 1], preset="p")
        == "p: digits, dirichlet(alpha=0.1), 4 clients, mlp, 3 rounds, seeds 0,1"
    )


def test_atomic_files_get_the_usual_mode(tmp_path):
    um = os.umask(0o022)
    try:
        report.write_text_atomic(str(tmp_path / "a.txt"), "x")
    finally:
        os.umask(um)
    assert (os.stat(tmp_path / "a.txt").st_mode & 0o777) == 0o644


def _drawn_figures(monkeypatch):
    """Every Figure saved from now on (the figure objects, to inspect what was drawn)."""
    from matplotlib.figure import Figure

    real, figs = Figure.savefig, []

    def keep(self, *a, **k):
        if self not in figs:
            figs.append(self)
        return real(self, *a, **k)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figs


def test_partition_legend_is_beside_the_bars(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    figs = _drawn_figures(monkeypatch)
    H = np.zeros((10, 10), dtype=int)
    H[np.arange(10), np.arange(10)] = 500
    H[9, 9] = 2000  # the tallest bar is the last client's, at the top right
    report.plot_partition(H, str(tmp_path / "p.png"), formats=("png",), dpi=60)
    (fig,) = figs
    fig.canvas.draw()
    ax = fig.axes[1]
    legend = ax.get_legend()
    assert legend is not None and [t.get_text() for t in legend.get_texts()] == [str(c) for c in range(10)]
    # the legend lies right of the axes: it covers no client's bar
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1


def test_identical_curves_stay_visible_and_caption_counts_seeds(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    figs = _drawn_figures(monkeypatch)
    same = _seed_runs(1)[0]
    report.plot_curves(
        {"fedavg": same, "fedprox:mu=0": [dict(m) for m in same], "kuramoto": same},
        str(tmp_path / "c.png"),
        formats=("png",),
        dpi=60,
    )
    fig = figs[-1]
    lines = fig.axes[0].get_lines()
    assert len(lines) == 3
    # same data, yet each curve has its own dash pattern and marker, and the one below is wider
    styles = {(ln.get_linestyle(), ln.get_marker(), ln.get_markerfacecolor() == "none") for ln in lines}
    assert len({s[0] for s in styles}) == 3 and len({s[1] for s in styles}) == 3
    assert lines[0].get_linewidth() > lines[1].get_linewidth() > lines[2].get_linewidth()
    assert lines[0].get_markersize() > lines[1].get_markersize()
    caption = " ".join(t.get_text() for t in fig.texts)
    assert "Lines: one run (a single seed) per method" in caption
    # one method, one run: the caption does not speak of methods; with seeds it counts them
    report.plot_curves({"fedavg": same}, str(tmp_path / "one.png"), formats=("png",), dpi=60)
    caption = " ".join(t.get_text() for t in figs[-1].texts)
    assert caption.startswith("Line: one run (a single seed)") and "per method" not in caption
    report.plot_curves({"fedavg": _seed_runs(3)}, str(tmp_path / "three.png"), formats=("png",), dpi=60)
    assert "mean over 3 seeds" in " ".join(t.get_text() for t in figs[-1].texts)
