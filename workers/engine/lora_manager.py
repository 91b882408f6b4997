"""LoRA adapters of one worker: registered by name, at most ``maxLoras`` resident, loaded beside serving.

An adapter is **registered** (``LoraModules`` at start, ``/v1/load_lora_adapter`` at run time) once
its folder passed the checks (workers/models/lora_adapter.py) and its tensors were read; from then
on requests may name it, until it is unloaded. At most ``capacity`` registered adapters are
**resident** (their tensors in device memory, ready for a step): when a request names an adapter
that is not, the least recently used resident adapter with no request in flight is dropped from
memory (it stays registered) and the adapter is read again from its folder. Requests of an adapter
that is not resident yet wait outside the scheduler ("parked") and join it when its tensors are in.
When every resident adapter has requests in flight, the read waits for one of them to finish.

Reading never blocks a step: the files are read and the tensors prepared on a thread of their own
(one OpenMP thread and the lowest CPU priority, so that it yields the cores to the steps), and the
result is swapped in by ``poll`` between two steps, on the loop thread, the only thread that
touches this object (the heartbeat thread reads ``listing``, a tuple replaced whole).

Unloading takes the name away at once (new requests for it are refused) while the requests already
accepted on it finish on it; its tensors are freed when the last one ends. Answers to load and
unload use MindIE's messages (its LoraManager's, which are vLLM's).
"""
from __future__ import annotations

import collections
import ctypes
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from mindie.contract.errors import UnknownAdapterError
from workers.engine.sequence import Sequence
from workers.models.config import ModelArgs
from workers.models.lora import AdapterWeights, lora_dtype, read_adapter
from workers.models.lora_adapter import MAX_RANK, AdapterError, AdapterPlan, check_adapter

log = logging.getLogger("workers.lora")

NAME_MAX = 256


@dataclass(eq=False)
class Adapter:
    """One registered adapter."""

    name: str
    path: str
    plan: AdapterPlan
    load_id: int  # unique per registration: the prefix cache's salt (a name reloaded from other files differs)
    static: bool = False  # from LoraModules
    unloading: bool = False
    weights: AdapterWeights | None = None  # resident when set
    refs: int = 0  # requests in flight on it (scheduled or parked)
    parked: list[Sequence] = field(default_factory=list)
    future: Future | None = None  # a read in progress (for parked requests)
    salt: int = 0

    def __post_init__(self) -> None:
        self.salt = hash(("lora", self.load_id))


@dataclass
class Answer:
    """The answer to a load or unload: ``reply`` is the caller's (who asked), HTTP status, message."""

    reply: object
    status: int
    message: str


def _reader_thread() -> None:
    """The reader thread yields to the steps: its torch ops run on one OpenMP thread (torch sets a
    new thread's count lazily on its first use, so take that first, then this thread's own), and
    it runs at the lowest CPU priority (nice 19, this thread only), so that on a busy host a read
    takes longer rather than the steps."""
    torch.get_num_threads()
    try:
        ctypes.CDLL(None).omp_set_num_threads(1)
    except (AttributeError, OSError):  # no OpenMP runtime loaded: torch runs its ops serially anyway
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux: the default priority
        pass


