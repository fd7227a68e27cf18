"""Reliability in figures: fuzz, chaos, full-disk, concurrency and metadata cases, counted.

Runs each family of faults at a chosen size and prints one table:

    family | cases tried | cases that held | data lost | longest time to a clean error

A case *holds* when it ends in a clean error (a ``DkicfError``, or a
``ValueError`` raised by dkicf itself) or in a correct result: never a
traceback from inside a library, a hang, a partial output, or a changed input.
*Data lost* counts inputs changed, outputs left half-written, and finished
fits that differ from the undisturbed one.

Families
    fuzz: convert / stores / models
        The hypothesis cases of ``tests/test_fuzz.py`` (files to convert;
        damaged dataset stores read as fit, predict and info read them;
        tampered model groups given to predict), ``--fuzz`` cases each.
    fuzz: k-means
        The hypothesis cases of ``tests/test_kmeans_properties.py``: random
        rows (duplicated rows and small integer grids among them) and options;
        each fits with the restarts sharing their passes and apart, which
        must agree, and each fit must agree with direct computations.
    fuzz: factorization
        The hypothesis cases of ``tests/test_icf_properties.py``: random rows
        (copies, grids, tight blobs, scales from 0.01 to 100), four kernels,
        all three pivot rules; each factor must keep the theorems of a partial
        Cholesky factorization against scikit-learn's full kernel matrix.
    chaos: worker kills
        Fits on a LocalCluster of 3 workers; in each, one worker is SIGKILLed
        during loading, an ICF pass, k-means or the final write (by turns, at
        a random moment); every finished fit must equal the undisturbed one
        bit for bit (pivots, L, centres, labels, P).
    chaos: driver kills
        A fit with a checkpoint in a child process, SIGKILLed at a random rank
        or k-means step, then resumed here: it must equal the undisturbed fit,
        and the killed run must have published nothing.
    full disk
        The output, the checkpoint and P in the output on a filesystem of a
        few hundred KB (``smallmem://``, full at a capacity drawn at random):
        a clean error naming the path, nothing published, the input intact,
        and, once space is freed, a result (resumed from the checkpoint where
        there is one) equal to the undisturbed fit.
    concurrency
        Rounds of 3 processes claiming the same output at once: exactly one
        may win; and claims of killed runs: detected, and taken over only
        with resume/overwrite.
    metadata
        Stores whose metadata claims far more rows than their chunks hold,
        opened under a 3 GiB address-space limit: refused before allocating.
    resume: factorization / k-means
        ``--resumes`` random cases each (the rows and options of
        ``tests/test_pivot_properties.py`` and ``tests/test_kmeans_properties.py``;
        all three pivot rules; a commit every 1, 2 or 5 passes, every k-means
        step), interrupted right after a commit drawn at random and resumed:
        each must equal the undisturbed fit bit for bit.

Run: python benchmarks/bench_campaign.py [--fuzz 200] [--kills 12] [--driver-kills 6]
     [--disk 12] [--rounds 10] [--resumes 100] [--seed 0] [--markdown]

Timings are wall-clock on whatever machine runs it (noisy on a shared one).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

PARAMS = {"n_clusters": 3, "gamma": 0.5, "rank": 24, "n_init": 1, "random_state": 0,
          "pivoting": "greedy", "max_iter": 30}


@dataclass
class Family:
    name: str
    tried: int = 0
    held: int = 0
    lost: int = 0
    longest_error_s: float = 0.0
    notes: str = ""

    def case(self, held: bool, lost: bool = False, error_s: float | None = None) -> None:
        self.tried += 1
        self.held += bool(held)
        self.lost += bool(lost)
        if error_s is not None:
            self.longest_error_s = max(self.longest_error_s, error_s)


def _model(url: str) -> dict:
    from dkicf import io

    arrays, _ = io.read_group(url)
    for name in ("labels", "P"):
        member = io.open_member(url, name)
        if member is not None:
            arrays[name] = member.compute(scheduler="synchronous")
    return arrays


def _same(a: dict, b: dict) -> bool:
    keys = ("pivots", "cholesky_factor", "cluster_centers", "labels", "P")
    return all(k in a and k in b and np.array_equal(a[k], b[k]) for k in keys)


# --------------------------------------------------------------------------- fuzz


def fuzz(examples: int, seed: int) -> list[Family]:
    import test_fuzz as tf
    import test_icf_properties as ti
    import test_kmeans_properties as tk
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    runs = {
        "fuzz: convert (csv, svmlight, npy, npz, parquet)": [
            given(data=tf.csv_texts(), label_column=tf._LABEL_COLUMNS)(
                lambda data, label_column: tf._convert_case(data, ".csv", label_column)),
            given(data=tf.svmlight_texts())(lambda data: tf._convert_case(data, ".svm")),
            given(case=tf.npy_files())(lambda case: tf._convert_case(case[0], ".npy")),
            given(case=tf.npz_files())(lambda case: tf._convert_case(case[0], ".npz")),
            given(data=tf.parquet_files(), label_column=tf._LABEL_COLUMNS)(
                lambda data, label_column: tf._convert_case(data, ".parquet", label_column)),
        ],
        "fuzz: dataset stores (fit, predict, info)": [
            given(mutations=st.lists(tf._MUTATIONS, min_size=1, max_size=3))(
                tf.test_fuzz_dataset_stores.hypothesis.inner_test)],
        "fuzz: model groups (predict)": [
            given(mutations=st.lists(tf._MODEL_MUTATIONS, min_size=1, max_size=3))(
                tf.test_fuzz_model_groups.hypothesis.inner_test)],
        "fuzz: k-means (restarts sharing passes against apart)": [
            given(case=tk.kmeans_cases())(
                tk.test_fuzz_restarts_sharing_their_passes_fit_as_apart.hypothesis.inner_test)],
        "fuzz: factorization (theorems against the full kernel matrix)": [
            given(case=ti.cases())(
                ti.test_the_factor_keeps_the_theorems_of_a_partial_cholesky_factorization
                .hypothesis.inner_test)],
    }
    families = []
    for name, tests in runs.items():
        family = Family(name)
        failures: dict[str, str] = {}
        for test in tests:
            inner = test.hypothesis.inner_test

            def counted(*args, _inner=inner, family=family, failures=failures, **kwargs):
                tf.CASE_TIMES = times = []
                try:
                    _inner(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - every failure is counted
                    text = str(exc)
                    lost = text.startswith(("data lost", "partial output"))
                    family.case(False, lost)
                    lines = [line for line in text.splitlines() if line.strip()] or ["?"]
                    # A traceback's last line names the exception; other failures, the first.
                    key = lines[-1] if text.startswith("not a clean error") else lines[0]
                    failures.setdefault(key.strip()[:160], repr((args, kwargs))[:300])
                else:
                    refused = [s for kind, s in times if kind == "refused"]
                    family.case(True, error_s=max(refused) if refused else None)
                finally:
                    tf.CASE_TIMES = None

            test.hypothesis.inner_test = counted
            settings(max_examples=examples, deadline=None, database=None,
                     suppress_health_check=list(HealthCheck), derandomize=False)(test)
            with contextlib.suppress(BaseException):
                test()
            test.hypothesis.inner_test = inner
        if failures:
            family.notes = "; ".join(f"{k} <- {v}" for k, v in list(failures.items())[:3])
        families.append(family)
    return families


# --------------------------------------------------------------------------- chaos


def _worker_pids(client) -> dict[str, int]:
    return client.run(os.getpid)


def chaos_workers(kills: int, seed: int, data: str, tmp: Path) -> Family:
    """Fits on 3 workers, one SIGKILLed at a random moment of a stage chosen by turns."""
    from dkicf import local_cluster, pipeline

    family = Family("chaos: worker kills (3 workers)")
    rng = random.Random(seed)
    client = local_cluster(3, 1, memory_limit="1GiB")
    try:
        reference = str(tmp / "reference.zarr")
        pipeline.fit_store(data, reference, PARAMS, client=client)
        expected = _model(reference)
        stages = ["loading", "icf", "kmeans", "write"]
        delivered = dict.fromkeys(stages, 0)
        restarts = 0
        for run in range(kills):
            stage = stages[run % len(stages)]
            out = tmp / f"chaos-{run}.zarr"
            trigger, done = threading.Event(), threading.Event()
            at = {"icf": rng.randint(1, PARAMS["rank"] - 1), "kmeans": rng.randint(1, 3)}
            killed: list[int] = []

            def progress(p, stage=stage, at=at, trigger=trigger):
                rank = getattr(p, "rank", None)
                if stage == "icf" and rank is not None and rank >= at["icf"]:
                    trigger.set()
                if stage == "kmeans" and rank is None and getattr(p, "step", 0) >= at["kmeans"]:
                    trigger.set()

            def killer(stage=stage, out=out, trigger=trigger, done=done, killed=killed,
                       client=client):
                if stage == "loading":
                    time.sleep(rng.uniform(0.0, 0.5))
                elif stage == "write":
                    deadline = time.monotonic() + 300
                    while time.monotonic() < deadline and not done.is_set() and not any(
                            (p / "labels").exists() for p in tmp.glob(f".{out.name}.dkicf-tmp-*")):
                        time.sleep(0.005)
                else:
                    trigger.wait(300)
                if done.is_set():  # the fit ended first: no kill in this stage
                    return
                pids = list(_worker_pids(client).values())
                victim = rng.choice(pids)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
                    killed.append(victim)

            thread = threading.Thread(target=killer, daemon=True)
            thread.start()
            t0 = time.perf_counter()
            try:
                pipeline.fit_store(data, str(out), PARAMS, client=client, progress=progress)
            except Exception as exc:  # noqa: BLE001 - a clean failure holds, with no output
                clean = type(exc).__module__.startswith("dkicf")
                staged = list(tmp.glob(f".{out.name}.dkicf-tmp-*"))
                family.case(clean and not out.exists() and not staged,
                            lost=out.exists() or bool(staged), error_s=time.perf_counter() - t0)
                outcome = f"error {type(exc).__name__}"
            else:
                same = _same(_model(str(out)), expected)
                family.case(same, lost=not same)
                outcome = "same" if same else "DIFFERENT"
            done.set()
            trigger.set()
            thread.join(60)
            delivered[stage] += len(killed)
            print(f"#   worker kill {run}: {stage}, {len(killed)} killed, {outcome}, "
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            try:
                # A nanny brings its worker back in seconds; now and then one does not.
                client.wait_for_workers(3, timeout=60)
            except Exception:  # noqa: BLE001 - a worker that does not come back is replaced
                restarts += 1
                cluster = client.cluster
                client.close()
                cluster.close()
                client = local_cluster(3, 1, memory_limit="1GiB")
        family.notes = (f"{kills} fits, {sum(delivered.values())} workers SIGKILLed ("
                        + ", ".join(f"{k} {v}" for k, v in delivered.items())
                        + f"); clusters replaced after a worker did not come back: {restarts}")
    finally:
        cluster = client.cluster
        client.close()
        cluster.close()
    return family


def chaos_driver(kills: int, seed: int, data: str, tmp: Path) -> Family:
    """A checkpointed fit in a child SIGKILLed at a random point, resumed here."""
    from dkicf import local_cluster, pipeline

    family = Family("chaos: driver kills + resume")
    rng = random.Random(seed + 1)
    client = local_cluster(2, 1, memory_limit="1GiB")
    try:
        reference = str(tmp / "reference-driver.zarr")
        pipeline.fit_store(data, reference, PARAMS, client=client)
        expected = _model(reference)
        for run in range(kills):
            out, ck = tmp / f"driver-{run}.zarr", tmp / f"driver-{run}-ck.zarr"
            in_kmeans = run % 2 == 1
            at = rng.randint(1, 3) if in_kmeans else rng.randint(2, PARAMS["rank"] - 1)
            code = textwrap.dedent(f"""
                import os, signal
                from distributed import Client
                from dkicf import pipeline

                def progress(p):
                    rank = getattr(p, "rank", None)
                    step = getattr(p, "step", 0)
                    if ({in_kmeans} and rank is None and step >= {at}) or \\
                            (not {in_kmeans} and rank is not None and rank >= {at}):
                        os.kill(os.getpid(), signal.SIGKILL)

                with Client({client.scheduler.address!r}) as c:
                    pipeline.fit_store({data!r}, {str(out)!r}, {PARAMS!r}, client=c,
                                       checkpoint={str(ck)!r}, checkpoint_every=3,
                                       progress=progress)
            """)
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=600)
            partial = out.exists()
            if proc.returncode != -signal.SIGKILL:
                print(f"#   driver kill {run}: not killed (exit {proc.returncode}): "
                      f"{proc.stderr[-500:]}", file=sys.stderr, flush=True)
                family.case(False, lost=partial)
                continue
            t0 = time.perf_counter()
            try:
                pipeline.fit_store(data, str(out), PARAMS, client=client, checkpoint=str(ck),
                                   checkpoint_every=3, resume=True)
            except Exception:  # noqa: BLE001
                family.case(False, lost=True, error_s=time.perf_counter() - t0)
                continue
            same = _same(_model(str(out)), expected)
            family.case(same and not partial, lost=partial or not same)
            print(f"#   driver kill {run}: {'k-means' if in_kmeans else 'factorization'} at "
                  f"{at}, {'same' if same else 'DIFFERENT'}"
                  f"{', partial output' if partial else ''}", file=sys.stderr, flush=True)
        family.notes = f"{kills} kills, alternately in the factorization and in k-means"
    finally:
        cluster = client.cluster
        client.close()
        cluster.close()
    return family


# --------------------------------------------------------------------------- resume


def _interrupted_and_resumed(fit, url: str, rng: random.Random):
    """``fit(checkpoint=url, resume=...)`` stopped at one of its commits drawn at random
    (a KeyboardInterrupt raised right after that commit), then resumed; the undisturbed
    fit; and the commit, or None where the stop did not happen.  None where the fit
    makes no commit."""
    import dkicf._commit as ck

    commits: list = []
    ck._fault_hook = lambda phase, step: commits.append((phase, step))
    try:
        reference = fit(checkpoint=url + "-reference", resume=False)
    finally:
        ck._fault_hook = None
    if not commits:
        return None
    at = commits[rng.randrange(len(commits))]

    def stop(phase, step):
        if (phase, step) == at:
            raise KeyboardInterrupt

    ck._fault_hook = stop
    try:
        fit(checkpoint=url, resume=False)
        at = None  # it ran to the end: nothing to resume
    except KeyboardInterrupt:
        pass
    finally:
        ck._fault_hook = None
    return fit(checkpoint=url, resume=True), reference, at


def resume_random(cases: int, seed: int, tmp: Path) -> list[Family]:
    """Factorizations and k-means fits of random, often degenerate data and options,
    interrupted at a random commit and resumed: each must equal the undisturbed fit bit
    for bit (numpy backend, in this process)."""
    import warnings

    import test_kmeans_properties as tk
    import test_pivot_properties as tp

    from dkicf import incomplete_cholesky, kmeans

    rng, nprng = random.Random(seed + 3), np.random.default_rng(seed + 3)
    icf, km = Family("resume: factorization at a random commit"), \
        Family("resume: k-means at a random commit")
    for case in range(cases):
        _, X, options = tp.random_case(nprng)
        rule = rng.choice(["greedy", "block-greedy", "rpcholesky"])
        every = rng.choice([1, 2, 5])
        extra = {"random_state": case} if rule == "rpcholesky" else {}

        factorize = functools.partial(incomplete_cholesky, X, pivoting=rule,
                                      checkpoint_every=every, **options, **extra)
        Y = tk.random_rows(rng.choice(tk.KINDS), rng.randint(20, 400), rng.randint(1, 5), nprng)
        cluster = functools.partial(
            kmeans, Y, rng.randint(1, min(np.unique(Y, axis=0).shape[0], 8)),
            algorithm=rng.choice(["lloyd", "minibatch-lloyd", "minibatch"]),
            init=rng.choice(["k-means||", "k-means++"]), n_init=rng.randint(1, 5),
            batch_size=rng.choice([8, 64]), tol=rng.choice([0.0, 1e-4]),
            max_iter=rng.choice([5, 30]), random_state=case, checkpoint_every=1)
        for family, fit, same in (
            (icf, factorize, lambda a, b: (np.array_equal(a.pivots, b.pivots)
                                           and np.array_equal(a.P, b.P)
                                           and a.n_passes == b.n_passes)),
            (km, cluster, lambda a, b: (np.array_equal(a.labels, b.labels)
                                        and np.array_equal(a.cluster_centers, b.cluster_centers)
                                        and a.inertias == b.inertias
                                        and a.n_steps_total == b.n_steps_total)),
        ):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # rank-deficient kernels, empty clusters
                    found = _interrupted_and_resumed(
                        fit, str(tmp / f"resume-{family.name[8:11]}-{case}"), rng)
            except Exception as exc:  # noqa: BLE001 - every failure is counted
                family.case(False, lost=True)
                family.notes = family.notes or f"case {case}: {exc!r}"[:300]
                continue
            if found is None:
                continue
            resumed, reference, at = found
            equal = bool(same(resumed, reference))
            family.case(at is not None and equal, lost=not equal)
            if not (at is not None and equal) and not family.notes:
                family.notes = (f"case {case}: " + (
                    "not stopped" if at is None else f"stopped after {at}, different"))
    for family in (icf, km):
        family.notes = family.notes or f"{cases} cases drawn, {family.tried} made a commit"
    return [icf, km]


# --------------------------------------------------------------------------- full disk


def full_disk(cases: int, seed: int, data: str, tmp: Path) -> Family:
    from _smallfs import SmallMemoryFileSystem as Small
    from distributed import Client

    from dkicf import io, pipeline

    family = Family("full disk (output, checkpoint, P store)")
    rng = random.Random(seed + 2)
    before = {p: p.read_bytes() for p in Path(data).rglob("*") if p.is_file()}
    with Client(processes=False, n_workers=1, threads_per_worker=2,
                dashboard_address=None) as client:
        reference = str(tmp / "reference-disk.zarr")
        pipeline.fit_store(data, reference, PARAMS, client=client)
        expected = _model(reference)
        wheres = ["output", "checkpoint", "P store"]
        for run in range(cases):
            where = wheres[run % 3]
            Small.reset(rng.randint(2_000, 900_000))
            out = f"smallmem://disk{run}/out.zarr"
            kw = {}
            if where == "checkpoint":
                kw = {"checkpoint": f"smallmem://disk{run}/ck.zarr", "checkpoint_every": 4}
            elif where == "P store":
                kw = {"p_storage": "zarr"}
            t0 = time.perf_counter()
            try:
                pipeline.fit_store(data, out, PARAMS, client=client, **kw)
                failed = None
            except io.DkicfIOError as exc:
                failed = exc
            except Exception:  # noqa: BLE001 - not a clean error
                family.case(False)
                continue
            elapsed = time.perf_counter() - t0
            fs = Small()
            if failed is not None:
                published = fs.exists(f"/disk{run}/out.zarr")
                clean = "no space left to write" in str(failed) and not published
                Small.capacity = 1 << 40  # space is freed
                try:
                    pipeline.fit_store(data, out, PARAMS, client=client,
                                       resume="checkpoint" in kw, **kw)
                    same = _same(_model(out), expected)
                except Exception:  # noqa: BLE001
                    same = False
                family.case(clean and same, lost=published or not same, error_s=elapsed)
            else:
                same = _same(_model(out), expected)
                family.case(same, lost=not same)
        Small.reset()
    intact = all(p.read_bytes() == b for p, b in before.items())
    if not intact:
        family.lost += 1
    family.notes = "capacities drawn in 2 KB..900 KB; output, checkpoint, P store by turns"
    return family


# --------------------------------------------------------------------------- concurrency


def concurrency(rounds: int, tmp: Path) -> Family:
    from dkicf import io

    family = Family("concurrency (claims)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    racer = textwrap.dedent("""
        import os, sys, time
        from dkicf import io
        open(f"ready-{sys.argv[1]}", "w").close()
        while not os.path.exists("go"):
            time.sleep(0.002)
        try:
            with io.claimed({"the output": "out.zarr"}):
                print("WON", flush=True)
                while not os.path.exists("done"):
                    time.sleep(0.01)
        except io.ClaimedError:
            print("REFUSED", flush=True)
    """)
    for r in range(rounds):
        where = tmp / f"race-{r}"
        where.mkdir()
        procs = [subprocess.Popen([sys.executable, "-c", racer, str(i)], cwd=where, env=env,
                                  stdout=subprocess.PIPE, text=True) for i in range(3)]
        while len(list(where.glob("ready-*"))) < 3:
            time.sleep(0.02)
        t0 = time.perf_counter()
        (where / "go").touch()
        while sum(p.poll() is not None for p in procs) < 2 and time.perf_counter() - t0 < 60:
            time.sleep(0.01)
        refused_s = time.perf_counter() - t0
        (where / "done").touch()
        outs = [p.communicate(timeout=60)[0] for p in procs]
        family.case(sum(o.startswith("WON") for o in outs) == 1, error_s=refused_s)
        # A killed holder: stale, refused without take_over, taken over with it.
        holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
            import os, signal
            from dkicf import io
            with io.claimed({"the output": "stale.zarr"}):
                os.kill(os.getpid(), signal.SIGKILL)
        """)], cwd=where, env=env)
        holder.wait(60)
        t0 = time.perf_counter()
        try:
            with io.claimed({"the output": where / "stale.zarr"}):
                ok = False
        except io.ClaimedError as exc:
            ok = exc.stale
        error_s = time.perf_counter() - t0
        with io.claimed({"the output": where / "stale.zarr"}, take_over=True):
            pass
        family.case(ok and not (where / ".stale.zarr.dkicf-claim").exists(), error_s=error_s)
    family.notes = f"{rounds} races of 3 processes, {rounds} stale claims"
    return family


