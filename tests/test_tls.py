"""HTTPS and mutual TLS on MindIE's three planes (mindie/runtime/tls.py, mindie/server/listeners.py), with
certificates made at test time (tests/certs.py).

The server test starts the real launcher with split ports (business, management, metrics on
their own listeners, each with its own certificate) and checks: every plane answers over HTTPS
with a client certificate; plain HTTP, no client certificate, a certificate of an unknown CA, a
revoked certificate and TLS 1.1 are refused at the handshake; routes stay on their plane;
SIGHUP loads a renewed certificate and refuses a broken one. Plain HTTP sent to an HTTPS port
gets a plain-HTTP 400 in MindIE's JSON shape (nginx's words), even a client still sending a
large body; a connection that never finishes its handshake is closed at the handshake timeout;
the receive timeouts work inside TLS (408). The unit tests cover every file problem that must
stop the start, each naming its key.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import threading
import time
import warnings
from pathlib import Path

import httpx
import pytest
from cryptography import x509

from mindie.config import load_config
from mindie.server.gunicorn_worker import TLS_HANDSHAKE_TIMEOUT_S
from mindie.server.listeners import plan_listeners
from mindie.runtime.tls import TlsError, check_plane, plane_tls
from tests.certs import NOW, DAY, Pki, pem_cert, pem_key, write
from tests.harness import Server, free_port, free_ports, short_run_dir, write_config


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def client_ctx(pki: Pki, who: str | None = "client", *, max_version=None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.root / "security/ca/ca.pem"))
    if who:
        cert, key, _ = getattr(pki, who)
        ctx.load_cert_chain(cert, key)
    if max_version:
        ctx.maximum_version = max_version
    return ctx


def handshake(port: int, ctx: ssl.SSLContext, host: str = "127.0.0.1") -> x509.Certificate:
    """A TLS handshake (plus one request, since TLS 1.3 reports a refused client certificate
    only after the client's side finished); returns the server's certificate."""
    with socket.create_connection((host, port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as s:
            der = s.getpeercert(binary_form=True)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            if not s.recv(1):
                raise ConnectionError("closed without an answer")
    return x509.load_der_x509_certificate(der)


def read_to_end(s: socket.socket, bound: float) -> tuple[bytes, float]:
    """What ``s`` receives until the server closes it (a reset ends it too), and when that was
    (seconds from now); fails after ``bound`` seconds."""
    t0 = time.monotonic()
    out = b""
    while True:
        left = bound - (time.monotonic() - t0)
        assert left > 0, f"still open after {bound} s: {out[:200]!r}"
        s.settimeout(left)
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return out, time.monotonic() - t0
        out += chunk


def plain_http(port: int, data: bytes, host: str = "127.0.0.1") -> bytes:
    """``data`` sent in plain text (all of it: the server must read while the client sends), then
    everything the server answers until it closes."""
    with socket.create_connection((host, port), timeout=15) as s:
        s.sendall(data)
        return read_to_end(s, 15)[0]


PLAIN_400 = (b'{"error":"The plain HTTP request was sent to HTTPS port.","error_type":"Bad Request"}')


def never_finish(port: int, first: bytes, out: list) -> None:
    """A client that opens a connection to the TLS port, sends ``first`` (maybe nothing, maybe
    part of a ClientHello) and waits: appends (bytes received, seconds until closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        if first:
            s.sendall(first)
        out.append(read_to_end(s, TLS_HANDSHAKE_TIMEOUT_S + 10))


def refused(port: int, ctx: ssl.SSLContext, host: str = "127.0.0.1") -> bool:
    try:
        handshake(port, ctx, host)
    except (ssl.SSLError, ConnectionError, OSError):
        return True
    return False


# -- the server ----------------------------------------------------------------------------------
def test_https_and_mutual_tls_on_three_planes(tmp_path: Path, pki: Pki, demo_model: str) -> None:
    ports = free_ports(3)
    cfg = write_config(pki.root / "config.json", port=ports[0], run_dir=short_run_dir(), model_path=demo_model,
                       workers=1, server={"managementIpAddress": "127.0.0.2", "managementPort": ports[1],
                                          "metricsPort": ports[2], "headTimeoutS": 2, **pki.server_config()})
    srv = Server(cfg, ports[0], tls=client_ctx(pki), health_url=f"https://127.0.0.2:{ports[1]}/health")
    try:
        srv.wait_ready()
        # Connections that never finish a handshake (nothing sent; half a ClientHello): closed at
        # the handshake timeout, while everything below goes on.
        stalled: list = []
        stallers = [threading.Thread(target=never_finish, args=(ports[0], first, stalled))
                    for first in (b"", b"\x16\x03\x01\x02")]
        for t in stallers:
            t.start()
        ok = client_ctx(pki)
        biz, mgmt, met = f"https://127.0.0.1:{ports[0]}", f"https://127.0.0.2:{ports[1]}", f"https://127.0.0.2:{ports[2]}"
        with httpx.Client(verify=ok, timeout=30) as c:
            r = c.post(biz + "/infer_token", json={"input_id": [5, 6, 7], "parameters": {"max_new_tokens": 3}})
            assert r.status_code == 200 and r.json()["generated_text"], r.text
            assert c.get(biz + "/v1/models").json()["data"][0]["id"] == "demo"
            assert c.get(mgmt + "/health").status_code == 200
            assert c.get(mgmt + "/v2/health/ready").status_code == 200
            assert "request_received_total" in c.get(met + "/metrics").text
            # Each route only on its plane.
            assert c.get(biz + "/health").status_code == 404
            assert c.get(biz + "/metrics").status_code == 404
            assert c.get(mgmt + "/v1/models").status_code == 404
            assert c.post(mgmt + "/infer_token", json={"input_id": [5]}).status_code == 404
            assert c.get(met + "/health").status_code == 404
        # Each plane presents its own certificate.
        for port, host, plane in ((ports[0], "127.0.0.1", "business"), (ports[1], "127.0.0.2", "management"),
                                  (ports[2], "127.0.0.2", "metrics")):
            assert handshake(port, ok, host).serial_number == getattr(pki, f"{plane}_cert").serial_number
            # Refused at the handshake: no client certificate, an unknown CA, a revoked one, TLS 1.1.
            assert refused(port, client_ctx(pki, None), host), plane
            assert refused(port, client_ctx(pki, "stranger"), host), plane
            assert refused(port, client_ctx(pki, "revoked"), host), plane
            assert refused(port, client_ctx(pki, "client", max_version=ssl.TLSVersion.TLSv1_2), host) is False
        old = client_ctx(pki)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            old.minimum_version = old.maximum_version = ssl.TLSVersion.TLSv1_1
        try:
            assert refused(ports[0], old)
        except ssl.SSLError:
            pass  # this OpenSSL cannot even offer TLS 1.1: refused all the same
        # With TLS 1.2 the refusal is in the handshake itself.
        with pytest.raises(ssl.SSLError):
            with socket.create_connection(("127.0.0.1", ports[0]), timeout=10) as raw:
                ctx = client_ctx(pki, "revoked", max_version=ssl.TLSVersion.TLSv1_2)
                ctx.wrap_socket(raw, server_hostname="127.0.0.1").close()
        # Plain HTTP on a TLS port: a plain-HTTP 400 saying so, on every plane, in MindIE's shape.
        for port, host in ((ports[0], "127.0.0.1"), (ports[1], "127.0.0.2"), (ports[2], "127.0.0.2")):
            r = httpx.get(f"http://{host}:{port}/v1/models", timeout=10)
            assert r.status_code == 400 and r.headers["content-type"] == "application/json", r
            assert r.content == PLAIN_400
        # ...also for a client that is still sending (an 8 MiB body, more than the socket buffers
        # hold: the server reads it away, instead of a reset that would lose the answer).
        size = 8 << 20
        answer = plain_http(ports[0], b"POST /infer_token HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size
                            + b" " * size)
        assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n") and answer.endswith(b"\r\n\r\n" + PLAIN_400), answer
        # Inside TLS, a request head that does not come in headTimeoutS (2 s) is answered 408.
        with socket.create_connection(("127.0.0.1", ports[0]), timeout=10) as raw:
            with ok.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
                got, took = read_to_end(s, 10)
        assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), got
        assert got.endswith(b'{"error":"The request head was not received within 2 s.","error_type":"Request Timeout"}')
        assert 1.5 < took < 5, took
        for t in stallers:
            t.join(TLS_HANDSHAKE_TIMEOUT_S + 15)
        assert len(stalled) == 2, stalled
        for got, took in stalled:
            assert got == b"" and TLS_HANDSHAKE_TIMEOUT_S - 1 < took < TLS_HANDSHAKE_TIMEOUT_S + 5, stalled

        # SIGHUP: a renewed certificate is served by the new front ends...
        cert_path = pki.root / "security/certs/business/server.pem"
        key_path = pki.root / "security/keys/business/server.key.pem"
        original = (cert_path.read_bytes(), key_path.read_bytes())
        new_cert, new_key = pki.ca.issue("business-renewed", server=True)
        write(key_path, pem_key(new_key))
        write(cert_path, pem_cert(new_cert), 0o644)
        srv.proc.send_signal(signal.SIGHUP)
        assert _serial_becomes(ports[0], ok, new_cert.serial_number), srv.tail()
        # ...and a broken one is refused: the server keeps serving the last good one.
        write(cert_path, b"not a certificate\n", 0o644)
        srv.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while "reload refused" not in srv.tail(200) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "reload refused" in srv.tail(200) and "ServerConfig.tlsCert" in srv.tail(200)
        time.sleep(1)
        assert handshake(ports[0], ok).serial_number == new_cert.serial_number
        assert srv.proc.poll() is None
        write(cert_path, original[0], 0o644)
        write(key_path, original[1])
    finally:
        assert srv.stop() == 0, srv.tail()


def _serial_becomes(port: int, ctx: ssl.SSLContext, serial: int, timeout: float = 40.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if handshake(port, ctx).serial_number == serial:
                return True
        except OSError:
            pass  # between the old front end and the new one
        time.sleep(0.3)
    return False


def test_a_bad_tls_file_stops_the_start_naming_the_key(tmp_path: Path, pki: Pki, demo_model: str) -> None:
    port = free_port()
    server = {**pki.server_config(), "tlsPk": "security/keys/none.pem"}
    cfg = write_config(pki.root / "bad.json", port=port, run_dir=short_run_dir(), model_path=demo_model,
                       workers=1, server=server)
    srv = Server(cfg, port)
    assert srv.proc.wait(60) == 2
    srv.log.close()
    log = srv.log_path.read_text()
    assert "ServerConfig.tlsPk:" in log and "does not exist" in log, log[-2000:]
    # A world-readable key, on the management plane this time.
    key = pki.root / "security/keys/management/server.key.pem"
    os.chmod(key, 0o644)
    try:
        cfg = write_config(pki.root / "bad2.json", port=port, run_dir=short_run_dir(), model_path=demo_model,
                           workers=1, server={**pki.server_config(), "managementPort": free_port()})
        srv = Server(cfg, port)
        assert srv.proc.wait(60) == 2
        srv.log.close()
        log = srv.log_path.read_text()
        assert "ServerConfig.managementTlsPk:" in log and "mode 0644" in log, log[-2000:]
    finally:
        os.chmod(key, 0o600)


def test_plain_http_quick_start_is_unchanged() -> None:
    """No config file: plain HTTP on loopback, planes on MindIE's default ports."""
    li = plan_listeners(load_config(env={}).config.server)
    assert [(x.host, x.port, x.planes, x.tls) for x in li] == [
        ("127.0.0.1", 1025, ("business",), None), ("127.0.0.2", 1026, ("management",), None),
        ("127.0.0.2", 1027, ("metrics",), None)]


@pytest.mark.parametrize("ports, merged", [
    ((2000, 2000, 2000), [("business", "management", "metrics")]),
    ((2000, 2000, 2001), [("business", "management"), ("metrics",)]),
    ((2000, 2001, 2001), [("business",), ("management", "metrics")]),
    ((2000, 2001, 2002), [("business",), ("management",), ("metrics",)]),
])
def test_planes_merge_when_ports_are_equal(tmp_path: Path, ports, merged) -> None:
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"ServerConfig": {"port": ports[0], "managementPort": ports[1], "metricsPort": ports[2]}}))
    assert [x.planes for x in plan_listeners(load_config(str(p), env={}).config.server)] == merged


