"""Prefill/decode disaggregation's protocol, one home for its three parties: the coordinator that
pairs instances (coordinator/pd_pairing.py), the server that serves each half
(mindie/api/pd_role.py, mindie/pipeline.py) and the device workers that move the KV blocks
(workers/pd_transfer.py).

- Roles: an instance is ``prefill``, ``decode`` or ``flex`` (hybrid: serves a request whole).
- The handoff header ``X-Mindie-PD`` on a request the coordinator relays, compact JSON with
  camelCase keys (``encode_header`` writes it, ``parse_header`` reads and checks it):

      prefill: {"op":"prefill","transferId":ID,"kvEndpoint":EP[,"kvCurvePublicKey":K]}
      decode:  {"op":"decode","transferId":ID,"kvEndpoint":EP}
      whole:   {"op":"whole"}

  ``whole`` asks any instance, a prefill one included, to serve the request to its end as a
  hybrid instance does: the coordinator's fallback when no decode instance is ready (MindIE
  falls back to hybrid serving), so a prefill-only fleet degrades instead of hanging.

  ``kvEndpoint`` is the decode worker's KV address (``ipc://`` on one host, ``tcp://`` across
  hosts); ``kvCurvePublicKey`` its CURVE public key (Z85), sent only with a prefill order to a
  tcp endpoint.
- The prefill instance's answer (``prefill_answer``): ``{"transferId", "promptTokens",
  "prefillMs"}``, read by the coordinator for its request log.
"""
from __future__ import annotations

import json
import re

import msgspec

from mindie.contract.http_error import ApiError
from mindie.contract.wire import PdOrder

PREFILL, DECODE, FLEX = "prefill", "decode", "flex"
WHOLE = "whole"  # an order, not a role: serve the request whole whatever the role
ROLES = (PREFILL, DECODE, FLEX)

HEADER = "X-Mindie-PD"
IPC, TCP = "ipc://", "tcp://"  # the KV endpoints' schemes
KV_SCHEMES = (IPC, TCP)
TRANSFER_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
Z85_KEY_RE = re.compile(r"^[0-9A-Za-z.:+=^!/*?&<>()\[\]{}@%$#-]{40}$")  # a 32-byte CURVE key in Z85


def encode_header(op: str, transfer_id: str, endpoint: str, curve_key: str = "") -> str:
    """The ``X-Mindie-PD`` value of a handoff step (``curve_key`` goes only with a prefill order
    to a tcp endpoint)."""
    doc = {"op": op, "transferId": transfer_id, "kvEndpoint": endpoint}
    if curve_key and op == PREFILL and endpoint.startswith(TCP):
        doc["kvCurvePublicKey"] = curve_key
    return json.dumps(doc, separators=(",", ":"))


def whole_header() -> str:
    """The ``X-Mindie-PD`` value that asks an instance to serve a request whole."""
    return json.dumps({"op": WHOLE}, separators=(",", ":"))


def parse_header(value: str | None) -> PdOrder | None:
    """The request's ``X-Mindie-PD`` order, or None without the header; ApiError 400 when malformed."""
    if value is None:
        return None
    try:
        d = json.loads(value)
    except ValueError:
        raise ApiError(400, f"{HEADER} is not JSON") from None
    if not isinstance(d, dict):
        raise ApiError(400, f"{HEADER} must be a JSON object")
    op, tid, ep = d.get("op"), d.get("transferId"), d.get("kvEndpoint")
    if op == WHOLE:
        return PdOrder(WHOLE, "", "", "")  # no transfer: nothing else to read
    if op not in (PREFILL, DECODE):
        raise ApiError(400, f"{HEADER}: op must be \"prefill\", \"decode\" or \"whole\"")
    if not isinstance(tid, str) or not TRANSFER_ID_RE.match(tid):
        raise ApiError(400, f"{HEADER}: transferId must match {TRANSFER_ID_RE.pattern}")
    if not isinstance(ep, str) or not ep.startswith(KV_SCHEMES):
        raise ApiError(400, f"{HEADER}: kvEndpoint must be an ipc:// or tcp:// endpoint (/v2/status pd.kvEndpoints)")
    key = d.get("kvCurvePublicKey", "")
    if not isinstance(key, str) or (key and not Z85_KEY_RE.match(key)):
        raise ApiError(400, f"{HEADER}: kvCurvePublicKey must be a 40-character Z85 key "
                            "(/v2/status pd.kvCurvePublicKey)")
    return PdOrder(op, tid, ep, key if op == PREFILL else "")


def prefill_answer(transfer_id: str, prompt_tokens: int, prefill_ms: float) -> bytes:
    """The prefill instance's answer once the decode worker acknowledged the KV blocks."""
    return msgspec.json.encode({"transferId": transfer_id, "promptTokens": prompt_tokens,
                                "prefillMs": round(prefill_ms, 3)})
