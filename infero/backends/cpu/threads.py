"""How many threads numpy's BLAS runs the CPU backend's products on.

One by default. A decode step is a few hundred small mat-vec products, each too short to share between threads,
and OpenBLAS's workers spin while they wait for the next one: with its default of one thread a core, decode ran
at 47.8 tok/s on an idle 2-core machine and at 1.5 tok/s while another process kept one core busy, against
38-39 tok/s with one thread (issue 28, at b3a2e05; docs/performance.md, "CPU backend", has the numbers since).
`--cpu-threads` or INFERO_CPU_THREADS asks for more.
"""

from __future__ import annotations

import os

from infero.errors import InferoError

ENV = "INFERO_CPU_THREADS"
DEFAULT_THREADS = 1


def requested_threads(configured: int | None) -> int:
    """The configured count, else $INFERO_CPU_THREADS, else DEFAULT_THREADS."""
    if configured is not None:
        value, source = configured, "cpu_threads"
    elif os.environ.get(ENV, "").strip():
        text, source = os.environ[ENV].strip(), ENV
        try:
            value = int(text)
        except ValueError:
            raise InferoError(f"{ENV}={text!r} is not a number of threads; set it to an integer >= 1") from None
    else:
        return DEFAULT_THREADS
    if value < 1:
        raise InferoError(f"{source}={value}: the CPU backend needs at least one thread; pass 1 or more")
    return value


def set_blas_threads(threads: int) -> None:
    """Limit every BLAS library loaded in the process (numpy's) to `threads` threads, from now on."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads, user_api="blas")
