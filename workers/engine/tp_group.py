"""The process group of a tensor-parallel instance: rendezvous, timeouts and the step broadcast.

An ``npuDeviceIds`` entry of N devices is one instance of N processes (ranks), one per device,
started together by the supervisor. Rank 0 is the worker the front ends talk to: it owns the
ZeroMQ sockets, the scheduler, the KV block tables and the sampler. Before each step it
broadcasts the step's inputs (``StepInputs``: token ids, positions, block tables, the rows whose
logits are needed); every rank then runs the same forward, whose all-reduces and all-gather
(workers/models/sharding.py) go over the *compute* group (gloo on CPU, nccl on CUDA, hccl on
NPU). The inputs go over a separate *control* group (always gloo, on the host), so that ranks
waiting for the next step never trip the compute group's timeout.

Rendezvous is a ``FileStore`` in the run directory, one fresh file per start of the group (never
a fixed port that two servers on a host would fight over). Startup waits for every rank with a
timeout and names the ranks that did not come up. A collective that waits longer than
``BackendConfig.tpCollectiveTimeoutS`` (a rank stopped or hung) raises ``GroupError``: rank 0 then
fails its requests and exits, and the supervisor restarts the whole group.
"""
from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import msgspec
import torch

from workers import settings

log = logging.getLogger("workers.tp")

# How long ranks wait for each other at start (processes, model loading) and in one collective.
# (BackendConfig.tpStartTimeoutS, tpCollectiveTimeoutS: the spec's, set again by settings.apply)
START_TIMEOUT_S = settings.engine().tp_start_timeout_s
COLLECTIVE_TIMEOUT_S = settings.engine().tp_collective_timeout_s
# The control group's timeout on ranks > 0, which wait there between steps: an idle rank 0 sends a
# no-op step well within it. Rank 0 uses the collective timeout there too: a gloo send waits for
# the peer's receive, so a stuck rank must not hold rank 0's broadcast for an hour.
CONTROL_TIMEOUT_S = 3600.0
KEEPALIVE_S = 60.0

DIST_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class GroupError(RuntimeError):
    """A rank of the instance is gone or stuck: the group cannot compute any more."""


class StepInputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step, as rank 0 scheduled it (workers/engine/model_runner.py builds it)."""

    input_ids: list[int] = []
    positions: list[int] = []
    block_tables: list[list[int]] = []
    num_computed: list[int] = []
    num_tokens: list[int] = []
    # Flat rows whose logits are computed, one LM-head call (an all-gather) per list, in order.
    logit_rows: list[list[int]] = []
    kind: int = 0  # STEP, NOOP or STOP
    # A hybrid model's state pool (workers/attention/state_cache.py ``prepare``), per sequence: its
    # slot, first position, rows, the row restored from, the saves, whether its rows verify a
    # proposal; and the copies made first ([] = no state pool).
    state_slots: list[int] = []
    state_starts: list[int] = []
    state_counts: list[int] = []
    state_restores: list[int] = []
    state_saves: list[list[tuple[int, int]]] = []
    state_verify: list[bool] = []
    state_copies: list[tuple[int, int]] = []
    # KV blocks copied (source, destination) before the forward: partial prefix hits (block_manager.py).
    block_copies: list[tuple[int, int]] = []


STEP, NOOP, STOP = 0, 1, 2
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(StepInputs).decode


class Group:
    """One rank's view of its instance."""

    def __init__(self, worker_id: str, rank: int, world: int, control):
        """``control``: the gloo group of the step broadcast; the model's collectives use the
        default (compute) group."""
        self.worker_id, self.rank, self.world = worker_id, rank, world
        self.control = control
        self.last_send = time.monotonic()

    # -- the step broadcast (rank 0 -> every rank) --------------------------------------------
    def send_step(self, inputs: StepInputs) -> None:
        import torch.distributed as dist
        data = _encode(inputs)
        try:
            dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0, group=self.control)
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.control)
        except RuntimeError as e:
            raise GroupError(f"tensor-parallel instance {self.worker_id}: a rank is gone ({e})") from e
        self.last_send = time.monotonic()

    def recv_step(self) -> StepInputs:
        import torch.distributed as dist
        n = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(n, 0, group=self.control)
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.control)
        return _decode(buf.numpy().tobytes())

    def keepalive(self) -> None:
        """Rank 0, idle: a no-op step now and then so the other ranks' wait never times out."""
        if time.monotonic() - self.last_send > KEEPALIVE_S:
            self.send_step(StepInputs(kind=NOOP))

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (the KV blocks every rank's memory can hold)."""
        import torch.distributed as dist
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def wait_all(self, what: str) -> None:
        """Every rank reached this point (rank 0 names those that did not within the start timeout)."""
        import torch.distributed as dist
        t0 = time.monotonic()
        try:
            dist.monitored_barrier(group=self.control, timeout=timedelta(seconds=START_TIMEOUT_S),
                                   wait_all_ranks=True)
        except RuntimeError as e:
            raise GroupError(f"tensor-parallel instance {self.worker_id}: not every rank {what} within "
                             f"{START_TIMEOUT_S:.0f} s (BackendConfig.tpStartTimeoutS): {e}") from e
        log.info("instance %s: all %d ranks %s (waited %.2f s)", self.worker_id, self.world, what,
                 time.monotonic() - t0)

    def stop(self) -> None:
        """Rank 0 stops: tell the others (they may be gone already)."""
        try:
            self.send_step(StepInputs(kind=STOP))
        except GroupError:
            pass
        self.close()

    def close(self) -> None:
        """Leave the groups (gloo's threads must be gone before the interpreter exits)."""
        import torch.distributed as dist
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # a peer gone already: nothing left to tidy
                log.debug("destroy_process_group: %s", e)


def store_key(rank: int) -> str:
    return f"rank{rank}/pid"


def join(worker_id: str, rank: int, world: int, store_path: str, device_type: str) -> Group:
    """Rendezvous through ``store_path`` and create the compute and control groups."""
    import torch.distributed as dist

    backend = DIST_BACKENDS.get(device_type)
    if backend is None:
        raise ValueError(f"no tensor-parallel backend for device type {device_type!r}")
    # Every rank runs on this host: gloo on the loopback interface unless told otherwise.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if backend == "hccl":
        import torch_npu  # noqa: F401  (registers the hccl backend)
    # A hung nccl/hccl collective must raise rather than wait forever.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    os.environ.setdefault("HCCL_ASYNC_ERROR_HANDLING", "1")
    store = dist.FileStore(store_path, world)
    store.set(store_key(rank), str(os.getpid()))
    # Every rank waits for all the others before the process group connects (its own connect
    # timeout is the short collective one), and names the ranks that did not come up.
    deadline = time.monotonic() + START_TIMEOUT_S
    missing = [r for r in range(world) if r != rank]
    while missing:
        missing = [r for r in missing if not store.check([store_key(r)])]
        if missing and time.monotonic() > deadline:
            raise GroupError(f"tensor-parallel instance {worker_id}: rank(s) {missing} did not come up within "
                             f"{START_TIMEOUT_S:.0f} s (BackendConfig.tpStartTimeoutS)")
        if missing:
            time.sleep(0.05)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    control = dist.new_group(backend="gloo", timeout=timedelta(
        seconds=COLLECTIVE_TIMEOUT_S if rank == 0 else CONTROL_TIMEOUT_S))
    log.info("instance %s: rank %d/%d joined (%s compute, collective timeout %.0f s)", worker_id, rank, world,
             backend, COLLECTIVE_TIMEOUT_S)
    return Group(worker_id, rank, world, control)
