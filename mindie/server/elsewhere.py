"""404s that say where a route lives (issue 52 finding 9).

With the planes on separate ports (mindie/server/listeners.py), a probe sent to the business port
(``/health``, ``/v2/health/ready``, ...) used to get a bare 404, and an operator had no hint that
the probes answer on ``managementIpAddress:managementPort``. Each listener here gets, for every path
another listener serves and it does not, a resource whose every method answers MindIE's 404 shape
naming the plane, its address and the config keys that set it. Common probe names that no plane
serves (``/v1/health``, ``/healthz``, ...) get the same answer pointing at the management plane's
probes.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from mindie.contract.http_error import ApiError
from mindie.server.listeners import Listener

# The config keys that place each plane (ServerConfig).
PLANE_KEYS = {"business": "ipAddress:port", "management": "managementIpAddress:managementPort",
              "metrics": "managementIpAddress:metricsPort"}
# Probe paths other servers use, served by no plane here: pointed at the management plane's probes.
PROBE_ALIASES = ("/v1/health", "/healthz", "/livez", "/readyz", "/ping", "/v2/health")
PROBES = ("/health", "/v2/health/live", "/v2/health/ready")


class Elsewhere:
    """Answers every method with a 404 saying which plane serves the path, and where."""

    def __init__(self, plane: str, url: str, probe_alias: bool = False):
        self.plane = plane
        self.url = url
        self.probe_alias = probe_alias

    def message(self, path: str) -> str:
        where = f"the {self.plane} plane at {self.url} (ServerConfig {PLANE_KEYS[self.plane]})"
        if self.probe_alias:
            return (f"{path} is not a route of this server; the health probes "
                    f"({', '.join(PROBES)}) are served by {where}.")
        return f"{path} is not served on this port; it is served by {where}: {self.url}{path}"

    async def _answer(self, req: Any, resp: Any, **_: Any) -> None:
        raise ApiError(404, self.message(req.path))

    on_get = on_head = on_post = on_put = on_delete = on_patch = _answer


def elsewhere_routes(routes: dict[str, Sequence[tuple[str, object, str | None]]], listeners: Iterable[Listener],
                     here: Listener) -> list[tuple[str, object, None]]:
    """The (path, Elsewhere, None) routes for listener ``here``: every path of another listener's
    planes that ``here`` does not serve, plus the probe aliases when no plane serves them."""
    own = {path for plane in here.planes for path, _, _ in routes[plane]}
    out: list[tuple[str, object, None]] = []
    taken = set(own)
    for other in listeners:
        if other.port == here.port:
            continue
        for plane in other.planes:
            for path, _, _ in routes[plane]:
                if path not in taken:
                    taken.add(path)
                    out.append((path, Elsewhere(plane, other.url), None))
    served = {path for plane_routes in routes.values() for path, _, _ in plane_routes}
    mgmt = next((li for li in listeners if "management" in li.planes), None)
    if mgmt is not None:
        for path in PROBE_ALIASES:
            if path not in served and path not in taken:
                out.append((path, Elsewhere("management", mgmt.url, probe_alias=True), None))
    return out
