"""The coordinator's allocator policy (compression.memory.cap_malloc_arenas): with the cap,
eight threads that allocate at once share two glibc arenas; without it each gets its own;
an operator's MALLOC_ARENA_MAX wins over the cap. Counted from glibc's own malloc_stats in
a fresh process (the cap applies to the arenas made after it)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import ctypes, sys, threading
    from geoloco.compression import cap_malloc_arenas
    if sys.argv[1] == "cap":
        print("capped", cap_malloc_arenas(2), file=sys.stderr)
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    together = threading.Barrier(8)

    def work():
        together.wait()  # every thread holds its blocks at the same time
        blocks = [libc.malloc(64 * 1024) for _ in range(8)]
        together.wait()
        for block in blocks:
            libc.free(block)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    libc.malloc_stats()  # to stderr: one "Arena N:" line per arena
""")


def arenas(mode: str, **env: str) -> tuple[int, str]:
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | env
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         env=environ, timeout=120, check=True).stderr
    return sum(line.startswith("Arena ") for line in out.splitlines()), out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and malloc_stats")
def test_the_cap_keeps_eight_allocating_threads_on_two_arenas() -> None:
    capped, out = arenas("cap")
    assert "capped True" in out and capped == 2, out
    uncapped, out = arenas("none")
    assert uncapped > 2, out  # what the cap prevents: an arena per thread


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and malloc_stats")
def test_the_operators_malloc_arena_max_wins() -> None:
    count, out = arenas("cap", MALLOC_ARENA_MAX="4")
    assert "capped False" in out and 2 < count <= 4, out
