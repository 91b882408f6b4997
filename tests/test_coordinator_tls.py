"""tls_config on both sides: the predict and manage listeners speak HTTPS with client
certificates (request_server, controller_server), and the coordinator reaches an HTTPS instance
with mutual TLS on its business and management planes (mindie_client, mindie_mangment)."""
from __future__ import annotations

import ssl

import httpx
import pytest

from tests.certs import Pki
from tests.coord_harness import Coordinator
from tests.harness import Server, free_port, short_run_dir, write_config


def test_tls_both_sides(tmp_path):
    pki = Pki(tmp_path)
    ca = str(tmp_path / "security" / "ca" / "ca.pem")
    client = ssl.create_default_context(cafile=ca)
    client.load_cert_chain(pki.client[0], pki.client[1])
    port = free_port()
    cfg = write_config(tmp_path / "config.json", port=port, run_dir=short_run_dir(), workers=1,
                       server=pki.server_config())
    srv = Server(cfg, port, tls=client)
    coord = None
    try:
        srv.wait_ready(180)
        items = {"business": {"ca_cert": "security/ca/ca.pem", "tls_cert": "security/certs/business/server.pem",
                              "tls_key": "security/keys/business/server.key.pem"},
                 "management": {"ca_cert": "security/ca/ca.pem", "tls_cert": "security/certs/management/server.pem",
                                "tls_key": "security/keys/management/server.key.pem"},
                 "client": {"ca_cert": "security/ca/ca.pem", "tls_cert": "clients/client.pem",
                            "tls_key": "clients/client.key.pem"}}
        coord = Coordinator(tmp_path, [srv], tls=client, config={"tls_config": {
            "request_server_tls_enable": True, "request_server_tls_items": items["business"],
            "controller_server_tls_enable": True, "controller_server_tls_items": items["management"],
            "mindie_client_tls_enable": True, "mindie_client_tls_items": items["client"],
            "mindie_mangment_tls_enable": True, "mindie_mangment_tls_items": items["client"]}})
        coord.wait_ready()  # over HTTPS: the instance was polled over mutual TLS
        assert "predict https://127.0.0.1:" in coord.wait_ready_line()
        body = {"inputs": "hello there", "parameters": {"max_new_tokens": 4}}
        via = httpx.post(coord.url + "/infer", json=body, timeout=60, verify=client)
        assert via.status_code == 200, via.text
        assert via.json() == httpx.post(srv.url + "/infer", json=body, timeout=60, verify=client).json()
        # no client certificate: the predict listener refuses the handshake
        bare = ssl.create_default_context(cafile=ca)
        with pytest.raises(httpx.HTTPError):
            httpx.post(coord.url + "/infer", json=body, timeout=10, verify=bare)
        with pytest.raises(httpx.HTTPError):
            httpx.get(coord.manage + "/v1/health", timeout=10, verify=bare)
    finally:
        if coord is not None:
            coord.stop()
        srv.stop()


def test_tls_refused_at_start_naming_the_key(tmp_path):
    """A TLS file the server's checks refuse (here: missing) stops the coordinator with exit 1
    and the key named."""
    coord = Coordinator(tmp_path, [], config={"tls_config": {
        "request_server_tls_enable": True,
        "request_server_tls_items": {"tls_cert": "nope/cert.pem", "tls_key": "nope/key.pem"}}})
    assert coord.proc.wait(30) == 1
    coord.log.close()
    text = coord.log_path.read_text()
    assert "TLS refused: tls_config.request_server_tls_items.tls_cert: " in text and "Traceback" not in text, text
