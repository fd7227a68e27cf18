"""Reproduce the paper's experiments: every method on the paper's grid, tables and figures.

:func:`run_paper` runs ICF kernel k-means (:class:`dkicf.KernelKMeans`) and the
paper's baselines (:mod:`dkicf.baselines`) over datasets x subset sizes x
repeats, and writes to ``out_dir``:

* ``results.csv``: one row per fit, written as the run goes, so a long run
  can be followed and a partial one is not lost.  Its columns: ``experiment``
  (``"grid"`` or ``"synthetic"``), ``dataset``, ``n``, ``n_features``,
  ``n_clusters``, ``gamma``, ``method``, ``size`` (None for the full-kernel
  methods), ``rank`` (ICF's rank reached), ``repeat``, ``seed``, ``acc``,
  ``nmi``, ``time_s`` (wall seconds of the fit; for ICF factorization up to
  ``s`` plus k-means), ``factor_time_s`` and ``kmeans_time_s`` (ICF's two
  parts), ``n_iter`` and ``note`` (warnings raised by the fit);
* ``results.md``: the run's settings, then per dataset a table of mean ± std
  of accuracy and NMI and the median time per method and subset size, the ICF
  trace errors and the synthetic results;
* ``trace_error.csv``: ``tr(K - P P^T)`` against the rank on the trace
  datasets;
* PNG figures mirroring the paper's: ``trace_error.png``, ``synthetic.png``,
  ``accuracy.png``, ``time.png`` and ``time_small.png``.

How the methods are timed
-------------------------
The factorization of ICF is deterministic: its pivots and ``P`` depend on the
data, the kernel and ``s`` only.  It is therefore computed once per dataset,
up to the largest subset size, and the factor of rank ``s`` is the first ``s``
columns of that one (greedy pivoting picks the same first ``s`` pivots
whatever the final rank).  The ICF time of a repeat at size ``s`` is the wall
time of a factorization run with ``max_rank=s``, measured once per dataset
and size, plus that repeat's own k-means time.  (The block pivot rules
report a whole pass of pivots at once, so the time until the ``s``-th pivot
of the longer run would count the rest of that pass.)  The k-means step is the one
``KernelKMeans(rank=s, tol=1e-3, algorithm="lloyd", random_state=seed)``
runs, with the same derived seed, so a repeat's labels are those of that
estimator's ``fit``.  Every baseline is timed as one call to its ``fit``
(kernel matrix, factorization or features included).

Resuming a run
--------------
With ``resume=True`` a run is identified by experiment, dataset, method,
size and repeat; the rows already in ``results.csv`` are kept and only the
missing runs are done.  The trace-error curves of an existing
``trace_error.csv`` are reused when they reach the rank asked for.  The old
rows must come from the same ``seed`` and data (checked: ``n``, ``gamma`` and
every repeat's seed); ``n_init`` and ``max_iter`` are not stored, so keep
them too.

The CLI entry is ``dkicf bench paper``; :func:`add_parser` (from
:mod:`dkicf._bench_grid`, which the command line's parser imports without
this module's baselines) and :func:`run_cli` plug it into :mod:`dkicf.cli`.
The tables and figures are drawn by :mod:`dkicf._bench_report`.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ._bench_grid import (
    DEFAULT_DATASETS,
    DEFAULT_SIZES,
    DEFAULT_TRACE_DATASETS,
    DISPLAY,
    FULL_METHODS,
    METHOD_LABELS,
    METHODS,
    PAPER_MAX_ITER,
    PAPER_TOL,
    SYNTHETIC,
    SYNTHETIC_RANK,
    add_parser,
    known_datasets,
)
from ._bench_report import Trace, figures, write_markdown, write_trace_csv
from .baselines import (
    ApproxKernelKMeans,
    ExactKernelKMeans,
    KernelCholKMeans,
    NystromKernelKMeans,
    RFFKernelKMeans,
)
from .datasets import PAPER_GAMMA, load_dataset
from .estimator import KernelKMeans
from .icf import ICFResult, incomplete_cholesky
from .kmeans import kmeans
from .metrics import clustering_accuracy, nmi

__all__ = [
    "METHODS",
    "SYNTHETIC",
    "DEFAULT_DATASETS",
    "DEFAULT_SIZES",
    "known_datasets",
    "run_paper",
    "add_parser",
    "run_cli",
]

# Other names the methods are known by.
_ALIASES = {"nyström": "nystrom", "exact": "kernel", "chol": "kernel+chol"}
_SYNTHETIC_N = 1000  # points of a 2-D set given without ":n"
_CSV_FIELDS = (
    "experiment", "dataset", "n", "n_features", "n_clusters", "gamma", "method", "size",
    "rank", "repeat", "seed", "acc", "nmi", "time_s", "factor_time_s", "kmeans_time_s",
    "n_iter", "note",
)


# --------------------------------------------------------------------------- inputs


@dataclass
class _Data:
    token: str
    name: str
    X: np.ndarray
    y: np.ndarray
    gamma: float
    note: str = ""

    @property
    def n(self) -> int:
        return int(self.X.shape[0])

    @property
    def n_clusters(self) -> int:
        return int(np.unique(self.y).size)

    @property
    def label(self) -> str:
        return self.token.replace(self.name, DISPLAY.get(self.name, self.name), 1)


def _parse_token(token) -> tuple[str, int | None]:
    """``"name"`` or ``"name:n"`` (a seeded subsample of n rows, or n synthetic points)."""
    if not isinstance(token, str):
        raise TypeError(f"a dataset must be given by name, got {token!r}.")
    name, _, count = token.strip().lower().partition(":")
    if name not in known_datasets():
        raise ValueError(
            f"Unknown dataset {token!r}. Known datasets are: {', '.join(known_datasets())} "
            "(append ':n' for a seeded subsample of n rows, e.g. 'mnist:20000')."
        )
    if not count:
        return name, None
    try:
        rows = int(count)
    except ValueError:
        rows = 0
    if rows < 1:
        raise ValueError(f"in dataset {token!r}, the part after ':' must be a row count >= 1.")
    return name, rows


def _load(token: str, data_home, seed: int) -> _Data:
    name, rows = _parse_token(token)
    if name in SYNTHETIC:
        make, gamma = SYNTHETIC[name]
        X, y = make(rows or _SYNTHETIC_N, random_state=seed)
        return _Data(token, name, X, y, gamma, note=f"generated, random_state={seed}")
    X, y = load_dataset(name, data_home=data_home)
    note = "all rows"
    if rows is not None:
        if rows > X.shape[0]:
            raise ValueError(
                f"dataset {token!r} asks for {rows} rows but {name} has n={X.shape[0]}; "
                f"use at most {X.shape[0]}."
            )
        if rows < X.shape[0]:
            pick = np.random.default_rng(seed).choice(X.shape[0], size=rows, replace=False)
            pick.sort()
            X, y = X[pick], y[pick]
            note = f"seeded subsample of {rows} rows (seed {seed})"
    return _Data(token, name, X, y, PAPER_GAMMA[name], note=note)


def _check_methods(methods) -> tuple[str, ...]:
    if methods is None:
        return METHODS
    if isinstance(methods, str):
        methods = [methods]
    out = []
    for m in methods:
        key = _ALIASES.get(str(m).lower(), str(m).lower())
        if key not in METHODS:
            raise ValueError(f"Unknown method {m!r}. Known methods are: {', '.join(METHODS)}.")
        if key not in out:
            out.append(key)
    if not out:
        raise ValueError(f"methods is empty; pick some of: {', '.join(METHODS)}.")
    return tuple(k for k in METHODS if k in out)


def _check_positive(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    return int(value)


def _check_sizes(sizes) -> tuple[int, ...]:
    if isinstance(sizes, (int, np.integer)):
        sizes = [sizes]
    sizes = [_check_positive(s, "every subset size") for s in sizes]
    if not sizes:
        raise ValueError("sizes is empty; give at least one subset size, e.g. [25, 50, 100].")
    return tuple(sorted(set(sizes)))


def _check_repeat_map(mapping, name: str, valid: Iterable[str]) -> dict[str, int]:
    valid = tuple(valid)
    out = {}
    for key, value in (mapping or {}).items():
        k = _ALIASES.get(str(key).lower(), str(key).lower())
        if k not in valid:
            raise ValueError(f"{name}: unknown key {key!r}; valid keys: {', '.join(valid)}.")
        out[k] = _check_positive(value, f"{name}[{key!r}]")
    return out


def _repeat_seed(seed: int, repeat: int) -> int:
    return int(np.random.SeedSequence([seed, repeat]).generate_state(1)[0] >> 1)


# --------------------------------------------------------------------------- runs


@dataclass
class _Factor:
    """One ICF run to the largest rank needed, and the wall time of runs to smaller ranks."""

    result: ICFResult
    elapsed: np.ndarray  # elapsed[r - 1]: seconds until the r-th pivot was reported
    P: np.ndarray = field(repr=False)
    note: str = ""  # warnings raised by the factorization
    times: dict[int, float] = field(default_factory=dict)  # s -> run with max_rank=s

    def time_at(self, s: int) -> float:
        """Wall seconds of the factorization to rank ``s``."""
        r = min(s, self.result.rank)
        if r == self.result.rank:
            return float(self.result.elapsed)
        if s in self.times:
            return self.times[s]
        return float(self.elapsed[r - 1])


def _factorize(
    data: _Data, max_rank: int, report: Callable[[int, int], None], timed: Iterable[int] = ()
) -> _Factor:
    """The factorization to ``max_rank``, and one timed run to each rank in ``timed``."""
    times: dict[int, float] = {}

    def progress(info):
        times[info.rank] = info.elapsed
        report(info.rank, info.max_rank)

    # gamma is a number, so the factorization uses no randomness (its seed only
    # draws the median heuristic's sample): greedy pivots depend on the data alone.
    kw = dict(kernel="gaussian", gamma=data.gamma, tol=PAPER_TOL, random_state=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = incomplete_cholesky(data.X, max_rank=max_rank, progress=progress, **kw)
        runs = {}
        for s in sorted(set(timed)):
            if s < res.rank:
                runs[s] = float(incomplete_cholesky(data.X, max_rank=s, **kw).elapsed)
    ranks = np.arange(1, res.rank + 1)
    known = np.array([times.get(r, np.nan) for r in ranks])
    # A pass that reports several pivots at once: later ranks share its time.
    elapsed = np.fmin.accumulate(known[::-1])[::-1] if known.size else known
    elapsed = np.where(np.isnan(elapsed), res.elapsed, elapsed)
    return _Factor(res, elapsed, np.asarray(res.P), note=_note(caught), times=runs)


def _icf_fit(data: _Data, factor: _Factor, s: int, seed: int, n_init: int, max_iter: int):
    """The k-means step of ``KernelKMeans(rank=s, ...)`` on the first s columns of the factor."""
    est = KernelKMeans(
        n_clusters=data.n_clusters, gamma=data.gamma, rank=s, tol=PAPER_TOL,
        algorithm="lloyd", n_init=n_init, max_iter=max_iter, random_state=seed,
    )
    _, km_seed = est._seeds()
    rank = min(s, factor.result.rank)
    t0 = time.perf_counter()
    km = kmeans(
        factor.P[:, :rank], est.n_clusters, algorithm=est.algorithm, batch_size=est.batch_size,
        n_init=est.n_init, max_iter=est.max_iter, tol=est.kmeans_tol, random_state=km_seed,
    )
    km_time = time.perf_counter() - t0
    labels = np.asarray(km.labels)
    return labels, km_time, rank, int(km.n_iter)


def _baseline(method: str, data: _Data, s: int | None, seed: int, n_init: int, max_iter: int):
    common = dict(n_clusters=data.n_clusters, gamma=data.gamma, max_iter=max_iter,
                  n_init=n_init, random_state=seed)
    if method == "kernel":
        return ExactKernelKMeans(**common)
    if method == "kernel+chol":
        return KernelCholKMeans(**common)
    cls = {"approx": ApproxKernelKMeans, "rff": RFFKernelKMeans, "nystrom": NystromKernelKMeans}
    return cls[method](n_components=s, **common)


def _note(caught) -> str:
    seen = []
    for w in caught:
        text = f"{w.category.__name__}: {str(w.message).splitlines()[0][:120]}"
        if text not in seen:
            seen.append(text)
    return " | ".join(seen)


class _Recorder:
    """Rows in memory and in results.csv, flushed row by row.

    ``previous`` rows (a resumed run's) are written first, through a temporary
    file renamed over ``path``, so an existing file is never left half-written.
    """

    def __init__(self, path: Path, previous: Sequence[dict] = ()):
        self.rows: list[dict] = list(previous)
        self._path = path
        self._file = None
        self.rewrite()

    def rewrite(self) -> None:
        """Write every row again (after kept rows changed), through a temporary file."""
        if self._file is not None:
            self._file.close()
        tmp = self._path.with_name(self._path.name + ".tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=_CSV_FIELDS)
            writer.writeheader()
            for row in self.rows:
                writer.writerow({k: _csv_value(row.get(k)) for k in _CSV_FIELDS})
        os.replace(tmp, self._path)
        self._file = open(self._path, "a", newline="", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._writer = csv.DictWriter(self._file, fieldnames=_CSV_FIELDS)

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self._writer.writerow({k: _csv_value(row.get(k)) for k in _CSV_FIELDS})
        self._file.flush()

    def close(self) -> None:
        self._file.close()


_INT_FIELDS = ("n", "n_features", "n_clusters", "size", "rank", "repeat", "seed", "n_iter")
_FLOAT_FIELDS = ("gamma", "acc", "nmi", "time_s", "factor_time_s", "kmeans_time_s")


def _read_results(path: Path) -> list[dict]:
    """The rows of a results.csv written by :func:`run_paper` (for ``resume``).

    A last line cut short by an interrupted write is dropped; any other
    malformed row is an error naming the file and the line.
    """
    with open(path, newline="", encoding="utf-8") as f:
        lines = f.read().splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines.pop()  # the run stopped while writing this row
    reader = csv.DictReader(lines)
    if tuple(reader.fieldnames or ()) != _CSV_FIELDS:
        raise ValueError(
            f"{path} is not a results.csv of 'dkicf bench paper' (its columns are "
            f"{reader.fieldnames}); use another out_dir or resume=False."
        )
    rows = []
    for line, raw in enumerate(reader, start=2):
        try:
            row = {k: raw[k] for k in _CSV_FIELDS}
            for k in _INT_FIELDS:
                row[k] = int(row[k]) if row[k] else None
            for k in _FLOAT_FIELDS:
                row[k] = float(row[k]) if row[k] else None
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"{path}, line {line}: cannot read this row ({exc}); the file is damaged. "
                "Remove the row or use another out_dir."
            ) from None
        rows.append(row)
    return rows


def _read_traces(path: Path) -> dict[str, Trace]:
    """The curves of a trace_error.csv written by :func:`run_paper` (for ``resume``)."""
    curves: dict[str, dict[int, float]] = {}
    try:
        with open(path, newline="", encoding="utf-8") as f:
            for raw in csv.DictReader(f):
                curves.setdefault(raw["dataset"], {})[int(raw["rank"])] = float(raw["trace_error"])
    except (KeyError, TypeError, ValueError):
        return {}  # unreadable: the curves are computed again
    out = {}
    for token, points in curves.items():
        rank = max(points)
        if 0 in points and all(r in points for r in range(1, rank + 1)):
            out[token] = Trace(points[0], np.array([points[r] for r in range(1, rank + 1)]))
    return out


def _csv_value(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


class _Progress:
    """A tqdm bar on stderr (or nothing) counting fits and factorizations."""

    def __init__(self, total: int, enabled: bool):
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, file=sys.stderr, unit="run", dynamic_ncols=True,
                             desc="bench paper")

    def where(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=True)

    def step(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _icf_reporter(progress: _Progress, label: str) -> Callable[[int, int], None]:
    def report(rank: int, max_rank: int) -> None:
        if rank == 1 or rank % 25 == 0 or rank == max_rank:
            progress.where(f"{label}: ICF rank {rank}/{max_rank}")

    return report


def _score(row: dict, y: np.ndarray, labels: np.ndarray) -> dict:
    row["acc"] = clustering_accuracy(y, labels)
    row["nmi"] = nmi(y, labels)
    return row


# --------------------------------------------------------------------------- driver


# What run_paper draws (each only when its experiment ran).
_FIGURES = ("trace_error.png", "synthetic.png", "accuracy.png", "time.png", "time_small.png")


def run_paper(
    datasets: Sequence[str] = DEFAULT_DATASETS, sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 10, out_dir: str | os.PathLike = "docs/results", *,
    data_home: str | os.PathLike | None = None, methods: Sequence[str] | None = None,
    progress: bool = True, max_exact_n: int = 12000, seed: int = 0,
    trace_datasets: Sequence[str] | None = DEFAULT_TRACE_DATASETS, trace_rank: int = 1000,
    synthetic: bool = True, n_init: int = 1, max_iter: int = PAPER_MAX_ITER,
    dataset_repeats: Mapping[str, int] | None = None,
    method_repeats: Mapping[str, int] | None = None, resume: bool = False,
    overwrite: bool = False,
) -> list[dict]:
    """Run every method over the paper's grid and write the tables and figures.

    Parameters
    ----------
    datasets : sequence of str
        Names from :func:`known_datasets` (case-insensitive): the paper's real
        datasets (loaded with :func:`dkicf.datasets.load_dataset`, scaled as
        the paper's kernel widths assume) and its 2-D sets ``"ring"``,
        ``"parabolic"``, ``"zigzag"`` (1,000 points).  ``"name:n"`` takes a
        seeded random subsample of ``n`` rows (``n`` points for a 2-D set).
        The Gaussian width is the paper's for each dataset.
    sizes : sequence of int
        Subset sizes ``s``: the rank of ICF, the subset of Approx and
        Nyström, the number of Fourier features of RFF.  A size larger than a
        dataset's ``n`` is refused before anything runs.
    repeats : int
        Runs per (dataset, method, size), with seeds derived from ``seed``.
    out_dir : str or path
        Folder for the outputs (created if needed).  One that holds an
        earlier run's ``results.csv`` is refused unless ``resume`` or
        ``overwrite`` is given.
    data_home : str or path, optional
        Folder holding the ``<name>.npz`` files (see :func:`load_dataset`).
    methods : sequence of str, optional
        Subset of :data:`METHODS`; default all.  ``"kernel"`` and
        ``"kernel+chol"`` run only on datasets with ``n <= max_exact_n``.
    progress : bool, default=True
        Show a tqdm progress bar on stderr.
    max_exact_n : int, default=12000
        Largest ``n`` on which the full-kernel methods run (the paper ran them
        on PenDigits and Satimage only).
    seed : int, default=0
        Root of every random choice: repeat ``r`` uses a seed derived from
        ``(seed, r)``, the same for every method; subsamples and the 2-D sets
        use ``seed`` itself.
    trace_datasets : sequence of str, optional
        Datasets for the trace-error figure (the paper: USPS at ``2^-10`` and
        MNIST at ``2^-6``); ``None`` or empty for no trace figure.
    trace_rank : int, default=1000
        Largest rank of the trace-error curves.
    synthetic : bool, default=True
        Cluster Ring, Parabolic and Zigzag with ICF at ``s = 50`` over the
        repeats and draw them with the pivots marked.
    n_init : int, default=1
        k-means (and kernel k-means) restarts inside every fit, the same for
        all methods.
    max_iter : int, default=1000
        Iteration cap of every k-means and kernel k-means (the paper's 1000).
    dataset_repeats : mapping of str to int, optional
        Repeats for some datasets instead of ``repeats`` (e.g. ``{"mnist": 5}``).
    method_repeats : mapping of str to int, optional
        A cap on the repeats of some methods (e.g. ``{"kernel+chol": 3}``).
    resume : bool, default=False
        Keep the rows of an existing ``out_dir/results.csv`` and run only the
        missing ones: an interrupted run continues, a run takes more sizes or
        repeats (see "Resuming a run" in the module's documentation).
    overwrite : bool, default=False
        Replace the results of an earlier run in ``out_dir`` (its figures
        that this run does not draw are removed at the end).

    Returns
    -------
    list of dict
        The rows of ``results.csv`` (its columns are in the module's
        documentation).

    Raises
    ------
    ValueError
        For an unknown dataset or method (the message lists the known ones), a
        size larger than a dataset's ``n`` (the message gives both), a
        non-positive count, or with ``resume``, a results.csv from other
        settings or a damaged one.
    FileExistsError
        ``out_dir`` holds an earlier run's results and neither ``resume`` nor
        ``overwrite`` is given.

    Examples
    --------
    >>> from dkicf.bench import run_paper
    >>> rows = run_paper(["ring:200"], [10, 20], 2, "bench-out", methods=["icf", "nystrom"],
    ...                  trace_datasets=["ring"], trace_rank=30, progress=False)  # doctest: +SKIP
    >>> sorted({r["method"] for r in rows})  # doctest: +SKIP
    ['icf', 'nystrom']
    """
    started = time.perf_counter()
    plan = _check_settings(
        datasets, sizes, repeats, methods=methods, max_exact_n=max_exact_n, seed=seed,
        trace_datasets=trace_datasets, trace_rank=trace_rank, synthetic=synthetic,
        n_init=n_init, max_iter=max_iter, dataset_repeats=dataset_repeats,
        method_repeats=method_repeats, data_home=data_home,
    )
    out = Path(out_dir)
    stale, previous, old_traces = _earlier_run(out, plan, resume=resume, overwrite=overwrite)
    bar = _Progress(_plan_runs(plan, previous, old_traces), progress)
    recorder = _Recorder(out / "results.csv", previous)
    synthetic_fits = {}  # the first repeat on each 2-D set, to draw
    try:
        if synthetic:
            synthetic_fits = _run_synthetic(plan, previous, recorder, bar)
        _run_grid(plan, previous, recorder, bar)
    finally:
        if plan.refreshed:
            recorder.rewrite()
        recorder.close()
        bar.close()
    _write_outputs(out, plan, recorder.rows, synthetic_fits, stale=stale,
                   elapsed=time.perf_counter() - started, resumed=len(previous))
    return recorder.rows


@dataclass
class _Plan:
    """A run of the grid: its checked settings, its data, and the runs it still has to do."""

    datasets: list[str]
    trace_datasets: list[str]
    sizes: tuple[int, ...]
    repeats: int
    methods: tuple[str, ...]
    max_exact_n: int
    trace_rank: int
    n_init: int
    max_iter: int
    seed: int
    synthetic: bool
    d_repeats: dict[str, int]
    m_repeats: dict[str, int]
    loaded: dict[str, _Data]
    done: set = field(default_factory=set)  # (experiment, dataset, method, size, repeat)
    # The runs still to do per dataset, as (method, size or None, repeat), in run order.
    grid: dict[str, list[tuple[str, int | None, int]]] = field(default_factory=dict)
    need: dict[str, int] = field(default_factory=dict)  # ranks to factorize per dataset
    traces: dict[str, Trace] = field(default_factory=dict)
    refreshed: int = 0  # kept ICF rows whose factorization time this run measured again

    @property
    def sized(self) -> list[str]:
        """The methods that take a subset size."""
        return [m for m in self.methods if m not in FULL_METHODS]

    def n_repeats(self, data: _Data, method: str) -> int:
        r = self.d_repeats.get(data.name, self.repeats)
        return min(r, self.m_repeats[method]) if method in self.m_repeats else r

    def exact_ok(self, data: _Data) -> bool:
        return data.n <= self.max_exact_n

    def todo(self, experiment: str, token: str, method: str, s, r: int) -> bool:
        return (experiment, token, method, s, r) not in self.done


def _check_settings(datasets, sizes, repeats, *, methods, max_exact_n, seed, trace_datasets,
                    trace_rank, synthetic, n_init, max_iter, dataset_repeats, method_repeats,
                    data_home) -> _Plan:
    """:func:`run_paper`'s arguments checked, and its datasets loaded, before anything runs."""
    if isinstance(datasets, str):
        datasets = [datasets]
    datasets = list(dict.fromkeys(datasets))
    trace_datasets = [] if trace_datasets is None else (
        [trace_datasets] if isinstance(trace_datasets, str) else list(trace_datasets))
    for token in datasets + trace_datasets:
        _parse_token(token)
    plan = _Plan(
        datasets=datasets,
        trace_datasets=trace_datasets,
        sizes=_check_sizes(sizes),
        repeats=_check_positive(repeats, "repeats"),
        methods=_check_methods(methods),
        max_exact_n=_check_positive(max_exact_n, "max_exact_n"),
        trace_rank=_check_positive(trace_rank, "trace_rank"),
        n_init=_check_positive(n_init, "n_init"),
        max_iter=_check_positive(max_iter, "max_iter"),
        seed=seed,
        synthetic=synthetic,
        d_repeats=_check_repeat_map(dataset_repeats, "dataset_repeats", known_datasets()),
        m_repeats=_check_repeat_map(method_repeats, "method_repeats", METHODS),
        loaded={},
    )
    for token in dict.fromkeys(datasets + trace_datasets):
        plan.loaded[token] = _load(token, data_home, seed)
    for token in datasets:
        data = plan.loaded[token]
        if plan.sized and plan.sizes[-1] > data.n:
            raise ValueError(
                f"subset size s={plan.sizes[-1]} is larger than n={data.n}, the number of rows "
                f"of dataset {token!r}; use sizes <= {data.n}."
            )
    return plan


def _earlier_run(out: Path, plan: _Plan, *, resume: bool, overwrite: bool):
    """What ``out`` holds of an earlier run: the figures to remove, the rows and the
    trace curves to keep."""
    if (out / "results.csv").exists() and not (resume or overwrite):
        raise FileExistsError(
            f"{out} holds the results of an earlier run ({out / 'results.csv'}); pass "
            "resume=True (dkicf bench paper: --resume) to continue it, overwrite=True "
            "(--overwrite) to replace it, or choose another out_dir (--out-dir)."
        )
    if resume and overwrite:
        raise ValueError("resume=True keeps the earlier results and overwrite=True replaces "
                         "them: pass one of the two.")
    out.mkdir(parents=True, exist_ok=True)
    stale = [out / name for name in _FIGURES if (out / name).exists()] if overwrite else []
    previous: list[dict] = []
    old_traces: dict[str, Trace] = {}
    if resume and (out / "results.csv").exists():
        previous = _read_results(out / "results.csv")
        _check_resumable(previous, plan.loaded, plan.seed, out / "results.csv")
        if (out / "trace_error.csv").exists():
            old_traces = _read_traces(out / "trace_error.csv")
    return stale, previous, old_traces


def _plan_runs(plan: _Plan, previous: list[dict], old_traces: dict[str, Trace]) -> int:
    """Fill in the runs still to do, the ranks to factorize and the trace curves kept;
    returns the steps of the progress bar."""
    plan.done = {(r["experiment"], r["dataset"], r["method"], r["size"], r["repeat"])
                 for r in previous}
    for token in plan.datasets:
        data = plan.loaded[token]
        cells = []
        for r in range(max(plan.n_repeats(data, m) for m in plan.methods)):
            for m in plan.methods:
                if m in FULL_METHODS and r < plan.n_repeats(data, m) and plan.exact_ok(data):
                    cells.append((m, None, r))
            cells += [(m, s, r) for s in plan.sizes for m in plan.sized
                      if r < plan.n_repeats(data, m)]
        plan.grid[token] = [c for c in cells if plan.todo("grid", token, *c)]
    # Ranks to factorize per dataset: the largest size still to run and the trace curve.
    for token in plan.datasets:
        icf_sizes = [s for m, s, _ in plan.grid[token] if m == "icf"]
        if icf_sizes:
            plan.need[token] = min(max(icf_sizes), plan.loaded[token].n)
    for token in plan.trace_datasets:
        rank = min(plan.trace_rank, plan.loaded[token].n)
        old = old_traces.get(token)
        if old is not None and old.rank >= rank:
            plan.traces[token] = Trace(old.initial_trace, old.trace_errors[:rank].copy())
        else:
            plan.need[token] = max(plan.need.get(token, 0), rank)
    total = len(plan.need) + sum(len(cells) for cells in plan.grid.values())
    return total + (len(SYNTHETIC) * (1 + plan.repeats) if plan.synthetic else 0)


def _run_synthetic(plan: _Plan, previous: list[dict], recorder: _Recorder, bar: _Progress):
    """ICF on the 2-D sets over the repeats; returns the first repeat's fits, to draw."""
    fits: dict[str, tuple[_Data, _Factor, np.ndarray]] = {}
    for name in SYNTHETIC:
        data = _load(name, None, plan.seed)
        bar.where(f"{data.label}: ICF")
        factor = _factorize(data, SYNTHETIC_RANK, _icf_reporter(bar, data.label))
        plan.refreshed += _refresh_factor_times(previous, "synthetic", data.token, factor)
        bar.step()
        for r in range(plan.repeats):
            rseed = _repeat_seed(plan.seed, r)
            bar.where(f"{data.label} ICF s={SYNTHETIC_RANK} repeat {r + 1}/{plan.repeats}")
            if plan.todo("synthetic", data.token, "icf", SYNTHETIC_RANK, r):
                labels = _record_icf(recorder, "synthetic", data, factor, SYNTHETIC_RANK, r,
                                     rseed, plan.n_init, plan.max_iter)
            elif r == 0:  # done before; its labels are drawn again
                labels = _icf_fit(data, factor, SYNTHETIC_RANK, rseed, plan.n_init,
                                  plan.max_iter)[0]
            if r == 0:
                fits[name] = (data, factor, labels)
            bar.step()
    return fits


def _run_grid(plan: _Plan, previous: list[dict], recorder: _Recorder, bar: _Progress) -> None:
    """Every run of the grid still to do, dataset by dataset, and the trace curves."""
    for token in dict.fromkeys(plan.datasets + plan.trace_datasets):
        data = plan.loaded[token]
        factor = None
        if token in plan.need:
            bar.where(f"{data.label}: ICF to rank {plan.need[token]}")
            timed = [s for m, s, _ in plan.grid.get(token, ()) if m == "icf"] + [
                r["size"] for r in previous
                if (r["experiment"], r["dataset"], r["method"]) == ("grid", token, "icf")
            ]
            factor = _factorize(data, plan.need[token], _icf_reporter(bar, data.label), timed)
            plan.refreshed += _refresh_factor_times(previous, "grid", token, factor)
            if token in plan.trace_datasets and token not in plan.traces:
                res = factor.result
                rank = min(plan.trace_rank, data.n)
                plan.traces[token] = Trace(res.initial_trace, res.trace_errors[:rank].copy())
            bar.step()
        if token not in plan.datasets:
            continue
        for m, s, r in plan.grid[token]:
            rseed = _repeat_seed(plan.seed, r)
            where = f"{data.label} {METHOD_LABELS[m]}" + ("" if s is None else f" s={s}")
            bar.where(f"{where} repeat {r + 1}")
            if m == "icf" and s is not None:
                _record_icf(recorder, "grid", data, factor, s, r, rseed, plan.n_init,
                            plan.max_iter)
            else:
                _record_baseline(recorder, data, m, s, r, rseed, plan.n_init, plan.max_iter)
            bar.step()
        # The factor (and its P) goes with this iteration; the trace curve was kept apart.


def _report_settings(plan: _Plan, elapsed: float, resumed: int) -> dict:
    """The run's settings as results.md states them."""
    return {
        "datasets": [plan.loaded[t] for t in plan.datasets],
        "sizes": plan.sizes,
        "repeats": plan.repeats,
        "dataset_repeats": plan.d_repeats,
        "method_repeats": plan.m_repeats,
        "methods": plan.methods,
        "max_exact_n": plan.max_exact_n,
        "seed": plan.seed,
        "n_init": plan.n_init,
        "max_iter": plan.max_iter,
        "trace": {t: plan.loaded[t] for t in plan.traces},
        "trace_rank": plan.trace_rank,
        "synthetic": plan.synthetic,
        "elapsed": elapsed,
        "resumed": resumed,
        "refreshed": plan.refreshed,
    }


def _write_outputs(out: Path, plan: _Plan, rows: list[dict], synthetic_fits: dict, *,
                   stale: list[Path], elapsed: float, resumed: int) -> None:
    """trace_error.csv, results.md and the figures, in place of an earlier run's."""
    write_trace_csv(out / "trace_error.csv", plan.traces, plan.loaded)
    write_markdown(out / "results.md", rows, plan.traces,
                   _report_settings(plan, elapsed, resumed))
    for path in stale:  # the earlier run's figures: this run draws its own
        path.unlink(missing_ok=True)
    figures(out, rows, plan.traces, plan.loaded, plan.datasets, synthetic_fits)


def _refresh_factor_times(rows: list[dict], experiment: str, token: str, factor: _Factor) -> int:
    """Give kept ICF rows of ``token`` this run's factorization time; returns how many.

    The factorization is deterministic, so a dataset's ICF rows share one
    factorization and one measure of its time, whichever run made the rows.
    """
    count = 0
    for row in rows:
        if (row["experiment"], row["dataset"], row["method"]) == (experiment, token, "icf"):
            row["factor_time_s"] = factor.time_at(row["size"])
            row["time_s"] = row["factor_time_s"] + (row["kmeans_time_s"] or 0.0)
            count += 1
    return count


def _check_resumable(rows: list[dict], loaded: dict[str, _Data], seed: int, path: Path) -> None:
    """Refuse to extend a results.csv written with another seed or other data."""
    for row in rows:
        problem = None
        if row["repeat"] is None or row["seed"] != _repeat_seed(seed, row["repeat"]):
            problem = f"its repeat {row['repeat']} has seed {row['seed']}, not that of seed={seed}"
        data = loaded.get(row["dataset"])
        if problem is None and data is not None:
            if row["n"] != data.n:
                problem = f"{row['dataset']} has n={row['n']} there and n={data.n} now"
            elif row["gamma"] is None or not math.isclose(row["gamma"], data.gamma, rel_tol=1e-5):
                problem = f"{row['dataset']} has gamma={row['gamma']} there, {data.gamma:g} now"
        if problem is not None:
            raise ValueError(
                f"cannot resume from {path}: {problem}. Resume with the settings of that run, "
                "or write to another out_dir."
            )


def _base_row(experiment: str, data: _Data, method: str, s, r: int, rseed: int) -> dict:
    return {
        "experiment": experiment,
        "dataset": data.token,
        "n": data.n,
        "n_features": int(data.X.shape[1]),
        "n_clusters": data.n_clusters,
        "gamma": data.gamma,
        "method": method,
        "size": s,
        "rank": None,
        "repeat": r,
        "seed": rseed,
    }


def _record_icf(recorder, experiment, data, factor, s, r, rseed, n_init, max_iter) -> np.ndarray:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        labels, km_time, rank, n_iter = _icf_fit(data, factor, s, rseed, n_init, max_iter)
    factor_time = factor.time_at(s)
    row = _base_row(experiment, data, "icf", s, r, rseed)
    row.update(rank=rank, time_s=factor_time + km_time, factor_time_s=factor_time,
               kmeans_time_s=km_time, n_iter=n_iter,
               note=" | ".join(filter(None, [factor.note, _note(caught)])))
    recorder.add(_score(row, data.y, labels))
    return labels


def _record_baseline(recorder, data, method, s, r, rseed, n_init, max_iter) -> None:
    est = _baseline(method, data, s, rseed, n_init, max_iter)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        est.fit(data.X)
        elapsed = time.perf_counter() - t0
    row = _base_row("grid", data, method, s, r, rseed)
    row.update(rank=getattr(est, "rank_", None), time_s=elapsed,
               n_iter=int(getattr(est, "n_iter_", 0)), note=_note(caught))
    recorder.add(_score(row, data.y, est.labels_))


def run_cli(args: argparse.Namespace) -> int:
    """Run the command parsed by the parser of :func:`add_parser`; returns the exit code."""
    if getattr(args, "bench_command", "paper") != "paper":  # pragma: no cover - argparse guards
        raise ValueError(f"unknown bench command {args.bench_command!r}; valid: paper.")
    rows = run_paper(
        args.datasets, args.sizes, args.repeats, args.out_dir,
        data_home=args.data_home, methods=args.methods,
        progress=not getattr(args, "quiet", False), max_exact_n=args.max_exact_n,
        seed=args.seed, trace_datasets=args.trace_datasets, trace_rank=args.trace_rank,
        synthetic=args.synthetic, n_init=args.n_init, max_iter=args.max_iter,
        dataset_repeats=dict(args.dataset_repeats), method_repeats=dict(args.method_repeats),
        resume=args.resume, overwrite=args.overwrite,
    )
    out = Path(args.out_dir)
    print(f"{len(rows)} runs; wrote {out / 'results.csv'}, {out / 'results.md'} and the "
          f"figures in {out}")
    return 0
