"""Runs CPU kernel pieces on a small pool of threads (the numba kernels release the GIL).

Threads pull pieces one at a time, so a thread that the OS delays does not hold up the
others the way a static split would. How many threads run them is the codec's own setting
(``compression.threads``).
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future, ThreadPoolExecutor

_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _executor(n_threads: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    if _pool is None or _pool_size != n_threads - 1:
        _pool = ThreadPoolExecutor(max_workers=n_threads - 1, thread_name_prefix="codec")
        _pool_size = n_threads - 1
    return _pool


def submit(fn, n_threads: int) -> Future:
    """Run fn on a pool thread while the caller goes on (at once on the caller's thread
    when n_threads is 1); work that run_tasks hands the pool afterwards waits behind it."""
    if n_threads > 1:
        return _executor(n_threads).submit(fn)
    done: Future = Future()
    done.set_result(fn())
    return done


def run_tasks(tasks: list, n_threads: int) -> None:
    """Run the callables in ``tasks`` on n_threads threads (the caller is one of them)."""
    if n_threads <= 1 or len(tasks) <= 1:
        for t in tasks:
            t()
        return
    pool = _executor(n_threads)
    counter = itertools.count()

    def worker() -> None:
        while (i := next(counter)) < len(tasks):
            tasks[i]()

    futures = [pool.submit(worker) for _ in range(n_threads - 1)]
    worker()
    for f in futures:
        f.result()


def pieces(n: int, size: int) -> list[tuple[int, int]]:
    k = max(1, -(-n // size))
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


