"""scripts/health_check.sh and scripts/prestop.sh (mindie/ops/probe.py) against the real launcher
(tests/harness.py) and against stand-ins for the states a real server is hard to hold in
(a socket that never answers, one that trickles, canned 503 bodies).

Exit statuses (mindie/ops/probe.py): 0 healthy, 1 unhealthy, 2 usage/config, 3 not running,
4 timeout, 5 TLS error, 6 starting, 7 stopped, 8 busy.

Needs the management routes /health/timed-N and /stopService (MindIE semantics, mindie.md
§2.3): test_timed_probe_runs_an_inference, test_https_and_mutual_tls_then_stop_service_and_prestop
and test_prestop_drains_in_flight_requests_and_leaves_nothing fail until they exist.
"""
from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from mindie.ops import probe
from tests.certs import Pki
from tests.harness import ROOT, Server, free_port, free_ports, process_roles, short_run_dir, wait_gone, write_config

pytestmark = pytest.mark.timeout(300)

HEALTH_CHECK = ROOT / "scripts" / "health_check.sh"
PRESTOP = ROOT / "scripts" / "prestop.sh"


class Result:
    def __init__(self, proc: subprocess.CompletedProcess, elapsed: float):
        self.rc, self.stdout, self.stderr, self.elapsed = proc.returncode, proc.stdout, proc.stderr, elapsed

    @property
    def line(self) -> str:
        return (self.stdout + self.stderr).strip()

    def __repr__(self) -> str:
        return f"rc={self.rc} in {self.elapsed:.2f} s: {self.line!r}"


def run_script(script: Path, *args: str, env: dict | None = None, timeout: float = 120) -> Result:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MIES_", "MINDIE_"))}
    e["PYTHON"] = sys.executable
    e.update(env or {})
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=e, timeout=timeout,
                          cwd="/")  # not the repository: the scripts must find it themselves
    return Result(proc, time.monotonic() - t0)


def check(config: Path | None, *args: str, **kw) -> Result:
    return run_script(HEALTH_CHECK, *(["--config", str(config)] if config else []), *args, **kw)


def one_line(r: Result) -> None:
    assert len(r.line.splitlines()) == 1, r
    assert (r.stdout.strip() == "") == (r.rc != 0), r  # healthy on stdout, the rest on stderr


def slack(tmp_path: Path) -> float:
    """The time a probe takes beyond its deadline here now: bash and Python starting (0.4 s on an
    idle machine, seconds on a loaded one), measured by a probe answered at once (connection
    refused); at least 1 s."""
    r = check(_cfg(tmp_path, free_port()), "liveness")
    assert r.rc == probe.NOT_RUNNING, r
    return max(1.0, 3 * r.elapsed)


def poll(fn, ok, timeout: float, interval: float = 0.3):
    deadline = time.monotonic() + timeout
    while True:
        r = fn()
        if ok(r) or time.monotonic() > deadline:
            return r
        time.sleep(interval)


# -- a real server, management plane on its own port ---------------------------------------------
@pytest.fixture(scope="module")
def split(tmp_path_factory, demo_model):
    """Business on 127.0.0.1:P, management + metrics on 127.0.0.2:M (BUSINESS apart)."""
    tmp = tmp_path_factory.mktemp("split")
    port, mport = free_ports(2)
    cfg = write_config(tmp / "config.json", port=port, run_dir=short_run_dir(), model_path=demo_model, workers=1,
                       server={"managementIpAddress": "127.0.0.2", "managementPort": mport, "metricsPort": mport})
    srv = Server(cfg, port, health_url=f"http://127.0.0.2:{mport}/health")
    srv.cfg, srv.mport = cfg, mport
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.mark.parametrize("mode", ["startup", "liveness", "readiness"])
def test_healthy_server_passes(split, mode) -> None:
    r = check(split.cfg, mode)
    assert r.rc == 0, r
    one_line(r)
    route = probe.ROUTES[mode]
    assert r.line.startswith(f"healthy: 200 from http://127.0.0.2:{split.mport}{route}"), r