# --------------------------------------------------------------------------- metadata


def metadata(tmp: Path) -> Family:
    import json

    import zarr

    family = Family("metadata claims (10**9..10**15 rows)")
    for rows in (10**9, 10**11, 10**13, 10**15):
        store = tmp / f"swollen-{rows}.zarr"
        group = zarr.open_group(str(store), mode="w")
        group.create_array("X", data=np.ones((4000, 2)), chunks=(10, 2))
        meta = json.loads((store / "X" / "zarr.json").read_text())
        meta["shape"][0] = rows
        (store / "X" / "zarr.json").write_text(json.dumps(meta))
        code = textwrap.dedent(f"""
            import resource, time
            resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
            from dkicf import io, pipeline
            for call in (lambda: io.open_dataset({str(store)!r}),
                         lambda: pipeline.describe({str(store)!r})):
                t0 = time.perf_counter()
                try:
                    call()
                    print("ACCEPTED")
                except io.DkicfIOError:
                    print("REFUSED", time.perf_counter() - t0)
        """)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
        for line in proc.stdout.splitlines() or ["CRASHED"]:
            refused = line.startswith("REFUSED")
            family.case(refused and proc.returncode == 0,
                        error_s=float(line.split()[1]) if refused else None)
    family.notes = "open_dataset and info, under a 3 GiB address-space limit"
    return family


