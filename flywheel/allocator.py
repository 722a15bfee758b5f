"""polars' memory allocator, configured for Flywheel's processes before polars loads.

polars allocates through a jemalloc of its own, which its import sets to hand memory it frees back to the kernel
within 0.5-1 s (a background thread purges it), so that a process's memory shrinks soon after a large query, and to
ask for fresh pages the next time, each one first touched through a page fault. Column-wise work frees and allocates
frames of hundreds of megabytes many times a second: in a recompute of 10M feedback events
(`bench/signals_recompute.py`) on a 2-core machine, half of the process's CPU time was the kernel's (5.2M minor page
faults; 51 s of system time beside 56 s of user time) and the recompute took 17.9-20.0 s. With freed pages kept for
30 s before they go back, the next frame reuses them: 10.1-11.1 s, for 0.7-0.8 GiB more peak memory (6.3-6.4 GiB
against 5.6). A process that stays idle gives them back after the 30 s.

jemalloc reads its settings once, at its first allocation, from `_RJEM_MALLOC_CONF`, which polars' import extends
with what the variable already holds (a later setting wins): `keep_freed_pages` sets it when nothing has loaded
polars yet (the `flywheel` command calls it first thing, `launcher/__init__.py`), and a value already set (by an
operator, in the environment) is kept. Processes started from this one inherit it.
"""

from __future__ import annotations

import os
import sys

ENV = "_RJEM_MALLOC_CONF"
# jemalloc's decay times (ms): how long a freed page stays with the process before it is handed back
KEEP_FREED_PAGES = "dirty_decay_ms:30000,muzzy_decay_ms:30000"


def keep_freed_pages() -> bool:
    """Set polars' allocator to keep freed pages for 30 s (`KEEP_FREED_PAGES`) unless the environment already
    sets it; returns whether this process's polars runs with it. Too late once polars is loaded (its allocator
    has read its settings): then it changes nothing."""
    if ENV in os.environ:
        return os.environ[ENV] == KEEP_FREED_PAGES
    if "polars" in sys.modules:
        return False
    os.environ[ENV] = KEEP_FREED_PAGES
    return True