def test_planes_come_from_the_environment_as_for_the_launcher(split) -> None:
    """No --config: MIES_CONFIG_JSON_PATH, as scripts/launch.sh reads it."""
    r = check(None, "readiness", env={"MIES_CONFIG_JSON_PATH": str(split.cfg)})
    assert r.rc == 0 and f"127.0.0.2:{split.mport}" in r.line, r
    # The launcher's overrides apply: MIES_CONTAINER_MANAGEMENT_IP moves the management plane.
    r = check(None, "readiness", env={"MIES_CONFIG_JSON_PATH": str(split.cfg),
                                      "MIES_CONTAINER_MANAGEMENT_IP": "127.0.0.3"})
    assert r.rc == probe.NOT_RUNNING and r.line == f"not running: connection refused to 127.0.0.3:{split.mport}", r


def test_timed_probe_runs_an_inference(split) -> None:
    """GET /health/timed-3: a one-token inference within 3 s (needs the /health/timed-N route)."""
    r = check(split.cfg, "timed", "3")
    assert r.rc == 0, r
    assert "/health/timed-3" in r.line and "healthy" in r.line, r
    one_line(r)
    assert check(split.cfg, "timed").rc == 0  # default N: 3


def test_stopped_workers_fail_readiness(split) -> None:
    """Device workers frozen (SIGSTOP): no worker answers, readiness fails."""
    workers = [p for p, role in process_roles(split.proc.pid).items() if role == "worker"]
    assert workers
    try:
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        r = poll(lambda: check(split.cfg, "readiness"), lambda r: r.rc != 0, timeout=20)
        # MindIE: 503 while no worker is ready (starting), 500 "Service is abnormal" when the
        # health checker finds the engine stuck: either way not ready, and said on one line.
        assert (r.rc == probe.STARTING and r.line.startswith("starting: 503 from ")
                or r.rc == probe.UNHEALTHY and r.line.startswith("unhealthy: 500 from ")), r
        one_line(r)
        assert r.elapsed < 5, r
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    r = poll(lambda: check(split.cfg, "readiness"), lambda r: r.rc == 0, timeout=30)
    assert r.rc == 0, r


# -- nothing there, a hung socket, a trickling one -----------------------------------------------
def _cfg(tmp_path: Path, mport: int, mip: str = "127.0.0.2", **server) -> Path:
    path = tmp_path / f"c{mport}.json"
    path.write_text(json.dumps({"ServerConfig": {"port": free_port(), "managementIpAddress": mip,
                                                 "managementPort": mport, "metricsPort": mport, **server}}))
    return path


def test_dead_server_is_not_running(tmp_path) -> None:
    port = free_port()
    # at once, not after the timeout (10 s: a loaded machine starts Python slowly)
    r = check(_cfg(tmp_path, port), "--timeout", "10", "liveness")
    assert r.rc == probe.NOT_RUNNING, r
    assert r.line == f"not running: connection refused to 127.0.0.2:{port}", r
    one_line(r)
    assert r.elapsed < 10, r
    # Nothing to drain is a successful drain.
    r = run_script(PRESTOP, "--config", str(_cfg(tmp_path, port)), "--wait", "5")
    assert r.rc == 0 and "nothing running" in r.line, r


@pytest.fixture
def listening_socket():
    """A socket that listens and never accepts: connections complete in the backlog."""
    s = socket.socket()
    s.bind(("127.0.0.2", 0))
    s.listen(16)
    yield s.getsockname()[1]
    s.close()


