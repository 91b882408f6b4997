"""The coordinator process: the predict and manage listeners (two uvicorn servers in one event
loop), the instance poller, and the ready line; SIGTERM/SIGINT stop it.

    mindie-coordinator ready: predict http://127.0.0.1:1025, manage http://127.0.0.1:1026 |
    load_balance | 2 instances: 0 127.0.0.1:1125 ready, 1 127.0.0.1:1225 ready
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

import uvicorn

from coordinator.config import Loaded

log = logging.getLogger("mindie.coordinator")


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to ``serve`` (two servers share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def setup_logging(loaded: Loaded) -> None:
    """Logging from ``log_info`` (MINDIE_LOG_LEVEL wins, as MindIE documents)."""
    import logging.handlers
    import os
    li = loaded.config.log_info
    level = (os.environ.get("MINDIE_LOG_LEVEL") or os.environ.get("MINDIEMS_LOG_LEVEL") or li.log_level).upper()
    level = {"WARN": "WARNING"}.get(level, level)
    fmt = logging.Formatter(f"%(asctime)s %(levelname)s [coordinator pid {os.getpid()}] %(name)s: %(message)s")
    handlers: list[logging.Handler] = []
    if li.to_stdout:
        handlers.append(logging.StreamHandler(sys.stderr))
    if li.to_file and li.run_log_path:
        os.makedirs(os.path.dirname(os.path.abspath(li.run_log_path)), mode=0o750, exist_ok=True)
        handlers.append(logging.handlers.RotatingFileHandler(
            li.run_log_path, maxBytes=li.max_log_file_size << 20, backupCount=li.max_log_file_num, encoding="utf-8"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)
    root.setLevel(level if level in ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG") else "INFO")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise


def _raise_fd_limit() -> None:
    """Each relayed stream holds two sockets (client, instance): lift the soft open-file limit to
    the hard one (a 1024 default would end the coordinator's reach near 500 streams)."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass
    log.info("open files: at most %s (%s streams at once, two sockets each)",
             resource.getrlimit(resource.RLIMIT_NOFILE)[0], resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2)


def serve(loaded: Loaded) -> int:
    """Run until SIGTERM/SIGINT; the exit status."""
    setup_logging(loaded)
    _raise_fd_limit()
    for note in loaded.notes:
        log.info("config: %s", note)
    try:
        try:
            import uvloop  # uvicorn[standard] brings it: a faster loop for thousands of streams
        except ImportError:
            return asyncio.run(_main(loaded))
        return uvloop.run(_main(loaded))
    except KeyboardInterrupt:
        return 0


async def _run(srv: uvicorn.Server) -> None:
    """``srv.serve()``; uvicorn ends a failed bind with sys.exit(1), kept inside this task."""
    try:
        await srv.serve()
    except SystemExit:
        pass


async def _main(loaded: Loaded) -> int:
    from coordinator.app import Coordinator
    from coordinator.manage_auth import ManageAuthError
    from mindie.runtime.tls import TlsError
    c = loaded.config
    h = c.http_config
    try:
        coord = Coordinator(c)
        listeners = coord.listeners()
    except TlsError as e:
        log.error("TLS refused: %s", e)
        return 1
    except ManageAuthError as e:
        log.error("manage port token refused: %s", e)
        return 1
    servers = []
    for name, app, ip, port, ssl_ctx in listeners:
        cfg = uvicorn.Config(app, host=ip, port=port, log_level="warning", access_log=False, lifespan="off",
                             timeout_keep_alive=h.keep_alive_seconds or 86400, server_header=False,
                             ws="none", limit_concurrency=None, backlog=4096,
                             timeout_graceful_shutdown=h.drainTimeoutS)
        srv = _Server(cfg)
        if ssl_ctx is not None:
            cfg.load()
            cfg.ssl = ssl_ctx  # uvicorn builds its own from files; ours is checked (mindie/runtime/tls.py)
        servers.append((name, srv))
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    coord.request_stop = stop.set  # /stopService on the manage port
    await coord.start()
    tasks = [asyncio.create_task(_run(srv), name=f"uvicorn-{name}") for name, srv in servers]
    while not all(srv.started for _, srv in servers):
        done = [t for t in tasks if t.done()]
        if done:  # a listener could not start (address in use): uvicorn logged why
            for _, srv in servers:
                srv.should_exit = True
            await asyncio.gather(*tasks, return_exceptions=True)
            await coord.stop()
            log.error("could not listen on every port: stopping")
            return 1
        await asyncio.sleep(0.02)
    coord.announce_ready_line()
    await stop.wait()
    # The drain (as a server's own, mindie/server/drain.py): the listeners stay open so a new
    # request gets MindIE's 503 rather than a refused connection, the requests in flight run
    # until drainTimeoutS, and what still runs then is cut with an error in its API's shape.
    coord.stopping = True
    log.info("stopping: new requests get 503; requests in flight get http_config.drainTimeoutS (%d s), then "
             "are cut with an error frame; the instances keep serving", h.drainTimeoutS)
    stop.clear()

    async def second_signal() -> None:  # a second SIGTERM/SIGINT: cut now
        await stop.wait()
        log.warning("second stop signal: cutting the requests in flight")
        for _, s in servers:
            s.force_exit = True
    force = asyncio.create_task(second_signal())
    await coord.relay.drain(h.drainTimeoutS, stop)
    for _, srv in servers:
        # what is left are answers being written (a cut's last frame) and idle connections
        srv.config.timeout_graceful_shutdown = 5
        srv.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)
    force.cancel()
    await coord.stop()
    log.info("stopped")
    return 0
