"""Is this endpoint a real server instance? Checked before an instance is routed to.

Anything could sit at an address a refresh names: a plain web server answering ``/health`` 200,
another service, or this coordinator itself (requests relayed to itself). An instance is
*admitted* only when its management plane answers the server's own routes in the server's
shape (mindie/api/status.py, health.py):

- ``GET /health``: 200 or 503 (starting, draining); anything else (404, 501, a 200 page of
  something else with ``/v1/config`` missing) refuses it;
- ``GET /v1/config``: a JSON object with ``modelName`` (its first model), ``maxSeqLen`` and
  ``cacheBlockSize``;
- ``GET /v2/status``: a JSON object whose ``resource`` holds the slot and block counts;
- ``GET /v2/models/{model}/getSlotCount``: ``total_slots``;
- ``GET /v1/models`` (its business plane, or its management plane when they share a port) lists
  ``modelName``, and the model the refresh named when it named one (a server may serve several);

and neither of its ports is one of this coordinator's own listeners (by address, and by the
connection's own ends for a name or an address of this host the refresh could not know).
A refused instance is logged with the reason, shown as ``refused`` in ``coordinator_info``, never
routed to, and checked again later (with a back-off: coordinator/registry.py).
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Annotated, Optional

import msgspec

Count = Annotated[int, msgspec.Meta(ge=0)]


class Refused(Exception):
    """The endpoint is not a server instance (or not the one it was routed for): why."""


class _S(msgspec.Struct, forbid_unknown_fields=False):
    pass


class ConfigShape(_S):
    modelName: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    maxSeqLen: Count
    cacheBlockSize: Annotated[int, msgspec.Meta(ge=1)]


class Resource(_S):
    availSlotsNum: Count
    availBlockNum: Count
    waitingRequestNum: Count
    runningRequestNum: Count
    totalNpuBlockNums: Count = 0


class ModelStateShape(_S):
    state: str = ""


class StatusShape(_S):
    resource: Resource
    # a server of several models (or in sleep mode): each model's state (docs/design.md, "Several
    # models"); absent from a one-model server, whose model is always loaded
    models: Optional[dict[str, ModelStateShape]] = None


class SlotsShape(_S):
    total_slots: Count


class _Model(_S):
    id: str


class ModelsShape(_S):
    data: list[_Model]


def shaped(what: str, content: bytes, tp: type):
    """``content`` decoded as ``tp``, else ``Refused`` saying which route answered what."""
    try:
        return msgspec.json.decode(content, type=tp)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        head = content[:60].decode("utf-8", "replace").replace("\n", " ").replace("\r", " ")
        raise Refused(f"{what} is not a MindIE server's answer ({e}; it begins {head!r})") from None


def check_health(status: int) -> None:
    if status not in (200, 503):
        raise Refused(f"GET /health answered {status} (a MindIE server answers 200 or 503)")


# -- this coordinator's own listeners ---------------------------------------------------------
Listener = tuple[str, int, str]  # (ip, port, name) of a predict or manage listener


def _addr(host: str) -> Optional[ipaddress._BaseAddress]:
    try:
        return ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None


def _covers(listen_ip: str, target: ipaddress._BaseAddress, target_is_local: bool) -> bool:
    """Does a listener bound to ``listen_ip`` accept connections to ``target``?"""
    lip = _addr(listen_ip)
    if lip is None:
        return False
    if lip.is_unspecified:  # 0.0.0.0 / ::: every address of this host
        return target_is_local
    return lip == target


def own_by_address(host: str, port: int, own: list[Listener]) -> Optional[str]:
    """The name of this coordinator's listener at ``host:port`` when ``host`` is an address
    that reaches it (a loopback address reaches a 0.0.0.0 listener); None otherwise. A host name
    is resolved at connection time: ``own_by_connection`` checks it then."""
    if host.lower() in ("localhost", "localhost."):
        host = "127.0.0.1"
    a = _addr(host)
    if a is None:
        return None
    for ip, p, name in own:
        if p == port and _covers(ip, a, a.is_loopback):
            return name
    return None


def own_by_connection(sock: Optional[socket.socket], port: int, own: list[Listener]) -> Optional[str]:
    """The listener's name when the connected ``sock`` reached this coordinator itself: the
    peer is one of its listeners' (address, port), where an address of this host shows as the
    socket's own address (the kernel picks the destination as the source for a local one)."""
    if sock is None:
        return None
    try:
        peer, local = sock.getpeername(), sock.getsockname()
    except OSError:
        return None
    a = _addr(peer[0])
    if a is None:
        return None
    local_ip = _addr(local[0])
    is_local = a.is_loopback or (local_ip is not None and a == local_ip)
    for ip, p, name in own:
        if p == peer[1] == port and _covers(ip, a, is_local):
            return name
    return None


async def tcp_probe(host: str, port: int, own: list[Listener], timeout: float) -> None:
    """Connect (TCP only, no request) to ``host:port`` and hang up: the cheap first contact with
    an endpoint not admitted (a closed port costs one refused connect, not an HTTP client's
    request). Raises OSError / TimeoutError when it cannot be reached, ``Refused`` when it is
    this coordinator."""
    loop = asyncio.get_running_loop()
    transport, _ = await asyncio.wait_for(loop.create_connection(asyncio.Protocol, host, port), timeout)
    try:
        name = own_by_connection(transport.get_extra_info("socket"), port, own)
    finally:
        transport.close()
    if name:
        raise Refused(f"{host}:{port} is this coordinator's own {name} port")
