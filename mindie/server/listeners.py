"""The HTTP listeners of a server: MindIE's three planes, merged where their ports are equal.

- business: ``ipAddress:port`` (inference and model queries),
- management: ``managementIpAddress:managementPort`` (health probes),
- metrics: ``managementIpAddress:metricsPort`` (Prometheus ``/metrics``).

Planes that share a port are served by one listener with the union of their routes (MindIE's
ALL_SAME, BUSINESS_MANAGEMENT_SAME, MANAGEMENT_METRICS_SAME and ALL_DIFFERENT cases; a business
port equal to the metrics port alone merges those two the same way). A merged listener binds the
address of its first plane (business, then management) and uses that plane's TLS files.

``mindie.ops.launch_plan`` writes the plan to ``<runDir>/listeners.json``; gunicorn binds what it lists
(deploy/gunicorn.conf.py) and every front end serves each socket with its planes' routes and its
TLS context (mindie/server/gunicorn_worker.py, mindie/server/app.py).
"""
from __future__ import annotations

import os
from typing import Optional

import msgspec

from mindie.runtime.tls import PlaneTls, plane_tls

PLANES = ("business", "management", "metrics")
LISTENERS_FILE = "listeners.json"


class Listener(msgspec.Struct, kw_only=True, frozen=True):
    host: str
    port: int
    planes: tuple[str, ...]
    tls: Optional[PlaneTls] = None  # None = plain HTTP

    @property
    def bind(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.bind}"


def plan_listeners(server) -> list[Listener]:
    """The listeners of a loaded ``ServerConfig``."""
    wanted = (("business", server.ip_address, server.port),
              ("management", server.management_ip_address, server.management_port),
              ("metrics", server.management_ip_address, server.metrics_port))
    by_port: dict[int, tuple[str, list[str]]] = {}
    for plane, addr, port in wanted:
        by_port.setdefault(port, (addr, []))[1].append(plane)
    out = []
    for port, (addr, planes) in by_port.items():
        tls = plane_tls(server, planes[0]) if server.https_enabled else None
        out.append(Listener(host=addr, port=port, planes=tuple(planes), tls=tls))
    return out


def listeners_path(run_dir: str) -> str:
    return os.path.join(run_dir, LISTENERS_FILE)


def write_listeners(listeners: list[Listener], run_dir: str) -> str:
    path = listeners_path(run_dir)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(listeners)))
    os.replace(tmp, path)
    return path


def read_listeners(path: str) -> list[Listener]:
    with open(path, "rb") as f:
        return msgspec.json.decode(f.read(), type=list[Listener])
