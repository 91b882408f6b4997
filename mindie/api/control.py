"""Control routes: POST /v2/models/{model}/stopInfer (business plane, mindie.md §5) and
GET /stopService (management plane, §2.3).

stopInfer names a request by the id its client gave in the ``req-id`` header (or the one the
server generated and returned in the ``req-id`` response header). Any front end may take it:
it asks every ready device worker, each ends the requests with that id at once (KV blocks freed,
a final frame with ``finish_reason`` "stop_sequence" to the front end that streams it) and says
how many it ended.

stopService drains the whole server: the stop order (mindie/server/service_state.py) makes every front
end refuse new inference with 503 "The service has been stopped." and cut what still runs
``ServerConfig.drainTimeoutS`` later (mindie/server/drain.py); the call returns 200 once no inference
request is in progress anywhere (admission count and the workers' queues both zero), then the
launcher is asked to stop every process (SIGTERM, as on a terminal's Ctrl-C; it finds the drain
done). With ``mode=Force`` the requests in progress are cut at once, the call returns at once, and
the launcher stops every process (SIGTERM first, SIGKILL for what is left after a bound). A second
call gets 500 without a body.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time

import falcon
import falcon.asgi
import msgspec

from mindie.server.admission import Admission
from mindie.pipeline import read_body
from mindie.api.status import Live
from mindie.device_client import DeviceClient
from mindie.runtime.lifecycle import request_stop
from mindie.contract.http_error import ApiError, not_found, validation_error
from mindie.server.service_state import FORCE, GRACEFUL, ServiceState

log = logging.getLogger("mindie.control")

ID_RE = re.compile(r"^[a-zA-Z0-9_-]{1,256}$")
ID_MESSAGE = ("The id can contain only digits, letters, underscores(_), hyphens(-) and no more than 256 words "
              "in length.")
STOP_ANSWER_TIMEOUT_S = 2.0
DRAIN_POLL_S = 0.05
CUT_GRACE_S = 3.0  # after the drain bound: time for every front end to cut and send the final frames


class StopInferResource:
    def __init__(self, client: DeviceClient, model_name: str, max_body_mb: int):
        self.client = client
        self.model_name = model_name
        self.max_body_mb = max_body_mb

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, model: str) -> None:
        if model != self.model_name:
            raise not_found(f"Model {model} not found.")
        raw = await read_body(req, self.max_body_mb)
        try:
            body = msgspec.json.decode(raw)
        except (msgspec.DecodeError, RecursionError):
            raise validation_error("Failed to parse request context to json")
        if not isinstance(body, dict) or body.get("id") is None:
            raise validation_error("Not found id.")
        rid = body["id"]
        if not isinstance(rid, str) or not ID_RE.match(rid):
            raise validation_error(ID_MESSAGE)
        found, complete = await self.client.stop_user(rid, STOP_ANSWER_TIMEOUT_S)
        if found:
            log.info("stopInfer %s: ended %d request(s)", rid, found)
            resp.content_type = falcon.MEDIA_JSON
            resp.data = raw  # MindIE echoes the request body
            return
        if not complete:
            raise ApiError(500, "Stop request failed, internal failed.")
        raise not_found(f"RequestId is {rid} not found.")


class StopServiceResource:
    def __init__(self, client: DeviceClient, state: ServiceState, admission: Admission | None, run_dir: str,
                 drain_timeout_s: float):
        self.client = client
        self.state = state
        self.admission = admission
        self.run_dir = run_dir
        self.drain_timeout_s = drain_timeout_s

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        force = req.get_param("mode") == FORCE
        if not self.state.stop(FORCE if force else GRACEFUL, self.drain_timeout_s):
            resp.status = 500  # MindIE: a second stopService
            resp.data = b""
            return
        log.warning("/stopService%s: new inference is refused from now on%s", " (Force)" if force else "",
                    "" if force else "; waiting for the requests in progress")
        if not force:
            left = await self._drain()
            if left:
                log.error("/stopService: %d requests still in progress %.0f s after the drain bound (%g s): "
                          "stopping anyway", left, CUT_GRACE_S, self.drain_timeout_s)
        resp.status = 200
        resp.data = b""
        resp.schedule_sync(lambda: self._stop_server(force))

    def in_progress(self) -> int:
        """Inference requests in progress server-wide: admitted by a front end (until their
        reply is sent) or queued or running on a worker."""
        held = self.admission.in_use() if self.admission is not None else 0
        live = Live(self.client)
        return max(held, live.running + live.waiting)

    async def _drain(self) -> int:
        """Wait until nothing is in progress; the front ends cut what still runs at the bound."""
        deadline = time.monotonic() + self.drain_timeout_s + CUT_GRACE_S
        while (left := self.in_progress()) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        return left

    def _stop_server(self, force: bool) -> None:
        try:
            pid = request_stop(self.run_dir)
            log.warning("/stopService%s: asked the launcher (pid %d) to stop the server", " (Force)" if force else "",
                        pid)
        except ProcessLookupError:
            pid = os.getppid()  # no launcher: stop at least this gunicorn master and its front ends
            log.warning("/stopService: no launcher owns %s: SIGTERM to the gunicorn master (pid %d)",
                        self.run_dir, pid)
            os.kill(pid, signal.SIGTERM)
