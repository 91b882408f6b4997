"""The LoRA adapters requests may name, as the front end knows them: from the device workers'
heartbeats (``wire.Heartbeat.adapters``), so every front end sees a load or an unload within one
heartbeat, and the asker before it answers (a worker sends a heartbeat before its answer).

The adapters loaded at run time are also recorded in the run directory (``lora_adapters.json``,
``LoadedAdapters``): a device worker that restarts comes back with ``LoraModules`` only, and the
front ends load the others into it again (``restore``) when its new instance says Welcome.

A request names an adapter by its model name (OpenAI ``model``, vLLM ``model``, TGI
``parameters.adapter_id``, and here ``/infer``'s ``parameters.adapter_id`` too); the codecs
resolve it with ``mindie.text.validation.check_model_name`` against ``Adapters``, and the device
client sends it only to workers that list the adapter.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets

import zmq

from mindie.device_client import DeviceClient, WorkerLink
from mindie.contract import wire as P

log = logging.getLogger("mindie.adapters")
LOADED_FILE = "lora_adapters.json"


class Adapters:
    """``name in adapters``: a ready worker lists it; ``listing()``: {name: path} of them all."""

    def __init__(self, client: DeviceClient | None = None):
        self.client = client

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.client is not None and self.client.has_adapter(name)

    def listing(self) -> dict[str, str]:
        return self.client.adapters() if self.client is not None else {}


class LoadedAdapters:
    """``<runDir>/lora_adapters.json``: {name: path} of the adapters loaded at run time and not
    unloaded, shared by the front ends (written under an flock, replaced atomically)."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOADED_FILE)

    def read(self) -> dict[str, str]:
        try:
            with open(self.path, "rb") as f:
                data = json.loads(f.read() or b"{}")
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} \
            if isinstance(data, dict) else {}

    def _update(self, change) -> None:
        # The lock is the run directory's own (flock on a directory): no lock file to clean up.
        lock = os.open(os.path.dirname(self.path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self.read()
            change(data)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.path)
        finally:
            os.close(lock)

    def record(self, name: str, path: str) -> None:
        self._update(lambda d: d.__setitem__(name, path))

    def forget(self, name: str) -> None:
        self._update(lambda d: d.pop(name, None))


def restore(client: DeviceClient, loaded: LoadedAdapters, link: WorkerLink) -> int:
    """A worker's new instance (started, or restarted after a crash): ask it to load the adapters
    loaded at run time (it has ``LoraModules`` only). Its answers are not awaited: every front end
    does this, the worker refuses the repeats, and requests name an adapter only on the workers
    whose heartbeats list it. Returns how many loads were sent."""
    sent = 0
    for name, path in loaded.read().items():
        try:
            link.push.send(P.encode(P.LoadAdapter(client.frontend_id, secrets.token_hex(8), name, path)),
                           zmq.NOBLOCK)
            sent += 1
        except Exception as e:  # noqa: BLE001  (a worker gone again: its next start restores)
            log.warning("could not send LoRA adapter %s to device worker %s: %s", name, link.ep.worker_id, e)
            break
    if sent:
        log.info("device worker %s (new instance): %d LoRA adapter(s) loaded at run time sent to it again",
                 link.ep.worker_id, sent)
    return sent
