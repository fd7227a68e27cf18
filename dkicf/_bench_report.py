"""The tables and figures of a run of the paper's grid (:func:`dkicf.bench.run_paper`).

``results.md`` (the settings, then per dataset mean ± std of accuracy and NMI
and the median time per method and size, the ICF trace errors and the
synthetic sets), ``trace_error.csv``, and the PNG figures.
"""

from __future__ import annotations

import csv
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._bench_grid import (
    DISPLAY,
    FULL_METHODS,
    METHOD_LABELS,
    METHODS,
    PAPER_TOL,
    SYNTHETIC,
    SYNTHETIC_RANK,
)
from .datasets import PAPER_SUBSET_SIZE
from .metrics import clustering_accuracy

__all__ = ["Trace", "figures", "write_markdown", "write_trace_csv"]

# Colour and marker of each method in the figures.
_STYLE = {
    "icf": ("tab:red", "o"),
    "kernel": ("black", None),
    "kernel+chol": ("tab:gray", None),
    "approx": ("tab:green", "s"),
    "rff": ("tab:purple", "^"),
    "nystrom": ("tab:blue", "D"),
}
# The ranks at which results.md lists the trace error.
_TRACE_MARKS = (10, 25, 50, 100, 200, 300, 500, 700, 1000, 2000)


@dataclass
class Trace:
    """The trace-error curve of one factorization (without its P)."""

    initial_trace: float
    trace_errors: np.ndarray

    @property
    def rank(self) -> int:
        return int(self.trace_errors.size)


def _format_gamma(gamma: float) -> str:
    e = math.log2(gamma)
    return f"2^{int(e)}" if e == int(e) else f"{gamma:g}"


def _groups(rows: list[dict], experiment: str = "grid") -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["experiment"] == experiment:
            out.setdefault((row["dataset"], row["method"], row["size"]), []).append(row)
    return out


def _stats(values) -> tuple[float, float]:
    v = np.asarray(values, dtype=float)
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def _summary(rows: list[dict], experiment: str = "grid") -> dict[tuple, dict]:
    out = {}
    for key, group in _groups(rows, experiment).items():
        acc, acc_sd = _stats([g["acc"] for g in group])
        nm, nm_sd = _stats([g["nmi"] for g in group])
        out[key] = {
            "runs": len(group),
            "acc": acc, "acc_sd": acc_sd, "nmi": nm, "nmi_sd": nm_sd,
            "time": float(np.median([g["time_s"] for g in group])),
            "factor_time": group[0].get("factor_time_s"),
            "rank": group[0].get("rank"),
        }
    return out


def _trace_points(res: Trace) -> list[tuple[int, float]]:
    marks = [r for r in _TRACE_MARKS if r <= res.rank]
    if res.rank not in marks:
        marks.append(res.rank)
    return [(r, float(res.trace_errors[r - 1])) for r in marks]


def write_trace_csv(path: Path, traces: dict[str, Trace], loaded) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["dataset", "gamma", "rank", "trace_error", "relative"])
        for token, res in traces.items():
            g = _format_gamma(loaded[token].gamma)
            w.writerow([token, g, 0, f"{res.initial_trace:.6g}", "1"])
            for r, e in enumerate(res.trace_errors, start=1):
                w.writerow([token, g, r, f"{e:.6g}", f"{e / res.initial_trace:.6g}"])


