"""The request pipeline's hang-up path (mindie/pipeline.py), in process: a non-stream client that
hangs up while its frames keep coming ends its request at once.

Python 3.11's ``asyncio.wait_for`` loses a cancel that lands in the tick its wait completes, and a
busy stream completes a wait every tick: a pipeline that only cancelled its collecting task would
go on collecting until the generation ended. The end-to-end tests (tests/test_server_e2e.py,
tests/test_tgi.py) saw that only now and then; here the race is forced on every step.
"""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from mindie.client import RequestStream
from mindie.contract import wire as P
from mindie.metrics import Metrics
from mindie.pipeline import Codec, Context, Job, Pipeline, Sub
from mindie.request_log import RequestRecord
from mindie.validation import Limits


class _Client:
    """Every submission's frames keep coming, one per loop tick, until it is cancelled."""

    def __init__(self) -> None:
        self.streams: list[RequestStream] = []
        self.cancelled: list[str] = []

    def submit(self, ids, params, priority, user_id=""):
        s = RequestStream("r1", link=None)  # the real stream: its get() is the wait_for in question
        self.streams.append(s)
        return s

    def cancel(self, stream: RequestStream) -> None:
        if not stream.finished:
            stream.finished = True
            self.cancelled.append(stream.request_id)


class _Codec(Codec):
    detokenize = False

    def reply(self, job, outs, ctx) -> bytes:
        return b"{}"


async def _hang_up_while_frames_come() -> tuple[float, int, _Client, SimpleNamespace]:
    client = _Client()
    pipeline = Pipeline(client, tokenizer=None, limits=Limits(), metrics=Metrics("m"))
    gone = asyncio.Event()

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    req = SimpleNamespace(_receive=receive)
    resp = SimpleNamespace(status=200, data=None, content_type=None)
    rec = RequestRecord("r1", "/infer")
    codec = _Codec()
    job = Job([Sub([1, 2, 3], P.SamplingParams(max_new_tokens=10**6))])
    outs = pipeline._submit(codec, job, rec)
    stream = client.streams[0]
    produced = 0

    async def produce():
        nonlocal produced
        while not stream.finished:
            stream._push(P.TokenFrame("r1", [7]))  # the collector's wait completes in the tick of any cancel
            produced += 1
            if produced == 200:
                gone.set()  # the client hangs up mid-generation
            await asyncio.sleep(0)

    producer = asyncio.create_task(produce())
    t0 = time.monotonic()
    await pipeline._collect(codec, job, outs, Context(req, rec, {}), resp)
    elapsed = time.monotonic() - t0
    await asyncio.sleep(0.05)
    after = produced
    await asyncio.sleep(0.05)
    producer.cancel()
    return elapsed, produced - after, client, resp


def test_non_stream_hang_up_ends_the_request_while_frames_keep_coming() -> None:
    result: list = []
    # On a thread of its own: a pipeline that keeps collecting never returns (and a timeout inside
    # the same loop could lose its cancel the same way), so the test bounds it from outside.
    runner = threading.Thread(target=lambda: result.append(asyncio.run(_hang_up_while_frames_come())), daemon=True)
    runner.start()
    runner.join(15)
    assert result, "the request was still being collected 15 s after its client hung up"
    elapsed, produced_later, client, resp = result[0]
    assert resp.status == 499
    assert client.cancelled == ["r1"]  # cancelled on its worker
    assert produced_later == 0  # nothing is produced for it any more
    assert elapsed < 2.0
