"""The coordinator's command line: read ``ms_coordinator.json``, start the predict and manage
listeners in one asyncio process, log the ready line, stop on SIGTERM/SIGINT.

    python -m coordinator --config ms_coordinator.json [predict_ip predict_port manage_ip manage_port]
    mindie-coordinator --config ms_coordinator.json --check     # validate only, exit 0/2

Exit codes: 0 stopped by a signal (or --check passed), 2 config refused (one line on stderr
naming the key), 1 could not listen (address in use, TLS files refused).
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

from mindie.config import ConfigError

log = logging.getLogger("mindie.coordinator")

EPILOG = """\
The config is MindIE MS's ms_coordinator.json (its keys and nesting; numbers may be strings as in
MindIE's shipped file), plus a static instance list:

  {"http_config": {"predict_ip": "127.0.0.1", "predict_port": 1025,
                   "manage_ip": "127.0.0.1", "manage_port": 1026},
   "digs_scheduler_config": {"deploy_mode": "single_node", "algorithm_type": "cache_affinity"},
   "exception_config": {"max_retry": 2, "first_token_timeout": 60},
   "instances": [{"id": 0, "ip": "127.0.0.1", "business_port": 1125, "mgmt_port": 1126},
                 {"id": 1, "ip": "127.0.0.1", "business_port": 1225, "mgmt_port": 1226}]}

Users send every inference API of the server (/infer, /infer_token, /v1/chat/completions,
/v1/completions, /generate, /generate_stream, /v2/models/{m}/infer|generate|generate_stream,
/v1/tokenizer, ...) to the predict port; the coordinator relays each request to one instance.
The manage port answers /v1/health, /v1/readiness (503 while no instance is ready),
/v2/health/live|ready, /v1/coordinator_info, /metrics and the MindIE management calls
POST /v1/instances/refresh|offline|online|query_tasks.

Without --config the file named by MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH is read (else all
defaults). MINDIE_MS_COORDINATOR_CONFIG_SINGLE_NODE_MAX_REQ and MINDIE_MS_COORDINATOR_CONFIG_MAX_REQ
override request_limit. Every key: docs/config.md, "Coordinator". An unknown or misspelt key
stops the start naming it (exit 2).
"""


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="mindie-coordinator",
        description="MindIE Motor coordinator: one endpoint over many mindie-py server instances "
                    "(load-balanced or cache-affine routing, retry, circuit breaker, aggregated metrics).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="ms_coordinator.json",
                   help="the coordinator config (default: $MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH, else defaults)")
    p.add_argument("--check", action="store_true", help="validate the config, print a summary and exit (0 ok, 2 refused)")
    # MindIE's ms_coordinator takes these four positionally, each overriding the config.
    p.add_argument("predict_ip", nargs="?", help="overrides http_config.predict_ip")
    p.add_argument("predict_port", nargs="?", help="overrides http_config.predict_port")
    p.add_argument("manage_ip", nargs="?", help="overrides http_config.manage_ip")
    p.add_argument("manage_port", nargs="?", help="overrides http_config.manage_port")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    from coordinator import config as cfg
    overrides = {k: getattr(args, k) for k in ("predict_ip", "predict_port", "manage_ip", "manage_port")
                 if getattr(args, k) is not None}
    try:
        loaded = cfg.load(args.config, overrides=overrides)
    except ConfigError as e:
        print(f"mindie-coordinator: config refused: {e}", file=sys.stderr, flush=True)
        return 2
    if args.check:
        c = loaded.config
        print(f"config ok: predict {c.http_config.predict_ip}:{c.http_config.predict_port}, manage "
              f"{c.http_config.manage_ip}:{c.http_config.manage_port}, {c.digs_scheduler_config.algorithm_type}, "
              f"{len(c.instances)} instance(s)", flush=True)
        for note in loaded.notes:
            print(f"note: {note}", flush=True)
        return 0
    from coordinator.server import serve
    return serve(loaded)
