"""LoRA adapters at run time (management plane): ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``, MindIE's routes, which take vLLM's bodies too.

Load: ``{"lora_name", "lora_path", "master_model"}`` (MindIE; vLLM sends the first two). The name
and path are checked as MindIE checks them, then every ready device worker is asked to load the
adapter (``wire.LoadAdapter``; each reads and checks it on a thread beside its steps,
workers/engine/lora_manager.py) and the answer waits for all of them. Success is 200 with
MindIE's (and vLLM's) plain-text message ``Success: LoRA adapter 'NAME' added successfully.``.
When any worker refuses (or does not answer within ``LOAD_ANSWER_TIMEOUT_S``), the workers that
loaded it unload it again and the answer is that worker's error in MindIE's shape
``{"error", "error_type"}``: 404 for a path with no adapter, 400 for an adapter this server cannot
serve on this model, a name loaded twice, a name waiting to unload.

Unload: ``{"lora_name"}``: every worker drops the name at once (new requests naming it get 404)
and frees the adapter's tensors when its requests in flight have finished on it. 200 ``Success:
LoRA adapter 'NAME' removed successfully.``, 404 ``The LoRA adapter 'NAME' cannot be found.``.

Paths (issue 52 finding 9): an adapter is read only from under ``ModelDeployConfig.loraRoot`` (a
relative ``lora_path`` from it; an absolute one must resolve, symbolic links followed, inside it),
and loading at run time is refused while it is unset. A path outside the root, one that does not
exist and one that is no adapter folder all get the same 404 ``No adapter found for 'PATH'.``
(the path as the client gave it), so the answer tells nobody which files exist; the server log
says which it was.

Loaded adapters are recorded in the run directory (mindie/lora_adapters.py ``LoadedAdapters``): a
device worker that restarts gets them again from the front ends.

MindIE itself answers these calls with 200 and the message whatever happened (503 for a bad name
or path); here a refusal has a 4xx status, so that a client can tell (vLLM's statuses).
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any

import falcon
import falcon.asgi
import msgspec

from mindie.text import ignored_fields
from mindie.lora_adapters import LoadedAdapters
from mindie.device_client import DeviceClient
from mindie.contract import wire as P
from mindie.contract.http_error import ApiError
from mindie.pipeline import read_body

log = logging.getLogger("mindie.lora")

LOAD_ANSWER_TIMEOUT_S = 120.0  # every worker reads the adapter's files: a large one takes seconds
UNLOAD_ANSWER_TIMEOUT_S = 5.0
NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,256}$")  # MindIE's check of lora_name
PATH_RE = re.compile(r"^(/(?:[\w\-.]+/)*[\w\-.]*/?)?$|^(?:[\w\-.]+/)*[\w\-.]*/?$")  # MindIE's check of lora_path
LOAD_SCHEMA = dict.fromkeys(("lora_name", "lora_path", "master_model", "load_inplace"))
UNLOAD_SCHEMA = dict.fromkeys(("lora_name", "lora_int_id"))


def _body(raw: bytes) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        raise ApiError(400, "Req body converts to json fail.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "Req body converts to json fail.")
    return body


def _name(body: dict[str, Any]) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ApiError(400, "Input invalid lora name")
    return name


def _worst(answers: list[P.AdapterAnswer]) -> P.AdapterAnswer:
    """The refusal to report: a client's mistake (4xx) before a server's."""
    return min(answers, key=lambda a: (not 400 <= a.status < 500, a.worker_id))


class LoadLoraResource:
    """POST /v1/load_lora_adapter."""

    def __init__(self, client: DeviceClient, model_name: str, max_body_mb: int, loaded: LoadedAdapters | None = None,
                 root: str = ""):
        """``loaded``: where the adapters loaded at run time are recorded (for workers that restart);
        ``root``: ModelDeployConfig.loraRoot, an absolute path ("" = no loading at run time)."""
        self.client = client
        self.model_name = model_name
        self.max_body_mb = max_body_mb
        self.loaded = loaded
        self.root = os.path.realpath(root) if root else ""

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = _body(await read_body(req, self.max_body_mb))
        ignored_fields.report(req, resp, ignored_fields.find(body, LOAD_SCHEMA))
        if body.get("lora_name") in (None, "") or body.get("lora_path") in (None, ""):
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        name = _name(body)
        path = body["lora_path"]
        if not isinstance(path, str) or not PATH_RE.match(path) or ".." in path:
            raise ApiError(400, "Input invalid lora path")
        master = body.get("master_model")
        if master not in (None, "") and master != self.model_name:
            raise ApiError(400, f"Call to load LoRA method failed: master_model '{master}' is not the served "
                                f"model '{self.model_name}'")
        if name == self.model_name:
            raise ApiError(400, f"Call to load LoRA method failed: The LoRA adapter '{name}' is invalid: it is the "
                                "base model's name")
        given = path
        path = self._under_root(given)
        links = self.client.ready_links()
        if not links:
            raise ApiError(503, "No device worker is ready")
        fid = self.client.frontend_id
        answers, missing = await self.client.ask_workers(lambda t: P.LoadAdapter(fid, t, name, path),
                                                         LOAD_ANSWER_TIMEOUT_S, links)
        bad = [a for a in answers.values() if a.status != 200]
        if not bad and not missing:
            log.info("LoRA adapter %s loaded from %s on %d device worker(s)", name, path, len(answers))
            if self.loaded is not None:
                self.loaded.record(name, path)
            resp.content_type = falcon.MEDIA_TEXT
            resp.text = next(iter(answers.values())).message
            return
        # All or nothing: the workers that loaded it (or may still) unload it again.
        undo = [lk for lk in links if lk.ep.worker_id in missing
                or (lk.ep.worker_id in answers and answers[lk.ep.worker_id].status == 200)]
        if undo:
            await self.client.ask_workers(lambda t: P.UnloadAdapter(fid, t, name), UNLOAD_ANSWER_TIMEOUT_S, undo)
        if bad:
            worst = _worst(bad)
            log.warning("LoRA adapter %s not loaded (%s: %d %s)", name, worst.worker_id, worst.status, worst.message)
            if worst.status == 404:  # no folder there: the same answer as a path outside the root
                raise not_found(given)
            raise ApiError(worst.status, worst.message)
        raise ApiError(500, f"Call to load LoRA method failed: device worker(s) {', '.join(missing)} did not answer "
                            f"within {LOAD_ANSWER_TIMEOUT_S:g} s; the adapter was unloaded again")


    def _under_root(self, given: str) -> str:
        """The adapter folder ``given`` names, resolved inside the root; ApiError otherwise (400 with
        no root; else the 404 a missing folder gets, whatever is there)."""
        if not self.root:
            raise ApiError(400, "Call to load LoRA method failed: LoRA adapters are loaded at run time only from "
                                "under ModelDeployConfig.loraRoot, which is not set")
        path = os.path.realpath(os.path.join(self.root, given))  # an absolute ``given`` replaces the root
        if os.path.commonpath([self.root, path]) != self.root:
            log.warning("LoRA adapter path %r refused: %s is outside loraRoot %s", given, path, self.root)
            raise not_found(given)
        return path


def not_found(given: str) -> ApiError:
    """The one answer for a path outside loraRoot, a missing one and one that is no adapter folder
    (the workers' 404: they read the folder, which may be on another host)."""
    return ApiError(404, f"No adapter found for '{given}'.")


class UnloadLoraResource:
    """POST /v1/unload_lora_adapter."""

    def __init__(self, client: DeviceClient, max_body_mb: int, loaded: LoadedAdapters | None = None):
        self.client = client
        self.max_body_mb = max_body_mb
        self.loaded = loaded

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = _body(await read_body(req, self.max_body_mb))
        ignored_fields.report(req, resp, ignored_fields.find(body, UNLOAD_SCHEMA))
        name = _name(body)
        links = self.client.ready_links()
        if not links:
            raise ApiError(503, "No device worker is ready")
        fid = self.client.frontend_id
        if self.loaded is not None:
            self.loaded.forget(name)  # first: a worker restarting meanwhile must not get it back
        answers, missing = await self.client.ask_workers(lambda t: P.UnloadAdapter(fid, t, name),
                                                         UNLOAD_ANSWER_TIMEOUT_S, links)
        done = [a for a in answers.values() if a.status == 200]
        if done:
            log.info("LoRA adapter %s unloaded from %d device worker(s)%s", name, len(done),
                     f" ({', '.join(missing)} did not answer)" if missing else "")
            resp.content_type = falcon.MEDIA_TEXT
            resp.text = done[0].message
            return
        if missing:
            raise ApiError(500, f"Call to unload LoRA method failed: device worker(s) {', '.join(missing)} did not "
                                f"answer within {UNLOAD_ANSWER_TIMEOUT_S:g} s")
        worst = _worst(list(answers.values()))
        raise ApiError(worst.status, worst.message)
