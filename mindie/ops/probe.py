"""Health probe and drain client for the management plane: ``mindie-probe`` /
``scripts/health_check.sh`` (Kubernetes exec probes, Docker HEALTHCHECK) and ``scripts/prestop.sh``.

    health_check.sh [--config FILE] [--timeout S] startup|liveness|readiness|timed [N]
    prestop.sh [--config FILE] [--wait S]        (= python3 -m mindie.ops.probe stop --wait S)

Where it connects: the listener that serves the management plane, planned from the same
config.json as the server (``--config FILE``, else ``$MIES_CONFIG_JSON_PATH``, else the built-in
defaults) by the server's own loader and planner (``mindie.config.load_config``,
``mindie.server.listeners.plan_listeners``), so the environment overrides (``MIES_CONTAINER_MANAGEMENT_IP``,
``MINDIE_HOST``, ``MINDIE_PORT``, ...) and the merging of planes with equal ports apply exactly
as for ``scripts/launch.sh``. A listener on ``0.0.0.0`` is probed on ``127.0.0.1`` (``::`` on
``::1``).

Which route each mode asks for, against MindIE's own probe script (mindie.md §9.3: Motor's
``probe.sh`` runs ``GET /v2/health/ready`` on ``managementPort`` for the startup, readiness *and*
liveness probes of MindIE Server; its ``health_probe.md`` recommends ``/health/timed-3``):

- ``readiness`` -> ``GET /v2/health/ready``, as MindIE: 200 only when the server takes work;
  503 while starting, stopped or BUSY, so a busy or draining pod leaves the Service's endpoints.
- ``liveness`` -> ``GET /v2/health/live``, where MindIE uses ``/v2/health/ready``: the two differ
  only for BUSY (live: 200 "alive but busy"; ready: 503), and a liveness probe that fails on
  BUSY makes the kubelet restart a pod *because* it is loaded, dropping its in-flight requests
  and pushing its load onto the others (a restart cascade under overload). Busy is a readiness
  matter, not a liveness one.
- ``startup`` -> ``GET /v2/health/live``: 503 until a device worker is ready (model loaded), then
  200 whether busy or not; a server that starts under a burst of traffic (BUSY at once) would
  never pass a ``/v2/health/ready`` startup probe and be killed after ``failureThreshold``.
- ``timed [N]`` -> ``GET /health/timed-N`` (default N 3, MindIE's recommended ``timed-3``): a real
  one-token inference must finish within N s; a deeper check than live (it catches a hung
  device), for a manual check or a slow liveness probe, not for a frequent one.

``--coordinator``: probe a MindIE Motor coordinator (``python -m coordinator``) instead: the
config is its ``ms_coordinator.json`` (``--config FILE``, else
``$MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH``, else its defaults), read by the coordinator's own
loader (``coordinator/probe.py``, which runs this probe with its resolver); the probe connects to ``http_config.manage_ip``/``manage_port`` (HTTPS with
``tls_config.controller_server_tls_enable``, trusting its ``ca_cert``) and asks, as MindIE's
probe.sh does for its coordinator: ``startup`` -> ``GET /v1/startup``, ``liveness`` -> ``GET
/v1/health`` (both 200 while the process serves), ``readiness`` -> ``GET /v1/readiness`` (503 while no instance is ready, so
a coordinator with nothing to route to leaves its Service). ``timed`` and ``stop`` are server
modes (a coordinator runs no inference; it stops on SIGTERM).

HTTPS: with ``ServerConfig.httpsEnabled`` the probe speaks TLS (1.2+) to the management
listener. It verifies the server certificate against ``--cacert FILE`` (env
``MINDIE_PROBE_CACERT``), else the plane's CA files (``tlsCaPath`` + ``managementTlsCaFile``, or
``tlsCaFile`` when the management plane shares the business port: the CA MindIE deployments
sign both sides with), else the system trust store; the name checked is the probed address
unless ``--server-name NAME`` (env ``MINDIE_PROBE_SERVER_NAME``) names the one in the
certificate. Mutual TLS (the plane has CA files): the client certificate is ``--cert FILE
--key FILE`` (env ``MINDIE_PROBE_CERT`` / ``MINDIE_PROBE_KEY``; an encrypted key's password in
the file ``--key-password-file`` / ``MINDIE_PROBE_KEY_PASSWORD_FILE``). Default: none; the server
then refuses the handshake and the probe says so (exit 5) instead of prompting or hanging.

Time: ``--timeout S`` (default 5; ``timed N``: N + 2) bounds the whole probe: every socket
operation gets what is left of it, and an interval timer ends the process at the deadline
whatever blocks (name resolution, a server that trickles bytes). ``stop`` is bounded by ``--wait``.

Exit status (one line of output: stdout when healthy, stderr otherwise):

  0  healthy (stop: drained, the management port refuses connections; or nothing was running)
  1  unhealthy: an answer other than the ones below (e.g. 500 from /health/timed-N, 404)
  2  usage or config error (the config's key is named)
  3  not running: connection refused (or the address is unreachable)
  4  timeout: no answer within --timeout (stop: the server still runs after --wait)
  5  TLS error: handshake refused, certificate not trusted, client certificate missing
  6  starting: 503 without a known message (no device worker ready yet, or stopping)
  7  stopped: 503 "The service has been stopped." (after /stopService)
  8  busy: 503 "Service is alive but busy..." (readiness only; live answers 200 when busy)
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import ssl
import sys
import time
from typing import Optional

OK, UNHEALTHY, USAGE, NOT_RUNNING, TIMEOUT, TLS_ERROR, STARTING, STOPPED, BUSY = range(9)

MODES = ("startup", "liveness", "readiness", "timed", "stop")
ROUTES = {"startup": "/v2/health/live", "liveness": "/v2/health/live", "readiness": "/v2/health/ready"}
# MindIE's probe.sh for its coordinator: /v1/startup, /v1/health and /v1/readiness.
COORDINATOR_ROUTES = {"startup": "/v1/startup", "liveness": "/v1/health", "readiness": "/v1/readiness"}
COORDINATOR_CONFIG_ENV = "MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH"
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_TIMED_N = 3
DEFAULT_STOP_WAIT_S = 100.0  # prestop.sh: MINDIE_PRESTOP_WAIT; deploy/k8s grace period 150 s
MAX_BODY = 64 * 1024

HELP_EPILOG = """\
modes:
  startup     GET /v2/health/live   (200 once a device worker is ready, busy or not)
  liveness    GET /v2/health/live   (MindIE's probe.sh uses /v2/health/ready: a busy pod
                                     must not be restarted: docs/operations.md)
  readiness   GET /v2/health/ready  (503 while starting, stopped or busy)
  timed [N]   GET /health/timed-N   (a real one-token inference within N s; default N 3)
  stop        GET /stopService, then wait until the management port refuses connections
              (--wait S, default 100; --force: ?mode=Force); exit 0 when drained or when
              nothing was running

