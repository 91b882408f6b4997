"""Per-process state of a front end (config, limits, tokenizer, device client, metrics) and
its lifespan: the device client starts and stops inside the worker's event loop.

The model's vocabulary size and maximum positions come from the workers' ``Welcome`` (the model as
the worker parsed it, ``ModelArgs``), not from reading its config.json here: until the first
Welcome both are 0 in ``limits``, "unknown, not checked" (no request reaches a worker before one
is welcomed anyway)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time

from mindie.lora_adapters import LoadedAdapters, restore
from mindie.server.admission import Admission
from mindie.device_client import DeviceClient
from mindie.config import Config, load_config
from mindie.contract.spec import Deployment, deployment_path, read_deployment
from mindie.text.detokenizer import load_tokenizer
from mindie.server.drain import DrainWatch
from mindie.server.listeners import read_listeners
from mindie.server.metrics import Metrics
from mindie.server.ready_line import announce_when_ready
from mindie.api.pd_role import RoleState
from mindie.server.service_state import STOPPING, ServiceState
from mindie.text.validation import Limits

log = logging.getLogger("mindie.frontend")
STARTUP_WAIT_S = 10.0


class FrontEnd:
    def __init__(self, config: Config, deployment: Deployment, shared: "FrontEnd | None" = None):
        """``shared``: with several models, the first model's front end, whose server-wide state
        (admission, service state, roles) this model's shares; LoRA adapters stay the first model's."""
        server = config.server
        deploy = config.backend.model_deploy
        self.config = config
        self.deployment = deployment
        self.run_dir = deployment.run_dir
        self.model_name = deployment.workers[0].model_name
        self.model_dir = deployment.model_dir
        self.started = int(time.time())
        self.full_text = server.full_text_enabled
        self.limits = Limits.from_config(
            max_seq_len=deploy.max_seq_len, max_input_token_len=deploy.max_input_token_len,
            max_iter_times=config.backend.schedule.max_iter_times, truncation=deploy.truncation,
            max_request_length_mb=server.max_request_length,
            token_timeout=server.token_timeout, e2e_timeout=server.e2e_timeout)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.metrics = Metrics(self.model_name)
        self.client = DeviceClient(deployment.workers, shared.client.frontend_id if shared else None)
        self.client.on_welcome = self.learn_model
        # LoRA adapters loaded at run time, loaded again into a worker that restarts (mindie/lora_adapters.py).
        self.loaded_adapters = LoadedAdapters(deployment.run_dir)
        if shared is None:
            self.client.on_new_instance = lambda link: restore(self.client, self.loaded_adapters, link)
        # Told (vocab_size) whenever the model's figures change (app.py: the health probe's token).
        self.model_listeners: list = []
        # maxLinkNum inference requests server-wide, shared with the other front ends (admission.py).
        self.admission = shared.admission if shared else Admission(deployment.run_dir, server.max_link_num)
        self.state = shared.state if shared else ServiceState(deployment.run_dir)
        self.roles = shared.roles if shared else RoleState(deployment.run_dir, config.server.pd_role)
        # What the health probes ask (several models: any model's workers, mindie/server/model_router.py).
        self.health_client = self.client
        self.primary = shared is None  # the ready line is the first model's
        self.wait_at_start = True  # several models: only those loaded at start are waited for
        # Cuts what still runs when a stop's drain ends (mindie/server/drain.py).
        self.drain = DrainWatch(self.client, self.state, server.drain_timeout_s)
        self.vocab_size = 0
        self._tasks: list[asyncio.Task] = []

    def learn_model(self, welcome) -> None:
        """A worker's Welcome: take its model's vocabulary size and maximum positions into
        ``limits`` (in place: the routes hold this object) unless they are already those."""
        vocab, mpe = welcome.vocab_size, welcome.max_position_embeddings
        if vocab <= 0 or (vocab, mpe) == (self.limits.vocab_size, self.limits.max_position_embeddings):
            return  # an older worker (0: unknown) or nothing new
        if self.limits.vocab_size and vocab != self.limits.vocab_size:
            log.warning("device worker %s reports vocabulary size %d, others %d", welcome.worker_id, vocab,
                        self.limits.vocab_size)
        new = dataclasses.replace(self.limits, vocab_size=vocab, max_position_embeddings=mpe)
        for f in ("vocab_size", "max_position_embeddings"):  # a frozen dataclass: set as its __post_init__ does
            object.__setattr__(self.limits, f, getattr(new, f))
        self.vocab_size = vocab
        for listener in self.model_listeners:
            listener(vocab)

    @classmethod
    def from_env(cls) -> "FrontEnd":
        """The config of $MIES_CONFIG_JSON_PATH and the launch plan of $MINDIE_DEPLOYMENT
        (default: deployment.json in the config's run directory)."""
        config = load_config().config
        return cls(config, read_deployment(os.environ.get("MINDIE_DEPLOYMENT") or
                                           deployment_path(config.server.run_dir)))

    # -- lifespan (falcon middleware, inside the worker's event loop) -------------------------
    async def process_startup(self, scope, event) -> None:
        await self.client.start()
        self._tasks.append(asyncio.create_task(self.drain.run(), name="drain-watch"))
        if self.primary and (path := os.environ.get("MINDIE_LISTENERS")):
            frontends = int(os.environ.get("MINDIE_FRONTENDS") or 1)
            self._tasks.append(asyncio.create_task(
                announce_when_ready(self.client, read_listeners(path), self.deployment, frontends), name="ready-line"))
        log.info("front end %s (pid %d) connecting to %d device workers", self.client.frontend_id, os.getpid(),
                 len(self.client.links))
        # Accept connections only once a worker link is up, if one comes soon: a front end
        # (re)started beside running ones would otherwise answer /health with 503 while the
        # others say 200 (connections queue in the shared socket meanwhile). Bounded well under
        # gunicorn's 30 s heartbeat timeout; past it /health says 503 until a worker is ready.
        deadline = time.monotonic() + STARTUP_WAIT_S
        while self.wait_at_start and not await self.client.wait_ready(0.1):
            if STOPPING.is_set():
                return
            if time.monotonic() >= deadline:
                log.info("no device worker ready after %.0f s: serving (/health is 503 until one is)",
                         STARTUP_WAIT_S)
                return

    async def process_shutdown(self, scope, event) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.client.close()
