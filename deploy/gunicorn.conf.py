"""gunicorn settings for the front ends (falcon.asgi app under uvicorn workers).

Started by scripts/launch.sh, which sets the environment read here. The device-worker
supervisor is NOT started from this file: it runs beside the gunicorn master under the
launcher (SIGHUP re-executes this file, and the master reaps children it does not own).
Nothing here imports prometheus_client: PROMETHEUS_MULTIPROC_DIR must be set before that.

Liveness (docs/design.md): the master gets SIGTERM when the launcher dies (on_starting); each
front end gets SIGTERM when the master dies (mindie/server/gunicorn_worker.py).
"""
import errno
import os
import signal
import socket
import sys

from mindie.runtime.lifecycle import die_with_parent, expected_parent
from mindie.server.listeners import read_listeners

# MindIE's planes (business, management, metrics; merged where ports are equal), as planned by
# mindie.ops.launch_plan. TLS is not gunicorn's: each front end wraps each socket with its plane's
# context (mindie/server/gunicorn_worker.py), so the planes can have their own certificates.
bind = [li.bind for li in read_listeners(os.environ["MINDIE_LISTENERS"])]
workers = int(os.environ.get("MINDIE_FRONTENDS", "1"))
worker_class = "mindie.server.gunicorn_worker.FrontEndWorker"
wsgi_app = "mindie.server.app:create_app()"
timeout = 30  # heartbeat of the event loop, not a request timeout
# ServerConfig.drainTimeoutS (mindie.ops.launch_plan resolves it): the front ends cut what still runs at
# that bound themselves (mindie/server/drain.py); gunicorn's SIGKILL comes well after.
graceful_timeout = int(float(os.environ.get("MINDIE_GRACEFUL_TIMEOUT") or 20)) + 10
keepalive = 75
reuse_port = True  # each front end gets its own SO_REUSEPORT socket: the kernel spreads connections
control_socket_disable = True  # two instances on one host must not share gunicorn's control socket
accesslog = os.environ.get("MINDIE_ACCESS_LOG") or None
loglevel = (os.environ.get("MINDIE_LOG_LEVEL") or "info").lower()
proc_name = "mindie-frontend"
if (os.environ.get("MINDIE_LOG_FORMAT") or "text").lower() == "json":
    # gunicorn's and uvicorn's own lines as JSON lines too (LogConfig.logFormat).
    _json = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    logconfig_dict = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"json": {"()": "mindie.runtime.log_setup.JsonLineFormatter", "process": "gunicorn"}},
        "handlers": {"json": _json, "console": _json, "error_console": _json},
        "root": {"level": loglevel.upper(), "handlers": ["json"]},
        "loggers": {name: {"handlers": ["json"], "level": loglevel.upper(), "propagate": False}
                    for name in ("gunicorn.error", "gunicorn.access", "uvicorn.error", "uvicorn.access")},
    }


class _ListenLine:
    """gunicorn logs "Listening at: <its listeners> (<pid>)"; with reuse_port every front end binds
    its own sockets and the master holds none, so the address was empty: name the planes."""

    def filter(self, record):
        if isinstance(record.msg, str) and record.msg.startswith("Listening at:") and record.args \
                and not record.args[0]:
            urls = ", ".join(f"{'+'.join(li.planes)} {li.url}" for li in read_listeners(os.environ["MINDIE_LISTENERS"]))
            record.args = (urls,) + tuple(record.args[1:])
        return True


def on_starting(server):
    server.log.error_log.addFilter(_ListenLine())
    # If the launcher dies, even by SIGKILL, the master gets SIGTERM (a graceful stop of its
    # front ends) instead of living on as an orphan; at once if it died before this line.
    # Not for a master re-executed by USR2 (its parent is the old master).
    if "GUNICORN_PID" not in os.environ:
        die_with_parent(signal.SIGTERM, expected_parent())
        _refuse_a_port_in_use(server)


def _refuse_a_port_in_use(server):
    """With reuse_port a second server binds the port of a running one without an error and the
    kernel splits the connections between them: probe each address without SO_REUSEPORT first."""
    if os.environ.get("LISTEN_FDS"):
        return  # sockets handed over by systemd
    for addr in server.cfg.address:
        if not isinstance(addr, tuple):
            continue  # a unix socket path
        family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of a past server is fine
            try:
                s.bind(addr[:2])
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                server.log.error("%s:%s is already in use (another server?): not starting", addr[0], addr[1])
                sys.exit(1)


def child_exit(server, worker):
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess
        multiprocess.mark_process_dead(worker.pid)