exit status:
  0 healthy / drained   1 unhealthy (other answer)   2 usage or config error
  3 not running (connection refused)   4 timeout   5 TLS error
  6 starting (503)   7 stopped (503 after /stopService)   8 busy (503 from /v2/health/ready)

--coordinator (a MindIE Motor coordinator, --config ms_coordinator.json):
  startup     GET /v1/startup       (200 while the coordinator serves)
  liveness    GET /v1/health
  readiness   GET /v1/readiness     (503 while no instance is ready to route to)

environment: MIES_CONFIG_JSON_PATH (config, as the server) and the server's overrides
(MIES_CONTAINER_MANAGEMENT_IP, MINDIE_HOST, MINDIE_PORT, ...); MINDIE_PROBE_CACERT,
MINDIE_PROBE_CERT, MINDIE_PROBE_KEY, MINDIE_PROBE_KEY_PASSWORD_FILE, MINDIE_PROBE_SERVER_NAME
(HTTPS: trusted CA, client certificate for mutual TLS, expected server name).
"""


class ProbeFailure(Exception):
    def __init__(self, code: int, message: str, closed: bool = False):
        super().__init__(message)
        self.code = code
        self.message = message
        self.closed = closed  # the server closed the connection without an answer (a reset or an EOF)


class _Deadline(BaseException):
    """Raised by the interval timer: the overall deadline passed (BaseException so no
    ``except Exception`` on the way swallows it)."""


# -- where to connect --------------------------------------------------------------------------------
class Target:
    def __init__(self, host: str, port: int, tls, listen_host: str):
        self.host, self.port, self.tls, self.listen_host = host, port, tls, listen_host

    @property
    def addr(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def url(self, path: str) -> str:
        return f"{'https' if self.tls else 'http'}://{self.addr}{path}"


def connect_host(listen: str) -> str:
    """The address to connect to for a listener bound to ``listen`` (all-zero: loopback)."""
    if listen in ("0.0.0.0", ""):
        return "127.0.0.1"
    if listen == "::":
        return "::1"
    return listen


def management_target(config_path: Optional[str], env=os.environ) -> Target:
    """The management plane's listener as the launcher plans it (same loader, same overrides)."""
    # Imported here, not at the top: a probe given --url reads no config, and a kubelet runs
    # this program every few seconds, so it loads only what its target needs.
    from mindie.config import ConfigError, load_config
    from mindie.server.listeners import plan_listeners

    try:
        server = load_config(config_path, env=env).config.server
        listeners = plan_listeners(server)
    except ConfigError as e:
        raise ProbeFailure(USAGE, f"config error: {e}") from None
    except OSError as e:
        raise ProbeFailure(USAGE, f"config error: {e}") from None
    li = next(x for x in listeners if "management" in x.planes)
    return Target(connect_host(li.host), li.port, li.tls, li.host)