class LoraManager:
    """The adapters of one worker (see the module docstring). ``refusal``: why this worker serves
    none ("" = it does): a tensor-parallel instance, the null model."""

    def __init__(self, args: ModelArgs | None, dtype: torch.dtype, device: torch.device | str, *, capacity: int,
                 max_rank: int, served_name: str, dynamic: bool, refusal: str = ""):
        self.args = args
        self.dtype = lora_dtype(dtype, device) if dtype is not None else None  # the adapters' tensors'
        self.device = device
        self.capacity = capacity
        self.max_rank = min(max_rank or MAX_RANK, MAX_RANK)
        self.served_name = served_name
        self.dynamic = dynamic  # maxLoras > 0: /v1/load_lora_adapter may register adapters
        self.refusal = refusal
        self.adapters: dict[str, Adapter] = {}
        self.resident: collections.OrderedDict[str, None] = collections.OrderedDict()  # LRU first
        self.reading: set[str] = set()  # reads for parked requests, each holding a slot
        self.wanting: collections.deque[str] = collections.deque()  # parked adapters waiting for a slot
        self.registering: dict[str, tuple[Future, object, str]] = {}  # name -> (read, reply, path)
        self.cancelled: set[str] = set()  # registrations unloaded before their read finished
        self.listing: tuple[tuple[str, str], ...] = ()  # (name, path) of the adapters requests may name
        self._ids = 0
        self._pool: ThreadPoolExecutor | None = None
        self.loads = 0  # reads completed (registrations and reloads), for the tests and the log
        self.evictions = 0

    # -- state ------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Reads in progress or requests waiting for one (the worker loop polls more often)."""
        return bool(self.registering or self.reading or self.wanting)

    @property
    def num_parked(self) -> int:
        return sum(len(a.parked) for a in self.adapters.values())

    def _list(self) -> None:
        self.listing = tuple((a.name, a.path) for a in self.adapters.values() if not a.unloading)

    def _submit(self, fn: Callable, *args) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-read", initializer=_reader_thread)
        return self._pool.submit(fn, *args)

    def _read(self, name: str, path: str) -> tuple[AdapterPlan, AdapterWeights]:
        """On the reader thread: check the folder, then read its tensors."""
        t0 = time.perf_counter()
        plan = check_adapter(path, self.args, self.max_rank)
        weights = read_adapter(name, plan, self.args, self.dtype, self.device)
        log.info("LoRA adapter %s read from %s in %.3f s (%s)", name, path, time.perf_counter() - t0,
                 plan.describe())
        return plan, weights

    # -- slots ------------------------------------------------------------------------------------
    def _free_slot(self) -> bool:
        """Whether an adapter can become resident now: a free slot, or the least recently used
        resident adapter with no request in flight dropped from memory for it."""
        if len(self.resident) + len(self.reading) < self.capacity:
            return True
        for name in self.resident:
            a = self.adapters[name]
            if a.refs == 0:
                del self.resident[name]
                a.weights = None
                self.evictions += 1
                log.info("LoRA adapter %s dropped from memory (least recently used, no request in flight; it stays "
                         "loaded and is read again when a request names it)", name)
                return True
        return False

    def _make_resident(self, a: Adapter, weights: AdapterWeights) -> None:
        a.weights = weights
        self.resident[a.name] = None
        self.resident.move_to_end(a.name)

    def _start_reads(self) -> None:
        while self.wanting and self._free_slot():
            a = self.adapters.get(self.wanting.popleft())
            if a is None or a.weights is not None or a.future is not None or not a.parked:
                continue
            self.reading.add(a.name)
            a.future = self._submit(self._read, a.name, a.path)

    def _remove(self, a: Adapter) -> None:
        """Forget an unloaded adapter whose last request ended."""
        self.adapters.pop(a.name, None)
        self.resident.pop(a.name, None)
        a.weights = None
        log.info("LoRA adapter %s unloaded", a.name)

    # -- registration -----------------------------------------------------------------------------
    def load_static(self, modules) -> None:
        """``LoraModules`` (name, path, base_model_name each), read at start on this thread; the first
        ``capacity`` stay resident. Raises what cannot be loaded (the worker's start fails)."""
        for m in modules:
            if self.refusal:
                raise RuntimeError(f"BackendConfig.ModelDeployConfig.LoraModules: {self.refusal}")
            try:
                plan, weights = self._read(m.name, m.path)
            except AdapterError as e:
                raise RuntimeError(f"BackendConfig.ModelDeployConfig.LoraModules {m.name}: {e}") from None
            a = self._register(m.name, m.path, plan, static=True)
            if len(self.resident) < self.capacity:
                self._make_resident(a, weights)
        self._list()

    def _register(self, name: str, path: str, plan: AdapterPlan, static: bool = False) -> Adapter:
        self._ids += 1
        a = self.adapters[name] = Adapter(name, plan.path or path, plan, self._ids, static=static)
        return a

    def begin_load(self, name: str, path: str, reply: object) -> Answer | None:
        """/v1/load_lora_adapter on this worker: an answer now (refused), or None: the folder is
        read on the reader thread and ``poll`` answers."""
        if self.refusal:
            return Answer(reply, 400, f"Call to load LoRA method failed: {self.refusal}")
        if not self.dynamic:
            return Answer(reply, 400, "Call to load LoRA method failed: LoRA adapters are not loaded at run time "
                                      "here: ModelDeployConfig.maxLoras is 0 (set it to the number of adapters to "
                                      "keep resident)")
        if name == self.served_name:
            return Answer(reply, 400, f"Call to load LoRA method failed: The LoRA adapter '{name}' is invalid: "
                                      "it is the base model's name")
        a = self.adapters.get(name)
        if a is not None and a.unloading:
            return Answer(reply, 400, f"The LoRA adapter '{name}' is waiting to unload.")
        if a is not None or name in self.registering:
            return Answer(reply, 400, f"The LoRA adapter '{name}' has already been added.")
        self.registering[name] = (self._submit(self._read, name, path), reply, path)
        return None

    def unload(self, name: str, reply: object) -> Answer:
        """/v1/unload_lora_adapter on this worker: the name goes at once; the requests in flight on
        it finish on it, and its tensors go with the last of them."""
        a = self.adapters.get(name)
        if a is None and name in self.registering and name not in self.cancelled:
            self.cancelled.add(name)  # still being read (a load that failed elsewhere is undone)
            return Answer(reply, 200, f"Success: LoRA adapter '{name}' removed successfully.")
        if a is None or a.unloading:
            return Answer(reply, 404, f"The LoRA adapter '{name}' cannot be found.")
        a.unloading = True
        if a.refs == 0:
            self._remove(a)
        else:
            log.info("LoRA adapter %s: unloaded once its %d request(s) in flight end", name, a.refs)
        self._list()
        return Answer(reply, 200, f"Success: LoRA adapter '{name}' removed successfully.")

    # -- requests ---------------------------------------------------------------------------------
    def acquire(self, seq: Sequence, name: str) -> bool:
        """A new request on adapter ``name``: True when it may be scheduled now, False when it waits
        for the adapter's tensors (``poll`` hands it back). ``UnknownAdapterError`` when not served."""
        a = self.adapters.get(name)
        if a is None or a.unloading:
            raise UnknownAdapterError(name)
        a.refs += 1
        seq.adapter = a
        if a.weights is not None:
            self.resident.move_to_end(name)
            return True
        a.parked.append(seq)
        if a.future is None and name not in self.wanting:
            self.wanting.append(name)
            self._start_reads()
        return False

    def release(self, seq: Sequence) -> None:
        """A request on an adapter ended (finished, cancelled, failed): idempotent."""
        a = seq.adapter
        if a is None:
            return
        seq.adapter = None
        a.refs -= 1
        if seq in a.parked:
            a.parked.remove(seq)
        if a.name in self.resident:
            self.resident.move_to_end(a.name)
        if a.refs == 0 and a.unloading:
            if a.future is None:
                self._remove(a)
        elif a.refs == 0:
            self._start_reads()  # its slot may go to a waiting adapter

    def poll(self) -> tuple[list[Answer], list[Sequence], list[tuple[Sequence, str]]]:
        """Between steps: finished reads swapped in. Returns the answers to send, the parked requests
        that may now be scheduled, and those that failed (request, message)."""
        answers: list[Answer] = []
        ready: list[Sequence] = []
        failed: list[tuple[Sequence, str]] = []
        for name, (fut, reply, path) in list(self.registering.items()):
            if not fut.done():
                continue
            del self.registering[name]
            if name in self.cancelled:
                self.cancelled.discard(name)
                answers.append(Answer(reply, 400, f"Call to load LoRA method failed: Loading LoRA '{name}' failed: "
                                                  "it was unloaded while it loaded"))
                continue
            try:
                plan, weights = fut.result()
            except AdapterError as e:
                answers.append(Answer(reply, e.status, f"Call to load LoRA method failed: Loading LoRA '{name}' "
                                                       f"failed: {e}"))
                continue
            except Exception as e:  # noqa: BLE001  (an unreadable file: answered, never a dead worker)
                log.exception("LoRA adapter %s: reading %s failed", name, path)
                answers.append(Answer(reply, 500, f"Call to load LoRA method failed: Loading LoRA '{name}' failed: "
                                                  f"{type(e).__name__}: {e}"))
                continue
            self.loads += 1
            a = self._register(name, path, plan)
            if self._free_slot():
                self._make_resident(a, weights)
            log.info("LoRA adapter %s loaded from %s (%s)%s", name, a.path, plan.describe(),
                     "" if a.weights is not None else "; not resident: every slot (maxLoras) has requests in flight")
            answers.append(Answer(reply, 200, f"Success: LoRA adapter '{name}' added successfully."))
        for name in list(self.reading):
            a = self.adapters.get(name)
            if a is None or a.future is None:
                self.reading.discard(name)
                continue
            if not a.future.done():
                continue
            fut, a.future = a.future, None
            self.reading.discard(name)
            try:
                _, weights = fut.result()
            except Exception as e:  # noqa: BLE001  (files changed or gone since the load)
                why = f"LoRA adapter '{name}' could not be read again from {a.path}: {e}"
                log.error("%s", why)
                for seq in list(a.parked):
                    failed.append((seq, why))
                continue
            self.loads += 1
            if a.unloading and a.refs == 0:
                self._remove(a)
                continue
            self._make_resident(a, weights)
            ready.extend(a.parked)
            a.parked.clear()
        self._start_reads()
        if answers:
            self._list()
        return answers, ready, failed

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
