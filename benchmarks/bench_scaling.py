"""Scale-out: ICF and k-means against the number of dask workers, and where a pass goes.

Setup (as in the scale-out issue): 10 Gaussian blobs in 16-D, float64, the
Gaussian kernel at gamma 0.02, the default block-greedy rule, rank ``s``.
For every worker count W (1, 2, 4, ... up to the cores present, or
``--workers``) a local cluster of W worker processes x 1 thread is started
(:func:`dkicf.local_cluster`: for W > 4 its scheduler and nannies run in
processes of their own; ``--shared-too`` also runs the largest W as a plain
LocalCluster, with them in the driver's process),
X is generated on the workers in ``--chunks-per-worker`` row chunks per
worker and held there by :func:`dkicf.persist_rows` (consecutive chunks on
the same worker; ``--placement dask`` leaves them where dask's own persist
puts them, often interleaved, which costs a task per run of chunks every
pass), then timed:

* ICF (:func:`dkicf.incomplete_cholesky`) and k-means (:func:`dkicf.kmeans`,
  10 clusters) on the cluster: seconds, speed-up over W = 1, efficiency;
* the numpy backend on the same rows (one process, a thread per core);
* scikit-learn's ``Nystroem(n_components=s)`` + ``MiniBatchKMeans``
  (k-means++, one initialisation) on the same rows: the one-process
  reference;
* identical pivots for numpy and every W (asserted);
* for the largest W, the figures the issue's many-core targets name: its
  ICF speed-up over the first W, the numpy backend's ICF time against it,
  and the whole fit against scikit-learn's pipeline;
* where each k-means went (until its first mini-batch step: k-means||; the
  mini-batch steps; the shared Lloyd passes; the labels' pass) and, on
  dask, its tasks' worker-seconds, from which the part that does not divide
  between the workers and a 16-worker time follow.

For each dask run the factorization's passes are split, from the
scheduler's task stream (start and stop of every task on every worker,
and every transfer between workers) and from timestamps the driver
takes around its own steps, into

(a) all workers computing an update;
(b) some workers idle while others finish (stragglers);
(c) the driver: sending the pass (submit until the first task starts),
    collecting its summaries (last task's end until the driver has them),
    candidate selection and the small Cholesky, fetching the candidates'
    rows, other bookkeeping;
(d) transfers of data between workers (X, P, states: there should be none).

plus the set-up before the first pass (copying X into the fit's own
memory, the kernel diagonal, the first summary) and the end (the result
arrays).  Transfers during the factorization are counted by key (X, state,
other) and their bytes printed; X or P moving between workers is a bug.
The CPU seconds of the driver's process are split by thread (main, dask's
event loop, unnamed threads such as BLAS's): BLAS threads that spin after
the driver's small products show up there.

The breakdown predicts other worker counts: the compute (a + b, in worker
seconds) divides by W, the driver's share (c) does not, so
``T(W) ~ setup + sum(c) + compute(1) / W`` (printed for 16 workers).

``--targets`` runs the 2-core targets of the issue instead: ICF with 2
workers against 1 at n = 1e6, s = 150, after a reference (the numpy
backend pinned to one core against both, on the same rows); the idle share of a pass at
n = 2e6; the driver's time per pass at n = 5e5 against 4e6 (two runs of each, taking
turns; the mean over their passes, and the median pass).

``--near-identity`` times block greedy against greedy on scikit-learn's
digits at gamma 2**-6 (blocks of one pivot: block greedy falls back to
greedy passes); ``--targets`` prints it too.  ``--small-data`` times both
rules on the paper's datasets (those found locally, at most 20,000 rows,
the paper's gamma, s = 100 and 500, numpy backend): block greedy is never
to be slower, and the pivots must be identical.

``--quick`` is the many-core plan: n = 2e6 with W = 1, 2, 4, 8, 16 (those
the machine has), then n = 8e6 with the largest W, each with numpy and
scikit-learn; about 5 minutes on 16 cores.  With ``$OUT`` set, everything
printed is also written to ``$OUT/scaling.txt``, line by line.

Run: python benchmarks/bench_scaling.py [--n 1000000] [--s 150] [--workers 1 2]
     python benchmarks/bench_scaling.py --targets
     python benchmarks/bench_scaling.py --near-identity --small-data
     python benchmarks/bench_scaling.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
import time

import numpy as np


def say(*parts) -> None:
    """Print a line, and append it to ``$OUT/scaling.txt`` at once (a run cut short by a
    time limit still leaves what it printed there)."""
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "scaling.txt"), "a") as fh:
            fh.write(line + "\n")


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


# ------------------------------------------------------------------ data


def _blob_rows(start: int, stop: int, n: int, d: int) -> np.ndarray:
    from dkicf.synthetic import generate_rows

    return generate_rows("blobs", start, stop, n_total=n, random_state=0, n_features=d,
                         centers=10)[0]


def numpy_data(n: int, d: int):
    from dkicf.synthetic import generate_rows

    return generate_rows("blobs", 0, n, n_total=n, random_state=0, n_features=d, centers=10)


def dask_data(client, n: int, d: int, chunks: int, placement: str = "rows"):
    """X generated on the workers, ``chunks`` row chunks, persisted (one read).

    ``placement="rows"``: :func:`dkicf.persist_rows` (consecutive chunks on
    the same worker); ``"dask"``: ``client.persist`` (where dask puts them,
    often interleaved).
    """
    import dask
    import dask.array as da
    from distributed import wait

    from dkicf import persist_rows

    edges = np.linspace(0, n, chunks + 1).round().astype(np.int64)
    parts = [
        da.from_delayed(dask.delayed(_blob_rows)(int(a), int(b), n, d), shape=(int(b - a), d),
                        dtype=np.float64)
        for a, b in zip(edges[:-1], edges[1:])
    ]
    X = da.concatenate(parts, axis=0)
    if placement == "rows":
        return persist_rows(X, client=client)
    X = client.persist(X)
    wait(X)
    return X


# ------------------------------------------------------------------ instrumentation


class DriverClock:
    """Timestamps (``time.time()``, the workers' clock on one machine) of the driver's steps."""

    def __init__(self):
        self.events: list[tuple[str, float, float]] = []
        self._undo: list = []

    def _wrap(self, owner, name: str, label: str) -> None:
        orig = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.time()
            try:
                return orig(*args, **kwargs)
            finally:
                self.events.append((label, t0, time.time()))

        setattr(owner, name, timed)
        self._undo.append((owner, name, orig))

    def __enter__(self):
        from dkicf import _backends, pivoting

        self._wrap(pivoting, "greedy_block", "select")
        self._wrap(_backends.DaskBackend, "rows", "rows")
        self._wrap(_backends.DaskBackend, "map_chunks", "map")
        self._wrap(_backends.DaskBackend, "apply", "apply")
        return self

    def __exit__(self, *exc):
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)
        self._undo.clear()


_KEY = re.compile(r"^icf-(?P<name>.+)-(?P<token>[0-9a-f]{16})-(?P<step>\d+)(?:-(?P<chunk>\d+))?$")


def _parse_key(key) -> dict | None:
    if isinstance(key, tuple):
        return None
    m = _KEY.match(str(key))
    return None if m is None else m.groupdict()


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _all_busy(per_worker: dict, lo: float, hi: float, n_workers: int) -> float:
    """Seconds in ``[lo, hi]`` during which every one of ``n_workers`` workers computes."""
    if len(per_worker) < n_workers:
        return 0.0
    edges = []
    for ivs in per_worker.values():
        # Merge each worker's intervals first: one thread, so they do not overlap.
        merged = []
        for a, b in sorted(ivs):
            a, b = max(a, lo), min(b, hi)
            if b <= a:
                continue
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        for a, b in merged:
            edges += [(a, 1), (b, -1)]
    edges.sort()
    busy, count, last = 0.0, 0, None
    for t, step in edges:
        if count == n_workers and last is not None:
            busy += t - last
        count += step
        last = t
    return busy


def _incoming_log(dask_worker=None) -> list:
    """On a worker: its log of data fetched from other workers (start, stop, keys and bytes)."""
    return [{"start": e["start"], "stop": e["stop"],
             "keys": {str(k): int(v) for k, v in e["keys"].items()}}
            for e in dask_worker.transfer_incoming_log]


def breakdown(tasks: list[dict], driver: list, n_workers: int, t_start: float,
              t_end: float, incoming: list, x_name: str) -> dict:
    """Per-pass split of the factorization's wall time (see the module docstring).

    ``incoming``: the workers' transfer logs (:func:`_incoming_log`), of
    which the entries of the factorization are kept; ``x_name``: the name
    of X's chunks.
    """
    computes: dict[int, list] = {}
    transfers = {"X": [0, 0.0], "state": [0, 0.0], "other": [0, 0.0]}
    transfer_time = []
    for entry in incoming:
        if entry["start"] < t_start or entry["start"] > t_end:
            continue
        transfer_time.append((entry["start"], entry["stop"]))
        for key, nbytes in entry["keys"].items():
            info = _parse_key(key)
            kind = "other"
            if x_name in key or (info is not None and info["name"] == "x"):
                kind = "X"
            elif info is not None and info["name"] in ("update", "init", "rebase",
                                                        "restore", "reload"):
                kind = "state"
            transfers[kind][0] += 1
            transfers[kind][1] += nbytes
    setup_work = 0.0
    for rec in tasks:
        info = _parse_key(rec.get("key"))
        for ss in rec.get("startstops", ()):
            if ss["action"] != "compute" or info is None:
                continue
            if info["name"] == "update":
                computes.setdefault(int(info["step"]), []).append(
                    (rec["worker"], ss["start"], ss["stop"]))
            elif info["name"] in ("x", "init"):
                setup_work += ss["stop"] - ss["start"]
    applies = sorted((a, b) for label, a, b in driver if label == "apply")
    passes = []
    for k, (a0, a1) in enumerate(applies):
        step = k + 1
        nxt = applies[k + 1][0] if k + 1 < len(applies) else t_end
        ivs = computes.get(step, [])
        if not ivs:
            continue
        first = min(s for _, s, _ in ivs)
        last = max(e for _, _, e in ivs)
        per_worker: dict = {}
        for w, s, e in ivs:
            per_worker.setdefault(w, []).append((s, e))
        busy = _all_busy(per_worker, first, last, n_workers)
        work = sum(e - s for _, s, e in ivs)

        def within(label, lo=a1, hi=nxt):
            return sum(max(0.0, min(e, hi) - max(s, lo)) for lab, s, e in driver
                       if lab == label)

        select, rows, cmap = within("select"), within("rows"), within("map")
        wall = nxt - a0
        send = max(0.0, first - a0)
        collect = max(0.0, a1 - last)
        other = max(0.0, (nxt - a1) - select - rows - cmap)
        xfer = _union_length([(max(s, a0), min(e, nxt)) for s, e in transfer_time
                              if e > a0 and s < nxt])
        passes.append({
            "step": step, "wall": wall, "all_busy": busy, "stragglers": (last - first) - busy,
            "send": send, "collect": collect, "select": select, "rows": rows + cmap,
            "other": other, "transfer": xfer, "work": work,
        })
    setup = (applies[0][0] - t_start) if applies else t_end - t_start
    end = (t_end - applies[-1][1]) if applies else 0.0
    return {"passes": passes, "setup": setup, "end": end, "transfers": transfers,
            "setup_work": setup_work}


def print_breakdown(bd: dict, label: str) -> dict:
    ps = bd["passes"]
    say(f"  pass breakdown, {label} (seconds; (c) = send + collect + select + rows + other)")
    say(f"  {'pass':>4} {'wall':>7} {'(a)busy':>8} {'(b)idle':>8} {'send':>7} {'collect':>8}"
        f" {'select':>7} {'rows':>7} {'other':>7} {'(d)xfer':>8}")
    for p in ps:
        say(f"  {p['step']:>4} {p['wall']:7.3f} {p['all_busy']:8.3f} {p['stragglers']:8.3f} "
            f"{p['send']:7.3f} {p['collect']:8.3f} {p['select']:7.3f} {p['rows']:7.3f} "
            f"{p['other']:7.3f} {p['transfer']:8.3f}")
    tot = {k: sum(p[k] for p in ps) for k in ("wall", "all_busy", "stragglers", "send",
                                               "collect", "select", "rows", "other",
                                               "transfer", "work")}
    per_pass = [p["send"] + p["collect"] + p["select"] + p["rows"] + p["other"] for p in ps]
    driver = sum(per_pass)
    wall = tot["wall"] or 1.0
    say(f"  total {tot['wall']:.3f} s in {len(ps)} passes: (a) all busy {tot['all_busy']:.3f} "
        f"({tot['all_busy'] / wall:.0%}), (b) stragglers {tot['stragglers']:.3f} "
        f"({tot['stragglers'] / wall:.0%}), (c) driver {driver:.3f} ({driver / wall:.0%}: "
        f"send {tot['send']:.3f}, collect {tot['collect']:.3f}, select {tot['select']:.3f}, "
        f"rows {tot['rows']:.3f}, other {tot['other']:.3f}), (d) transfers "
        f"{tot['transfer']:.3f}")
    say(f"  set-up before the first pass {bd['setup']:.3f} s (worker-seconds of copying X and "
        f"the kernel diagonal {bd['setup_work']:.3f}), after the last {bd['end']:.3f} s; "
        f"worker-seconds of update tasks {tot['work']:.3f}")
    tr = bd["transfers"]
    say("  transfers between workers during the factorization: "
        + ", ".join(f"{k} {c} ({b / 2**20:.1f} MiB)" for k, (c, b) in tr.items()))
    return {**tot, "driver": driver, "n_passes": len(ps), "driver_per_pass": per_pass,
            "setup": bd["setup"],
            "setup_work": bd["setup_work"], "end": bd["end"],
            "moved": tr["X"][0] + tr["state"][0]}


@contextlib.contextmanager
def _profiled():
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield prof
    finally:
        prof.disable()


def _print_profile(prof, label: str, top: int = 25) -> None:
    """The driver thread's own time by function (``--profile``): where (c) goes."""
    import io
    import pstats

    for order in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(top)
        say(f"  driver profile, {label}, by {order}:")
        for line in buf.getvalue().splitlines():
            if line.strip() and not line.startswith(("   Ordered", "   List")):
                say("    " + line.rstrip()[:150])


# ------------------------------------------------------------------ runs


class _KMeansClock:
    """A k-means progress callback that notes when each report came, for
    :meth:`phases`: where the k-means' wall time goes."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.events: list[tuple[float, str]] = []

    def __call__(self, info) -> None:
        self.events.append((time.perf_counter() - self.t0, info.phase))

    def phases(self, total: float) -> dict:
        """Seconds until the first mini-batch step (k-means|| and the first run's start),
        of the mini-batch steps (all runs, with the later runs' starts), of the shared
        Lloyd passes, and after the last report (the labels' pass)."""
        mb = [t for t, phase in self.events if phase == "minibatch"]
        last = self.events[-1][0] if self.events else 0.0
        first_mb = mb[0] if mb else 0.0
        end_mb = mb[-1] if mb else first_mb
        lloyd = [t for t, phase in self.events if phase == "lloyd"]
        return {"start": first_mb, "minibatch": end_mb - first_mb,
                "lloyd": (lloyd[-1] if lloyd else end_mb) - end_mb,
                "labels": total - last}


def run_numpy(X, s: int, gamma: float, k: int, with_kmeans: bool) -> dict:
    from dkicf import incomplete_cholesky, kmeans

    t0 = time.perf_counter()
    res = incomplete_cholesky(X, gamma=gamma, max_rank=s, tol=0.0)
    t_icf = time.perf_counter() - t0
    out = {"icf": t_icf, "pivots": res.pivots, "passes": res.n_passes}
    if with_kmeans:
        clock = _KMeansClock()
        km = kmeans(res.P, k, random_state=0, progress=clock)
        out["kmeans"] = time.perf_counter() - clock.t0
        out["kmeans_phases"] = clock.phases(out["kmeans"])
        out["labels"] = np.asarray(km.labels)
    return out


class _CpuClock:
    """CPU seconds (user + system) of this process, the scheduler and the workers, and of
    the other processes of this machine's cluster (nannies), from the start to ``used()``."""

    def __init__(self, client):
        import psutil

        me = psutil.Process()
        workers = set(client.run(os.getpid).values())
        scheduler = client.run_on_scheduler(os.getpid)
        self.roles = {me.pid: "driver"}
        self.roles.update({pid: "workers" for pid in workers})
        self.roles.setdefault(scheduler, "scheduler")  # in the driver's process: "driver"
        self.procs = [me, *me.children(recursive=True)]
        self.before = self._now()
        self.threads_before = _thread_cpu()

    def _now(self) -> dict:
        out = {}
        for p in self.procs:
            with contextlib.suppress(Exception):
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
        return out

    def used(self) -> dict:
        after = self._now()
        used: dict[str, float] = {}
        for pid, t in after.items():
            role = self.roles.get(pid, "other")
            used[role] = used.get(role, 0.0) + t - self.before.get(pid, t)
        return used

    def driver_threads(self) -> dict:
        """CPU seconds of the driver's own threads since the start, by kind: its main
        thread, dask's event loop (the client, and a local scheduler and nannies), and
        the rest (threads without a Python name are BLAS's or other libraries')."""
        after = _thread_cpu()
        kinds: dict[str, float] = {}
        for tid, (name, t) in after.items():
            kind = ("main" if name == "MainThread" else "event loop" if name == "IO loop"
                    else "unnamed (BLAS, ...)" if name is None else "other Python threads")
            kinds[kind] = kinds.get(kind, 0.0) + t - self.threads_before.get(tid, (name, t))[1]
        return kinds


def _thread_cpu() -> dict:
    """``{thread id: (Python name or None, CPU seconds)}`` of this process's threads (Linux;
    empty elsewhere)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[int(tid)] = (names.get(int(tid)), (int(fields[11]) + int(fields[12])) / tick)
    return out


# The k-means' tasks by what they do, from their keys' names (first match).
_KMEANS_KINDS = (("-update-", "k-means|| updates"), ("-draw-", "k-means|| draws"),
                 ("kmeans-rows", "row fetches"), ("kmeans-lloyd", "Lloyd"),
                 ("kmeans-assign", "labels"))


def kmeans_task_kinds(records: list) -> dict:
    """Worker-seconds of a k-means's tasks by kind (see ``_KMEANS_KINDS``), from a task stream."""
    kinds: dict = {}
    for rec in records:
        key = rec["key"][0] if isinstance(rec["key"], tuple) else rec["key"]
        kind = next((label for part, label in _KMEANS_KINDS if part in str(key)), "other")
        for ss in rec.get("startstops", ()):
            if ss["action"] == "compute":
                kinds[kind] = kinds.get(kind, 0.0) + ss["stop"] - ss["start"]
    return kinds


def kmeans_prediction(r: dict, W: int, target: int) -> tuple[float, float]:
    """A dask run's k-means: the seconds its tasks do not fill at ``W`` workers, and
    those plus its tasks' worker-seconds over ``target`` workers."""
    ph = r["kmeans_phases"]
    serial = max(0.0, r["kmeans"] - ph["worker_s"] / W)
    return serial, serial + ph["worker_s"] / target


def say_kmeans_phases(rows: dict) -> None:
    """Where each run's k-means went, and (dask) the tasks' worker-seconds: what divides
    between the workers, against what stays on the driver."""
    for name, r in rows.items():
        ph = r.get("kmeans_phases")
        if ph is None:
            continue
        line = (f"  k-means phases, {name}: until the first mini-batch step (k-means||) "
                f"{ph['start']:.2f} s, mini-batch steps {ph['minibatch']:.2f} s, Lloyd passes "
                f"{ph['lloyd']:.2f} s, labels {ph['labels']:.2f} s")
        if "worker_s" in ph and name.startswith("W="):
            serial, t16 = kmeans_prediction(r, int(name[2:].split()[0]), 16)
            line += (f"; tasks {ph['worker_s']:.2f} worker-seconds, so about "
                     f"{serial:.2f} s not divided between the workers; T(16) ~ {t16:.2f} s")
        say(line)
        if ph.get("driver_threads"):
            say("    the driver's threads, CPU seconds: " + ", ".join(
                f"{k} {v:.2f}" for k, v in sorted(ph["driver_threads"].items()) if v >= 0.005))
        if ph.get("kinds"):
            order = [label for _, label in _KMEANS_KINDS] + ["other"]
            say("    its tasks by kind, worker-seconds: " + ", ".join(
                f"{label} {ph['kinds'][label]:.2f}" for label in order if label in ph["kinds"]))


def say_cpu(used: dict, wall: float, W: int, threads: dict | None = None) -> None:
    """CPU seconds of the factorization by process (and the driver's by thread), and the
    wall time they bound on this machine's cores."""
    cores = len(os.sched_getaffinity(0))
    total = sum(used.values())
    parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(used.items()))
    say(f"  CPU seconds of the factorization, W = {W}: {parts}; in all {total:.2f} over "
        f"{wall:.2f} s of wall time ({total / wall:.2f} of {cores} cores busy on average); "
        f"on {cores} cores it cannot take less than {total / cores:.2f} s")
    if threads:
        say("    the driver's threads: " + ", ".join(
            f"{k} {v:.2f}" for k, v in sorted(threads.items()) if v >= 0.005))


def run_dask(n: int, d: int, W: int, s: int, gamma: float, k: int, chunks_per_worker: int,
             with_kmeans: bool, want_breakdown: bool, profile: bool = False,
             separate="auto", placement: str = "rows") -> dict:
    from distributed import get_task_stream

    from dkicf import incomplete_cholesky, kmeans, local_cluster

    client = local_cluster(W, 1, separate_processes=separate)
    try:
        X = dask_data(client, n, d, W * chunks_per_worker, placement)
        clock = DriverClock()
        with contextlib.ExitStack() as stack:
            ts = stack.enter_context(get_task_stream(client)) if want_breakdown else None
            if want_breakdown:
                stack.enter_context(clock)
            prof = stack.enter_context(_profiled()) if profile else None
            cpu = _CpuClock(client)
            t_start = time.time()
            t0 = time.perf_counter()
            res = incomplete_cholesky(X, gamma=gamma, max_rank=s, tol=0.0, client=client)
            t_icf = time.perf_counter() - t0
            t_end = time.time()
            cpu_used, cpu_threads = cpu.used(), cpu.driver_threads()
        if prof is not None:
            _print_profile(prof, f"W = {W}")
        out = {"icf": t_icf, "pivots": res.pivots, "passes": res.n_passes, "cpu": cpu_used,
               "cpu_threads": cpu_threads}
        if want_breakdown:
            incoming = [e for log in client.run(_incoming_log).values() for e in log]
            out["breakdown"] = breakdown(ts.data, clock.events, W, t_start, t_end, incoming,
                                         X.name)
        if with_kmeans:
            with get_task_stream(client) as kts:
                clock = _KMeansClock()
                cpu = _CpuClock(client)
                km = kmeans(res.P, k, random_state=0, client=client, progress=clock)
                out["kmeans"] = time.perf_counter() - clock.t0
            out["kmeans_phases"] = clock.phases(out["kmeans"])
            out["kmeans_phases"]["driver_threads"] = cpu.driver_threads()
            kinds = kmeans_task_kinds(kts.data)
            out["kmeans_phases"]["worker_s"] = sum(kinds.values())
            out["kmeans_phases"]["kinds"] = kinds
            out["labels"] = np.asarray(km.labels.compute())
        del res, X
        return out
    finally:
        cluster = client.cluster
        client.close()
        cluster.close()


def run_sklearn(X, s: int, gamma: float, k: int) -> dict:
    from sklearn.cluster import MiniBatchKMeans
    from sklearn.kernel_approximation import Nystroem

    t0 = time.perf_counter()
    F = Nystroem(gamma=gamma, n_components=s, random_state=0).fit_transform(X)
    t_ny = time.perf_counter() - t0
    t0 = time.perf_counter()
    km = MiniBatchKMeans(n_clusters=k, random_state=0, n_init=1).fit(F)
    return {"icf": t_ny, "kmeans": time.perf_counter() - t0, "labels": km.labels_}


def ari(labels, y) -> float:
    from sklearn.metrics import adjusted_rand_score

    return float(adjusted_rand_score(y, labels))


def scaling(n: int, s: int, d: int, gamma: float, workers: list[int], chunks_per_worker: int,
            with_kmeans: bool, with_numpy: bool, with_sklearn: bool, want_breakdown: bool,
            k: int = 10, profile: bool = False, shared_too: bool = False,
            placement: str = "rows") -> dict:
    held = {"rows": "held by dkicf.persist_rows", "dask": "held where dask's persist put them"}
    say(f"\n== n = {n:,}, d = {d}, s = {s}, gamma = {gamma}, k = {k}; "
        f"{cores()} cores; dask: W workers x 1 thread, {chunks_per_worker} chunk(s) per worker "
        f"{held[placement]}")
    X, y = numpy_data(n, d) if (with_numpy or with_sklearn or with_kmeans) else (None, None)
    rows = {}
    if with_numpy:
        rows["numpy"] = run_numpy(X, s, gamma, k, with_kmeans)
    totals = {}
    for W in workers:
        rows[f"W={W}"] = r = run_dask(n, d, W, s, gamma, k, chunks_per_worker, with_kmeans,
                                      want_breakdown, profile and W == max(workers),
                                      placement=placement)
        if want_breakdown:
            totals[W] = print_breakdown(r["breakdown"], f"W = {W}")
        say_cpu(r["cpu"], r["icf"], W, r.get("cpu_threads"))
    if shared_too and max(workers) > 4:
        # The largest W again, scheduler and nannies in the driver's process (a LocalCluster).
        W = max(workers)
        rows[f"W={W} LocalCluster"] = r = run_dask(n, d, W, s, gamma, k, chunks_per_worker,
                                                   with_kmeans, want_breakdown, False, False,
                                                   placement)
        if want_breakdown:
            print_breakdown(r["breakdown"], f"W = {W}, scheduler and nannies in the driver")
    ref = rows.get("numpy", next(iter(rows.values())))["pivots"]
    same = {name: bool(np.array_equal(r["pivots"], ref)) for name, r in rows.items()}
    if with_sklearn:
        rows["sklearn Nystroem+MiniBatchKMeans"] = run_sklearn(X, s, gamma, k)
    base = rows.get(f"W={workers[0]}", {}).get("icf")
    say(f"  {'run':<32} {'ICF':>8} {'k-means':>8} {'total':>8} {'ICF x':>6} {'eff':>5} "
        f"{'passes':>6} {'ARI':>5} pivots")
    for name, r in rows.items():
        km = r.get("kmeans", float("nan"))
        W = int(name[2:].split()[0]) if name.startswith("W=") else None
        speed = base / r["icf"] if base and W else float("nan")
        eff = speed * workers[0] / W if W else float("nan")
        a = ari(r["labels"], y) if "labels" in r else float("nan")
        piv = "" if name not in same else ("same" if same[name] else "DIFFERENT")
        say(f"  {name:<32} {r['icf']:8.2f} {km:8.2f} {r['icf'] + km:8.2f} {speed:6.2f} "
            f"{eff:5.2f} {r.get('passes', ''):>6} {a:5.2f} {piv}")
    assert all(same.values()), f"pivots differ between runs: {same}"
    say(f"  pivots identical across {', '.join(same)}: yes")
    say_against_targets(rows, workers)
    say_kmeans_phases(rows)
    if len(workers) >= 2:
        ws = np.array(workers, dtype=float)
        ts = np.array([rows[f"W={w}"]["icf"] for w in workers])
        A = np.stack([np.ones_like(ws), 1.0 / ws], axis=1)
        (a_fit, b_fit), *_ = np.linalg.lstsq(A, ts, rcond=None)
        say(f"  Amdahl fit of ICF times, T(W) = a + b / W: a = {a_fit:.2f} s (serial), "
            f"b = {b_fit:.2f} s; bound on speed-up (a + b) / a = "
            f"{(a_fit + b_fit) / max(a_fit, 1e-9):.1f}")
    if totals:
        W0 = workers[0]
        t = totals[W0]
        # The set-up's tasks divide between the workers; what remains of it does not.
        work = t["work"] + t["setup_work"]
        serial = t["setup"] - t["setup_work"] / W0 + t["end"] + t["driver"] + t["transfer"]
        measured = rows[f"W={W0}"]["icf"]
        for target in sorted({16, cores()}):
            pred = serial + work / target
            say(f"  from the W = {W0} breakdown: T({target}) ~ serial {serial:.2f} s "
                f"(driver, transfers, set-up and end less their tasks) + worker-seconds "
                f"{work:.2f} / {target} = {pred:.2f} s, a speed-up of {measured / pred:.1f} "
                f"over the {measured:.2f} s measured at W = {W0}")
            if "worker_s" in rows[f"W={W0}"].get("kmeans_phases", {}):
                _, km = kmeans_prediction(rows[f"W={W0}"], W0, target)
                say(f"    the whole fit at W = {target}: ICF {pred:.2f} s + k-means {km:.2f} s "
                    f"= {pred + km:.2f} s (the issue's target at n = 8e6 on 16 cores: 4 s)")
    return {"rows": rows, "totals": totals}


def say_against_targets(rows: dict, workers: list[int]) -> None:
    """The run's figures that the issue's many-core targets name, for the largest W:
    its ICF speed-up, the numpy backend's time against it, and the whole fit against
    scikit-learn's pipeline."""
    top, first = max(workers), workers[0]
    r = rows.get(f"W={top}")
    if r is None:
        return
    if top != first:
        say(f"  ICF at W = {top} against W = {first}: "
            f"{rows[f'W={first}']['icf'] / r['icf']:.2f}x faster (the issue, 16 against 1 "
            f"at n = 2e6: >= 10x)")
    if "numpy" in rows:
        say(f"  numpy backend ({cores()} threads) against W = {top}: "
            f"{rows['numpy']['icf'] / r['icf']:.2f}x the ICF time (the issue: <= 1.1x)")
    sk = rows.get("sklearn Nystroem+MiniBatchKMeans")
    if sk is not None and "kmeans" in r:
        mine, theirs = r["icf"] + r["kmeans"], sk["icf"] + sk["kmeans"]
        say(f"  whole fit at W = {top}: {mine:.2f} s against {theirs:.2f} s for scikit-learn's "
            f"pipeline, {theirs / mine:.2f}x as fast (the issue at n = 8e6 on 16 cores: "
            f"<= 4 s and >= 3x)")


def _rules_taking_turns(X, gamma: float, s: int, repeats: int) -> tuple[dict, dict]:
    """Greedy and block greedy on ``X`` (numpy backend), taking turns: each rule's best
    seconds of ``repeats`` and its last result; the pivots must be identical."""
    import warnings

    from dkicf import incomplete_cholesky

    best, runs = {}, {}
    for _ in range(repeats):
        for rule in ("greedy", "block-greedy"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a near-identity kernel warns
                t0 = time.perf_counter()
                runs[rule] = incomplete_cholesky(X, gamma=gamma, max_rank=s, tol=0.0,
                                                 pivoting=rule)
                best[rule] = min(best.get(rule, math.inf), time.perf_counter() - t0)
    assert np.array_equal(runs["greedy"].pivots, runs["block-greedy"].pivots), \
        "block greedy's pivots differ from greedy's"
    return best, runs


def near_identity(repeats: int = 7) -> None:
    """Block greedy against greedy where blocks stay at one pivot (scikit-learn's digits at
    gamma 2**-6, 300 pivots): seconds (best of ``repeats``), passes, identical pivots."""
    from sklearn.datasets import load_digits

    X = load_digits().data.astype(np.float64)
    say(f"\n== near-identity kernel: digits ({X.shape[0]} x {X.shape[1]}), gamma 2**-6, "
        f"300 pivots, numpy backend, best of {repeats}")
    best, runs = _rules_taking_turns(X, 2.0**-6, 300, repeats)
    blocks = runs["block-greedy"].info["blocks"]
    singles = sum(1 for _, _, why in blocks if why == "single")
    for rule in ("greedy", "block-greedy"):
        say(f"  {rule:<13} {best[rule] * 1e3:8.1f} ms  {runs[rule].n_passes:4d} passes")
    say(f"  block greedy / greedy: {best['block-greedy'] / best['greedy']:.2f}x; "
        f"{singles} of {len(blocks)} passes fell back to one pivot; pivots identical: True")


def small_data(repeats: int = 3, rows: int = 20_000, ranks=(100, 500)) -> None:
    """Block greedy against greedy on the paper's datasets found locally (numpy backend):
    seconds (best of ``repeats``, the rules taking turns), passes, identical pivots."""
    from dkicf.datasets import DATASETS, PAPER_GAMMA, load_dataset

    say(f"\n== block greedy against greedy on the paper's datasets (first {rows:,} rows, "
        f"paper's gamma, numpy backend, best of {repeats})")
    for name in DATASETS:
        try:
            X = load_dataset(name, download=False)[0][:rows].astype(np.float64)
        except (FileNotFoundError, OSError) as exc:
            say(f"  {name}: skipped ({str(exc).splitlines()[0][:70]})")
            continue
        for s in ranks:
            best, runs = _rules_taking_turns(X, PAPER_GAMMA[name], s, repeats)
            say(f"  {name:<9} {X.shape[0]:>6} x {X.shape[1]:<3} s = {s:<4} greedy "
                f"{best['greedy'] * 1e3:7.1f} ms, block greedy {best['block-greedy'] * 1e3:7.1f} ms"
                f" ({runs['block-greedy'].n_passes} passes): "
                f"{best['block-greedy'] / best['greedy']:.2f}x; pivots identical: True")


def numpy_cores(n: int, s: int, d: int, gamma: float, cores: int, repeats: int = 3) -> float:
    """A reference for the workers' speed-up: the numpy backend (no dask, no cluster)
    on one core against ``cores`` cores, on the same rows.

    The process is pinned to the cores for each run (the backend runs a
    thread per core it may use); each figure is the best of ``repeats``
    after a first run that touches the memory.  Returns the speed-up.
    """
    from threadpoolctl import threadpool_limits

    from dkicf import incomplete_cholesky

    X = numpy_data(n, d)[0]
    allowed = os.sched_getaffinity(0)
    best = {}
    try:
        for c in (1, cores):
            os.sched_setaffinity(0, sorted(allowed)[:c])
            times = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                with threadpool_limits(c):  # BLAS sized its pool for every core at import
                    incomplete_cholesky(X, gamma=gamma, max_rank=s, tol=0.0)
                times.append(time.perf_counter() - t0)
            best[c] = min(times[1:])
    finally:
        os.sched_setaffinity(0, allowed)
    say(f"  numpy backend at n = {n:,}, s = {s}, best of {repeats}: "
        f"1 core {best[1]:.2f} s, {cores} cores {best[cores]:.2f} s, "
        f"{best[1] / best[cores]:.2f}x")
    return best[1] / best[cores]


def targets(s: int, d: int, gamma: float, chunks_per_worker: int,
            placement: str = "rows", rounds: int = 2) -> None:
    """The issue's 2-core targets."""
    say("\n#### 2-core targets of the scale-out issue")
    reference = numpy_cores(1_000_000, s, d, gamma, 2)
    r = scaling(1_000_000, s, d, gamma, [1, 2], chunks_per_worker, False, False, False, True,
                placement=placement)
    one, two = r["rows"]["W=1"]["icf"], r["rows"]["W=2"]["icf"]
    say(f"TARGET ICF speed-up 2 workers vs 1 at n = 1e6, s = {s}: {one / two:.2f}x "
        f"(target >= 1.8x; the numpy backend gains {reference:.2f}x from 2 cores)")
    r = scaling(2_000_000, s, d, gamma, [2], chunks_per_worker, False, False, False, True,
                placement=placement)
    t = r["totals"][2]
    say(f"TARGET idle (stragglers) share of a pass at n = 2e6, W = 2: "
        f"{t['stragglers'] / t['wall']:.1%} (target <= 10%); all passes' walls {t['wall']:.2f} s")
    # The driver's time per pass, taking turns between the two sizes (this shared
    # machine's stalls land on one pass at a time): the mean over all passes, as
    # the target reads, and the median pass, which one stall does not move.
    per: dict = {500_000: [], 4_000_000: []}
    for _ in range(rounds):
        for n in per:
            r = scaling(n, s, d, gamma, [2], chunks_per_worker, False, False, False, True,
                        placement=placement)
            per[n].append(r["totals"][2]["driver_per_pass"])
    mean = {n: float(np.mean(np.concatenate(v))) for n, v in per.items()}
    med = {n: float(np.median(np.concatenate(v))) for n, v in per.items()}
    for n, v in per.items():
        say(f"  driver per pass at n = {n:.0e}, run by run (mean / median, ms): "
            + ", ".join(f"{np.mean(x) * 1e3:.1f} / {np.median(x) * 1e3:.1f}" for x in v))
    say(f"TARGET driver time per pass, W = 2, {rounds} runs each: n = 5e5 "
        f"{mean[500_000] * 1e3:.1f} ms, n = 4e6 {mean[4_000_000] * 1e3:.1f} ms, ratio "
        f"{mean[4_000_000] / mean[500_000]:.2f} (target within 1.2x); median pass "
        f"{med[500_000] * 1e3:.1f} and {med[4_000_000] * 1e3:.1f} ms, ratio "
        f"{med[4_000_000] / med[500_000]:.2f}")


def prefault(gib: float) -> None:
    """Touch ``gib`` GiB of fresh memory once and free it.

    On a virtual machine the first touch of memory the guest has never
    used costs a fault in the hypervisor (here up to seconds per GiB),
    which would be charged to whichever run comes first; after this, every
    run allocates memory the guest already has.
    """
    if gib <= 0:
        return
    t0 = time.perf_counter()
    step = 1 << 28
    bufs = []
    for _ in range(int(gib * 2**30) // step):
        b = np.empty(step // 8)
        b[:] = 0.0
        bufs.append(b)
    del bufs
    say(f"  pre-faulted {gib:.1f} GiB of memory in {time.perf_counter() - t0:.1f} s")


def _version() -> str:
    import subprocess

    import dkicf

    here = os.path.dirname(os.path.abspath(dkicf.__file__))
    try:
        rev = subprocess.run(["git", "-C", here, "log", "-1", "--format=%h %s"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return f"dkicf from {here} {rev[:70]}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=float, nargs="+", default=[1e6], help="rows (several allowed)")
    p.add_argument("--s", type=int, default=150, help="rank (max_rank)")
    p.add_argument("--d", type=int, default=16)
    p.add_argument("--gamma", type=float, default=0.02)
    p.add_argument("--workers", type=int, nargs="+", default=None,
                   help="worker counts (default 1, 2, 4, ... up to the cores)")
    p.add_argument("--chunks-per-worker", type=int, default=4)
    p.add_argument("--placement", choices=("rows", "dask"), default="rows",
                   help="X held by dkicf.persist_rows (consecutive chunks per worker, the "
                        "default) or where dask's own persist puts them")
    p.add_argument("--no-kmeans", action="store_true")
    p.add_argument("--no-numpy", action="store_true")
    p.add_argument("--no-sklearn", action="store_true")
    p.add_argument("--no-breakdown", action="store_true")
    p.add_argument("--shared-too", action="store_true",
                   help="run the largest W also as a LocalCluster (scheduler and nannies in "
                        "the driver's process), beside the default of processes of their own")
    p.add_argument("--profile", action="store_true",
                   help="profile the driver thread during the largest W's factorization")
    p.add_argument("--targets", action="store_true", help="the issue's 2-core targets")
    p.add_argument("--near-identity", action="store_true",
                   help="only block greedy against greedy on a near-identity kernel")
    p.add_argument("--small-data", action="store_true",
                   help="only block greedy against greedy on the paper's datasets")
    p.add_argument("--quick", action="store_true",
                   help="n = 2e6 with W = 1, 2, 4, 8, 16, then n = 8e6 with the largest W")
    p.add_argument("--prefault-gb", type=float, default=None,
                   help="GiB of memory to touch once first (default: about the largest "
                        "run's P and X, at most half the memory)")
    args = p.parse_args(argv)
    C = cores()
    say(f"bench_scaling: {C} cores, python {sys.version.split()[0]}, {_version()}")
    if args.near_identity or args.small_data:
        args.prefault_gb = 0.0
    if args.prefault_gb is None:
        import psutil

        largest = 8e6 if args.quick else (4e6 if args.targets else max(args.n))
        need = 1.5 * 8 * largest * (args.s + args.d) / 2**30
        args.prefault_gb = min(need, 0.5 * psutil.virtual_memory().available / 2**30)
    prefault(args.prefault_gb)
    # The driver's k-means imports scikit-learn's on first use (about 1.2 s here):
    # imported now, no run's k-means pays it, the first alone.
    import sklearn.cluster  # noqa: F401
    default_w = [w for w in (1, 2, 4, 8, 16, 32, 64) if w <= C]
    t_run = time.perf_counter()
    try:
        if args.near_identity or args.small_data:
            if args.near_identity:
                near_identity()
            if args.small_data:
                small_data()
        elif args.targets:
            targets(args.s, args.d, args.gamma, args.chunks_per_worker, args.placement)
            near_identity()
        elif args.quick:
            ws = args.workers or default_w
            scaling(2_000_000, args.s, args.d, args.gamma, ws, args.chunks_per_worker,
                    not args.no_kmeans, not args.no_numpy, not args.no_sklearn,
                    not args.no_breakdown, shared_too=args.shared_too,
                    placement=args.placement)
            scaling(8_000_000, args.s, args.d, args.gamma, [max(ws)], args.chunks_per_worker,
                    not args.no_kmeans, not args.no_numpy, not args.no_sklearn,
                    not args.no_breakdown, shared_too=args.shared_too,
                    placement=args.placement)
        else:
            for n in args.n:
                scaling(int(n), args.s, args.d, args.gamma, args.workers or default_w,
                        args.chunks_per_worker, not args.no_kmeans, not args.no_numpy,
                        not args.no_sklearn, not args.no_breakdown, profile=args.profile,
                        shared_too=args.shared_too, placement=args.placement)
    finally:
        say(f"\nbench_scaling: {time.perf_counter() - t_run:.0f} s in all")


if __name__ == "__main__":
    main()
