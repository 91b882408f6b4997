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

from mindie.device_client import RequestStream
from mindie.contract import wire as P
from mindie.server.metrics import Metrics
from mindie.pipeline import Codec, Context, Job, Pipeline, Sub
from mindie.server.request_log import RequestRecord
from mindie.text.validation import Limits


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
            stream.finished = stream.cancelled = True  # as DeviceClient.cancel
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


# -- frames that arrive as a wait times out ------------------------------------------------------
# Under load (a thousand streams on one front end) the reader task may push a request's frames
# after the stream's wait timed out but before the waiting task resumed: asyncio's wait_for then
# cancels the wait although its event is set. Those frames were left queued and get() said [];
# the generation saw a finished stream with nothing in hand, took it for a cancel and ended
# silently: an SSE answer of 200 with an empty body, logged ``status=200 out=0 error=''``.
# A zero timeout forces that order on every call (the push is queued before the wait's task runs).

def test_frames_pushed_as_the_wait_times_out_are_returned() -> None:
    async def main() -> tuple[list, list]:
        s = RequestStream("r1", link=None)
        final = P.TokenFrame("r1", [7], finish_reason="length")
        asyncio.get_running_loop().call_soon(s._push, final)  # lands while get(0) is timing out
        first = await s.get(0.0)
        return first, (await s.get(0.0) if not first else [])

    first, second = asyncio.run(main())
    assert first, f"the final frame was not returned by the wait it ended (next call: {second})"
    assert [f.finish_reason for f in first] == ["length"]


def test_a_short_stream_whose_frames_land_on_a_tick_is_streamed_in_full(monkeypatch) -> None:
    """The whole pipeline of a stream: each token frame lands as a tick's wait times out (a tick
    of 0 s: every wait does), the stream still carries every token and its finish, and the request
    log says so (never ``status=200 out=0``)."""
    import mindie.text.generation
    import mindie.sse
    monkeypatch.setattr(mindie.text.generation, "IDLE_TICK_S", 0.0)
    monkeypatch.setattr(mindie.sse, "IDLE_TICK_S", 0.0)

    class _Render(_Codec):
        def render(self, job, out, p, ctx):
            return [b"%d:%s;" % (t, p.finish_reason.encode()) for t in p.token_ids]

    async def main() -> tuple[bytes, RequestRecord]:
        client = _Client()
        pipeline = Pipeline(client, tokenizer=None, limits=Limits(), metrics=Metrics("m"))
        rec = RequestRecord("r1", "/infer")
        job = Job([Sub([1, 2, 3], P.SamplingParams(max_new_tokens=2))], stream=True)
        codec = _Render()
        outs = pipeline._submit(codec, job, rec)
        stream = client.streams[0]
        loop = asyncio.get_running_loop()
        frames = [P.TokenFrame("r1", [7]), P.TokenFrame("r1", [8], finish_reason="length")]
        body = b""
        async for item in pipeline._stream(codec, job, outs, Context(None, rec, {}), None):
            if frames and not stream.frames:  # the next frame lands as the following wait times out
                loop.call_soon(stream._push, frames.pop(0))
            body += item.serialize()
        return body, rec

    body, rec = asyncio.run(asyncio.wait_for(main(), 15))
    assert body == b"7:;8:length;", body
    assert (rec.status, rec.output_tokens, rec.finish_reason, rec.error) == (200, 2, "length", "")


def test_a_stream_that_ends_without_its_finish_is_an_error_not_an_empty_success() -> None:
    """A generation whose pieces end without a finish reason (its stream cancelled under it) ends
    the answer with an error event and is logged as such, not as a 200 with no output."""

    class _Render(_Codec):
        def render(self, job, out, p, ctx):
            return [b"tok"]

        def stream_error(self, job, err):
            return err.body()

    async def main() -> tuple[bytes, RequestRecord]:
        client = _Client()
        pipeline = Pipeline(client, tokenizer=None, limits=Limits(), metrics=Metrics("m"))
        rec = RequestRecord("r1", "/infer")
        job = Job([Sub([1, 2, 3], P.SamplingParams(max_new_tokens=2))], stream=True)
        codec = _Render()
        outs = pipeline._submit(codec, job, rec)
        client.cancel(client.streams[0])  # as if cancelled by this front end before anything came
        body = b""
        async for item in pipeline._stream(codec, job, outs, Context(None, rec, {}), None):
            body += item.serialize()
        return body, rec

    body, rec = asyncio.run(asyncio.wait_for(main(), 15))
    assert b'"error"' in body and b"without a finish reason" in body, body
    assert rec.status == 500 and rec.output_tokens == 0 and "finish reason" in rec.error
