"""BLAS thread counts as threadpoolctl sees them, and the check that a fit's driver steps
run on one BLAS thread."""

from __future__ import annotations

import pytest


def blas_threads() -> set[int]:
    """The thread counts of the process's BLAS libraries."""
    from threadpoolctl import threadpool_info

    return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}


def check_driver_steps_run_one_blas_thread(monkeypatch, owner, name: str, fit):
    """With BLAS at two threads, ``owner.<name>`` (a driver step) sees one while ``fit()``
    runs; two are back afterwards, also when that step fails.  Returns the first fit's
    result."""
    from threadpoolctl import threadpool_limits

    seen, real = set(), getattr(owner, name)

    def step(*args, **kw):
        seen.update(blas_threads())
        return real(*args, **kw)

    monkeypatch.setattr(owner, name, step)
    with threadpool_limits(2, user_api="blas"):
        if blas_threads() != {2}:
            pytest.skip("needs a BLAS that can run two threads")
        result = fit()
        assert seen == {1} and blas_threads() == {2}

        def failing(*a, **k):
            raise FloatingPointError("the step failed")

        monkeypatch.setattr(owner, name, failing)
        with pytest.raises(FloatingPointError, match="the step failed"):
            fit()
        assert blas_threads() == {2}
    return result