def test_hung_server_times_out(tmp_path, listening_socket) -> None:
    late = slack(tmp_path)
    for mode in ("readiness", "liveness"):
        r = check(_cfg(tmp_path, listening_socket), "--timeout", "2", mode)
        assert r.rc == probe.TIMEOUT and r.line.startswith("timeout: "), r
        one_line(r)
        assert 1.9 < r.elapsed < 2 + late, (r, late)
    # timed N: the deadline follows N (N + 2 s) unless --timeout says otherwise.
    r = check(_cfg(tmp_path, listening_socket), "timed", "1")
    assert r.rc == probe.TIMEOUT and 2.9 < r.elapsed < 3 + late, (r, late)
    # prestop: /stopService never answers either; the wait bounds it.
    r = run_script(PRESTOP, "--config", str(_cfg(tmp_path, listening_socket)), "--wait", "2")
    assert r.rc == probe.TIMEOUT and 1.9 < r.elapsed < 2 + late, (r, late)


def _serve(handler, host: str = "127.0.0.2"):
    """A thread accepting connections on ``host`` and handing each to ``handler(conn)``."""
    s = socket.socket()
    s.bind((host, 0))
    s.listen(16)
    stop = threading.Event()

    def loop():
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = s.accept()
            except OSError:
                continue
            threading.Thread(target=handler, args=(conn, stop), daemon=True).start()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return s.getsockname()[1], lambda: (stop.set(), t.join(), s.close())


def test_a_server_that_trickles_its_answer_hits_the_overall_deadline(tmp_path) -> None:
    """Bytes keep coming (no socket timeout ever fires), the answer never ends: the total
    deadline ends the probe all the same."""

    def trickle(conn, stop):
        with conn:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            while not stop.is_set():
                try:
                    conn.sendall(b"X")
                except OSError:
                    return
                time.sleep(0.3)

    late = slack(tmp_path)
    port, close = _serve(trickle)
    try:
        r = check(_cfg(tmp_path, port), "--timeout", "2", "readiness")
        assert r.rc == probe.TIMEOUT, r
        one_line(r)
        assert r.elapsed < 2 + late, (r, late)
    finally:
        close()


def test_each_answer_has_its_exit_status(tmp_path) -> None:
    """MindIE's answers (mindie.md §2.3), from a stand-in server, and the listen address
    0.0.0.0 probed on 127.0.0.1."""
    answers = {
        "/v2/health/ready": (503, b'{"message":"Service is alive but busy. Consider reducing request frequency"}'),
        "/v2/health/live": (503, b'{"error":"The service has been stopped.","error_type":"Service Unavailable"}'),
        "/health/timed-3": (500, b'{"error":"Engine callback timeout","error_type":"Incomplete Generation"}'),
        "/health/timed-5": (200, b'{"status":"healthy"}'),
    }

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = answers.get(self.path, (503, b""))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        cfg = _cfg(tmp_path, httpd.server_address[1], mip="0.0.0.0", ipAddress="0.0.0.0",
                   allowAllZeroIpListening=True)
        r = check(cfg, "readiness")
        assert r.rc == probe.BUSY and r.line.startswith("busy: 503 from http://127.0.0.1:"), r
        r = check(cfg, "liveness")
        assert r.rc == probe.STOPPED and "stopped: 503" in r.line and "The service has been stopped." in r.line, r
        answers["/v2/health/live"] = (503, b"")
        r = check(cfg, "startup")
        assert r.rc == probe.STARTING and r.line.startswith("starting: 503"), r
        answers["/v2/health/live"] = (200, b'{"message":"Service is alive but busy"}')
        r = check(cfg, "liveness")
        assert r.rc == 0 and "alive but busy" in r.line, r  # busy is alive
        r = check(cfg, "timed")
        assert r.rc == probe.UNHEALTHY and "500" in r.line and "Engine callback timeout" in r.line, r
        assert check(cfg, "timed", "5").rc == 0
        for r in (check(cfg, "readiness"), check(cfg, "timed")):
            one_line(r)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_usage_and_config_errors(tmp_path) -> None:
    r = check(None, "sideways")
    assert r.rc == probe.USAGE and len(r.line.splitlines()) == 1, r
    r = check(None, "readiness", "3")
    assert r.rc == probe.USAGE, r
    r = check(None, "timed", "601")
    assert r.rc == probe.USAGE and "[1, 600]" in r.line, r
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"ServerConfig": {"managementPort": 80}}))
    r = check(bad, "readiness")
    assert r.rc == probe.USAGE and "ServerConfig.managementPort" in r.line, r
    one_line(r)
    r = check(None, "--help")
    assert r.rc == 0 and "exit status" in r.stdout and "/v2/health/ready" in r.stdout


