"""Health probe of a coordinator's manage listener: ``scripts/health_check.sh --coordinator``,
``python -m coordinator.probe`` and ``mindie-probe --coordinator`` (through the
``mindie.probe_targets`` entry point: the server's probe imports nothing of the coordinator).

The target is read from the coordinator's ``ms_coordinator.json`` by the coordinator's own loader
(``--config FILE``, else ``$MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH``, else its defaults):
``http_config.manage_ip``/``manage_port``, HTTPS with ``tls_config.controller_server_tls_enable``
(trusting its ``ca_cert``). The modes, exit statuses and TLS flags are the server probe's
(``mindie/ops/probe.py``): startup -> ``GET /v1/startup``, liveness -> ``GET /v1/health``,
readiness -> ``GET /v1/readiness``.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from mindie.config import ConfigError
from mindie.ops import probe as server_probe
from coordinator.config import load


class _ManageTls:
    """The manage listener's TLS as the probe's client_context() reads a plane's (its CA files,
    the key naming them)."""

    def __init__(self, ca_cert: str):
        self.ca_files = [ca_cert] if ca_cert else []
        self.ca_key = "tls_config.controller_server_tls_items.ca_cert"


def coordinator_target(config_path: Optional[str], env=os.environ) -> server_probe.Target:
    """The coordinator's manage listener, from its ms_coordinator.json."""
    if config_path is None:
        config_path = env.get(server_probe.COORDINATOR_CONFIG_ENV, "").strip() or None
    try:
        c = load(config_path, env=env).config
    except (ConfigError, OSError) as e:
        raise server_probe.ProbeFailure(server_probe.USAGE, f"config error: {e}") from None
    h, t = c.http_config, c.tls_config
    tls = _ManageTls(t.controller_server_tls_items.ca_cert) if t.controller_server_tls_enable else None
    return server_probe.Target(server_probe.connect_host(h.manage_ip), h.manage_port, tls, h.manage_ip)


def main(argv: Optional[list[str]] = None) -> int:
    """``--coordinator`` implied: the probe's command line with this resolver."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--coordinator" not in args:
        args.insert(0, "--coordinator")
    return server_probe.main(args, coordinator_target=coordinator_target)


if __name__ == "__main__":
    sys.exit(main())