# -- file checks, each naming its key --------------------------------------------------------------
def _plane(pki: Pki, tmp_path: Path, plane: str = "business", **server) -> object:
    p = pki.root / f"unit-{plane}-{len(list(pki.root.glob('unit-*')))}.json"
    p.write_text(json.dumps({"ServerConfig": {**pki.server_config(), **server}}))
    return plane_tls(load_config(str(p), env={}).config.server, plane)


def _fails(t, key: str, words: str) -> None:
    with pytest.raises(TlsError) as e:
        check_plane(t)
    assert e.value.key == key and words in str(e.value), str(e.value)


def test_good_files_load(pki: Pki, tmp_path: Path) -> None:
    for plane in ("business", "management", "metrics"):
        ctx, said = check_plane(_plane(pki, tmp_path, plane))
        assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.minimum_version == ssl.TLSVersion.TLSv1_2
        assert ctx.verify_flags & ssl.VERIFY_CRL_CHECK_LEAF
        assert said == []


def test_missing_and_unreadable_files(pki: Pki, tmp_path: Path) -> None:
    _fails(_plane(pki, tmp_path, tlsCert="security/none.pem"), "ServerConfig.tlsCert", "does not exist")
    _fails(_plane(pki, tmp_path, "metrics", metricsTlsPk="nope.pem"), "ServerConfig.metricsTlsPk", "does not exist")
    _fails(_plane(pki, tmp_path, tlsCaFile=["nope.pem"]), "ServerConfig.tlsCaFile", "does not exist")
    _fails(_plane(pki, tmp_path, "management", managementTlsCaFile=["x.pem"]), "ServerConfig.managementTlsCaFile",
           "does not exist")
    _fails(_plane(pki, tmp_path, tlsCrlFiles=["nope.pem"]), "ServerConfig.tlsCrlFiles", "does not exist")
    if os.getuid() != 0:  # root reads anything
        key = pki.root / "security/keys/business/server.key.pem"
        os.chmod(key, 0o000)
        try:
            _fails(_plane(pki, tmp_path), "ServerConfig.tlsPk", "cannot read")
        finally:
            os.chmod(key, 0o600)


