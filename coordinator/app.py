"""The coordinator's parts wired together: config -> registry + poller, router, relay (predict
port), management API (manage port), metrics. One ``Coordinator`` per process."""
from __future__ import annotations

import logging
import ssl
import time
from typing import Any, Optional

import httpx

from coordinator.config import CoordinatorConfig, TlsItems
from coordinator.registry import Instance, Poller, Registry

log = logging.getLogger("mindie.coordinator")


def _client_context(items: TlsItems, plane: str) -> ssl.SSLContext:
    """A client context for talking to instances: their CA, and our certificate when given
    (mutual TLS). Raises ``TlsError`` naming the key of a file that cannot be used."""
    from mindie.runtime.tls import TlsError
    k = f"tls_config.{plane}_tls_items"
    key = f"{k}.ca_cert"
    try:
        ctx = ssl.create_default_context(cafile=items.ca_cert or None)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if items.tls_cert:
            password = None
            if items.tls_passwd:
                key = f"{k}.tls_passwd"
                with open(items.tls_passwd, "rb") as f:
                    password = f.read().rstrip(b"\r\n")
            key = f"{k}.tls_cert"
            ctx.load_cert_chain(items.tls_cert, items.tls_key or None, password=password)
        if items.tls_crl:
            key = f"{k}.tls_crl"
            ctx.load_verify_locations(cafile=items.tls_crl)
            ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    except (OSError, ssl.SSLError) as e:
        raise TlsError(key, f"{type(e).__name__}: {e}") from None
    return ctx


def _server_context(items: TlsItems, plane: str, prefix: str) -> ssl.SSLContext:
    """A checked server context (mindie/runtime/tls.py's checks) for the predict or manage listener."""
    from mindie.runtime.tls import PlaneTls, server_context
    k = f"tls_config.{prefix}_tls_items"
    return server_context(PlaneTls(
        plane=plane, cert=items.tls_cert, key=items.tls_key, key_password_file=items.tls_passwd,
        ca_files=[items.ca_cert] if items.ca_cert else [], crl_files=[items.tls_crl] if items.tls_crl else [],
        cert_key=f"{k}.tls_cert", key_key=f"{k}.tls_key", password_key=f"{k}.tls_passwd",
        ca_key=f"{k}.ca_cert", crl_key=f"{k}.tls_crl"))


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.started = time.time()
        self.stopping = False  # /stopService was called: new requests get 503
        self.request_stop = lambda: None  # set by the process (coordinator/server.py)
        t = config.tls_config
        e = config.exception_config
        self.registry = Registry(e.breakerFailures, e.breakerOpenMs / 1000.0, t.mindie_client_tls_enable,
                                 t.mindie_mangment_tls_enable, config.digs_scheduler_config.max_res_num)
        for rec in config.instances:
            self.registry.add(Instance(id=rec.id, ip=rec.ip, business_port=rec.business_port,
                                       mgmt_port=rec.mgmt_port, metric_port=rec.metric_port, source="config",
                                       role_given=rec.role))
        self.business_ssl = (_client_context(t.mindie_client_tls_items, "mindie_client")
                             if t.mindie_client_tls_enable else None)
        self.mgmt_ssl = (_client_context(t.mindie_mangment_tls_items, "mindie_mangment")
                         if t.mindie_mangment_tls_enable else None)
        h = config.http_config
        headers = {"User-Agent": h.user_agent}
        # No pool limit: each relayed stream holds one upstream connection (thousands at once).
        # httpx: the coordinator's own calls (polls, metrics, stopInfer), bounded by http_timeout_seconds
        timeout = httpx.Timeout(h.http_timeout_seconds or None, connect=5.0)
        self.business = httpx.AsyncClient(verify=self.business_ssl or True, headers=headers, timeout=timeout,
                                          limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        from coordinator.upstream import Pool
        # the relay's own client (coordinator/upstream.py)
        self.pool = Pool(self.business_ssl, connect_timeout=5.0)
        self.mgmt = httpx.AsyncClient(verify=self.mgmt_ssl or True, headers=headers, timeout=timeout,
                                      limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self.poller = Poller(self.registry, self.mgmt, h.pollIntervalMs / 1000.0, h.http_timeout_seconds,
                             business=self.business, own=self.own_listeners())
        from coordinator.metrics import CoordinatorMetrics
        from coordinator.router import Router
        from coordinator.relay import Relay
        from coordinator.manage import manage_app
        self.metrics = CoordinatorMetrics(self)
        self.router = Router(config, self.registry, self.metrics)
        self.relay = Relay(self)
        self.manage = manage_app(self)

    def listeners(self) -> list[tuple[str, Any, str, int, Optional[ssl.SSLContext]]]:
        """(name, ASGI app, ip, port, server TLS context or None) of the predict and manage listeners."""
        h, t = self.config.http_config, self.config.tls_config
        pred = _server_context(t.request_server_tls_items, "predict", "request_server") \
            if t.request_server_tls_enable else None
        man = _server_context(t.controller_server_tls_items, "manage", "controller_server") \
            if t.controller_server_tls_enable else None
        return [("predict", self.relay, h.predict_ip, h.predict_port, pred),
                ("manage", self.manage, h.manage_ip, h.manage_port, man)]

    def own_listeners(self) -> list[tuple[str, int, str]]:
        """(ip, port, name) of this coordinator's listeners: never an instance (admission_check.py)."""
        h = self.config.http_config
        return [(h.predict_ip, h.predict_port, "predict"), (h.manage_ip, h.manage_port, "manage")]

    def url(self, name: str) -> str:
        h, t = self.config.http_config, self.config.tls_config
        if name == "predict":
            return f"{'https' if t.request_server_tls_enable else 'http'}://{h.predict_ip}:{h.predict_port}"
        return f"{'https' if t.controller_server_tls_enable else 'http'}://{h.manage_ip}:{h.manage_port}"

    async def start(self) -> None:
        """The first poll before the listeners open, so a restarted coordinator routes at once
        (bounded: an instance that does not answer within a poll's deadline is left to the poller)."""
        await self.poller.poll_all(wait_s=self.poller.timeout_s + 1.0)
        self.poller.start()

    async def stop(self) -> None:
        await self.poller.stop()
        await self.business.aclose()
        self.pool.close()
        await self.mgmt.aclose()

    def relay_stats(self) -> dict:
        """MindIE's request_length_info: the mean input length in tokens, estimated from the
        bodies' characters with string_token_rate (output lengths are not seen by the relay: 0)."""
        n = max(1, self.relay.received)
        return {"input_len": int(self.relay.input_chars / n / self.config.string_token_rate), "output_len": 0}

    def announce_ready_line(self) -> None:
        insts = ", ".join(f"{i.id} {i.host}:{i.business_port} {i.state()}" for i in self.registry.instances.values())
        n = len(self.registry.instances)
        d = self.config.digs_scheduler_config
        if d.deploy_mode != "single_node":
            insts = ", ".join(f"{i.id} {i.host}:{i.business_port} {i.role} {i.state()}"
                              for i in self.registry.instances.values())
        log.info("mindie-coordinator ready: predict %s, manage %s | %s | %d instance%s%s", self.url("predict"),
                 self.url("manage"), d.algorithm_type if d.deploy_mode == "single_node"
                 else f"{d.deploy_mode} {d.algorithm_type}", n, "s" * (n != 1),
                 f": {insts}" if insts else "")
