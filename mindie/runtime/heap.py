"""glibc's ``malloc_trim``: the heap's free pages handed back to the kernel.

Freed memory stays resident in a glibc heap until trimmed: a loader's temporaries (a GGUF tensor's
chunks, the JSON a tokenizer is parsed from) would otherwise count in the process's memory for
its whole life. Gemma 3's tokenizer (262k tokens) leaves ~190 MiB of such pages in each front end
that loads it, as much as the model's weights. One home for the binding: the front ends
(mindie/text/detokenizer.py), the constraint compiler's tokenizer, the GGUF loader and the CPU
backend's periodic trim use it.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim(pad)``, or None where the C library is not glibc."""
    try:
        fn = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def trim() -> None:
    """Hand every free page of the heap back now (nothing where there is no glibc)."""
    fn = _malloc_trim()
    if fn is not None:
        fn(0)