def write_markdown(path: Path, rows, traces, settings) -> None:
    summary = _summary(rows)
    lines = ["# Reproduction of the paper's experiments", ""]
    lines += _settings_lines(settings)
    for data in settings["datasets"]:
        lines += ["", f"## {data.label}", "",
                  f"n = {data.n}, d = {data.X.shape[1]}, k = {data.n_clusters}, "
                  f"gamma = {_format_gamma(data.gamma)} ({data.note}).", ""]
        keys = [k for k in summary if k[0] == data.token]
        if not keys:
            lines.append("No runs.")
            continue
        if any(m in settings["methods"] for m in FULL_METHODS) and data.n > settings[
                "max_exact_n"]:
            lines += [f"Kernel and Kernel+Chol not run: n = {data.n} > max_exact_n = "
                      f"{settings['max_exact_n']} (the paper ran them on PenDigits and "
                      "Satimage only).", ""]
        lines += ["| method | s | runs | ACC mean ± std | NMI mean ± std | median time (s) |",
                  "|---|---:|---:|---|---|---:|"]
        order = {m: i for i, m in enumerate(METHODS)}
        for key in sorted(keys, key=lambda k: (order[k[1]], k[2] or 0)):
            st = summary[key]
            s = "full" if key[2] is None else str(key[2])
            if key[1] == "icf" and st["rank"] is not None and key[2] is not None \
                    and st["rank"] < key[2]:
                s += f" (rank {st['rank']})"
            lines.append(
                f"| {METHOD_LABELS[key[1]]} | {s} | {st['runs']} | "
                f"{st['acc']:.4f} ± {st['acc_sd']:.4f} | {st['nmi']:.4f} ± {st['nmi_sd']:.4f} | "
                f"{st['time']:.3g} |"
            )
        lines += _comparison_lines(summary, data.token)
    synth = _summary(rows, "synthetic")
    if synth:
        lines += ["", "## Synthetic 2-D sets (ICF, s = 50)", "",
                  "| dataset | gamma | runs | ACC mean ± std | min ACC | median time (s) |",
                  "|---|---|---:|---|---:|---:|"]
        for key, st in synth.items():
            accs = [r["acc"] for r in _groups(rows, "synthetic")[key]]
            lines.append(
                f"| {DISPLAY.get(key[0], key[0])} | {_format_gamma(SYNTHETIC[key[0]][1])} | "
                f"{st['runs']} | {st['acc']:.4f} ± {st['acc_sd']:.4f} | {min(accs):.4f} | "
                f"{st['time']:.3g} |"
            )
    if traces:
        lines += ["", "## ICF trace error tr(K - PP^T)", "",
                  "Relative to tr(K) = n.  'decay per 100' is (e(s2)/e(s1))^(100/(s2-s1)) "
                  "between consecutive ranks: constant for an exponential decay, rising "
                  "towards 1 for a slower one.", "",
                  "| dataset | gamma | s | trace error | relative | decay per 100 |",
                  "|---|---|---:|---:|---:|---:|"]
        for token, res in traces.items():
            prev = None
            for r, e in _trace_points(res):
                decay = "" if prev is None or e <= 0 or prev[1] <= 0 else \
                    f"{(e / prev[1]) ** (100.0 / (r - prev[0])):.3f}"
                lines.append(
                    f"| {settings['trace'][token].label} | "
                    f"{_format_gamma(settings['trace'][token].gamma)} | {r} | {e:.4g} | "
                    f"{e / res.initial_trace:.3e} | {decay} |"
                )
                prev = (r, e)
    lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")


def _comparison_lines(summary: dict, token: str) -> list[str]:
    """ICF next to the sampling baselines at every size, and against the full kernel."""
    sized = [m for m in METHODS if m not in FULL_METHODS
             and any(k[0] == token and k[1] == m for k in summary)]
    sizes = sorted({k[2] for k in summary if k[0] == token and k[2] is not None})
    lines = []
    if len(sized) > 1 and sizes:
        lines += ["", "ACC at equal subset size (mean ± std; the best mean in bold, the "
                  "smallest std marked *):", "",
                  "| s | " + " | ".join(METHOD_LABELS[m] for m in sized) + " |",
                  "|---:|" + "---|" * len(sized)]
        for size in sizes:
            cells = {m: summary.get((token, m, size)) for m in sized}
            present = [m for m in sized if cells[m] is not None]
            best = max(present, key=lambda m: cells[m]["acc"])
            steady = min(present, key=lambda m: cells[m]["acc_sd"])
            row = []
            for m in sized:
                st = cells[m]
                if st is None:
                    row.append("")
                    continue
                text = f"{st['acc']:.4f} ± {st['acc_sd']:.4f}"
                text = f"**{text}**" if m == best else text
                row.append(text + (" *" if m == steady else ""))
            lines.append(f"| {size} | " + " | ".join(row) + " |")
    full = summary.get((token, "kernel", None))
    icf = [(size, summary[(token, "icf", size)]) for size in sizes
           if (token, "icf", size) in summary]
    if full is not None and icf:
        bar = full["acc"] - full["acc_sd"]
        reached = [size for size, st in icf if st["acc"] >= bar]
        missed = [size for size, st in icf if st["acc"] < bar]
        if not reached:
            where = "at none of the sizes run"
        elif not missed or missed[-1] < reached[0]:
            where = f"from s = {reached[0]} on"
        else:
            where = (f"at s = {', '.join(map(str, reached))} "
                     f"(not at s = {', '.join(map(str, missed))})")
        lines += ["", f"Kernel (full matrix): ACC {full['acc']:.4f} ± {full['acc_sd']:.4f}, "
                  f"median time {full['time']:.3g} s.  ICF's mean ACC is at least Kernel's "
                  f"mean minus one std ({bar:.4f}) {where}."]
    return lines


