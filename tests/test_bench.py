"""Tests of dkicf.bench: a tiny run of the paper's grid, its outputs and its input errors."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from dkicf import KernelKMeans
from dkicf.bench import METHODS, SYNTHETIC, add_parser, known_datasets, run_paper
from dkicf.metrics import clustering_accuracy
from dkicf.synthetic import make_zigzag

pytest.importorskip("matplotlib")

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
FIGURES = ("trace_error.png", "synthetic.png", "accuracy.png", "time.png", "time_small.png")


def _quick(out, **kw):
    """A run small enough for the test suite: 120 Ring points, sizes 10 and 20."""
    args = dict(datasets=["ring:120"], sizes=[10, 20], repeats=2, out_dir=out,
                progress=False, trace_datasets=["ring:120"], trace_rank=30, synthetic=False)
    args.update(kw)
    return run_paper(**args)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rows = _quick(out, synthetic=True)
    return out, rows


def test_tiny_run_writes_csv_table_and_figures(tiny_run):
    import matplotlib.image as mpimg

    out, rows = tiny_run
    # 3 synthetic sets x 2 repeats; grid: 4 sized methods x 2 sizes x 2 repeats + 2 full x 2.
    assert len(rows) == 3 * 2 + 4 * 2 * 2 + 2 * 2
    with open(out / "results.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    assert {r["method"] for r in table if r["experiment"] == "grid"} == set(METHODS)
    assert {r["dataset"] for r in table if r["experiment"] == "synthetic"} == set(SYNTHETIC)
    for r in table:
        assert 0.0 <= float(r["acc"]) <= 1.0
        assert 0.0 <= float(r["nmi"]) <= 1.0 + 1e-12
        assert float(r["time_s"]) > 0.0
    md = (out / "results.md").read_text()
    assert "| method | s | runs | ACC mean ± std | NMI mean ± std | median time (s) |" in md
    assert "## Ring:120" in md and "| Nyström | 20 | 2 |" in md and "| Kernel | full | 2 |" in md
    assert "## ICF trace error" in md and "## Synthetic 2-D sets" in md
    for name in FIGURES:
        image = mpimg.imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    with open(out / "trace_error.csv", newline="") as f:
        trace = list(csv.DictReader(f))
    assert [int(r["rank"]) for r in trace] == list(range(31))
    errors = [float(r["trace_error"]) for r in trace]
    assert errors[0] == pytest.approx(120.0) and np.all(np.diff(errors) <= 1e-9)


def test_icf_time_is_factorization_plus_kmeans(tiny_run):
    _, rows = tiny_run
    icf = [r for r in rows if r["method"] == "icf" and r["experiment"] == "grid"]
    for r in icf:
        assert r["time_s"] == pytest.approx(r["factor_time_s"] + r["kmeans_time_s"])
        assert r["rank"] == r["size"]
    # One timed factorization per dataset and size: every repeat at a size shares its time
    # (each size is its own run, so a smaller s need not take less time on a busy machine).
    by_size = {}
    for r in icf:
        by_size.setdefault(r["size"], set()).add(r["factor_time_s"])
    assert sorted(by_size) == [10, 20] and all(len(v) == 1 for v in by_size.values())


def test_icf_rows_equal_the_estimator(tmp_path):
    rows = _quick(tmp_path, datasets=["zigzag:300"], methods=["icf"], trace_datasets=None)
    X, y = make_zigzag(300, random_state=0)
    for r in rows:
        est = KernelKMeans(n_clusters=2, gamma=SYNTHETIC["zigzag"][1], rank=r["size"], tol=1e-3,
                           algorithm="lloyd", n_init=1, max_iter=1000, random_state=r["seed"])
        assert r["acc"] == clustering_accuracy(y, est.fit(X).labels_)
    assert not (tmp_path / "trace_error.png").exists()


def test_repeat_caps_and_exact_limit(tmp_path):
    rows = _quick(tmp_path, methods=["icf", "rff", "kernel"], trace_datasets=None,
                  max_exact_n=100, dataset_repeats={"ring": 3}, method_repeats={"rff": 1})
    count = {}
    for r in rows:
        count[r["method"]] = count.get(r["method"], 0) + 1
    assert count == {"icf": 3 * 2, "rff": 1 * 2}
    assert "not run: n = 120 > max_exact_n = 100" in (tmp_path / "results.md").read_text()


def test_unknown_dataset_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="Unknown dataset 'pendigit'. Known datasets are: "
                                         "pendigits, .*ring, parabolic, zigzag"):
        _quick(tmp_path, datasets=["pendigit"])
    with pytest.raises(ValueError, match="Unknown dataset 'digits'"):
        _quick(tmp_path, trace_datasets=["digits"])
    assert not any(tmp_path.iterdir())
    assert "mnist" in known_datasets() and "ring" in known_datasets()


def test_oversize_subset_is_refused_with_both_numbers(tmp_path):
    with pytest.raises(ValueError, match=r"subset size s=150 is larger than n=120.*ring:120"):
        _quick(tmp_path, sizes=[10, 150], methods=["icf"])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"methods": ["icf", "spectral"]}, "Unknown method 'spectral'. Known methods are: icf"),
        ({"methods": []}, "methods is empty"),
        ({"sizes": [0, 10]}, "every subset size must be an integer >= 1, got 0"),
        ({"repeats": 0}, "repeats must be an integer >= 1"),
        ({"datasets": ["ring:0"]}, "row count >= 1"),
        ({"method_repeats": {"spectral": 1}}, "method_repeats: unknown key 'spectral'"),
    ],
)
def test_bad_arguments(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        _quick(tmp_path, **kw)


def test_cli_parser_and_run(tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser(prog="dkicf")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args([
        "bench", "paper", "--datasets", "parabolic:100", "--sizes", "10", "--repeats", "1",
        "--methods", "icf", "Nyström", "--out-dir", str(tmp_path), "--trace-datasets",
        "--no-synthetic", "--method-repeats", "nystrom=1",
    ])
    assert args.command == "bench" and args.bench_command == "paper"
    from dkicf.bench import run_cli

    args.quiet = True
    assert run_cli(args) == 0
    assert "2 runs" in capsys.readouterr().out
    assert (tmp_path / "accuracy.png").exists() and not (tmp_path / "trace_error.png").exists()
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "paper", "--sizes", "0"])


@pytest.mark.skipif(not (SHARED_DATA / "pendigits.npz").is_file(),
                    reason=f"pendigits.npz not found in {SHARED_DATA} (no network in tests)")
def test_real_dataset_subsample(tmp_path):
    rows = run_paper(["pendigits:400"], [10, 20], 1, tmp_path, data_home=SHARED_DATA,
                     methods=["icf", "approx", "kernel"], progress=False,
                     trace_datasets=None, synthetic=False)
    assert {(r["method"], r["size"]) for r in rows} == {
        ("icf", 10), ("icf", 20), ("approx", 10), ("approx", 20), ("kernel", None)}
    assert all(r["n"] == 400 and r["n_features"] == 16 and r["gamma"] == 2.0**-16 for r in rows)
    assert "seeded subsample of 400 rows" in (tmp_path / "results.md").read_text()


# ----------------------------------------------------------------- resume


def _keyed(rows):
    return {(r["experiment"], r["dataset"], r["method"], r["size"], r["repeat"]): r for r in rows}


def test_resume_keeps_the_old_rows_and_runs_only_the_missing_ones(tmp_path):
    first = _quick(tmp_path, repeats=1, sizes=[10], methods=["icf", "nystrom"])
    resumed = _quick(tmp_path, repeats=2, methods=["icf", "nystrom"], resume=True)
    fresh = _quick(tmp_path / "fresh", repeats=2, methods=["icf", "nystrom"])
    old, new, ref = _keyed(first), _keyed(resumed), _keyed(fresh)
    assert len(resumed) == len(fresh) == 2 * 2 * 2 and new.keys() == ref.keys()
    for key, row in old.items():  # kept as read back, timing included (6 digits)
        if row["method"] == "icf":  # the factorization was timed again in this run
            assert new[key]["kmeans_time_s"] == pytest.approx(row["kmeans_time_s"], rel=1e-5)
        else:
            assert new[key]["time_s"] == pytest.approx(row["time_s"], rel=1e-5)
    for key, row in ref.items():  # the same seeds give the same clusterings
        assert new[key]["seed"] == row["seed"]
        assert new[key]["acc"] == pytest.approx(row["acc"], abs=1e-6)
    with open(tmp_path / "results.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == len(fresh)
    assert "resumed: 2 runs were kept" in (tmp_path / "results.md").read_text()


def test_resume_of_a_finished_run_runs_nothing_and_reuses_the_trace(tmp_path, monkeypatch):
    _quick(tmp_path, repeats=1, methods=["nystrom"])
    import dkicf.bench as bench

    def fail(*args, **kwargs):
        raise AssertionError("a finished run was run again")

    monkeypatch.setattr(bench, "_record_baseline", fail)
    monkeypatch.setattr(bench, "_factorize", fail)
    rows = _quick(tmp_path, repeats=1, methods=["nystrom"], resume=True)
    assert len(rows) == 2
    with open(tmp_path / "trace_error.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 30 + 1


def test_resume_drops_a_row_cut_short_by_an_interrupted_write(tmp_path):
    _quick(tmp_path, repeats=1, methods=["nystrom"])
    path = tmp_path / "results.csv"
    text = path.read_text()
    path.write_text(text[: text.rindex("\n", 0, len(text) - 1) + 1] + "grid,ring:120,120,2")
    rows = _quick(tmp_path, repeats=1, methods=["nystrom"], resume=True)
    assert sorted(r["size"] for r in rows) == [10, 20]
    assert path.read_text().count("\n") == 3


def test_an_earlier_run_is_kept_unless_resume_or_overwrite(tmp_path):
    _quick(tmp_path, repeats=1, methods=["nystrom"])
    before = (tmp_path / "results.csv").read_bytes()
    assert (tmp_path / "trace_error.png").exists()
    with pytest.raises(FileExistsError, match="--resume.*--overwrite"):
        _quick(tmp_path, repeats=1, methods=["icf"])
    assert (tmp_path / "results.csv").read_bytes() == before
    with pytest.raises(ValueError, match="one of the two"):
        _quick(tmp_path, repeats=1, methods=["icf"], resume=True, overwrite=True)
    rows = _quick(tmp_path, repeats=1, methods=["icf"], trace_datasets=None, overwrite=True)
    with open(tmp_path / "results.csv", newline="") as f:
        assert {r["method"] for r in csv.DictReader(f)} == {"icf"} == {r["method"] for r in rows}
    # The earlier run's trace figure is not left beside results it does not belong to.
    assert not (tmp_path / "trace_error.png").exists() and (tmp_path / "accuracy.png").exists()


def test_cli_accepts_quiet_and_overwrite_after_paper(tmp_path):
    from dkicf.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "paper", "--out-dir", str(tmp_path), "--quiet", "--overwrite"])
    assert args.quiet and args.overwrite and not args.resume


@pytest.mark.parametrize("change, match", [
    (dict(seed=1), "has seed"),
    (dict(datasets=["ring:100"], trace_datasets=[]), None),  # another token: nothing to check
])
def test_resume_refuses_rows_of_another_seed(tmp_path, change, match):
    _quick(tmp_path, repeats=1, methods=["nystrom"])
    if match is None:
        rows = _quick(tmp_path, repeats=1, methods=["nystrom"], resume=True, **change)
        assert {r["dataset"] for r in rows} == {"ring:120", "ring:100"}
        return
    before = (tmp_path / "results.csv").read_bytes()
    with pytest.raises(ValueError, match=match):
        _quick(tmp_path, repeats=1, methods=["nystrom"], resume=True, **change)
    assert (tmp_path / "results.csv").read_bytes() == before  # nothing lost


def test_resume_refuses_a_file_that_is_not_a_results_csv(tmp_path):
    (tmp_path / "results.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a results.csv"):
        _quick(tmp_path, repeats=1, methods=["nystrom"], resume=True)
    assert (tmp_path / "results.csv").read_text() == "a,b\n1,2\n"


def test_resume_gives_kept_icf_rows_this_runs_factorization_time(tmp_path):
    _quick(tmp_path, repeats=1, methods=["icf"])
    path = tmp_path / "results.csv"
    rows = list(csv.DictReader(open(path, newline="")))
    for row in rows:  # pretend the first run's factorization was far slower
        row["factor_time_s"] = "100"
        row["time_s"] = str(100 + float(row["kmeans_time_s"]))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    out = _quick(tmp_path, repeats=2, methods=["icf"], resume=True)
    by_size = {}
    for row in out:
        by_size.setdefault(row["size"], set()).add(row["factor_time_s"])
        assert row["time_s"] == pytest.approx(row["factor_time_s"] + row["kmeans_time_s"])
    assert all(len(times) == 1 and max(times) < 100 for times in by_size.values())
    on_disk = list(csv.DictReader(open(path, newline="")))
    assert len(on_disk) == 4 and all(float(r["factor_time_s"]) < 100 for r in on_disk)
    assert "the ICF rows kept for it (2)" in (tmp_path / "results.md").read_text()


def test_icf_time_at_each_size_is_that_of_a_run_to_that_rank(tmp_path, monkeypatch):
    """Block rules report a pass of pivots at once: each s gets its own timed run."""
    import dkicf.bench as bench

    calls = []
    real = bench.incomplete_cholesky

    def spy(X, **kw):
        res = real(X, **kw)
        calls.append((kw["max_rank"], res.elapsed))
        return res

    monkeypatch.setattr(bench, "incomplete_cholesky", spy)
    rows = _quick(tmp_path, repeats=1, sizes=[5, 10, 20], methods=["icf"], trace_datasets=[])
    assert sorted(k for k, _ in calls) == [5, 10, 20]
    elapsed = dict(calls)
    for row in rows:
        assert row["factor_time_s"] == elapsed[row["size"]]
