"""gunicorn settings for the front ends (falcon.asgi app under uvicorn workers).

Started by scripts/launch.sh, which sets the environment read here. The device-worker
supervisor is NOT started from this file: it runs beside the gunicorn master under the
launcher (SIGHUP re-executes this file, and the master reaps children it does not own).
Nothing here imports prometheus_client: PROMETHEUS_MULTIPROC_DIR must be set before that.
"""
import ctypes
import os
import signal

bind = [f"{os.environ.get('MINDIE_HOST', '127.0.0.1')}:{os.environ.get('MINDIE_PORT', '1025')}"]
workers = int(os.environ.get("MINDIE_FRONTENDS", "1"))
worker_class = "mindie.gunicorn_worker.FrontEndWorker"
wsgi_app = "mindie.app:create_app()"
timeout = 30  # heartbeat of the event loop, not a request timeout
graceful_timeout = int(os.environ.get("MINDIE_GRACEFUL_TIMEOUT", "15"))
keepalive = 75
reuse_port = True  # each front end gets its own SO_REUSEPORT socket: the kernel spreads connections
control_socket_disable = True  # two instances on one host must not share gunicorn's control socket
accesslog = os.environ.get("MINDIE_ACCESS_LOG") or None
loglevel = os.environ.get("MINDIE_LOG_LEVEL", "info").lower()
proc_name = "mindie-frontend"
certfile = os.environ.get("MINDIE_TLS_CERT") or None
keyfile = os.environ.get("MINDIE_TLS_KEY") or None
ca_certs = os.environ.get("MINDIE_TLS_CA") or None
if ca_certs:
    cert_reqs = 2  # ssl.CERT_REQUIRED: mutual TLS as MindIE's examples use


def on_starting(server):
    # If the launcher is SIGKILLed, the master gets SIGTERM instead of living on as an orphan.
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM, 0, 0, 0)
    except OSError:
        pass


def child_exit(server, worker):
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess
        multiprocess.mark_process_dead(worker.pid)
