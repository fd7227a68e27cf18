"""Fit dkicf on PBS with dask-jobqueue: the dask workers are PBS jobs submitted from here.

Run it on a login node (or inside a small job of its own) from a Python
environment that the compute nodes see too, with ``pip install "dkicf[hpc]"``
and ``cryptography``::

    python pbs-jobqueue.py /scratch/$USER/data.zarr /scratch/$USER/model.zarr \\
        --clusters 10 --jobs 8 --cores 16 --memory 110GiB --processes 4 \\
        --walltime 04:00:00 --queue workq --interface ib0

Each job becomes ``--processes`` dask workers with ``cores / processes``
threads and ``memory / processes`` of memory each (see ../README.md for
sizing).  ``--print-script`` shows the batch script and submits nothing.

The scheduler runs in this process and listens on ``--interface``, where
every user of the site's network can reach it.  Connections are therefore
mutual TLS with throwaway certificates, written readable by you only into
``--shared-dir`` (it must be visible to the compute nodes); ``--no-tls``
turns that off on a network you trust.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dkicf.deploy import jobqueue_script, start_cluster
from dkicf.pipeline import fit_store


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="input Zarr store of X")
    parser.add_argument("out", help="output Zarr group")
    parser.add_argument("--clusters", type=int, default=10)
    parser.add_argument("--rank", type=int, default=500, help="rank s of the factorization")
    parser.add_argument("--jobs", type=int, default=4, help="PBS jobs (nodes) of workers")
    parser.add_argument("--cores", type=int, default=16, help="CPUs per job")
    parser.add_argument("--memory", default="110GiB", help="memory per job")
    parser.add_argument("--processes", type=int, default=4, help="dask workers per job")
    parser.add_argument("--walltime", default="04:00:00")
    parser.add_argument("--queue", default=None, help="PBS queue")
    parser.add_argument("--account", default=None)
    parser.add_argument("--interface", default=None, help="network interface, e.g. ib0")
    parser.add_argument("--local-directory", default="$TMPDIR",
                        help="node-local disk for spilling (expanded on the node)")
    parser.add_argument("--shared-dir", default=str(Path.home() / ".dkicf"),
                        help="directory on a shared filesystem for the TLS files")
    parser.add_argument("--no-tls", action="store_true")
    parser.add_argument("--print-script", action="store_true")
    args = parser.parse_args(argv)

    options = dict(
        jobs=args.jobs, cores=args.cores, memory=args.memory, processes=args.processes,
        walltime=args.walltime, queue=args.queue, account=args.account,
        interface=args.interface, local_directory=args.local_directory,
        log_directory="dkicf-pbs-logs",
    )
    if args.print_script:
        print(jobqueue_script("pbs", **options))
        if not args.no_tls:  # on stderr: stdout stays the script
            print(f"note: as submitted, the workers connect over tls://, with throwaway "
                  f"certificates that the cluster writes into {args.shared_dir} when it starts "
                  "(--tls-ca-file, --tls-cert and --tls-key in the worker command); the script "
                  "above shows plain tcp://, which only --no-tls submits.", file=sys.stderr)
        return
    if args.no_tls:
        options.update(security=False)  # plain TCP, as asked (start_cluster warns)
    else:
        os.makedirs(args.shared_dir, mode=0o700, exist_ok=True)
        options.update(security=True, shared_temp_directory=args.shared_dir)

    client, cluster = start_cluster("pbs", **options)
    try:
        n_workers = args.jobs * args.processes
        print(f"scheduler {cluster.scheduler_address}; waiting for {n_workers} workers")
        # Wait for every worker (the queue may take a while), so that X is spread
        # over all of them from the start.
        client.wait_for_workers(n_workers)
        report = fit_store(
            args.data, args.out, {"n_clusters": args.clusters, "rank": args.rank},
            client=client,
        )
        print(report)
    finally:
        client.close()
        cluster.close()


if __name__ == "__main__":
    main()