def coordinator_target(config_path: Optional[str], env=os.environ) -> Target:
    """The coordinator's manage listener. The coordinator knows its own config: its resolver
    (``coordinator/probe.py``) is found through the ``mindie.probe_targets`` entry point of the
    installed package, so this module imports nothing of the coordinator (``python -m
    coordinator.probe`` and ``health_check.sh --coordinator`` pass it in directly)."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="mindie.probe_targets") if ep.name == "coordinator"]
    if not found:
        raise ProbeFailure(USAGE, "--coordinator: the coordinator package is not installed with this one; "
                                  "run scripts/health_check.sh --coordinator or python -m coordinator.probe")
    return found[0].load()(config_path, env=env)


# -- TLS -------------------------------------------------------------------------------------------------
def client_context(tls, *, cacert: str = "", cert: str = "", key: str = "",
                   key_password_file: str = "") -> ssl.SSLContext:
    """The client side of the plane's TLS: trusted CA, optional client certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the certificate and the name
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        if cacert:
            ctx.load_verify_locations(cafile=cacert)
        elif tls.ca_files:
            for path in tls.ca_files:
                ctx.load_verify_locations(cafile=path)
        else:
            ctx.load_default_certs()
    except (OSError, ssl.SSLError) as e:
        which = cacert or ", ".join(tls.ca_files)
        raise ProbeFailure(USAGE, f"cannot load the CA file {which} ({tls.ca_key if not cacert else '--cacert'}): "
                           f"{getattr(e, 'strerror', None) or e}") from None
    if cert or key:
        if not (cert and key):
            raise ProbeFailure(USAGE, "a client certificate needs both --cert and --key "
                                      "(MINDIE_PROBE_CERT and MINDIE_PROBE_KEY)")
        password = b""  # never a prompt on a terminal for an encrypted key
        if key_password_file:
            try:
                with open(key_password_file, "rb") as f:
                    password = f.read().rstrip(b"\r\n")
            except OSError as e:
                raise ProbeFailure(USAGE, f"cannot read the key password file {key_password_file}: "
                                          f"{e.strerror or e}") from None
        try:
            ctx.load_cert_chain(cert, key, password=password)
        except (OSError, ssl.SSLError) as e:
            raise ProbeFailure(USAGE, f"cannot load the client certificate {cert} with key {key}: "
                                      f"{getattr(e, 'strerror', None) or getattr(e, 'reason', None) or e}") from None
    return ctx


