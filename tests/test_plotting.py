"""The plots' artists: labels, legends, ticks and what they show, not only that a PNG exists."""

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from dkicf import plotting  # noqa: E402


def _close(fig):
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_trace_error_is_relative_to_the_trace_with_tol_marked():
    errors = np.array([50.0, 10.0, 1.0, 0.1])
    fig = plotting._trace_error_figure(errors, initial_trace=100.0, tol=0.5)
    ax = fig.axes[0]
    line = ax.get_lines()[0]
    np.testing.assert_allclose(line.get_xdata(), [0, 1, 2, 3, 4])
    np.testing.assert_allclose(line.get_ydata(), [1.0, 0.5, 0.1, 0.01, 0.001])
    tol_line = ax.get_lines()[1]
    np.testing.assert_allclose(tol_line.get_ydata(), [0.005, 0.005])
    assert "tr $K$" in ax.get_ylabel() and ax.get_xlabel().startswith("rank s")
    assert ax.get_yscale() == "log"
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert texts == ["trace error", "tol = 0.5 (5.0e-03 of tr K)"]
    _close(fig)
    # A tol far below the curve is named in the legend, not drawn.
    fig = plotting._trace_error_figure(errors, initial_trace=100.0, tol=1e-9)
    ax = fig.axes[0]
    assert len(ax.get_lines()[1].get_ydata()) == 0
    assert ax.get_legend().get_texts()[1].get_text().endswith("below the axis")
    _close(fig)


def test_cluster_sizes_have_one_integer_tick_per_cluster():
    fig = plotting._cluster_sizes_figure(np.array([5, 0, 12]))
    ax = fig.axes[0]
    assert [t for t in ax.get_xticks()] == [0, 1, 2]
    assert [p.get_height() for p in ax.patches] == [5, 0, 12]
    assert all(float(t).is_integer() for t in ax.get_yticks())
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("cluster", "points")
    colours = {p.get_facecolor() for p in ax.patches}
    assert len(colours) == 3  # one colour per cluster, as in the scatter
    _close(fig)


def test_scatter_legend_names_every_cluster_with_its_size_in_distinct_colours():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 2))
    labels = np.repeat([0, 1, 2], [100, 150, 50])
    fig = plotting._scatter_figure(X, labels, counts=np.array([1000, 1500, 500]),
                                   pivots=X[:4], xlabel="a", ylabel="b")
    ax = fig.axes[0]
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert texts == ["cluster 0 (1,000 points)", "cluster 1 (1,500 points)",
                     "cluster 2 (500 points)", "4 pivots"]
    points = ax.collections[:3]
    assert [len(c.get_offsets()) for c in points] == [100, 150, 50]
    colours = [tuple(c.get_facecolor()[0]) for c in points]
    assert len(set(colours)) == 3
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("a", "b")
    _close(fig)


def test_pca_scatter_of_p_for_more_than_two_features():
    rng = np.random.default_rng(1)
    # Spread along the first axis only: the first component carries ~all variance.
    P = np.zeros((200, 5))
    P[:, 0] = np.repeat([-3.0, 3.0], 100) + rng.normal(scale=0.1, size=200)
    P[:, 1] = rng.normal(scale=0.01, size=200)
    labels = np.repeat([0, 1], 100)
    fig = plotting._pca_figure(P, labels, pivot_features=P[:3])
    ax = fig.axes[0]
    assert ax.get_xlabel().startswith("principal component 1 of P (100% of variance)")
    assert ax.get_ylabel().startswith("principal component 2 of P (0% of variance)")
    xs = [c.get_offsets()[:, 0] for c in ax.collections[:2]]
    assert np.sign(xs[0]).std() == 0 and np.sign(xs[1]).std() == 0  # one side each
    assert np.sign(xs[0][0]) != np.sign(xs[1][0])
    _close(fig)


def test_plot_model_writes_the_pca_scatter_for_wide_data(tmp_path):
    import matplotlib.image

    from dkicf import KernelKMeans
    from dkicf.synthetic import make_blobs

    X, _ = make_blobs(600, n_features=6, centers=3, random_state=0)
    model = KernelKMeans(n_clusters=3, rank=15, random_state=0).fit(X)
    model.save(tmp_path / "m.zarr")  # a saved model holds no P: computed from the data
    paths = plotting.plot_model(str(tmp_path / "m.zarr"), tmp_path / "plots")
    assert [p.name for p in paths] == ["trace_error.png", "cluster_sizes.png"]
    from dkicf import io

    np.save(tmp_path / "x.npy", X)
    io.convert(tmp_path / "x.npy", tmp_path / "x.zarr", dtype="float64")
    paths = plotting.plot_model(str(tmp_path / "m.zarr"), tmp_path / "plots",
                                data=str(tmp_path / "x.zarr"))
    assert [p.name for p in paths] == ["trace_error.png", "cluster_sizes.png", "clusters.png"]
    for p in paths:
        assert matplotlib.image.imread(p).shape[0] > 100
