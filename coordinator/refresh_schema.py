"""The body of ``POST /v1/instances/refresh``, validated before anything is stored.

Two forms are accepted (docs/apis.md, "Coordinator"): MindIE MS's (``ids`` + ``instances`` with
``id``, ``ip``, ``port``, ``metric_port``, ``model_name``, ``static_info``, ``dynamic_info``) and
the newer Motor's (``event`` add/del/set + ``instances[].endpoints`` of ``{id, ip,
business_port, mgmt_port}``). Numbers may be strings (MindIE writes ports as ``"1025"``).

Every field is typed and bounded here (msgspec), and an ``ip`` must be an IP address or a host
name: a value with a space, CR or LF, or anything else, would otherwise end up in URLs, the
``Host`` header and log lines. A failure is a ``RefreshError`` naming the field
(``instances[3].static_info.total_slots_num``); the caller answers 400 and stores nothing.
"""
from __future__ import annotations

import ipaddress
import json
import re
from typing import Annotated, Any, Literal, Optional, Union

import msgspec

# An instance's planes: the server refuses ports below 1024 for them (ServerConfig.port's range)
Port = Annotated[int, msgspec.Meta(ge=1024, le=65535)]
Id = Annotated[int, msgspec.Meta(ge=0, le=2 ** 63 - 1)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2 ** 31 - 1)]  # slots, blocks, lengths: an int32 in MindIE
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
Name = Annotated[str, msgspec.Meta(max_length=256)]
RoleCode = Union[Annotated[int, msgspec.Meta(ge=0, le=255)], Annotated[str, msgspec.Meta(max_length=16)], None]

_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


class RefreshError(ValueError):
    """A refresh body refused: ``field`` is the dotted path, ``message`` says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field, self.message = field, message


class _S(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """MindIE's Controller may send more keys than these: they are ignored, not refused."""


class StaticInfo(_S):
    group_id: Count = 0
    max_seq_len: Count = 0
    max_output_len: Count = 0
    total_slots_num: Count = 0
    total_block_num: Count = 0
    block_size: Count = 0
    label: Annotated[int, msgspec.Meta(ge=0, le=255)] = 0  # 2=P 3=D (0/1 hybrid)
    role: RoleCode = None  # 80='P' 68='D' 85=undefined, or a name


class DynamicInfo(_S):
    avail_slots_num: Count = 0
    avail_block_num: Count = 0
    peers: Annotated[list[Id], msgspec.Meta(max_length=10000)] = []


class Endpoint(_S):
    """The newer Motor's endpoint record."""
    id: Id
    ip: Host
    business_port: Port
    mgmt_port: Optional[Port] = None
    metric_port: Optional[Port] = None


class Record(_S):
    """One ``instances[]`` element: MindIE MS's record, or a holder of ``endpoints``."""
    id: Optional[Id] = None
    ip: Optional[Host] = None
    port: Optional[Port] = None
    business_port: Optional[Port] = None
    mgmt_port: Optional[Port] = None
    metric_port: Optional[Port] = None
    model_name: Name = ""
    role: RoleCode = None
    static_info: Optional[StaticInfo] = None
    dynamic_info: Optional[DynamicInfo] = None
    endpoints: Optional[list[Endpoint]] = None


class Body(_S, kw_only=True):
    event: Literal["add", "del", "set"] = "set"
    ids: Optional[list[Id]] = None
    instances: list[Record]


def check_host(host: str, field: str) -> str:
    """``host`` as given when it is an IP address (IPv6 without brackets) or a DNS host name;
    else ``RefreshError``. Addresses that name no single host (0.0.0.0, ::, multicast) are refused."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        name = host[:-1] if host.endswith(".") else host
        if not name or len(name) > 253 or not all(_LABEL.fullmatch(p) for p in name.split(".")):
            raise RefreshError(field, f"must be an IP address or a host name, got {json.dumps(host)}") from None
        if name.replace(".", "").isdigit():  # "1.2.3" is neither: refused, not resolved as a name
            raise RefreshError(field, f"must be an IP address or a host name, got {json.dumps(host)}")
        return host
    if addr.is_unspecified or addr.is_multicast or (addr.version == 4 and str(addr) == "255.255.255.255"):
        raise RefreshError(field, f"{host} is not the address of one host")
    return host


def _where(path: str) -> str:
    """msgspec's ``$.instances[0].ip`` -> ``instances[0].ip``."""
    return path.lstrip("$").lstrip(".")


