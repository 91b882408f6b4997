"""The LoRA adapters requests may name, as the front end knows them: from the device workers'
heartbeats (``wire.Heartbeat.adapters``), so every front end sees a load or an unload within one
heartbeat, and the asker before it answers (a worker sends a heartbeat before its answer).

A request names an adapter by its model name (OpenAI ``model``, vLLM ``model``, TGI
``parameters.adapter_id``, and here ``/infer``'s ``parameters.adapter_id`` too); the codecs
resolve it with ``mindie.validation.check_model_name`` against ``Adapters``, and the device
client sends it only to workers that list the adapter.
"""
from __future__ import annotations

from mindie.client import DeviceClient


class Adapters:
    """``name in adapters``: a ready worker lists it; ``listing()``: {name: path} of them all."""

    def __init__(self, client: DeviceClient | None = None):
        self.client = client

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.client is not None and self.client.has_adapter(name)

    def listing(self) -> dict[str, str]:
        return self.client.adapters() if self.client is not None else {}