def test_the_address_the_launcher_would_bind(tmp_path) -> None:
    """Same loader and planner as the launcher: merged planes, all-zero addresses, overrides."""
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"ServerConfig": {"ipAddress": "0.0.0.0", "allowAllZeroIpListening": True,
                                              "port": 2000, "managementPort": 2000, "metricsPort": 2001}}))
    t = probe.management_target(str(p), env={})
    assert (t.host, t.port, t.listen_host) == ("127.0.0.1", 2000, "0.0.0.0")  # merged: business address
    t = probe.management_target(str(p), env={"MINDIE_PORT": "2002"})
    assert (t.host, t.port, t.listen_host) == ("127.0.0.1", 2002, "0.0.0.0")  # -p moves the planes together
    t = probe.management_target(str(p), env={"MINDIE_PORT": "2002", "MINDIE_MANAGEMENT_PORT": "2000"})
    assert (t.host, t.port) == ("127.0.0.2", 2000)  # business moved away: management on its own
    t = probe.management_target(None, env={})
    assert (t.host, t.port, t.tls) == ("127.0.0.2", 1026, None)  # MindIE's defaults
    assert probe.connect_host("::") == "::1"


# -- drain ---------------------------------------------------------------------------------------
class Streaming(threading.Thread):
    """A streaming request in flight: ``started`` once its first frame arrived."""

    def __init__(self, srv: Server, tokens: int = 150):
        super().__init__(daemon=True)
        self.srv, self.tokens = srv, tokens
        self.started = threading.Event()
        self.status, self.body, self.error = None, b"", None

    def run(self):
        body = {"input_id": [5618, 19678, 701], "stream": True,
                "parameters": {"max_new_tokens": self.tokens, "details": True}}
        try:
            with httpx.stream("POST", self.srv.url + "/infer_token", json=body, timeout=120,
                              verify=self.srv.tls or True) as r:
                self.status = r.status_code
                for chunk in r.iter_bytes():
                    self.body += chunk
                    self.started.set()
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.started.set()

    def frames(self) -> list[dict]:
        return [json.loads(line[6:]) for line in self.body.decode().split("\n\n") if line.startswith("data: ")]


def _all_gone(srv: Server, pids: list[int], timeout: float = 40) -> None:
    assert wait_gone(pids + [srv.proc.pid], timeout) is not None, (
        {p: r for p, r in process_roles(srv.proc.pid).items()}, srv.tail())


def _stop_service_then_probes_fail_and_prestop_drains(srv: Server, env: dict) -> None:
    """GET /stopService (it answers once the in-flight request finished, then the server exits);
    the probes fail from then on; prestop.sh after it exits 0 and nothing is left. ``env``: the
    probes' client identity (mutual TLS)."""
    pids = list(process_roles(srv.proc.pid))
    req = Streaming(srv)
    req.start()
    assert req.started.wait(60) and req.error is None, req.error
    stop_answer = {}

    def stop_service():
        try:
            stop_answer["r"] = httpx.get(srv.health_url.replace("/health", "/stopService"), timeout=120,
                                         verify=srv.tls or True)
        except httpx.HTTPError as e:
            stop_answer["r"] = e

    stopper = threading.Thread(target=stop_service, daemon=True)
    stopper.start()
    # Draining once /stopService has arrived (later on a loaded machine): not ready (503
    # "stopped" from /v2/health/ready, or gone already).
    r = poll(lambda: check(srv.cfg, "readiness", env=env), lambda r: r.rc != 0, timeout=20)
    assert r.rc in (probe.STOPPED, probe.STARTING, probe.NOT_RUNNING), f"ready while draining: {r}"
    one_line(r)
    stopper.join(120)
    req.join(120)
    assert isinstance(stop_answer.get("r"), httpx.Response) and stop_answer["r"].status_code == 200, stop_answer
    # The in-flight request finished normally before the answer.
    assert req.status == 200 and req.error is None, (req.status, req.error)
    assert req.frames()[-1]["details"]["finish_reason"] in ("length", "eos_token", "stop"), req.body[-300:]
    r = run_script(PRESTOP, "--config", str(srv.cfg), "--wait", "60", env=env)
    assert r.rc == 0 and r.line.startswith("drained: "), f"prestop after /stopService: {r}"
    one_line(r)
    _all_gone(srv, pids)
    r = check(srv.cfg, "readiness", env=env)
    assert r.rc == probe.NOT_RUNNING and "connection refused" in r.line, r