class _HTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to an address, checking the certificate against ``server_name`` (SNI too)."""

    def __init__(self, host, port, *, timeout, context, server_name):
        super().__init__(host, port, timeout=timeout, context=context)
        self._server_name = server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self._server_name)


# -- one request ---------------------------------------------------------------------------------------
class Prober:
    def __init__(self, target: Target, deadline: float, ctx: Optional[ssl.SSLContext], server_name: str,
                 client_cert: bool):
        self.target, self.deadline, self.ctx = target, deadline, ctx
        self.server_name = server_name or target.host
        self.client_cert = client_cert

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _Deadline()
        return left

    def request(self, path: str) -> tuple[int, bytes]:
        t = self.target
        if t.tls:
            conn = _HTTPSConnection(t.host, t.port, timeout=self.left(), context=self.ctx,
                                    server_name=self.server_name)
        else:
            conn = http.client.HTTPConnection(t.host, t.port, timeout=self.left())
        try:
            conn.connect()
            conn.sock.settimeout(self.left())
            conn.putrequest("GET", path, skip_accept_encoding=True)
            conn.putheader("Connection", "close")
            conn.putheader("User-Agent", "mindie-probe")
            conn.endheaders()
            conn.sock.settimeout(self.left())
            resp = conn.getresponse()
            conn.sock and conn.sock.settimeout(self.left())
            body = resp.read(MAX_BODY)
            return resp.status, body
        except ssl.SSLError as e:
            raise ProbeFailure(TLS_ERROR, self._tls_text(e)) from None
        except socket.timeout:
            raise ProbeFailure(TIMEOUT, f"timeout: no answer from {t.url(path)} within the deadline") from None
        except ConnectionRefusedError:
            raise ProbeFailure(NOT_RUNNING, f"not running: connection refused to {t.addr}") from None
        except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected) as e:
            if t.tls and t.tls.ca_files:
                # TLS 1.3: a refused client certificate shows after the handshake, often as a close.
                if not self.client_cert:
                    raise ProbeFailure(TLS_ERROR, f"TLS error: {t.addr} closed the connection ({type(e).__name__}); "
                                       "the management plane asks for a client certificate: pass --cert/--key "
                                       "or MINDIE_PROBE_CERT/MINDIE_PROBE_KEY", closed=True) from None
                raise ProbeFailure(TLS_ERROR, f"TLS error: {t.addr} closed the connection without an answer "
                                   f"({type(e).__name__}): the client certificate was probably refused (not "
                                   "signed by the plane's CA, revoked or expired)", closed=True) from None
            raise ProbeFailure(UNHEALTHY, f"unhealthy: {t.addr} closed the connection without an answer "
                               f"({type(e).__name__})", closed=True) from None
        except http.client.HTTPException as e:
            raise ProbeFailure(UNHEALTHY, f"unhealthy: bad HTTP answer from {t.url(path)}: "
                               f"{type(e).__name__} {e}") from None
        except OSError as e:
            if e.errno in (101, 113, 99):  # ENETUNREACH, EHOSTUNREACH, EADDRNOTAVAIL
                raise ProbeFailure(NOT_RUNNING, f"not running: {t.addr} unreachable ({e.strerror})") from None
            raise ProbeFailure(UNHEALTHY, f"unhealthy: {t.url(path)}: {e.strerror or e}") from None
        finally:
            conn.close()

    def _tls_text(self, e: ssl.SSLError) -> str:
        if isinstance(e, ssl.SSLCertVerificationError):  # the server's certificate
            return (f"TLS error: {self.target.addr}: certificate verify failed: {e.verify_message} "
                    "(trusted CA: --cacert or MINDIE_PROBE_CACERT; expected name: --server-name)")
        text = f"TLS error: {self.target.addr}: {e.reason or e}"
        if not self.client_cert and self.target.tls and self.target.tls.ca_files:
            text += " (the management plane asks for a client certificate: pass --cert/--key or " \
                    "MINDIE_PROBE_CERT/MINDIE_PROBE_KEY)"
        return text


def _message(body: bytes) -> str:
    """The text of a MindIE answer body: its "message" or "error", else the raw text."""
    text = body.decode("utf-8", "replace").strip()
    try:
        doc = json.loads(text)
    except ValueError:
        return text[:200]
    if isinstance(doc, dict):
        return str(doc.get("message") or doc.get("error") or doc.get("status") or text)[:200]
    return text[:200]


def classify(status: int, body: bytes, url: str) -> tuple[int, str]:
    """(exit status, line) for an answer of a health route."""
    msg = _message(body)
    if status == 200:
        return OK, f"healthy: 200 from {url}" + (f" ({msg})" if msg else "")
    if status == 503:
        low = msg.lower()
        if "stopped" in low:
            return STOPPED, f"stopped: 503 from {url} ({msg})"
        if "busy" in low:
            return BUSY, f"busy: 503 from {url} ({msg})"
        return STARTING, (f"starting: 503 from {url} ({msg})" if msg else
                          f"starting: 503 from {url} (no device worker ready yet, or the server is stopping)")
    return UNHEALTHY, f"unhealthy: {status} from {url}" + (f" ({msg})" if msg else "")


def probe(prober: Prober, mode: str, n: int, coordinator: bool = False) -> tuple[int, str]:
    path = COORDINATOR_ROUTES[mode] if coordinator else f"/health/timed-{n}" if mode == "timed" else ROUTES[mode]
    t0 = time.monotonic()
    status, body = prober.request(path)
    code, line = classify(status, body, prober.target.url(path))
    return code, f"{line} in {1000 * (time.monotonic() - t0):.0f} ms" if code == OK else line


# stop: how long a server that closed /stopService's connection unanswered has to refuse connections
# before the close counts as a refused client certificate
EXIT_GRACE_S = 5.0


def refuses(target: Target, timeout: float) -> bool:
    """True when nothing accepts TCP connections on the management port any more."""
    try:
        with socket.create_connection((target.host, target.port), timeout=max(0.05, timeout)):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False  # a timeout or another error: not proven gone


def stop(prober: Prober, force: bool, wait: float) -> tuple[int, str]:
    """GET /stopService (it answers once in-flight requests finished), then wait until the
    management port refuses connections."""
    t = prober.target
    path = "/stopService" + ("?mode=Force" if force else "")
    t0 = time.monotonic()
    try:
        status, body = prober.request(path)
        answer = f"{status}" + (f" {_message(body)}" if _message(body) else "")
    except ProbeFailure as f:
        if f.code == NOT_RUNNING:
            return OK, f"drained: nothing running on {t.addr} (connection refused)"
        if f.code == TLS_ERROR and f.closed:
            # Closed without an answer over mutual TLS: a refused client certificate, or a server
            # already exiting (a /stopService before this one) whose listener took the connection as
            # it closed. An exiting server refuses connections within moments; a refused certificate
            # is refused again while the port keeps accepting.
            end = time.monotonic() + min(EXIT_GRACE_S, max(0.0, prober.deadline - time.monotonic()))
            while time.monotonic() < end:
                if refuses(t, min(1.0, max(0.05, end - time.monotonic()))):
                    return OK, (f"drained: {t.addr} closed the /stopService connection and then refused "
                                f"connections after {time.monotonic() - t0:.1f} s (already stopping)")
                time.sleep(0.1)
            raise
        if f.code == UNHEALTHY:  # closed as the server exits: it may well be going away
            status, answer = 0, f.message
        else:
            raise
    if status == 404:
        return UNHEALTHY, f"unhealthy: 404 from {t.url(path)}: this server has no /stopService"
    if status not in (0, 200, 500):  # 500: a second call, the server is already stopping
        return UNHEALTHY, f"unhealthy: {answer} from {t.url(path)}"
    while True:
        try:
            left = prober.left()
        except _Deadline:
            return TIMEOUT, (f"timeout: {t.addr} still accepts connections {wait:g} s after /stopService "
                             f"(answered {answer})")
        if refuses(t, min(1.0, left)):
            return OK, (f"drained: /stopService answered {answer}; {t.addr} refuses connections after "
                        f"{time.monotonic() - t0:.1f} s")
        time.sleep(min(0.2, max(0.0, prober.deadline - time.monotonic())))


# -- command line --------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (USAGE)
        self.exit(USAGE, f"{self.prog}: {message} (see --help)\n")


def parse_args(argv):
    p = _Parser(
        prog=os.environ.get("MINDIE_PROBE_PROG") or "mindie-probe", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=HELP_EPILOG,
        description="Probe the management plane of a mindie-py server (the planes, addresses, ports and TLS "
                    "files of its config.json), or drain it (stop).")
    p.add_argument("mode", choices=MODES, metavar="MODE", help="startup, liveness, readiness, timed or stop")
    p.add_argument("n", nargs="?", type=int, default=None, metavar="N", help="timed: seconds for the inference (1..600, default 3)")
    p.add_argument("-c", "--config", default=None, metavar="FILE", help="config.json (default: $MIES_CONFIG_JSON_PATH, else defaults)")
    p.add_argument("-t", "--timeout", type=float, default=None, metavar="S",
                   help=f"overall limit in seconds (default {DEFAULT_TIMEOUT_S:g}; timed N: N + 2)")
    p.add_argument("--wait", type=float, default=None, metavar="S",
                   help=f"stop: seconds to wait for the drain and exit (default $MINDIE_PRESTOP_WAIT, else "
                        f"{DEFAULT_STOP_WAIT_S:g})")
    p.add_argument("--force", action="store_true", help="stop: /stopService?mode=Force")
    p.add_argument("--coordinator", action="store_true",
                   help="probe a MindIE Motor coordinator: --config is its ms_coordinator.json (default "
                        f"${COORDINATOR_CONFIG_ENV}); startup, liveness and readiness only")
    p.add_argument("--cacert", metavar="FILE", default=os.environ.get("MINDIE_PROBE_CACERT", ""),
                   help="HTTPS: CA file the server certificate is checked against [MINDIE_PROBE_CACERT] "
                        "(default: the plane's tlsCaPath CA files)")
    p.add_argument("--cert", metavar="FILE", default=os.environ.get("MINDIE_PROBE_CERT", ""),
                   help="mutual TLS: client certificate [MINDIE_PROBE_CERT] (default: none)")
    p.add_argument("--key", metavar="FILE", default=os.environ.get("MINDIE_PROBE_KEY", ""),
                   help="mutual TLS: its private key [MINDIE_PROBE_KEY]")
    p.add_argument("--key-password-file", metavar="FILE", default=os.environ.get("MINDIE_PROBE_KEY_PASSWORD_FILE", ""),
                   help="a file holding the client key's password [MINDIE_PROBE_KEY_PASSWORD_FILE]")
    p.add_argument("--server-name", metavar="NAME", default=os.environ.get("MINDIE_PROBE_SERVER_NAME", ""),
                   help="HTTPS: the name the server certificate must carry (default: the probed address) "
                        "[MINDIE_PROBE_SERVER_NAME]")
    args = p.parse_args(argv)
    if args.n is not None and args.mode != "timed":
        p.error(f"N is only for timed, not {args.mode}")
    if args.coordinator and args.mode in ("timed", "stop"):
        p.error(f"{args.mode} is a server mode: a coordinator runs no inference and stops on SIGTERM "
                "(--coordinator takes startup, liveness or readiness)")
    if args.mode == "timed":
        args.n = DEFAULT_TIMED_N if args.n is None else args.n
        if not 1 <= args.n <= 600:
            p.error(f"timed N must be in [1, 600] (MindIE's range), got {args.n}")
    if args.timeout is not None and not args.timeout > 0:
        p.error(f"--timeout must be > 0, got {args.timeout}")
    if args.mode == "stop":
        if args.wait is None:
            env = os.environ.get("MINDIE_PRESTOP_WAIT", "").strip()
            try:
                args.wait = float(env) if env else DEFAULT_STOP_WAIT_S
            except ValueError:
                p.error(f"MINDIE_PRESTOP_WAIT must be a number of seconds, got {env!r}")
        if not args.wait > 0:
            p.error(f"--wait must be > 0, got {args.wait}")
    return args


def _on_alarm(signum, frame):
    raise _Deadline()


def run(argv=None, coordinator_target=coordinator_target) -> tuple[int, str]:
    """One probe: (exit status, the line to print). ``coordinator_target`` resolves ``--coordinator``'s
    target from its config (``coordinator/probe.py`` passes its own)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.mode == "stop":
        budget = args.wait
    elif args.timeout is not None:
        budget = args.timeout
    else:
        budget = args.n + 2.0 if args.mode == "timed" else DEFAULT_TIMEOUT_S
    start = time.monotonic()
    deadline = start + budget
    # The hard limit: whatever blocks (name lookup, a server trickling its answer) ends here.
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, budget + 0.05)
    target = None
    try:
        target = coordinator_target(args.config) if args.coordinator else management_target(args.config)
        ctx = None
        if target.tls:
            ctx = client_context(target.tls, cacert=args.cacert, cert=args.cert, key=args.key,
                                 key_password_file=args.key_password_file)
        prober = Prober(target, deadline, ctx, args.server_name, bool(args.cert))
        if args.mode == "stop":
            return stop(prober, args.force, args.wait)
        return probe(prober, args.mode, args.n or 0, args.coordinator)
    except ProbeFailure as f:
        return f.code, f.message
    except _Deadline:
        where = target.addr if target else "the server"
        if args.mode == "stop":
            return TIMEOUT, f"timeout: {where} still running {budget:g} s after /stopService"
        return TIMEOUT, f"timeout: no answer from {where} within {budget:g} s"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def main(argv=None, **run_kw) -> int:
    try:
        code, line = run(argv, **run_kw)
    except _Deadline:  # the timer fired between the end of run() and its reset
        code, line = TIMEOUT, "timeout"
    print(line, file=sys.stdout if code == OK else sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
