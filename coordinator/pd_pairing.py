"""Prefill/decode disaggregation in the coordinator (``digs_scheduler_config.deploy_mode:
pd_separate``): the roles instances report, the decode side's KV endpoint for a pair, and the
handoff headers (the protocol itself, roles, header name and encoding, is mindie/contract/pd.py).

Roles. An instance is ``prefill``, ``decode`` or ``flex`` (hybrid: today's instance, serves a
request whole). The role an instance *reports* on its management plane (``/v2/status``, polled)
wins; else the role its record was given (the static ``instances[].role`` extension, or MindIE's
refresh ``static_info``: ``label`` 2=P 3=D, ``role`` 80='P' 68='D' 85=undefined); else ``flex``.

Handoff (MindIE Motor's HANDOFF, vLLM's proxy): the coordinator sends the request (same path,
same body) to a prefill instance with the ``prefill`` header (``handoff_header``); the prefill instance computes
the prompt, ships its KV blocks to the chosen decode instance's KV address and answers a small
JSON; the coordinator then sends the same request to the decode instance with the ``decode``
headers (carrying the prefill's answer) and relays the decode instance's answer, stream or not.

Degraded (no decode instance ready): a prefill instance gets the request with the ``whole``
order (``WHOLE_HEADER``) and serves it to its end, as MindIE falls back to hybrid serving.
"""
from __future__ import annotations

from typing import Any

from mindie.contract.pd import DECODE, FLEX, HEADER, IPC, PREFILL, encode_header, whole_header

H_PD = HEADER.lower().encode()  # as ASGI spells header names
PD_HEADERS = (H_PD,)  # a client's own is dropped, never forwarded
# to a prefill instance when no decode instance is ready: serve the request whole (router.pick_pd)
WHOLE_HEADER = (H_PD, whole_header().encode())

# MindIE MS static_info numbers: label 2=P 3=D (0/1 hybrid); role 80='P' 68='D' 85='U'ndefined
_LABELS = {2: PREFILL, 3: DECODE}
_ROLE_CODES = {80: PREFILL, 68: DECODE, 85: ""}
_NAMES = {PREFILL: PREFILL, "p": PREFILL, DECODE: DECODE, "d": DECODE, FLEX: FLEX, "hybrid": FLEX,
          "mixed": FLEX, "none": "", "u": "", "undefined": "", "": ""}


def parse_role(value: Any) -> str:
    """``prefill`` | ``decode`` | ``flex`` | "" (unknown) from any of the spellings instances and
    MindIE's Controller use: names, letters, MindIE's role codes (80/68/85)."""
    if isinstance(value, bool) or value is None:
        return ""
    if isinstance(value, int):
        return _ROLE_CODES.get(value, "")
    if isinstance(value, str):
        v = value.strip().lower()
        if v.isdigit():
            return _ROLE_CODES.get(int(v), "")
        return _NAMES.get(v, "")
    return ""


def role_from_static(static: dict) -> str:
    """The role in a MindIE refresh ``static_info`` (``role`` first, then ``label``)."""
    if not isinstance(static, dict):
        return ""
    r = parse_role(static.get("role"))
    if r:
        return r
    try:
        return _LABELS.get(int(static.get("label")), "")
    except (TypeError, ValueError):
        return ""


def role_from_status(body: Any) -> tuple[str, list[str], str]:
    """(role, KV endpoints, KV CURVE public key) an instance reports in its ``/v2/status`` (or
    ``/v1/status``) body: ``service.currentRole`` (MindIE's key; "none" = no role yet) or
    ``pd.role``, ``pd.kvEndpoints`` (one per device worker), ``pd.kvCurvePublicKey``."""
    if not isinstance(body, dict):
        return "", [], ""
    svc = body.get("service") if isinstance(body.get("service"), dict) else {}
    pdb = body.get("pd") if isinstance(body.get("pd"), dict) else {}
    role = parse_role(svc.get("currentRole")) or parse_role(pdb.get("role")) or parse_role(body.get("role"))
    eps = pdb.get("kvEndpoints")
    eps = [e for e in eps if isinstance(e, str) and e] if isinstance(eps, list) else []
    key = pdb.get("kvCurvePublicKey")
    return role, eps, key if isinstance(key, str) else ""


def pick_endpoint(endpoints: list[str], same_host: bool, n: int) -> str:
    """The decode instance's KV endpoint for the ``n``-th handoff to it: its ipc endpoints when
    the prefill instance is on the same host (no TCP, no CURVE), else its tcp ones; round robin
    over its device workers. "" when it reports none."""
    ipc = [e for e in endpoints if e.startswith(IPC)]
    other = [e for e in endpoints if not e.startswith(IPC)]
    pool = (ipc or other) if same_host else (other or ipc)
    return pool[n % len(pool)] if pool else ""


def handoff_header(op: str, transfer_id: str, endpoint: str, curve_key: str = "") -> tuple[bytes, bytes]:
    """The handoff header of one step as an ASGI (name, value) pair."""
    return H_PD, encode_header(op, transfer_id, endpoint, curve_key).encode()
