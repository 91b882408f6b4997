"""How many threads a CPU worker's next step runs on, chosen from the step times it measures.

A step on more threads is faster only while those threads get their cores. On a host with
other load (noisy neighbours, a shared VM, tests beside a benchmark), a step split over two
threads waits at every OpenMP barrier for whichever thread the kernel descheduled: measured on a
2-core Zen 3 with a load average of 3-4, one decode stream on the default model ran at 20 tok/s
with a borrowed second core and 51 tok/s on one (ITL p99 1000 against 197 ms;
docs/performance.md, "Several CPU workers"). No load figure predicts this well (our own spinning
OpenMP threads count as load), so the worker measures instead: it keeps a moving average of the
step time per (step size, wide or narrow), steps the way that has been faster, and now and then
tries the other way so that the choice follows the host's load as it changes.

"Wide" is every thread the worker may use for the step: its own share plus idle siblings' cores
(core sharing, workers/backends/core_share.py) or, for a worker alone on its cores, all of them.
"Narrow" is its own share, or half of its cores for a worker alone.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

log = logging.getLogger("workers.backends")

ALPHA = 0.25  # weight of a new step time in its moving average ...
ALPHA_TRY = 0.5  # ... and of a try of the other way (rare: its average is older)
EXPLORE_STEPS = 16  # steps of one size the preferred way before one the other way ...
EXPLORE_S = 0.25  # ... and at least this long since the last such try
NARROW_WIN = 0.9  # narrow is preferred only when its steps take under this fraction of wide's
LOG_EVERY_S = 30.0  # a change of preference is logged at most this often


class StepWidth:
    """The wide-or-narrow choice per step size (tokens in the step, by factors of 4: ``bucket``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.ema: dict[tuple[int, bool], float] = {}
        self.since: dict[int, int] = {}  # steps of a size since its last try of the other way
        self.tried: dict[int, float] = {}
        self.prefers_narrow: dict[int, bool] = {}
        self._logged = -LOG_EVERY_S
        self._t0: float | None = None
        self._key: tuple[int, bool] | None = None
        self._trying = False  # the step chosen last is a try of the other way

    @staticmethod
    def bucket(tokens: int) -> int:
        """Step sizes by factors of 4 (1-3, 4-15, 16-63, ... tokens): speculative steps share a size."""
        return (max(1, tokens).bit_length() + 1) // 2

    def choose_wide(self, tokens: int) -> bool:
        """Whether the next step of ``tokens`` tokens should run wide."""
        b = self.bucket(tokens)
        wide, narrow = self.ema.get((b, True)), self.ema.get((b, False))
        if wide is None and narrow is None:
            # A size never measured: the host's contention is the same for every size, so start the
            # way the sizes already measured prefer (a busy host: narrow from the first request on).
            self._trying = False
            return not any(self.prefers_narrow.values())
        if wide is None or narrow is None:
            # One way measured: try the other at once rather than after EXPLORE_STEPS steps, so the
            # first request after the start already steps the faster way on a busy host (issue 52:
            # 20 s and two requests to notice the contention got the README's first request a
            # 500 at its 10 s timeout).
            self.since[b], self.tried[b] = 0, self.clock()
            self._trying = True
            return wide is None
        prefer_wide = narrow >= wide * NARROW_WIN
        n = self.since.get(b, 0) + 1
        now = self.clock()
        if n >= EXPLORE_STEPS and now - self.tried.get(b, -EXPLORE_S) >= EXPLORE_S:
            self.since[b], self.tried[b] = 0, now
            self._trying = True
            return not prefer_wide
        self.since[b] = n
        self._trying = False
        return prefer_wide

    def started(self, tokens: int, wide: bool) -> None:
        """A step of ``tokens`` tokens starts now, ``wide`` or not (as it really runs)."""
        self._key = (self.bucket(tokens), wide)
        self._t0 = self.clock()

    def skip(self) -> None:
        """The step starting now says nothing about the choice (it had none: no idle sibling)."""
        self._key = self._t0 = None

    def finished(self) -> None:
        if self._key is None or self._t0 is None:
            return
        dt = self.clock() - self._t0
        key, self._key = self._key, None
        old = self.ema.get(key)
        self.ema[key] = dt if old is None else old + (ALPHA_TRY if self._trying else ALPHA) * (dt - old)
        self._note(key[0])

    def _note(self, b: int) -> None:
        wide, narrow = self.ema.get((b, True)), self.ema.get((b, False))
        if wide is None or narrow is None:
            return
        now_narrow = narrow < wide * NARROW_WIN
        if now_narrow == self.prefers_narrow.get(b, False):
            return
        self.prefers_narrow[b] = now_narrow
        now = self.clock()
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            lo, hi = 1 << max(0, 2 * b - 2), (1 << 2 * b) - 1
            log.info("step width: steps of %d-%d tokens now run %s (%.1f ms narrow, %.1f ms wide: %s)",
                     lo, hi, "narrow" if now_narrow else "wide", narrow * 1e3, wide * 1e3,
                     "the host is busy, more threads wait for each other" if now_narrow
                     else "the cores are free again")


def narrow_threads_alone(spec) -> int:
    """The narrow thread count of a CPU worker alone on its cores (no core sharing, not a
    tensor-parallel rank, more than one thread, cpuTuning.adaptiveThreads), else 0: the worker
    steps with it and its warm-up builds its oneDNN primitives."""
    if (spec.device_type != "cpu" or spec.null_model or spec.core_share_file or spec.threads <= 1
            or len(spec.device_ids) > 1 or not spec.engine.cpu.adaptive_threads):
        return 0
    return spec.threads // 2


def _set_threads(n: int) -> None:
    import torch
    torch.set_num_threads(n)


class StepThreads:
    """The worker's hooks around each step (``Engine.launch(before=, after=)``): the thread count
    of the step, from core sharing's idle siblings and the width chosen by ``StepWidth``."""

    def __init__(self, cores=None, threads: int = 1, adaptive: bool = True, set_threads=_set_threads,
                 width: StepWidth | None = None):
        self.cores = cores  # a CoreShare, or None for a worker alone on its cores
        self.threads = threads  # a worker alone: its cores ("wide"); narrow = half of them (narrow_threads_alone)
        self.width = (width or StepWidth()) if adaptive else None
        self._set_threads = set_threads
        self._current = 0

    def describe(self) -> str:
        if self.cores is not None:
            wide = f"{self.cores.base} threads and idle siblings' cores"
            narrow = f"{self.cores.base} threads"
        else:
            wide, narrow = f"{self.threads} threads", f"{max(1, self.threads // 2)} threads"
        if self.width is None:
            return f"fixed: every step on {wide} (cpuTuning.adaptiveThreads false)"
        return f"adaptive: wide {wide}, narrow {narrow}, by measured step times (cpuTuning.adaptiveThreads)"

    def before(self, tokens: int) -> int:
        wide = self.width is None or self.width.choose_wide(tokens)
        if self.cores is not None:
            n = self.cores.apply(borrow=wide)
            if self.width is not None:
                if n > self.cores.base:
                    self.width.started(tokens, True)
                elif self.cores.could_borrow:
                    self.width.started(tokens, False)
                else:
                    self.width.skip()  # no idle sibling: narrow without a choice
            return n
        n = self.threads if wide else max(1, self.threads // 2)
        if n != self._current:
            self._set_threads(n)
            self._current = n
        if self.width is not None:
            self.width.started(tokens, wide)
        return n

    def after(self) -> None:
        if self.width is not None:
            self.width.finished()