def parse(raw: bytes) -> Any:
    """The JSON document (not yet validated), or ``RefreshError``."""
    try:
        doc = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise RefreshError("", f"Request format is invalid: {e}") from None
    if not isinstance(doc, dict):
        raise RefreshError("", "the body must be a JSON object")
    return doc


def count(doc: Any) -> int:
    """How many instance records a parsed document holds: the bound is checked on this before
    any record is validated (a body of a million records costs its parse, nothing more)."""
    items = doc.get("instances") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        return 0
    n = 0
    for it in items:
        eps = it.get("endpoints") if isinstance(it, dict) else None
        n += len(eps) if isinstance(eps, list) else 1
    return n


def validate(doc: Any) -> Body:
    """The typed body, or ``RefreshError`` naming the first field at fault."""
    try:
        # strict=False: MindIE writes numbers as strings ("1025"); "abc" is still refused
        return msgspec.convert(doc, Body, strict=False)
    except msgspec.ValidationError as e:
        m = re.fullmatch(r"(.*?) - at `(.*)`", str(e), re.S)
        what, where = (m.group(1), _where(m.group(2))) if m else (str(e), "")
        what = re.sub(r"^Expected `([^`]+)`, got `([^`]+)`", r"must be \1, got \2", what)
        what = re.sub(r"^Expected `[^`]+` (.+)", r"must be \1", what).replace("that's ", "")
        if what.startswith("Object missing required field"):
            name = what.split("`")[1] if "`" in what else ""
            where, what = f"{where}.{name}" if where else name, "is required"
        elif what.startswith("Invalid enum value"):
            what = 'must be "add", "del" or "set"'
        raise RefreshError(where, what) from None


class Rec(msgspec.Struct, frozen=True):
    """One instance as the refresh describes it, checked."""
    id: int
    ip: str
    business_port: int
    mgmt_port: int
    metric_port: Optional[int]
    model_name: str
    role: Any
    static_info: dict
    dynamic_info: Optional[DynamicInfo]
    where: str  # the field path of its record, for messages


def records(body: Body) -> list[Rec]:
    """Every instance of the body, flattened (``endpoints`` expanded), each checked: an id and an
    ip, a business port and a management port, a host that is an address or a name; no id and
    no endpoint twice."""
    out: list[Rec] = []
    for n, it in enumerate(body.instances):
        where = f"instances[{n}]"
        static = msgspec.to_builtins(it.static_info) if it.static_info is not None else {}
        if it.endpoints is not None:
            for m, ep in enumerate(it.endpoints):
                w = f"{where}.endpoints[{m}]"
                mgmt = ep.mgmt_port or ep.metric_port
                if mgmt is None:
                    raise RefreshError(f"{w}.mgmt_port", "is required: the instance's management port")
                out.append(Rec(ep.id, check_host(ep.ip, f"{w}.ip"), ep.business_port, mgmt, ep.metric_port,
                               it.model_name, it.role, static, it.dynamic_info, w))
            continue
        if it.id is None:
            raise RefreshError(f"{where}.id", "is required")
        if it.ip is None:
            raise RefreshError(f"{where}.ip", "is required")
        port = it.port or it.business_port
        if port is None:
            raise RefreshError(f"{where}.port", "is required (or business_port): the instance's business port")
        mgmt = it.mgmt_port or it.metric_port
        if mgmt is None:
            raise RefreshError(f"{where}.mgmt_port", "is required (or metric_port): the instance's management port")
        out.append(Rec(it.id, check_host(it.ip, f"{where}.ip"), port, mgmt, it.metric_port, it.model_name,
                       it.role, static, it.dynamic_info, where))
    ids: dict[int, str] = {}
    eps: dict[tuple[str, int], str] = {}
    for r in out:
        if r.id in ids:
            raise RefreshError(f"{r.where}.id", f"{r.id} is already {ids[r.id]}'s")
        ids[r.id] = r.where
        key = (r.ip.lower(), r.business_port)
        if key in eps:
            raise RefreshError(f"{r.where}.ip", f"{r.ip}:{r.business_port} is already {eps[key]}'s endpoint")
        eps[key] = r.where
    return out