def test_permissions(pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = pki.root / "security/keys/business/server.key.pem"
    cert = pki.root / "security/certs/business/server.pem"
    try:
        os.chmod(key, 0o644)
        _fails(_plane(pki, tmp_path), "ServerConfig.tlsPk", "mode 0644")
        monkeypatch.setenv("MINDIE_TLS_CHECK_PERMISSIONS", "0")
        check_plane(_plane(pki, tmp_path))  # the documented override
        monkeypatch.delenv("MINDIE_TLS_CHECK_PERMISSIONS")
        os.chmod(key, 0o640)
        check_plane(_plane(pki, tmp_path))  # group-readable is fine (ssl-cert group)
        os.chmod(cert, 0o666)
        _fails(_plane(pki, tmp_path), "ServerConfig.tlsCert", "mode 0666")
    finally:
        os.chmod(key, 0o600)
        os.chmod(cert, 0o644)


def test_expired_not_yet_valid_and_mismatched(pki: Pki, tmp_path: Path) -> None:
    d = tmp_path / "sec"
    expired, k1 = pki.ca.issue("old", server=True, not_before=NOW - 10 * DAY, not_after=NOW - DAY)
    future, k2 = pki.ca.issue("new", server=True, not_before=NOW + DAY, not_after=NOW + 10 * DAY)
    write(d / "expired.pem", pem_cert(expired), 0o644)
    write(d / "expired.key", pem_key(k1))
    write(d / "future.pem", pem_cert(future), 0o644)
    write(d / "future.key", pem_key(k2))
    _fails(_plane(pki, tmp_path, tlsCert=str(d / "expired.pem"), tlsPk=str(d / "expired.key")),
           "ServerConfig.tlsCert", "expired")
    _fails(_plane(pki, tmp_path, tlsCert=str(d / "future.pem"), tlsPk=str(d / "future.key")),
           "ServerConfig.tlsCert", "not valid before")
    _fails(_plane(pki, tmp_path, tlsPk=str(d / "expired.key")), "ServerConfig.tlsPk", "does not match")
    write(d / "garbage.pem", b"-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n", 0o644)
    _fails(_plane(pki, tmp_path, tlsCert=str(d / "garbage.pem")), "ServerConfig.tlsCert", "no PEM certificate")
    soon, k3 = pki.ca.issue("soon", server=True, not_after=NOW + 5 * DAY)
    write(d / "soon.pem", pem_cert(soon), 0o644)
    write(d / "soon.key", pem_key(k3))
    _, said = check_plane(_plane(pki, tmp_path, tlsCert=str(d / "soon.pem"), tlsPk=str(d / "soon.key")))
    assert any("expires on" in w for w in said)


def test_encrypted_key_with_a_password_file(pki: Pki, tmp_path: Path) -> None:
    d = tmp_path / "enc"
    cert, key = pki.ca.issue("enc", server=True)
    write(d / "server.pem", pem_cert(cert), 0o644)
    write(d / "server.key.pem", pem_key(key, b"s3cret"))
    write(d / "key_pwd.txt", b"s3cret\n")
    write(d / "wrong_pwd.txt", b"nope\n")
    base = {"tlsCert": str(d / "server.pem"), "tlsPk": str(d / "server.key.pem")}
    check_plane(_plane(pki, tmp_path, **base, tlsPkPwd=str(d / "key_pwd.txt")))
    _fails(_plane(pki, tmp_path, **base), "ServerConfig.tlsPk", "is encrypted")
    _fails(_plane(pki, tmp_path, **base, tlsPkPwd=str(d / "wrong_pwd.txt")), "ServerConfig.tlsPkPwd", "wrong password")
    os.chmod(d / "key_pwd.txt", 0o644)
    _fails(_plane(pki, tmp_path, **base, tlsPkPwd=str(d / "key_pwd.txt")), "ServerConfig.tlsPkPwd", "mode 0644")


def test_server_only_tls_is_said_and_crl_needs_a_ca(pki: Pki, tmp_path: Path) -> None:
    ctx, said = check_plane(_plane(pki, tmp_path, tlsCaFile=[], tlsCrlFiles=[]))
    assert ctx.verify_mode == ssl.CERT_NONE and any("no mutual TLS" in w for w in said)
    _fails(_plane(pki, tmp_path, tlsCaFile=[]), "ServerConfig.tlsCrlFiles", "need CA files")
