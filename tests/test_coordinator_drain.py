"""A drain through the coordinator never cuts silently (issue 52, finding 4), on real processes
(two instances started by scripts/launch.sh, the coordinator process, loopback): SIGTERM to the
coordinator refuses new requests with MindIE's 503, lets the streams in flight run until
``http_config.drainTimeoutS``, then ends each one still running with an error frame in its API
family's shape (native, OpenAI, vLLM, TGI, Triton) and a request-log line that names the cut."""
from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.coord_harness import Coordinator, start_instances
from tests.test_coordinator_faults import PROMPT, last_frame

pytestmark = pytest.mark.timeout(300)

DRAIN_S = 2
TOKENS = 1500  # far more than a drain of DRAIN_S lets finish, at any speed this host has
STREAMS = {
    "native": ("/infer", {"inputs": PROMPT, "stream": True,
                          "parameters": {"max_new_tokens": TOKENS, "ignore_eos": True}}),
    "openai": ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": PROMPT}],
                                        "max_tokens": TOKENS, "ignore_eos": True, "stream": True}),
    "tgi": ("/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": TOKENS}}),
    "vllm": ("/generate", {"prompt": PROMPT, "max_tokens": TOKENS, "ignore_eos": True, "stream": True}),
    "triton": ("/v2/models/demo/generate_stream", {"id": "x", "text_input": PROMPT,
                                                   "parameters": {"max_new_tokens": TOKENS}}),
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drain")
    servers = start_instances(tmp, 2, schedule={"maxIterTimes": 2048})
    try:
        yield tmp, servers
    finally:
        for s in servers:
            s.stop()


class Stream:
    """One streamed request through the coordinator in a thread: its raw bytes and end time."""

    def __init__(self, url: str, path: str, body: dict) -> None:
        self.raw = bytearray()
        self.status = 0
        self.ended: float | None = None
        self.thread = threading.Thread(target=self._run, args=(url + path, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url, json=body, timeout=60) as r:
                self.status = r.status_code
                for chunk in r.iter_raw():
                    self.raw.extend(chunk)
        finally:
            self.ended = time.monotonic()

    def frames(self) -> int:
        return max(self.raw.count(b"data:"), self.raw.count(b"\0"))


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def check_drain_cut(family: str, s: Stream, drain_s: float) -> None:
    """The stream ended with the drain's error frame in ``family``'s shape."""
    assert s.status == 200, (family, s.status, bytes(s.raw[-300:]))
    last = last_frame(family, bytes(s.raw))
    if family == "openai":
        err = last["error"]
        assert err["code"] == 503, last
        message = err["message"]
    else:
        assert last.get("error_type") == "Service Unavailable", (family, last)
        message = last["error"]
    assert "The service has been stopped." in message and f"drainTimeoutS = {drain_s:g} s" in message, message


def test_sigterm_drains_then_cuts_every_family_with_an_error_frame(fleet):
    tmp, servers = fleet
    coord = Coordinator(tmp, servers, name="drain", config={"http_config": {"drainTimeoutS": DRAIN_S}})
    try:
        coord.wait_ready()
        streams = {fam: Stream(coord.url, *STREAMS[fam]) for fam in STREAMS}
        wait_until(lambda: all(s.frames() >= 3 for s in streams.values()), 60,
                   f"streams not started: {[(f, s.status, bytes(s.raw[:200])) for f, s in streams.items()]}")
        t0 = time.monotonic()
        coord.proc.send_signal(signal.SIGTERM)
        # new requests: MindIE's 503 (the listener stays open during the drain)
        wait_until(lambda: httpx.get(coord.manage + "/v1/readiness", timeout=5).status_code == 503, 10,
                   "readiness still 200 after SIGTERM")
        r = httpx.post(coord.url + "/infer", json={"inputs": "a", "parameters": {"max_new_tokens": 2}}, timeout=10)
        assert r.status_code == 503 and r.json()["error"] == "The service has been stopped.", r.text
        assert all(s.ended is None for s in streams.values()), "a stream ended before the drain's end"
        for s in streams.values():
            s.thread.join(DRAIN_S + 20)
        for fam, s in streams.items():
            assert s.ended is not None, fam
            # not before the drain's end, and soon after it
            assert DRAIN_S - 0.5 <= s.ended - t0 <= DRAIN_S + 10, (fam, s.ended - t0)
            check_drain_cut(fam, s, DRAIN_S)
        assert coord.proc.wait(30) == 0, coord.tail()
        lines = coord.request_lines()
        cut = [ln for ln in lines if "cut by the coordinator's drain" in ln]
        assert len(cut) == len(STREAMS), lines
        assert all(" status 200 " in ln for ln in cut), cut  # the stream had begun: its status stays
        refused = [ln for ln in lines if " status 503 " in ln and "stopping" in ln]
        assert refused, lines
        print(f"SIGTERM -> {len(cut)} streams cut with error frames at "
              f"{max(s.ended for s in streams.values()) - t0:.2f} s (drainTimeoutS {DRAIN_S})")
    finally:
        coord.stop()
