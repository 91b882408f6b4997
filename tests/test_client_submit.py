"""DeviceClient.submit when a ready worker's job socket has no peer yet: a restarted worker's
heartbeats reach the front end before the front end's push socket has reconnected to it, so a
NOBLOCK send to it raises zmq.Again. The request goes to the next ready worker instead of ending
with a 503 while another could serve it (tests/test_tensor_parallel.py met that window)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import zmq

from mindie.device_client import DeviceClient, NoWorkerError, WorkerLink
from mindie.contract import wire as P


class Push:
    def __init__(self, connected: bool):
        self.connected = connected
        self.sent: list[bytes] = []

    def send(self, data: bytes, flags: int = 0) -> None:
        assert flags == zmq.NOBLOCK
        if not self.connected:
            raise zmq.Again()
        self.sent.append(data)


def _client(*pushes: Push) -> DeviceClient:
    c = DeviceClient([])
    for i, push in enumerate(pushes):
        c.links[f"w{i}"] = WorkerLink(SimpleNamespace(worker_id=f"w{i}"), push, welcomed=True)
    return c


def test_a_worker_not_yet_reconnected_is_skipped_for_the_next():
    fresh, busy = Push(False), Push(True)
    c = _client(fresh, busy)
    c.links["w1"].inflight["old"] = None  # w1 is the more loaded: w0 is tried first
    stream = c.submit([5, 6, 7], P.SamplingParams(max_new_tokens=4), request_id="r1")
    assert stream.link is c.links["w1"] and busy.sent and not fresh.sent
    assert "r1" in c.links["w1"].inflight and "r1" not in c.links["w0"].inflight
    assert P.decode_job(busy.sent[0]).request_id == "r1"


def test_no_worker_connected_names_them():
    c = _client(Push(False), Push(False))
    with pytest.raises(NoWorkerError, match=r"device workers w0, w1 are not connected"):
        c.submit([5], P.SamplingParams(max_new_tokens=1))
    assert not any(link.inflight for link in c.links.values())
    c = _client(Push(False))
    with pytest.raises(NoWorkerError, match=r"device worker w0 is not connected"):
        c.submit([5], P.SamplingParams(max_new_tokens=1))
