"""The instance's prefill/decode role, the server's side of disaggregation (docs/design.md
"Disaggregated prefill/decode"; the protocol, header included, is mindie/contract/pd.py; the worker
side workers/pd_transfer.py).

- The role (``prefill`` | ``decode`` | ``flex``): ``ServerConfig.pdRole`` at start, changed by
  MindIE's ``POST /v1/role/{role}`` / ``/v2/role/{role}`` (``RoleResource``; bodies checked as
  MindIE checks them), kept in the private run directory (``pd.role``) so that every front end
  follows one role (``RoleState``), and reported in /v1/status and /v2/status (``role_status``).
- What each role serves (``refusal``): the request pipeline (mindie/pipeline.py) asks it with the
  request's ``X-Mindie-PD`` order.
"""
from __future__ import annotations

import json
import os

import falcon
import falcon.asgi
import msgspec

from mindie.contract import wire as P
from mindie.contract.http_error import ApiError
from mindie.contract.pd import DECODE, FLEX, HEADER, PREFILL, ROLES, WHOLE

ROLE_FILE = "pd.role"
BAD_BODY = "Req body converts to json fail. Reset to previous node status."


class RoleState:
    """The instance's role, shared by the front ends through a file in the run directory (one
    ``stat`` per read; re-read when it changed). Its JSON: ``{"role", "p_percentage", "peers"}``."""

    def __init__(self, run_dir: str, start_role: str = FLEX):
        self.path = os.path.join(run_dir, ROLE_FILE) if run_dir else ""
        self.start_role = start_role
        self._mtime = -1.0
        self._state = {"role": start_role, "peers": []}

    def state(self) -> dict:
        if not self.path:
            return self._state
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return {"role": self.start_role, "peers": []}
        if mtime != self._mtime:
            try:
                with open(self.path, encoding="utf-8") as f:
                    self._state = json.load(f)
                self._mtime = mtime
            except (OSError, ValueError):
                pass  # being replaced: the last one read stands
        return self._state

    @property
    def role(self) -> str:
        return self.state().get("role", self.start_role)

    def set(self, role: str, body: dict) -> None:
        state = {"role": role, "peers": [p.get("id") for p in body.get("peers") or [] if isinstance(p, dict)]}
        if isinstance(body.get("local"), dict) and "p_percentage" in body["local"]:
            state["p_percentage"] = body["local"]["p_percentage"]
        self._state = state
        if self.path:
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(state, f)
            os.replace(tmp, self.path)  # atomic: front ends never read half a file


def refusal(role: str, order: P.PdOrder | None) -> ApiError | None:
    """What ``role`` does not serve: a prefill instance serves only PD prefill requests and those
    the coordinator orders served whole (``op whole``: its fallback with no decode instance ready);
    a decode instance PD decode requests and plain ones (it can compute a prompt itself); flex all."""
    if role == PREFILL and (order is None or order.op not in (PREFILL, WHOLE)):
        return ApiError(503, "This instance's role is prefill: it serves only prefill requests of a PD pair "
                             f"({HEADER} op prefill) and whole ones ({HEADER} op whole).")
    if role == DECODE and order is not None and order.op == PREFILL:
        return ApiError(503, "This instance's role is decode: it does not serve prefill requests of a PD pair.")
    return None


def _is_num_str(v) -> bool:
    return isinstance(v, str) and v.isdigit()


def _check_devices(node: dict) -> bool:
    for d in node.get("device", []):
        if not isinstance(d, dict) or not all(_is_num_str(d.get(k)) for k in ("device_logical_id", "device_id")):
            return False
        if not isinstance(d.get("device_ip"), str):
            return False
        if "rank_id" in d and not _is_num_str(d["rank_id"]):
            return False
    return isinstance(node.get("device", []), list)


def _check_node_v1(node) -> bool:
    """MindIE's CheckPDIPInfo: server_ip a string, id and host_ip both or neither, p_percentage 0..100."""
    if not isinstance(node, dict) or not isinstance(node.get("server_ip"), str):
        return False
    if ("id" in node) != ("host_ip" in node):
        return False
    if "id" in node and (not isinstance(node["id"], int) or isinstance(node["id"], bool) or node["id"] < 0):
        return False
    if "p_percentage" in node:
        p = node["p_percentage"]
        if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p <= 100:
            return False
    return _check_devices(node)


def _check_node_v2(node) -> bool:
    """MindIE's CheckPDV2IPInfo: server_ip, dp_inst_list of {dp_inst_id, device}."""
    if not isinstance(node, dict) or not isinstance(node.get("server_ip"), str):
        return False
    dps = node.get("dp_inst_list")
    if not isinstance(dps, list):
        return False
    return all(isinstance(dp, dict) and isinstance(dp.get("dp_inst_id"), int) and _check_devices(dp) for dp in dps)


def check_role_body(body: object, version: int) -> bool:
    """MindIE's CheckPDRoleReqJson (v1) / CheckPDRoleV2ReqJson (v2)."""
    if not isinstance(body, dict):
        return False
    local, peers = body.get("local"), body.get("peers")
    if version == 1:
        if not _check_node_v1(local):
            return False
        return not isinstance(peers, list) or all(_check_node_v1(p) for p in peers)
    if not isinstance(local, list):
        return False
    if not isinstance(peers, list):
        return True
    return all(_check_node_v2(n) for n in local) and all(
        isinstance(p, list) and all(_check_node_v2(n) for n in p) for p in peers)


class RoleResource:
    """``POST /v1/role/{role}`` and ``/v2/role/{role}`` (MindIE's Controller calls them)."""

    def __init__(self, roles: RoleState, max_mb: int, version: int):
        self.roles, self.max_mb, self.version = roles, max_mb, version

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, role: str) -> None:
        if role not in ROLES:
            raise falcon.HTTPNotFound()
        raw = await req.stream.read(self.max_mb * 1024 * 1024 + 1)
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            body = None
        if not check_role_body(body, self.version):
            raise ApiError(422, BAD_BODY, "Input validation error")
        self.roles.set(role, body)
        resp.content_type = falcon.MEDIA_JSON
        resp.data = b'{"result":"ok"}'


def role_status(roles: RoleState) -> dict:
    """The ``service`` keys /v1/status and /v2/status report (MindIE's), and ``linkStatus``."""
    st = roles.state()
    service = {"roleStatus": "RoleReady", "currentRole": st.get("role", roles.start_role)}
    if service["currentRole"] == FLEX and "p_percentage" in st:
        service["p_percentage"] = st["p_percentage"]
    return {"service": service, "linkStatus": {"peers": [{"target": p, "link": "ok"} for p in st.get("peers", [])
                                                         if p is not None]}}


__all__ = ["RoleResource", "RoleState", "check_role_body", "refusal", "role_status"]