def _settings_lines(st) -> list[str]:
    reps = f"{st['repeats']}"
    extra = [f"{k}: {v}" for k, v in st["dataset_repeats"].items()]
    extra += [f"{METHOD_LABELS[k]}: at most {v}" for k, v in st["method_repeats"].items()]
    if extra:
        reps += f" ({'; '.join(extra)})"
    load = ""
    if hasattr(os, "getloadavg"):
        load = ", load average at the end {:.1f} / {:.1f} / {:.1f}".format(*os.getloadavg())
    return [
        f"- datasets: {', '.join(d.token for d in st['datasets']) or 'none'}",
        f"- subset sizes s: {', '.join(map(str, st['sizes']))}",
        f"- methods: {', '.join(METHOD_LABELS[m] for m in st['methods'])}",
        f"- repeats: {reps}; repeat r uses the seed derived from (seed={st['seed']}, r), "
        "the same for every method",
        f"- every k-means / kernel k-means: n_init = {st['n_init']}, at most "
        f"{st['max_iter']} iterations; Kernel and Kernel+Chol only where n <= "
        f"{st['max_exact_n']}",
        f"- ICF: KernelKMeans(rank=s, tol={PAPER_TOL:g}, algorithm='lloyd'), Gaussian kernel "
        "with the paper's gamma, default pivot rule ('block-greedy': the paper's greedy "
        "pivots, several per pass over X).  The factorization is deterministic, so it ran once per "
        "dataset up to the largest s, and the wall time of a factorization to rank s "
        "(one run per s) is added to each repeat's k-means time.",
        "- baselines: the wall time of one fit (kernel matrix, factorization or features "
        "included)",
        "- std is the sample standard deviation over the repeats; time is the median",
        f"- machine: {os.cpu_count()} cores ({platform.machine()}), Python "
        f"{platform.python_version()}, numpy {np.__version__}{load}",
        f"- total wall time of the run: {st['elapsed'] / 60:.1f} min"
        + (f" (resumed: {st['resumed']} runs were kept from an earlier results.csv with "
           "their times; where this run factorized a dataset again, the ICF rows kept "
           f"for it ({st.get('refreshed', 0)}) take this run's factorization time)"
           if st.get("resumed") else ""),
    ]


