"""Per-process state of a front end: config, limits, tokenizer, device client, metrics."""
from __future__ import annotations

import json
import logging
import os
import time

import falcon.asgi

from mindie.client import DeviceClient
from mindie.config import Config, load_config
from mindie.detokenizer import IncrementalDetokenizer, load_tokenizer
from mindie.errors import request_too_large
from mindie.metrics import Metrics
from mindie.topology import model_dir, worker_endpoints
from mindie.validation import Limits

log = logging.getLogger("mindie.frontend")


class FrontEnd:
    def __init__(self, config: Config):
        self.config = config
        server = config.ServerConfig
        deploy = config.BackendConfig.ModelDeployConfig
        self.model_name = deploy.ModelConfig[0].modelName
        self.model_dir = model_dir(config)
        self.started = int(time.time())
        with open(os.path.join(self.model_dir, "config.json")) as f:
            model_cfg = json.load(f)
        self.vocab_size = int(model_cfg.get("vocab_size", 0))
        self.max_body = server.maxRequestLength * 1024 * 1024
        self.limits = Limits.from_config(
            max_seq_len=deploy.maxSeqLen, max_input_token_len=deploy.maxInputTokenLen,
            max_iter_times=config.BackendConfig.ScheduleConfig.maxIterTimes, truncation=deploy.truncation,
            vocab_size=self.vocab_size, max_request_length_mb=server.maxRequestLength,
            max_position_embeddings=int(model_cfg.get("max_position_embeddings", 0)))
        self.token_timeout = float(config.token_timeout)
        self.e2e_timeout = float(config.e2e_timeout)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.metrics = Metrics(self.model_name)
        self.client: DeviceClient | None = None

    @classmethod
    def from_env(cls) -> "FrontEnd":
        return cls(load_config())

    # -- lifespan (inside the worker's event loop) -------------------------------------------
    async def process_startup(self, scope, event) -> None:
        self.client = DeviceClient(worker_endpoints(self.config))
        await self.client.start()
        log.info("front end %s (pid %d) connecting to %d device workers", self.client.frontend_id, os.getpid(),
                 len(self.client.links))

    async def process_shutdown(self, scope, event) -> None:
        if self.client is not None:
            await self.client.close()

    # -- helpers for the resources -----------------------------------------------------------
    async def read_body(self, req: falcon.asgi.Request) -> bytes:
        """The request body, refusing more than maxRequestLength MB (413) without reading it all."""
        if req.content_length is not None and req.content_length > self.max_body:
            raise request_too_large(self.config.ServerConfig.maxRequestLength)
        chunks = []
        size = 0
        async for chunk in req.stream:
            size += len(chunk)
            if size > self.max_body:
                raise request_too_large(self.config.ServerConfig.maxRequestLength)
            chunks.append(chunk)
        return b"".join(chunks)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer)

    def ready(self) -> bool:
        return self.client is not None and bool(self.client.ready_links())

    def refresh_gauges(self) -> None:
        if self.client is None:
            return
        running = waiting = free = total = 0
        for link in self.client.ready_links():
            hb = link.heartbeat
            if hb:
                running += hb.running
                waiting += hb.waiting
                free += hb.free_blocks
                total += hb.total_blocks
        self.metrics.workers(running, waiting, 1.0 - free / total if total else 0.0)