# --------------------------------------------------------------------------- main


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fuzz", type=int, default=200, help="hypothesis cases per fuzz target")
    p.add_argument("--kills", type=int, default=12, help="worker kills (one per fit)")
    p.add_argument("--driver-kills", type=int, default=6)
    p.add_argument("--disk", type=int, default=12, help="full-disk cases")
    p.add_argument("--rounds", type=int, default=10, help="concurrency rounds")
    p.add_argument("--resumes", type=int, default=100,
                   help="random cases interrupted at a commit and resumed (per family)")
    p.add_argument("--n", type=int, default=4000, help="rows of the chaos and disk data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="*", help="families to run (fuzz chaos driver disk "
                                             "concurrency metadata resume)")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = p.parse_args(argv)
    only = set(args.only or ["fuzz", "chaos", "driver", "disk", "concurrency", "metadata",
                             "resume"])

    from dkicf import io

    tmp = Path(tempfile.mkdtemp(prefix="dkicf-campaign-"))
    data = str(tmp / "data.zarr")
    io.generate("blobs", data, args.n, chunk_rows=max(1, args.n // 4), centers=3)
    families: list[Family] = []
    started = time.perf_counter()
    steps = [
        ("fuzz", lambda: fuzz(args.fuzz, args.seed)),
        ("metadata", lambda: [metadata(tmp)]),
        ("concurrency", lambda: [concurrency(args.rounds, tmp)]),
        ("disk", lambda: [full_disk(args.disk, args.seed, data, tmp)]),
        ("chaos", lambda: [chaos_workers(args.kills, args.seed, data, tmp)]),
        ("driver", lambda: [chaos_driver(args.driver_kills, args.seed, data, tmp)]),
        ("resume", lambda: resume_random(args.resumes, args.seed, tmp)),
    ]
    for key, step in steps:
        if key not in only:
            continue
        t0 = time.perf_counter()
        try:
            results = step()
        except Exception:  # noqa: BLE001 - a family that cannot run is reported, not hidden
            traceback.print_exc()
            results = [Family(f"{key} (did not run)", notes="see the traceback above")]
        for family in results:
            # Each row as soon as it is known: a campaign cut short keeps what it measured.
            print(f"# {family.name}: {time.perf_counter() - t0:.0f} s; tried {family.tried}, "
                  f"held {family.held}, lost {family.lost}, longest error "
                  f"{family.longest_error_s:.2f} s; {family.notes}", file=sys.stderr, flush=True)
        families += results
    header = ("family", "cases tried", "held", "data lost", "longest time to a clean error")
    rows = [(f.name, str(f.tried), str(f.held), str(f.lost),
             f"{f.longest_error_s:.2f} s" if f.longest_error_s else "-") for f in families]
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join(["---"] + ["---:"] * 4) + "|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(5)]
        for row in [header, *rows]:
            print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                            for i, (c, w) in enumerate(zip(row, widths))))
    print(f"\ntotal {time.perf_counter() - started:.0f} s; seed {args.seed}; "
          f"python {sys.version.split()[0]}", file=sys.stderr)
    for family in families:
        if family.notes:
            print(f"{family.name}: {family.notes}", file=sys.stderr)


if __name__ == "__main__":
    main()