# --------------------------------------------------------------------------- figures


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panels(plt, count: int, width: float = 4.6, height: float = 3.4):
    ncols = 1 if count == 1 else 2 if count in (2, 4) else 3
    nrows = math.ceil(count / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    flat = axes.ravel()
    for ax in flat[count:]:
        ax.set_visible(False)
    return fig, flat[:count]


def figures(out: Path, rows, traces, loaded, datasets, synthetic_fits) -> None:
    plt = _pyplot()
    if traces:
        _trace_figure(plt, out / "trace_error.png", traces, loaded)
    if synthetic_fits:
        _synthetic_figure(plt, out / "synthetic.png", synthetic_fits, _summary(rows, "synthetic"))
    summary = _summary(rows)
    grid = [t for t in datasets if any(k[0] == t for k in summary)]
    if grid:
        _curve_figure(plt, out / "accuracy.png", summary, grid, loaded, "acc")
        _curve_figure(plt, out / "time.png", summary, grid, loaded, "time")
        _small_time_figure(plt, out / "time_small.png", summary, grid, loaded)


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _trace_figure(plt, path, traces, loaded) -> None:
    fig, axes = _panels(plt, len(traces))
    for ax, (token, res) in zip(axes, traces.items()):
        te = np.concatenate([[res.initial_trace], res.trace_errors])
        ranks = np.arange(te.size)
        keep = te > 0
        ax.semilogy(ranks[keep], te[keep], color="tab:red", lw=1.6)
        ax.set_xlabel("rank s")
        ax.set_ylabel(r"tr$(K - PP^\top)$")
        ax.set_title(f"{loaded[token].label}, gamma = {_format_gamma(loaded[token].gamma)}")
        ax.grid(True, which="both", alpha=0.3)
    _save(plt, fig, path)


def _synthetic_figure(plt, path, fits, summary) -> None:
    fig, axes = _panels(plt, len(fits), width=4.0, height=4.0)
    for ax, (data, factor, labels) in zip(axes, fits.values()):
        acc = clustering_accuracy(data.y, labels)
        ax.scatter(data.X[:, 0], data.X[:, 1], c=labels, cmap="coolwarm", s=5, linewidths=0)
        piv = factor.result.pivot_rows[:SYNTHETIC_RANK]
        ax.scatter(piv[:, 0], piv[:, 1], s=55, facecolors="none", edgecolors="green",
                   linewidths=1.3, label=f"{piv.shape[0]} pivots")
        ax.set_aspect("equal", adjustable="datalim")
        title = f"{data.label}, gamma = {_format_gamma(data.gamma)}\nACC {acc:.3f} (repeat 1)"
        st = summary.get((data.token, "icf", SYNTHETIC_RANK))
        if st is not None and st["runs"] > 1:
            title += f", mean of {st['runs']}: {st['acc']:.3f}"
        ax.set_title(title, fontsize=10)
        ax.legend(loc="lower right", fontsize=8)
    _save(plt, fig, path)


def _curve_figure(plt, path, summary, grid, loaded, what: str) -> None:
    fig, axes = _panels(plt, len(grid))
    for ax, token in zip(axes, grid):
        keys = [k for k in summary if k[0] == token]
        for m in METHODS:
            color, marker = _STYLE[m]
            if m in FULL_METHODS:
                full = summary.get((token, m, None))
                if full is None:
                    continue
                ls = "--" if m == "kernel" else ":"
                ax.axhline(full[what], color=color, ls=ls, lw=1.3, label=METHOD_LABELS[m])
                if what == "acc" and full["acc_sd"] > 0:
                    ax.axhspan(full["acc"] - full["acc_sd"], full["acc"] + full["acc_sd"],
                               color=color, alpha=0.08)
                continue
            sizes = sorted(k[2] for k in keys if k[1] == m)
            if not sizes:
                continue
            vals = [summary[(token, m, s)][what] for s in sizes]
            if what == "acc":
                err = [summary[(token, m, s)]["acc_sd"] for s in sizes]
                ax.errorbar(sizes, vals, yerr=err, color=color, marker=marker, ms=4, lw=1.3,
                            capsize=3, label=METHOD_LABELS[m])
            else:
                ax.plot(sizes, vals, color=color, marker=marker, ms=4, lw=1.3,
                        label=METHOD_LABELS[m])
        ax.set_xscale("log")
        grid_sizes = sorted({k[2] for k in keys if k[2] is not None})
        ax.set_xticks(grid_sizes, [str(v) for v in grid_sizes])
        ax.minorticks_off()
        ax.set_xlabel("subset size s")
        if what == "acc":
            ax.set_ylabel("clustering accuracy")
        else:
            ax.set_yscale("log")
            ax.set_ylabel("median wall time (s)")
        ax.set_title(loaded[token].label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    _save(plt, fig, path)


def _small_size(name: str, sizes: list[int]) -> int:
    want = PAPER_SUBSET_SIZE.get(name, sizes[0])
    return min(sizes, key=lambda s: (abs(s - want), s))


def _small_time_figure(plt, path, summary, grid, loaded) -> None:
    fig, axes = _panels(plt, len(grid))
    for ax, token in zip(axes, grid):
        keys = [k for k in summary if k[0] == token]
        sizes = sorted({k[2] for k in keys if k[2] is not None})
        s = _small_size(loaded[token].name, sizes) if sizes else None
        bars = []
        for m in METHODS:
            key = (token, m, None if m in FULL_METHODS else s)
            if key in summary:
                bars.append((m, summary[key]))
        x = np.arange(len(bars))
        heights = [b[1]["time"] for b in bars]
        ax.bar(x, heights, color=[_STYLE[m][0] for m, _ in bars])
        for xi, (_, st) in zip(x, bars):
            ax.annotate(f"ACC {st['acc']:.3f}", (xi, st["time"]), ha="center", va="bottom",
                        fontsize=7, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(x, ["Chol" if m == "kernel+chol" else METHOD_LABELS[m] for m, _ in bars],
                      fontsize=8)
        ax.set_ylabel("median wall time (s)")
        ax.set_title(f"{loaded[token].label}, s = {s}")
        if heights and max(heights) > 20 * min(heights):
            ax.set_yscale("log")
            ax.set_ylim(top=max(heights) * 4)
        elif heights:
            ax.set_ylim(0, max(heights) * 1.15)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    _save(plt, fig, path)
