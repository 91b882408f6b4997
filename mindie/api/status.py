"""Status and config routes, filled from the config and the workers' live heartbeats
(mindie.md §2.2, §2.3): /info, /v1/config, /v1/status, /v2/status, /v2/models/{m}/getSlotCount on
the management plane; /v2, /v2/models/{m}, /v2/models/{m}/config on the business plane.

"npu" in MindIE's names means the device of the workers (NPU, GPU or CPU memory): its KV blocks.
There is no swap space, so the "cpu" block figures are 0 and "swapped" requests are the
preempted ones waiting to be recomputed. Every worker counts: slots and blocks are summed over
the ready workers (a worker that is not ready offers none).
"""
from __future__ import annotations

import os

import falcon
import falcon.asgi
import msgspec

from mindie.device_client import DeviceClient
from mindie.config import Config
from mindie.contract.spec import EngineConfig
from mindie.contract.http_error import not_found
from mindie.api.pd_role import RoleState, role_status
from mindie.runtime.curve import WORKER_PUBLIC, CurveKeyError, read_certificate

MINDIE_VERSION = "1.0.0"


def _json(resp: falcon.asgi.Response, body: dict) -> None:
    resp.content_type = falcon.MEDIA_JSON
    resp.data = msgspec.json.encode(body)


def kv_endpoints(specs) -> list[str]:
    """Where this instance's decode workers receive KV blocks: each worker's ipc endpoint (peers on
    this host), then each one's tcp endpoint (peers elsewhere; ServerConfig.interCommPort)."""
    return [ep.kv_endpoint for ep in specs if ep.kv_endpoint] + [ep.kv_tcp_endpoint for ep in specs
                                                                 if ep.kv_tcp_endpoint]


_KEYS: dict[str, str] = {}


def kv_curve_key(specs) -> dict:
    """``{"kvCurvePublicKey": ...}``: the workers' CURVE public key a prefill instance checks this
    instance's tcp KV endpoints with; {} without one (ipc only, plain tcp, unreadable key)."""
    key_dir = next((ep.kv_curve_key_dir for ep in specs if ep.kv_tcp_endpoint and ep.kv_curve_key_dir), "")
    if not key_dir:
        return {}
    if key_dir not in _KEYS:
        try:
            _KEYS[key_dir] = read_certificate(os.path.join(key_dir, WORKER_PUBLIC), secret=False)[0].decode()
        except CurveKeyError:
            return {}
    return {"kvCurvePublicKey": _KEYS[key_dir]}


class Live:
    """Sums over the last heartbeat of every ready worker."""

    def __init__(self, client: DeviceClient):
        beats = client.heartbeats()
        self.beats = beats
        self.slots = sum(hb.max_batch_size for hb in beats)
        self.running = sum(hb.running for hb in beats)
        self.waiting = sum(hb.waiting for hb in beats)
        self.swapped = sum(hb.swapped for hb in beats)
        self.free_blocks = sum(hb.free_blocks for hb in beats)
        self.total_blocks = sum(hb.total_blocks for hb in beats)

    @property
    def free_slots(self) -> int:
        return max(0, self.slots - self.running)


