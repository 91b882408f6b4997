"""Take the long-lived heap out of the garbage collector's full passes.

Once torch and the model are loaded a device worker tracks ~170k objects, and a full (oldest
generation) collection of them takes 35-50 ms here; the front end's takes ~7 ms. CPython starts
one whenever enough objects have survived the younger collections: at random points while
serving, where it stalls a step or a stream (TTFT and ITL p99, docs/performance.md).
``gc.freeze()`` once start-up is done moves every object alive then into a permanent generation
that collections skip (vLLM does the same); objects created while serving are collected as
before. ``BackendConfig.gcFreeze: false`` (``MINDIE_GC_FREEZE=0``) leaves the collector alone.
"""
from __future__ import annotations

import gc
import logging
import time



def freeze_heap(log: logging.Logger, who: str, enabled: bool = True) -> int:
    """Collect once, then freeze what is left; returns how many objects were frozen (0: off, as
    ``enabled`` false: the plan's ``EngineConfig.gc_freeze``)."""
    if not enabled:
        return 0
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d start-up objects frozen out of the garbage collector's passes in %.0f ms", who, frozen,
             (time.perf_counter() - t0) * 1e3)
    return frozen
