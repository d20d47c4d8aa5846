"""A few threads for numpy work that lets go of the GIL (gathers, copies).

Numpy releases the GIL inside its loops over large arrays, so memory-bound
work on separate columns or separate row ranges runs side by side on
several cores.  Results never depend on the number of threads: each task
writes only its own output.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

MAX_THREADS = 4  # memory bandwidth, not cores, bounds these tasks


def threads() -> int:
    """Threads to use: the cores this process may run on, at most MAX_THREADS;
    ``STALLWATCH_THREADS`` overrides (1: everything in the calling thread)."""
    env = os.environ.get("STALLWATCH_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


def in_parallel(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(x) for x in items]``, on up to ``threads()`` threads, in order.
    The first exception raised by a task is raised here."""
    n = min(threads(), len(items))
    if n <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="stallwatch-analyze") as pool:
        return list(pool.map(fn, items))