@pytest.mark.parametrize("exits", [True, False], ids=["server-exiting", "certificate-refused"])
def test_stop_after_a_close_without_answer_over_mutual_tls(monkeypatch, exits) -> None:
    """prestop's /stopService closed without an answer over mutual TLS (the probe's "client
    certificate was probably refused"): a server already exiting (a /stopService before this one)
    refuses connections moments later, and that is a drain; a port that keeps accepting is the
    refused certificate, reported as the TLS error (CI once saw the first as the second)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    target = probe.Target("127.0.0.1", port, object(), "127.0.0.1")
    prober = probe.Prober(target, time.monotonic() + 30, None, "", client_cert=True)

    def closed(path):
        if exits:  # the exiting server's listener goes a moment after the close
            threading.Timer(0.3, listener.close).start()
        raise probe.ProbeFailure(probe.TLS_ERROR, "TLS error: closed the connection without an answer", closed=True)

    monkeypatch.setattr(prober, "request", closed)
    monkeypatch.setattr(probe, "EXIT_GRACE_S", 1.0)
    try:
        if exits:
            code, line = probe.stop(prober, force=False, wait=30)
            assert code == probe.OK and line.startswith("drained: ") and "already stopping" in line, line
        else:
            t0 = time.monotonic()
            with pytest.raises(probe.ProbeFailure) as e:
                probe.stop(prober, force=False, wait=30)
            assert e.value.code == probe.TLS_ERROR and 0.9 < time.monotonic() - t0 < 5, e.value.message
    finally:
        listener.close()


def test_prestop_drains_in_flight_requests_and_leaves_nothing(split) -> None:
    """The Kubernetes preStop hook alone: it returns 0 only once the request in flight finished
    and every process of the server has exited. On the module's server (not a start of its own),
    which it stops: it is the last test of this file to use it, and the tests above leave it
    serving, as wait_ready confirms."""
    srv = split
    try:
        srv.wait_ready(60)
        pids = list(process_roles(srv.proc.pid))
        req = Streaming(srv)
        req.start()
        assert req.started.wait(60) and req.error is None, req.error
        r = run_script(PRESTOP, "--config", str(srv.cfg), "--wait", "90")
        assert r.rc == 0 and r.line.startswith("drained: /stopService answered 200"), (r, srv.tail())
        assert not req.is_alive() or req.join(5) is None
        assert req.status == 200 and req.error is None, (req.status, req.error)
        assert req.frames()[-1]["details"]["finish_reason"] in ("length", "eos_token", "stop")
        assert "connection refused" in check(srv.cfg, "liveness").line
        _all_gone(srv, pids)
        # A second prestop (kubelet retries, systemd after a crash): nothing to drain.
        assert run_script(PRESTOP, "--config", str(srv.cfg), "--wait", "5").rc == 0
    finally:
        srv.stop()


# -- HTTPS, mutual TLS -----------------------------------------------------------------------------
def test_https_and_mutual_tls_then_stop_service_and_prestop(tmp_path, demo_model) -> None:
    """The probes over mutual TLS: right after the launch not ready, then healthy with a client
    certificate and refused without one, with a stranger's, a revoked one, against another CA or
    another name. Then, on the same server, GET /stopService with a request in flight: the probes
    fail from then on and prestop.sh after it exits 0 with nothing left (one start for what were
    test_https_and_mutual_tls and test_stop_service_then_probes_fail_and_prestop_drains)."""
    pki = Pki(tmp_path / "pki")
    port, mport, xport = free_ports(3)
    cfg = write_config(pki.root / "config.json", port=port, run_dir=short_run_dir(), model_path=demo_model,
                       workers=1, server={"managementIpAddress": "127.0.0.2", "managementPort": mport,
                                          "metricsPort": xport, **pki.server_config()})
    client_cert, client_key, _ = pki.client
    ctx = ssl.create_default_context(cafile=str(pki.root / "security/ca/ca.pem"))
    ctx.load_cert_chain(client_cert, client_key)
    srv = Server(cfg, port, tls=ctx, health_url=f"https://127.0.0.2:{mport}/health")
    srv.cfg = cfg
    env = {"MINDIE_PROBE_CERT": client_cert, "MINDIE_PROBE_KEY": client_key}
    try:
        first = check(cfg, "readiness", env=env)  # right after the launch: not ready yet
        assert first.rc in (probe.NOT_RUNNING, probe.STARTING), first
        srv.wait_ready()
        r = check(cfg, "readiness", env=env)
        assert r.rc == 0 and r.line.startswith(f"healthy: 200 from https://127.0.0.2:{mport}/v2/health/ready"), r
        r = check(cfg, "--cert", client_cert, "--key", client_key, "liveness")
        assert r.rc == 0, r
        # No client certificate: refused at the handshake, and the probe says what is missing.
        r = check(cfg, "--timeout", "3", "readiness")
        assert r.rc == probe.TLS_ERROR and r.line.startswith("TLS error: ") and "MINDIE_PROBE_CERT" in r.line, r
        one_line(r)
        # A certificate of another CA, a revoked one: refused.
        cert, key, _ = pki.stranger
        r = check(cfg, "--cert", cert, "--key", key, "--timeout", "3", "readiness")
        assert r.rc == probe.TLS_ERROR, r
        cert, key, _ = pki.revoked
        assert check(cfg, "--cert", cert, "--key", key, "--timeout", "3", "readiness").rc == probe.TLS_ERROR
        # The server's certificate checked against another CA: not trusted.
        other = pki.root / "other-ca.pem"
        from tests.certs import pem_cert
        other.write_bytes(pem_cert(pki.other_ca.cert))
        r = check(cfg, "--cacert", str(other), "--timeout", "3", "readiness", env=env)
        assert r.rc == probe.TLS_ERROR and "certificate verify failed" in r.line, r
        # ... and against a name it does not carry.
        r = check(cfg, "--server-name", "elsewhere.example", "--timeout", "3", "readiness", env=env)
        assert r.rc == probe.TLS_ERROR, r
        # A half-given client identity is a usage error.
        assert check(cfg, "--cert", client_cert, "readiness").rc == probe.USAGE
        # Plain HTTP config against the TLS port: no HTTP answer, not healthy.
        plain = _cfg(tmp_path, mport)
        assert check(plain, "--timeout", "3", "readiness").rc not in (0, probe.NOT_RUNNING)
        _stop_service_then_probes_fail_and_prestop_drains(srv, env)
    finally:
        assert srv.stop() == 0, srv.tail()


def test_tls_handshake_to_a_hung_server_times_out(tmp_path, listening_socket) -> None:
    pki = Pki(tmp_path / "pki")
    cfg = pki.root / "config.json"
    cfg.write_text(json.dumps({"ServerConfig": {"port": free_port(), "managementIpAddress": "127.0.0.2",
                                                "managementPort": listening_socket, "metricsPort": free_port(),
                                                **pki.server_config()}}))
    late = slack(tmp_path)
    r = check(cfg, "--timeout", "2", "readiness")
    assert r.rc == probe.TIMEOUT and 1.9 < r.elapsed < 2 + late, (r, late)
