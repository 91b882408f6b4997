"""Prefill/decode disaggregation in the coordinator (``digs_scheduler_config.deploy_mode:
pd_separate``): instance roles and the handoff headers.

Roles. An instance is ``prefill``, ``decode`` or ``flex`` (hybrid: today's instance, serves a
request whole). The role an instance *reports* on its management plane (``/v2/status``, polled)
wins; else the role its record was given (the static ``instances[].role`` extension, or MindIE's
refresh ``static_info``: ``label`` 2=P 3=D, ``role`` 80='P' 68='D' 85=undefined); else ``flex``.

Handoff (MindIE Motor's HANDOFF, vLLM's proxy): the coordinator sends the request (same path,
same body) to a prefill instance with the ``prefill`` headers below; the prefill instance computes
the prompt, ships its KV blocks to the chosen decode instance's KV address and answers a small
JSON; the coordinator then sends the same request to the decode instance with the ``decode``
headers (carrying the prefill's answer) and relays the decode instance's answer, stream or not.
The wire names live here so the server side's protocol (docs/design.md, "Prefill/decode
disaggregation") is matched in one place.
"""
from __future__ import annotations

import json
from typing import Any

PREFILL, DECODE, FLEX = "prefill", "decode", "flex"

# header names (lower case: ASGI/h11 carry them so)
H_STAGE = b"x-mindie-pd"
H_ID = b"x-mindie-pd-id"
H_PEER = b"x-mindie-pd-peer"
H_PARAMS = b"x-mindie-pd-params"
PD_HEADERS = (H_STAGE, H_ID, H_PEER, H_PARAMS)  # a client's own are dropped, never forwarded

# MindIE MS static_info numbers: label 2=P 3=D (0/1 hybrid); role 80='P' 68='D' 85='U'ndefined
_LABELS = {2: PREFILL, 3: DECODE}
_ROLE_CODES = {80: PREFILL, 68: DECODE, 85: ""}
_NAMES = {"prefill": PREFILL, "p": PREFILL, "decode": DECODE, "d": DECODE, "flex": FLEX, "hybrid": FLEX,
          "mixed": FLEX, "none": FLEX, "u": "", "undefined": "", "": ""}


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


def role_from_status(body: Any) -> tuple[str, str]:
    """(role, KV address) an instance reports in its ``/v2/status`` (or ``/v1/status``) body;
    "" where it says nothing."""
    if not isinstance(body, dict):
        return "", ""
    role, addr = "", ""
    for where in (body, body.get("pd") if isinstance(body.get("pd"), dict) else {},
                  body.get("server") if isinstance(body.get("server"), dict) else {}):
        role = role or parse_role(where.get("role"))
        for k in ("pdKvAddress", "kvAddress", "kv_address"):
            if not addr and isinstance(where.get(k), str):
                addr = where[k]
    return role, addr


def prefill_headers(pd_id: str, peer: str) -> list[tuple[bytes, bytes]]:
    return [(H_STAGE, PREFILL.encode()), (H_ID, pd_id.encode()), (H_PEER, peer.encode("latin-1", "replace"))]


def decode_headers(pd_id: str, params: Any) -> list[tuple[bytes, bytes]]:
    text = params if isinstance(params, str) else json.dumps(params, separators=(",", ":"))
    return [(H_STAGE, DECODE.encode()), (H_ID, pd_id.encode()), (H_PARAMS, text.encode("latin-1", "replace"))]