class StatusRoutes:
    """Every status route of one front end; one Falcon responder per route (suffixes)."""

    def __init__(self, config: Config, client: DeviceClient, model_name: str, model_dir: str, device: str = "cpu",
                 engine: EngineConfig | None = None, roles: RoleState | None = None):
        """``engine``: the launch plan's engine settings, as settled (shown by /v1/config)."""
        self.config = config
        self.engine = engine
        self.roles = roles or RoleState("", config.server.pd_role)  # prefill/decode role (mindie/api/pd_role.py)
        self.model_dir = model_dir
        self.client = client
        self.model_name = model_name
        self.device = device
        deploy = config.backend.model_deploy
        self.model = next((m for m in deploy.models if m.model_name == model_name), deploy.models[0])

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise not_found(f"Model {model} not found.")

    # -- management plane ---------------------------------------------------------------------
    async def on_get_info(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        """GET /info (TGI's info, MindIE's fields and order)."""
        deploy, sch = self.config.backend.model_deploy, self.config.backend.schedule
        beats = self.client.heartbeats()
        device = beats[0].device.split(":")[0].split(" ")[0] if beats else self.device
        _json(resp, {
            "docker_label": None, "max_batch_total_tokens": sch.max_prefill_tokens, "max_best_of": 1,
            "max_concurrent_requests": sch.max_batch_size, "max_stop_sequences": None, "max_waiting_tokens": None,
            "sha": None, "validation_workers": None, "version": MINDIE_VERSION, "waiting_served_ratio": None,
            "models": [{"model_device_type": device, "model_dtype": self.model.dtype, "model_id": self.model_name,
                        "model_pipeline_tag": "text-generation", "model_sha": None,
                        "max_total_tokens": deploy.max_seq_len}],
            "max_input_length": deploy.max_input_token_len})

    async def on_get_v1_config(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        """GET /v1/config: MindIE's keys, and (project extensions) ``engine``, every engine and
        kernel setting as the launch plan resolved it (deployment.json's ``engine``), and
        ``workers``, each live device worker's id and device description (on CPU the kernels it
        dispatches to)."""
        deploy, sch = self.config.backend.model_deploy, self.config.backend.schedule
        body = {"modelName": self.model_name, "maxSeqLen": deploy.max_seq_len,
                "npuMemSize": self.model.npu_mem_size, "cpuMemSize": self.model.cpu_mem_size,
                "worldSize": self.model.world_size, "maxOutputLen": sch.max_iter_times,
                "cacheBlockSize": sch.cache_block_size}
        server = self.config.server
        body.update({"inferMode": server.infer_mode, "pdRole": server.pd_role, "currentRole": self.roles.role})
        if self.engine is not None:
            body["engine"] = msgspec.to_builtins(self.engine)
        # Project extension: each device worker's own description (CPU: the kernels it chose for
        # this machine, workers/backends/cpu_dispatch.py).
        body["workers"] = [{"workerId": hb.worker_id, "device": hb.device}
                           for hb in sorted(self.client.heartbeats(), key=lambda b: b.worker_id)]
        _json(resp, body)

    def _v1_status(self, live: Live) -> dict:
        role = role_status(self.roles)
        if not live.beats:
            role["service"]["roleStatus"] = "RoleUnknown"
        return {
            "service": role["service"],
            "resource": {"availSlotsNum": live.free_slots, "availBlockNum": live.free_blocks,
                         "waitingRequestNum": live.waiting, "runningRequestNum": live.running,
                         "swappedRequestNum": live.swapped, "freeNpuBlockNums": live.free_blocks,
                         "freeCpuBlockNums": 0, "totalNpuBlockNums": live.total_blocks, "totalCpuBlockNums": 0},
            "linkStatus": role["linkStatus"],
            # Project extension: where decode workers receive KV blocks (mindie/contract/pd.py, workers/pd_transfer.py).
            "pd": {"role": role["service"]["currentRole"],
                   "kvEndpoints": kv_endpoints(self.client.endpoints),
                   **kv_curve_key(self.client.endpoints),
                   "transfersActive": sum(hb.kv_transfers for hb in live.beats),
                   "heldBlocks": sum(hb.kv_held for hb in live.beats),
                   "computedPromptTokens": sum(hb.prompt_tokens for hb in live.beats)},
        }

    async def on_get_v1_status(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        """GET /v1/status."""
        _json(resp, self._v1_status(Live(self.client)))

    async def on_get_v2_status(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        """GET /v2/status: /v1/status plus the per-worker ("dp rank") block figures."""
        live = Live(self.client)
        body = self._v1_status(live)
        per = {str(i): hb.free_blocks for i, hb in enumerate(sorted(live.beats, key=lambda b: b.worker_id))}
        body["resource"].update({"totalAvailNpuSlotsNum": live.free_slots, "totalAvailNpuBlockNum": live.free_blocks,
                                 "dpInstMap": per, "maxAvailNpuBlockNum": max(per.values(), default=0)})
        _json(resp, body)

    async def on_get_slots(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, model: str) -> None:
        """GET /v2/models/{model}/getSlotCount."""
        self._check_model(model)
        live = Live(self.client)
        _json(resp, {"total_slots": live.slots, "free_slots": live.free_slots,
                     "available_tokens_length": sum(hb.free_blocks * hb.block_size for hb in live.beats)})

    # -- business plane -----------------------------------------------------------------------
    async def on_get_v2(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        """GET /v2 (Triton server metadata)."""
        sch = self.config.backend.schedule
        _json(resp, {"name": "MindIE Server", "version": MINDIE_VERSION, "extensions": {
            "max_iter_times": sch.max_iter_times, "prefill_policy_type": 0, "decode_policy_type": 0,
            "max_prefill_batch_size": sch.max_prefill_batch_size, "max_prefill_tokens": sch.max_prefill_tokens}})

    async def on_get_v2_model(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, model: str) -> None:
        """GET /v2/models/{model} (Triton model metadata)."""
        self._check_model(model)
        _json(resp, {"name": self.model_name, "platform": "MindIE Server",
                     "inputs": [{"name": "input0", "shape": [-1], "datatype": "UINT32"}],
                     "outputs": [{"name": "output0", "shape": [-1], "datatype": "UINT32"}]})

    async def on_get_v2_model_config(self, req: falcon.asgi.Request, resp: falcon.asgi.Response,
                                     model: str) -> None:
        """GET /v2/models/{model}/config."""
        self._check_model(model)
        deploy = self.config.backend.model_deploy
        weights = os.path.basename(os.path.normpath(self.model.model_weight_path or self.model_dir))
        _json(resp, {"model_name": self.model_name, "input_datatype": "UINT32", "output_datatype": "UINT32",
                     "max_seq_len": deploy.max_seq_len, "npu_mem_size": self.model.npu_mem_size,
                     "cpu_mem_size": self.model.cpu_mem_size, "world_size": self.model.world_size,
                     "model_weight_path": weights, "model_instance_type": "Standard"})
