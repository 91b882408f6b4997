"""Messages between the front ends and the model host (workers/model_host.py), several models.

A front end's DEALER talks to the model host's ROUTER (``Deployment.models_endpoint``):

- ``ModelUse`` (front end -> host, on every change and every ``USE_INTERVAL_S``): the front end's
  whole view, not a delta, so a lost or repeated message changes nothing: its requests running
  per model (a model with any is busy: never evicted), those waiting for a model to load, and the
  keep_alive its latest Ollama request asked for per model. A front end silent for
  ``USE_TIMEOUT_S`` counts for nothing (it died).
- ``ModelOrder`` (front end -> host): ``POST /models/load`` and ``/models/unload``, vLLM's
  ``POST /sleep`` and ``/wake_up``; answered by a ``ModelAnswer`` with the same token once done
  (loaded and ready, or stopped; asleep with every model stopped, or awake with those loaded
  before reloaded).
- ``ModelReport`` (host -> every front end heard from, on every change and every
  ``USE_INTERVAL_S``): each model's state.

States: ``unloaded``, ``loading``, ``loaded``, ``draining`` (chosen for eviction: requests already
running finish, new ones wait for its reload), ``unloading``.
"""
from __future__ import annotations

import msgspec

USE_INTERVAL_S = 0.5
USE_TIMEOUT_S = 5.0

UNLOADED, LOADING, LOADED, DRAINING, UNLOADING = "unloaded", "loading", "loaded", "draining", "unloading"


class ModelUse(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    frontend_id: str
    running: dict[str, int] = {}
    waiting: dict[str, int] = {}
    keep_alive: dict[str, float] = {}  # seconds, per model (Ollama's keep_alive); absent = the default


class ModelOrder(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    frontend_id: str
    token: str
    op: str  # "load" | "unload" | "sleep" | "wake_up"
    model: str = ""
    level: int = 1  # sleep


class ModelAnswer(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    token: str
    status: int  # 200, or the HTTP status of the refusal
    message: str = ""


class ModelState(msgspec.Struct):
    state: str = UNLOADED
    pids: list[int] = []
    loaded_at: float = 0.0  # time.time() the model became ready
    load_s: float = 0.0  # how long its last load took
    expires_at: float = 0.0  # time.time() it unloads if still idle (0 = never)
    running: int = 0  # requests running on it, over every front end
    threads: int = 0  # CPU threads of each of its workers
    kv_gb: float = 0.0  # KV budget of each of its workers (cpuMemSize, or npuMemSize on an accelerator)
    error: str = ""  # why its last load failed, or why it is never loaded (``refused``)
    refused: bool = False  # alone more than maxLoadedMemSize: requests for it fail at once (503)
    mem_gb: float = 0.0  # its estimated resident GiB (weights + KV budget; workers/model_memory.py)


class ModelReport(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    models: dict[str, ModelState]
    max_loaded: int
    sleeping: int = 0  # the sleep level (vLLM's POST /sleep), 0 = awake
    max_mem_gb: float = 0.0  # ModelDeployConfig.maxLoadedMemSize, 0 = no bound


ToHost = ModelUse | ModelOrder
ToFrontEnd = ModelAnswer | ModelReport

_enc = msgspec.msgpack.Encoder()
_to_host = msgspec.msgpack.Decoder(ToHost)
_to_fe = msgspec.msgpack.Decoder(ToFrontEnd)


def encode(msg: msgspec.Struct) -> bytes:
    return _enc.encode(msg)


def decode_to_host(data: bytes) -> ToHost:
    return _to_host.decode(data)


def decode_to_frontend(data: bytes) -> ToFrontEnd:
    return _to_fe.decode(data)
