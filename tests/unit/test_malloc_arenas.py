"""The coordinator's allocator policy (compression.memory.cap_malloc_arenas, map_large_allocations): with the cap,
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


MAPPED = textwrap.dedent("""
    import ctypes, sys
    from geoloco.compression import map_large_allocations
    if sys.argv[1] == "map":
        print("mapped", map_large_allocations(512 * 1024), file=sys.stderr)

    class MallInfo2(ctypes.Structure):  # glibc >= 2.33
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = MallInfo2
    libc.free(libc.malloc(3 << 20))  # a frame freed: glibc's own threshold rises above 3 MiB
    before = libc.mallinfo2().hblks
    held = [libc.malloc(1 << 20) for _ in range(6)]  # then six 1 MiB message buffers at once
    print("new mappings", libc.mallinfo2().hblks - before, file=sys.stderr)
""")


def mapped_regions(mode: str, **env: str) -> tuple[int, str]:
    """The mappings of their own that six 1 MiB buffers got, after a 3 MiB one was freed."""
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"} | env
    out = subprocess.run([sys.executable, "-c", MAPPED, mode], capture_output=True, text=True,
                         env=environ, timeout=120, check=True).stderr
    line = next(x for x in out.splitlines() if x.startswith("new mappings"))
    return int(line.split()[-1]), out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2")
def test_buffers_past_the_threshold_keep_mappings_of_their_own() -> None:
    """Without the fixed threshold, the 1 MiB buffers after a freed 3 MiB one come from the
    arena (which keeps what is freed); with it, each is a mapping returned at free."""
    regions, out = mapped_regions("map")
    assert "mapped True" in out and regions == 6, out
    regions, out = mapped_regions("none")
    assert regions == 0, out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2")
def test_the_operators_mmap_threshold_wins() -> None:
    regions, out = mapped_regions("map", MALLOC_MMAP_THRESHOLD_=str(4 << 20))
    assert "mapped False" in out and regions == 0, out
